"""Scores `service.costmodel` against published training-throughput measurements.

The data (benchmarks/published/measurements.yaml) are real runs read from five public sources:
MosaicML llm-foundry's MPT benchmark tables, Narayanan et al. 2021 (Megatron-LM PTD-P and DeepSpeed
ZeRO-3), Korthikanti et al. 2022 (selective recompute + sequence parallelism), torchtitan's
performance docs and IBM/PyTorch's FSDP blog. Each row becomes a `ModelSpec`, `ClusterSpec`, `Plan` and
`Workload`; the cost model predicts tokens/s per GPU and we compare with what was measured:

* mean absolute % error, overall, per source, and source-balanced (mean of the per-source means);
* rank agreement within each source (Spearman) and among configurations of one model on one GPU
  type (Kendall tau-b), which is what choosing a plan depends on;
* the same for a constant-MFU baseline (40 % by default, FLOPs = 6N + 12·L·h·s per token).

Rows whose layout DeepSpeed cannot run (`megatron_only`: tp>1 with pp>1) are scored through
`estimate_table` on an unvalidated `PlanTable`, since `Plan` rejects them.

Usage: python benchmarks/throughput_accuracy.py [--data PATH] [--out PATH] [--baseline-mfu 0.4] [--worst 10]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.catalog import load_gpu, load_model
from service.plans.table import PRECISION_CODES, RECOMPUTE_CODES, PlanTable
from service.spec import ClusterSpec, GPUSpec, ModelSpec, Plan, Workload, plan_problem

HERE = Path(__file__).resolve().parent
DATA_PATH = HERE / "published" / "measurements.yaml"
RESULTS_PATH = HERE / "results" / "throughput_accuracy.json"
FlopsFormula = Literal["narayanan2021_eq3", "korthikanti2022_eq7"]


class Source(BaseModel):
    """Where a group of measurements comes from and how it defines its numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    citation: str
    framework: str
    metric: str
    mfu_definition: str = ""
    flops_formula: str = ""
    read_via: str = ""


