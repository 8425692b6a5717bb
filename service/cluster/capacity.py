"""What a Ray cluster can run: the resources it has now and the most its autoscaler can add.

A search sized from `ray.cluster_resources()` alone sees no GPU on a cluster whose GPU nodes scale from
zero (`min_workers: 0`) and refuses before the autoscaler can add one. Sized from the autoscaler's
maximum (the node types' resources × their max_workers, capped by the cluster's max), it launches
trials that make the autoscaler add nodes; and a trial needing more than even that maximum is refused
up front, in one line, instead of pending forever.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError

CONFIG_ENV = "SERVICE_AUTOSCALING_CONFIG"
MAX_ENV = "SERVICE_CLUSTER_MAX_RESOURCES"  # JSON, e.g. {"GPU": 36}: set where no autoscaler YAML is at hand
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` leaves the config on the head


@dataclass(frozen=True)
class Capacity:
    """One resource (e.g. "GPU", "CPU") of the connected cluster."""

    unit: str
    now: float
    most: float  # with every autoscalable node up; equals `now` on a cluster without an autoscaler
    autoscaled: bool


def most_from_config(config: dict[str, Any], unit: str) -> float:
    """`unit` with every worker node type at its max_workers, within the cluster's max_workers
    (the largest nodes first), plus the head's: an upper bound of what the autoscaler can bring up."""
    types = config.get("available_node_types", {})
    head = config.get("head_node_type")
    per_node: list[float] = []
    for name, node_type in types.items():
        if name != head:
            amount = float(node_type.get("resources", {}).get(unit, 0))
            per_node += [amount] * int(node_type.get("max_workers", config.get("max_workers", 0)))
    cap = int(config.get("max_workers", len(per_node)))
    head_amount = float(types.get(head, {}).get("resources", {}).get(unit, 0))
    return head_amount + sum(sorted(per_node, reverse=True)[:cap])


def _autoscaler_config() -> dict[str, Any] | None:
    import yaml

    path = os.environ.get(CONFIG_ENV) or BOOTSTRAP_CONFIG
    file = Path(path).expanduser()
    if not file.is_file():
        return None
    data = yaml.safe_load(file.read_text())
    return data if isinstance(data, dict) else None


def declared_most(unit: str) -> float:
    """$SERVICE_CLUSTER_MAX_RESOURCES's count of `unit`; a `SpecError` naming the variable when it is not
    a JSON object of non-negative numbers (`GPU=36`, `{"GPU": "many"}`)."""
    text = os.environ[MAX_ENV]
    try:
        declared = json.loads(text)
        if not isinstance(declared, dict):
            raise ValueError("not an object")
        value = float(declared.get(unit, 0))
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{unit} is {value}")
    except (ValueError, TypeError) as err:
        raise SpecError(
            MAX_ENV, f'{text!r} is not a JSON object of counts like {{"GPU": 36}} ({err})'
        ) from None
    return value


def capacity(unit: str) -> Capacity:
    """Reads the connected cluster (ray.init first). Its maximum comes from the cluster config in the
    GCS where the autoscaler reports one (the call Ray Train makes before placing workers), else
    $SERVICE_CLUSTER_MAX_RESOURCES, else the autoscaler's YAML: $SERVICE_AUTOSCALING_CONFIG, or the
    one `ray up` leaves on the head."""
    import ray
    from ray._private.state import state

    now = float(ray.cluster_resources().get(unit, 0.0))
    try:
        reported = state.get_max_resources_from_cluster_config()
    except Exception:  # no autoscaler state in this GCS (e.g. a plain local ray.init)
        reported = None
    if reported:
        return Capacity(unit, now, max(now, float(reported.get(unit, 0))), autoscaled=True)
    if os.environ.get(MAX_ENV):  # e.g. KubeRay, whose node groups live in the RayCluster resource
        return Capacity(unit, now, max(now, declared_most(unit)), autoscaled=True)
    config = _autoscaler_config()
    if config is None:
        return Capacity(unit, now, now, autoscaled=False)
    return Capacity(unit, now, max(now, most_from_config(config, unit)), autoscaled=True)


def max_concurrent_trials(world_size: int, device: str) -> int:
    """Trials that fit side by side at full scale-out: GPUs (cuda) or CPUs (cpu, one kept for the
    trials' drivers) ÷ world size; a `SpecError` when not even one trial ever fits."""
    unit = "GPU" if device == "cuda" else "CPU"
    cap = capacity(unit)
    reserved = 0.0 if device == "cuda" else 1.0
    fit = int((cap.most - reserved) // world_size)
    if fit < 1:
        extra = "" if device == "cuda" else " (+1 kept for trial drivers)"
        most = f"at most {cap.most:g} with autoscaling, {cap.now:g} now" if cap.autoscaled else f"{cap.now:g}"
        # CPU workers are processes: a CPU machine's Ray can offer more logical CPUs than it has cores.
        hint = f" (start it with `ray start --head --num-cpus={world_size + 1}`)" if device == "cpu" else ""
        raise SpecError(
            "proxy.num_workers",
            f"a trial needs {world_size} {unit}s{extra} but the Ray cluster offers {most}{hint}",
        )
    return fit
