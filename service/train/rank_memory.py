"""What every rank holds, read during a proxy step and gathered over the ranks: model state by class at
its peak moments (`StateProbe`), the routed experts' padded load (`moe_load`), and the busiest rank's
figures the cost model is compared with (`busiest_rank_memory`). Each gather is an all-gather: every
rank must call it."""

from __future__ import annotations

import math
from typing import Any

import torch

from service.train import measure, moe

# The rank's model state, its classes, and the routed experts' share of it (MoE models).
STATE_KEYS = ("model_state", *measure.STATE_CLASSES, "expert_state")


def gather_over_ranks(values: list[float]) -> list[list[float]]:
    """Every rank's `values`, in rank order (an all-gather: every rank must call it)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [[float(x) for x in row.tolist()] for row in out]


def moe_load(engine: Any) -> float:
    """The routed experts' padded load in the busiest metered forward (`moe.padded_load`), the largest of
    the ranks' (ranks of one EP group share it: C is all-reduced over the group), as the activations are
    the busiest rank's; NaN where no rank holds a MoE block (an all-gather: every rank must call it)."""
    mine = moe.padded_load(engine.module)
    loads = [row[0] for row in gather_over_ranks([math.nan if mine is None else mine])]
    counted = [x for x in loads if math.isfinite(x)]
    return max(counted) if counted else math.nan


def busiest_rank_memory(rows: list[list[float]]) -> dict[str, float]:
    """Memory of the busiest rank, from every rank's [model state, its classes…, the experts' share,
    activations, peak].

    The cost model's per-GPU memory is the busiest GPU's (with a pipeline, the first or the last stage,
    whichever holds more), so the measurement it is compared with is too: model state (with its
    breakdown) from the rank holding the most, saved activations and peak memory their maxima. Rank 0
    alone is the first pipeline stage, which holds no logits: with pp 2 and one micro-batch the last
    stage holds more, and rank 0's figure was 14 % under a correct prediction.
    """
    n = len(STATE_KEYS)
    state_row = max(rows, key=lambda r: r[0])
    out = {f"measured_{k}_bytes_per_rank": state_row[i] for i, k in enumerate(STATE_KEYS)}
    out["measured_activation_bytes_per_rank"] = max(r[n] for r in rows)
    out["measured_peak_memory_bytes_per_rank"] = max(r[n + 1] for r in rows)
    return out


class StateProbe:
    """Reads model-state bytes at the two moments of an armed step when they peak, and keeps the larger
    of each class: just before ZeRO-1/2 reduce the accumulated full gradients into partitions
    (`reduce_gradients`, at the accumulation boundary; ZeRO-1 holds full gradients until then), and just
    before the optimizer step (partitioned gradients, fp32 master copies and moments all alive)."""

    def __init__(self, engine: Any):
        self.engine, self.armed = engine, False
        self.bytes = dict.fromkeys(STATE_KEYS, 0)
        self.detail: dict[str, int] = {}
        optimizer = engine.optimizer
        self._wrap(optimizer, "step", disarm=True)
        if hasattr(optimizer, "reduce_gradients"):
            self._wrap(optimizer, "reduce_gradients", disarm=False)

    def _read(self) -> None:
        detail: dict[str, int] = {}
        now = measure.model_state_bytes(self.engine.module, self.engine.optimizer, detail)
        now["expert_state"] = measure.expert_state_bytes(self.engine.module, self.engine.optimizer)
        self.bytes = {k: max(v, self.bytes.get(k, 0)) for k, v in now.items() if k != "model_state"}
        self.bytes["model_state"] = sum(self.bytes[c] for c in ("params", "grads", "optimizer", "master"))
        for k, v in detail.items():
            self.detail[k] = max(v, self.detail.get(k, 0))

    def _wrap(self, optimizer: Any, name: str, disarm: bool) -> None:
        inner = getattr(optimizer, name)

        def probed(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self._read()
                self.armed = not disarm
            return inner(*args, **kwargs)

        setattr(optimizer, name, probed)


def memory_rows(probe: StateProbe, meter: measure.ActivationMeter, device: torch.device) -> list[list[float]]:
    """Every rank's model state (by class), peak saved activations and peak memory."""
    mine = [float(probe.bytes[k]) for k in STATE_KEYS]
    return gather_over_ranks([*mine, float(meter.peak_bytes), float(measure.peak_memory_bytes(device))])