class Measured(BaseModel):
    """Exactly one measured quantity, in the source's own terms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_s_per_gpu: float | None = Field(None, gt=0)
    step_time_s: float | None = Field(None, gt=0)
    tflops_per_gpu: float | None = Field(None, gt=0)
    mfu: float | None = Field(None, gt=0, le=1)
    flops_formula: FlopsFormula | None = None
    peak_tflops: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_value(self) -> Measured:
        given = [
            k for k in ("tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu", "mfu") if getattr(self, k)
        ]
        if len(given) != 1:
            raise ValueError(f"give exactly one measured value, got {given or 'none'}")
        if (self.tflops_per_gpu or self.mfu) and self.flops_formula is None:
            raise ValueError("tflops_per_gpu and mfu need flops_formula")
        if self.mfu and self.peak_tflops is None:
            raise ValueError("mfu needs peak_tflops")
        return self


class Measurement(BaseModel):
    """One published run: its layout, as `Plan` fields, and what it measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    source: str
    ref: str
    model: str
    gpu: str
    gpu_overrides: dict[str, float] = Field(default_factory=dict)
    num_gpus: int = Field(gt=0)
    gpus_per_node: int = Field(8, gt=0)
    dp: int = Field(gt=0)
    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    zero_stage: Literal[0, 1, 2, 3]
    micro_batch: int = Field(gt=0)
    grad_accum: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    recompute: Literal["none", "selective", "full"]
    sequence_parallel: bool = False
    precision: Literal["bf16", "fp16"] = "bf16"
    measured: Measured
    reported_mfu: float | None = None
    megatron_only: bool = False
    approximate: bool = False
    assumptions: list[str] = Field(default_factory=list)
    notes: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Measurement:
        if self.dp * self.tp * self.pp != self.num_gpus:
            raise ValueError(f"dp·tp·pp = {self.dp * self.tp * self.pp} but num_gpus = {self.num_gpus}")
        if self.micro_batch * self.grad_accum * self.dp != self.global_batch:
            raise ValueError("micro_batch·grad_accum·dp != global_batch")
        return self

    def plan_fields(self) -> dict[str, Any]:
        keys = ("dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "recompute", "sequence_parallel")
        return {**{k: getattr(self, k) for k in keys}, "precision": self.precision}


class Dataset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: dict[str, Source]
    models: dict[str, dict[str, Any]]
    measurements: list[Measurement]

    @model_validator(mode="after")
    def _known_sources(self) -> Dataset:
        ids = [m.id for m in self.measurements]
        if len(set(ids)) != len(ids):
            raise ValueError("measurement ids must be unique")
        for m in self.measurements:
            if m.source not in self.sources:
                raise ValueError(f"{m.id}: unknown source {m.source!r}")
        return self


def load_dataset(path: Path = DATA_PATH) -> Dataset:
    return Dataset.model_validate(yaml.safe_load(Path(path).read_text()))


def model_spec(ds: Dataset, name: str) -> ModelSpec:
    """An inline model from the data file (its bookkeeping keys dropped), else a catalog model."""
    if name in ds.models:
        fields = {k: v for k, v in ds.models[name].items() if k not in ("source", "source_num_params")}
        return ModelSpec(name=name, **fields)
    return load_model(name)


def cluster_spec(row: Measurement) -> ClusterSpec:
    gpu = load_gpu(row.gpu)
    if row.gpu_overrides:
        gpu = GPUSpec.model_validate({**gpu.model_dump(), **row.gpu_overrides})
    nodes = max(1, row.num_gpus // row.gpus_per_node)
    return ClusterSpec(gpu=gpu, num_nodes=nodes, gpus_per_node=min(row.gpus_per_node, row.num_gpus))


def workload(row: Measurement) -> Workload:
    # tokens_to_train only sets hours and dollars, which this benchmark does not score.
    # Megatron-LM in 2021-22 materialised the attention scores; every other source ran fused attention.
    flash = not row.source.startswith("megatron-")
    return Workload(
        seq_len=row.seq_len,
        global_batch_sequences=row.global_batch,
        tokens_to_train=1e9,
        flash_attention=flash,
    )


def megatron_only_problem(row: Measurement, model: ModelSpec, cluster: ClusterSpec) -> str | None:
    """Why a `megatron_only` row is not a sound Megatron layout, or None.

    `plan_problem` stays the one judge of the divisibility rules: it checks the TP half of the layout
    (pp folded into dp) and the PP half (tp folded into dp) separately, so only the DeepSpeed rule
    against combining them is skipped. The batch split is checked by `Measurement`.
    """
    f = row.plan_fields()
    tp_half = Plan(**{**f, "pp": 1, "dp": row.dp * row.pp})
    pp_half = Plan(**{**f, "tp": 1, "dp": row.dp * row.tp, "sequence_parallel": False})
    for half in (tp_half, pp_half):
        problem = plan_problem(half, model, cluster)
        if problem:
            return f"{problem[0]}: {problem[1]}"
    return None


def narayanan_eq3_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Narayanan et al. 2021, Eq. 3 divided by B·s: 96·l·h²·(1 + s/(6h) + V/(16·l·h)), recompute included."""
    n_layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 96 * n_layers * h * h * (1 + seq_len / (6 * h) + v / (16 * n_layers * h))


def korthikanti_eq7_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Korthikanti et al. 2022, Eq. 7 divided by B·s: 72·L·h²·(1 + s/(6h) + V/(12·h·L)) model FLOPs."""
    n_layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 72 * n_layers * h * h * (1 + seq_len / (6 * h) + v / (12 * h * n_layers))


FLOPS_PER_TOKEN = {
    "narayanan2021_eq3": narayanan_eq3_flops_per_token,
    "korthikanti2022_eq7": korthikanti_eq7_flops_per_token,
}


def measured_tokens_per_s_per_gpu(row: Measurement, model: ModelSpec) -> float:
    """The measurement as tokens/s per GPU, converted with the source's own FLOP formula."""
    m = row.measured
    if m.tokens_per_s_per_gpu:
        return m.tokens_per_s_per_gpu
    if m.step_time_s:
        return row.global_batch * row.seq_len / (m.step_time_s * row.num_gpus)
    assert m.flops_formula is not None
    per_token = FLOPS_PER_TOKEN[m.flops_formula](model, row.seq_len)
    if m.tflops_per_gpu:
        return m.tflops_per_gpu * 1e12 / per_token
    assert m.mfu is not None and m.peak_tflops is not None
    return m.mfu * m.peak_tflops * 1e12 / per_token


def baseline_tokens_per_s_per_gpu(model: ModelSpec, gpu: GPUSpec, row: Measurement, mfu: float) -> float:
    """Constant-MFU guess: mfu × peak over 6N + 12·L·h·s FLOPs per token (PaLM, Appendix B)."""
    per_token = 6 * model.num_params + 12 * model.num_layers * model.hidden_size * row.seq_len
    return mfu * gpu.peak_tflops(row.precision) * 1e12 / per_token


def megatron_plan_table(row: Measurement) -> PlanTable:
    """A one-row `PlanTable` of the row's layout, built without `Plan`'s DeepSpeed-only checks."""
    cols = {
        **row.plan_fields(),
        "recompute": RECOMPUTE_CODES.index(row.recompute),
        "precision": PRECISION_CODES.index(row.precision),
        "offload_optimizer": False,
        "offload_params": False,
    }
    return PlanTable.from_columns(**{k: np.asarray([v]) for k, v in cols.items()})


def predict(row: Measurement, model: ModelSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """The cost model's tokens/s per GPU, MFU, fit, memory and time breakdown for one row.

    `Estimate` holds a validated `Plan`, so megatron-only rows are read off the `EstimateTable`. These
    runs did fit, so the only falsifiable memory claim is total ≤ HBM: no headroom is applied.
    """
    from service.costmodel import estimate, estimate_table
    from service.costmodel.result import TIME_TERMS

    wl = workload(row)
    if row.megatron_only:
        t = estimate_table(model, cluster, wl, megatron_plan_table(row), memory_headroom=0.0)
        keys = ("tokens_per_s_per_gpu", "mfu", "step_time_s")
        values: dict[str, Any] = {k: float(getattr(t, k)[0]) for k in keys}
        values |= {"fits": bool(t.fits[0]), "memory_gib": float(t.total_bytes[0]) / 2**30}
        times = {k: float(getattr(t, f"{k}_s")[0]) for k in TIME_TERMS}
    else:
        e = estimate(model, cluster, Plan(**row.plan_fields()), wl, memory_headroom=0.0)
        values = {"tokens_per_s_per_gpu": e.tokens_per_s_per_gpu, "mfu": e.mfu, "step_time_s": e.step_time_s}
        values |= {"fits": e.fits, "memory_gib": e.memory_per_gpu_bytes.total / 2**30}
        times = e.time_breakdown_s.model_dump()
    return {**{f"predicted_{k}": v for k, v in values.items()}, "time_breakdown_s": times}


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):  # ties share their mean rank
        tie = x == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho: Pearson correlation of the ranks (nan when either side is constant)."""
    rx, ry = _ranks(np.asarray(x, float)), _ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b over all pairs (ties in either variable handled as in Kendall 1945)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    i, j = np.triu_indices(len(x), k=1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    n0 = len(i)
    nx, ny = int(np.count_nonzero(sx)), int(np.count_nonzero(sy))
    if nx == 0 or ny == 0 or n0 == 0:
        return math.nan
    return float((sx * sy).sum() / math.sqrt(nx * ny))


def evaluate(ds: Dataset, baseline_mfu: float) -> list[dict[str, Any]]:
    """One result per row: measured and predicted tokens/s/GPU and the errors of model and baseline."""
    keep = {"id", "source", "model", "gpu", "num_gpus", "seq_len", "megatron_only", "approximate"}
    results = []
    for row in ds.measurements:
        model, cluster = model_spec(ds, row.model), cluster_spec(row)
        meas = measured_tokens_per_s_per_gpu(row, model)
        base = baseline_tokens_per_s_per_gpu(model, cluster.gpu, row, baseline_mfu)
        pred = predict(row, model, cluster)
        results.append(
            {
                **row.model_dump(include=keep),
                "plan": Plan.model_construct(**row.plan_fields()).short(),
                "measured_tokens_per_s_per_gpu": meas,
                "baseline_tokens_per_s_per_gpu": base,
                **pred,
                "error": pred["predicted_tokens_per_s_per_gpu"] / meas - 1,
                "baseline_error": base / meas - 1,
            }
        )
    return results


def _stats(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    err = np.array([r[key] for r in rows])
    return {
        "n": len(rows),
        "mape": float(np.mean(np.abs(err))),
        "median_ape": float(np.median(np.abs(err))),
        "bias_log": float(np.mean(np.log1p(err))),
        "max_ape": float(np.max(np.abs(err))),
    }


def _rank_stats(rows: list[dict[str, Any]], pred_key: str) -> dict[str, float]:
    """Spearman over the whole group, and mean Kendall tau-b within (model, gpu) sub-groups of ≥3 rows."""
    meas = np.array([r["measured_tokens_per_s_per_gpu"] for r in rows])
    pred = np.array([r[pred_key] for r in rows])
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r["model"], r["gpu"])].append(i)
    taus = [kendall_tau_b(meas[ix], pred[ix]) for ix in groups.values() if len(ix) >= 3]
    taus = [t for t in taus if not math.isnan(t)]
    return {
        "spearman": spearman(meas, pred) if len(rows) >= 3 else math.nan,
        "kendall_within_model_gpu": float(np.mean(taus)) if taus else math.nan,
        "groups": len(taus),
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Error and ranking statistics, overall, per source and for the rows without approximations."""
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_source[r["source"]].append(r)
    core = [r for r in results if not r["approximate"]]
    out: dict[str, Any] = {}
    for label, key, pred_key in (
        ("model", "error", "predicted_tokens_per_s_per_gpu"),
        ("baseline", "baseline_error", "baseline_tokens_per_s_per_gpu"),
    ):
        per_source = {
            s: {**_stats(rs, key), **_rank_stats(rs, pred_key)} for s, rs in sorted(by_source.items())
        }
        out[label] = {
            "overall": {**_stats(results, key), **_rank_stats(results, pred_key)},
            "core_rows": _stats(core, key) if core else {},
            "source_balanced_mape": float(np.mean([v["mape"] for v in per_source.values()])),
            "per_source": per_source,
        }
    out["predicted_not_fitting"] = [r["id"] for r in results if not r["predicted_fits"]]
    return out


def print_report(
    results: list[dict[str, Any]], summary: dict[str, Any], worst: int, baseline_mfu: float
) -> None:
    print(f"{'id':48s} {'plan':36s} {'meas':>8s} {'pred':>8s} {'err':>7s} {'base':>7s}")
    for r in results:
        flag = "*" if r["approximate"] else " "
        print(
            f"{r['id'][:47]:47s}{flag} {r['plan'][:36]:36s} {r['measured_tokens_per_s_per_gpu']:8.0f} "
            f"{r['predicted_tokens_per_s_per_gpu']:8.0f} {r['error']:+7.1%} {r['baseline_error']:+7.1%}"
        )
    print("\n(* = approximate row: an assumption or an unexpressible layout, see measurements.yaml)")
    print(
        f"\n{'':28s}{'n':>4s} {'MAPE':>7s} {'median':>7s} {'rho':>6s} {'tau':>6s} | "
        f"{'base MAPE':>9s} {'rho':>6s} {'tau':>6s}  (baseline = constant MFU {baseline_mfu:.0%})"
    )
    m, b = summary["model"], summary["baseline"]
    rows = [("ALL", m["overall"], b["overall"])] + [
        (s, m["per_source"][s], b["per_source"][s]) for s in m["per_source"]
    ]
    for name, ms, bs in rows:
        print(
            f"{name[:28]:28s}{ms['n']:4d} {ms['mape']:7.1%} {ms['median_ape']:7.1%} "
            f"{ms['spearman']:+6.2f} "
            f"{ms['kendall_within_model_gpu']:+6.2f} | {bs['mape']:9.1%} {bs['spearman']:+6.2f} "
            f"{bs['kendall_within_model_gpu']:+6.2f}"
        )
    print(
        f"source-balanced MAPE: model {m['source_balanced_mape']:.1%}, "
        f"baseline {b['source_balanced_mape']:.1%}; "
        f"rows without approximations: model {m['core_rows'].get('mape', math.nan):.1%} "
        f"(n={m['core_rows'].get('n', 0)}), baseline {b['core_rows'].get('mape', math.nan):.1%}"
    )
    print(f"runs predicted to exceed HBM (no headroom): {len(summary['predicted_not_fitting'])}")
    print(f"\nworst {worst} rows by |error|:")
    for r in sorted(results, key=lambda r: -abs(r["error"]))[:worst]:
        t = r["time_breakdown_s"]
        total = sum(t.values()) or 1.0
        parts = " ".join(f"{k}={v / total:.0%}" for k, v in t.items() if v / total >= 0.01)
        print(
            f"  {r['id']:48s} meas {r['measured_tokens_per_s_per_gpu']:7.0f} pred "
            f"{r['predicted_tokens_per_s_per_gpu']:7.0f} ({r['error']:+.0%}) "
            f"mfu {r['predicted_mfu']:.2f} | {parts}"
        )


def _json_safe(value: Any) -> Any:
    """NaN (an undefined rank statistic) as null, so the results file is standard JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA_PATH)
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    parser.add_argument("--baseline-mfu", type=float, default=0.40)
    parser.add_argument("--worst", type=int, default=10)
    args = parser.parse_args(argv)
    ds = load_dataset(args.data)
    results = evaluate(ds, args.baseline_mfu)
    summary = summarize(results)
    print_report(results, summary, args.worst, args.baseline_mfu)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"data": str(args.data), "baseline_mfu": args.baseline_mfu, "summary": summary, "rows": results}
    args.out.write_text(json.dumps(_json_safe(payload), indent=1, allow_nan=False) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
