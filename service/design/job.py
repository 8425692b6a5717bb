"""`Run`: small runs → a defended production plan → a memo. Shaped like Ray's API: config in, `fit()`,
a typed `RunResult` out.

    >>> from service import Run
    >>> result = Run("experiments/llama2-13b-32xh100.yaml").fit()               # doctest: +SKIP
    >>> result.selected_label, result.predicted["hours"], result.memo_paths     # doctest: +SKIP

Pipeline (`Run._fit`, one named step after another, each a function from typed records to a typed
record: service/design/steps.py): rank every plan with intervals on the parameters it starts from;
shape the proxies, choose what they validate (service/design/validate.py) and run them through the Ray
Tune `Search`; calibrate the memory terms on them (time terms too when they ran on the production GPU
type) and widen the intervals for the extrapolation; decide: rank every cluster on the calibrated
model with goodput included, select under the budget, test the choice under the sensitivity
scenarios; assemble the `RunResult`; then service/design/finish.py writes the DeepSpeed config, the
launch command, the memo, result.json and the MLflow parent run.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.design import steps
from service.design.decide import Scored
from service.design.finish import finish
from service.design.proxies import run_proxies
from service.design.steps import ProxyEvidence, time_provenance
from service.design.validate import choose, design_proxy
from service.report.proxy_records import ProxyChoice, ProxyDesign
from service.report.result import RunResult
from service.search.result import SearchResult
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.params import ModelParams, load_params
from service.tracking.uri import repo_root

__all__ = ["DEFAULT_MAX_PROXIES", "Run", "default_out_dir", "time_provenance"]

DEFAULT_MAX_PROXIES = 4


def default_out_dir(experiment: ExperimentSpec) -> Path:
    """`run/<name>` under the results folder ($SERVICE_STORAGE_PATH on a cluster, else the repository's
    ray_results; see service.cluster.storage); a name that would leave that folder is refused (the spec
    refuses such names already; `model_construct` skips the spec's check)."""
    from service.cluster.storage import results_root

    root = (results_root(repo_root() / "ray_results") / "run").resolve()
    out = (root / experiment.name).resolve()
    if out.parent != root:
        raise SpecError("name", f"{experiment.name!r} is not a plain folder name; it would leave {root}")
    return out


def detect_device() -> tuple[str, str, int]:
    """("cuda", device name, GPUs) when a CUDA GPU is here, else ("cpu", "", 0)."""
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda", str(torch.cuda.get_device_name(0)), int(torch.cuda.device_count())
    except ImportError:
        pass
    return "cpu", "", 0


def same_device(proxy_device: str, catalog_name: str, device_name: str) -> bool:
    """Whether the proxies run on the production device type: CPU proxies for a `cpu` cluster, or a
    CUDA device (e.g. 'NVIDIA H100 80GB HBM3') of the catalog's type ('h100-sxm-80gb')."""
    if proxy_device == "cpu":
        return catalog_name == "cpu"
    return bool(device_name) and catalog_name.split("-")[0].upper() in device_name.upper()


def time_terms_for(design: ProxyDesign, same: bool) -> ProxyDesign:
    """The design with what the memo says about time terms, once it is known whether the proxies ran on
    the production device type (only then are time terms fitted on them)."""
    if not same:
        why = "kept at the published-set parameters (the proxies ran on another device type)"
        return design.model_copy(update={"time_terms": why})
    return design.model_copy(
        update={
            "time_terms": "fitted on the proxies: they ran on the production device type",
            "identifies": [
                *design.identifies,
                "time terms (efficiencies, per-step overheads) on this device type",
            ],
            "cannot_identify": [c for c in design.cannot_identify if not c.startswith("GPU time terms")],
        }
    )


class Run:
    """Plans, validates on proxies, calibrates, selects and writes the memo for one experiment.

    Args:
        experiment: an `ExperimentSpec` or the path of its YAML.
        params: the cost model's parameter set (a `ModelParams` or a YAML path); None = the shipped one.
        storage_path: the run's folder (memo, configs, the proxy search); a folder holding a killed
            run's search continues it. Default: `run/<experiment>` under $SERVICE_STORAGE_PATH, else under
            `<repo>/ray_results`.
        max_proxies: most proxy plans to run (each a Ray Train trial).
        proxy_steps: optimizer steps per proxy (default: the proxy spec's).
        device: "cpu" or "cuda" for the proxies (default: cuda when a GPU is here).
        run_proxies: False plans and writes the memo on the prior alone (no Ray).
        progress: a progress bar on stderr while proxies run.
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        *,
        params: ModelParams | str | Path | None = None,
        storage_path: str | Path | None = None,
        max_proxies: int = DEFAULT_MAX_PROXIES,
        proxy_steps: int | None = None,
        device: str | None = None,
        run_proxies: bool = True,
        progress: bool = False,
    ):
        self.spec = experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        self.experiment_path = None if isinstance(experiment, ExperimentSpec) else str(experiment)
        self.params = params if isinstance(params, ModelParams) else load_params(params)
        if max_proxies < 0:
            raise SpecError("max_proxies", f"must be 0 or more, got {max_proxies}")
        self.out_dir = Path(storage_path or default_out_dir(self.spec)).resolve()
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise SpecError("storage_path", f"{self.out_dir} is a file, not a folder")
        self.max_proxies = max_proxies if run_proxies else 0
        self.proxy_steps = proxy_steps
        if device not in (None, "cpu", "cuda"):
            raise SpecError("device", f"unknown device {device!r}; allowed: cpu, cuda")
        self.device, self.device_name, self.devices = detect_device()
        if device is not None and device != self.device:
            self.device, self.device_name, self.devices = device, "", 0
        self.progress = progress

    # -- the pipeline ------------------------------------------------------------------------------
    def fit(self) -> RunResult:
        """Runs the pipeline. One run per output folder at a time: while another process runs in
        `out_dir`, this raises `FolderLocked` (a `SpecError`) naming the folder and that process."""
        from service.search.lock import folder_lock

        with folder_lock(self.out_dir, "run"):  # creates the folder
            return self._fit()

    def _fit(self) -> RunResult:
        started = time.time()
        spec, prior = self.spec, self.params
        ranked = steps.rank_prior(spec, prior)
        proxies = self._run_proxies(ranked)
        fitted = steps.calibrate(spec, proxies, prior)
        decision = steps.decide(spec, proxies, fitted, prior)
        created = datetime.now(UTC).isoformat(timespec="seconds")
        result = steps.assemble(spec, proxies, fitted, decision, self.out_dir, created)
        main, chosen = decision.main, decision.chosen
        return finish(result, spec, main, chosen, proxies.search_name, started, self.experiment_path)

    def _run_proxies(self, ranked: Scored) -> ProxyEvidence:
        """Shapes the proxies, chooses which production plans they validate (in the prior's order) and
        runs them through the Ray Tune search (none when `max_proxies` is 0)."""
        proxy_exp, design = design_proxy(self.spec, self.device, self.devices or None)
        on_gpu = same_device(design.device, self.spec.cluster.gpu.name, self.device_name)
        order = [(int(r), ranked.plans.row(int(r))) for r in ranked.selection.order]
        choices, notes = choose(order, proxy_exp, self.max_proxies)
        picked = [ProxyChoice(plan=c.plan.short(), proxy=c.proxy_plan.short(), why=c.reason) for c in choices]
        design = time_terms_for(design, on_gpu).model_copy(update={"choices": picked, "skipped": notes})
        search, name = self._proxies(proxy_exp, choices)
        return ProxyEvidence(proxy_exp, design, choices, search, name, on_gpu)

    def _proxies(
        self, proxy_exp: ExperimentSpec, choices: list[Any]
    ) -> tuple[SearchResult | None, str | None]:
        if not choices:
            return None, None
        result, name = run_proxies(
            proxy_exp, choices, self.out_dir / "search", self.proxy_steps, self.progress
        )
        return result, name
