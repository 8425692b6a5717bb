"""Recent published runs on stacks the fit has not seen (issue #32): how far the shipped cost model lands.

Two runs files, none of their rows in the fit (every one is out of sample), each read as a runs file
(service/calibrate/runs.py) and priced with the shipped parameter set:
- benchmarks/published/deepspeed_recent.yaml: 2023-2026 runs of DeepSpeed ZeRO (stages 1-3, with CPU
  optimizer offload where the source ran it) on dense decoder LLMs, the seed's own stack;
- benchmarks/published/hopper_recent.yaml: 2024-2025 FSDP2 runs with torch.compile (and Float8) on H100
  and H200 from torchtitan's benchmarks folder.
A row the model cannot price (its plan or specs are refused) is listed as unpriced with the reason; the
published sources that were checked and left out are in the comment block at the end of each data file.

    python benchmarks/recent_runs_check.py  # [--params P] [--out FILE.json]

Prints per row predicted vs measured tokens/s per GPU, the predicted memory against what the source
measured (where it did), and per source, per GPU type and overall the mean log bias (mean
ln(pred/measured)) and the MAPE. Informational: no goal, exit 0.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from service.calibrate.crossval import run_stack
from service.calibrate.nearest import add_checks_option, save_checks
from service.calibrate.runs import load_dataset, measured_run
from service.costmodel import estimate
from service.spec.params import load_params

HERE = Path(__file__).resolve().parent
DATA_PATHS = (HERE / "published" / "deepspeed_recent.yaml", HERE / "published" / "hopper_recent.yaml")
CHECKS_NOTE = (
    "Published runs on stacks the fit has not seen (benchmarks/published/deepspeed_recent.yaml, "
    "hopper_recent.yaml), none of them fit on, each with the shipped parameter set's predicted / "
    "measured - 1. Written by benchmarks/recent_runs_check.py; the memo prints the nearest ones "
    "beside its number."
)
RESULTS_PATH = HERE / "results" / "recent_runs_check.json"
GIB = 2**30


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    logs = np.log([r["predicted_tokens_per_s_per_gpu"] / r["measured_tokens_per_s_per_gpu"] for r in rows])
    return {
        "runs": len(rows),
        "mean_log_bias": round(float(np.mean(logs)), 4),
        "mape": round(float(np.mean([abs(r["error"]) for r in rows])), 4),
        "median_error": round(float(np.median([r["error"] for r in rows])), 4),
        "interval_coverage": round(float(np.mean([r["covered"] for r in rows])), 4),
    }


def _rows(path: Path, params: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The priced rows of one runs file, and the ones the model refuses (id: why)."""
    ds = load_dataset(path)
    raw = {m["id"]: m for m in yaml.safe_load(path.read_text())["measurements"]}
    rows, unpriced = [], {}
    for row in ds.measurements:
        try:
            run = measured_run(ds, row)
            # Every run here did fit on its GPUs: ask with no headroom, as throughput_accuracy.py does.
            est = estimate(run.model, run.cluster, run.plan, run.workload, memory_headroom=0, params=params)
        except Exception as err:  # a layout or spec the model refuses: reported, not scored
            unpriced[row.id] = f"{type(err).__name__}: {err}"
            continue
        measured = float(run.tokens_per_s_per_gpu or 0.0)
        details = raw[row.id].get("details", {})
        low, high = (v / run.cluster.num_gpus for v in est.tokens_per_s_interval)
        peak = details.get("source_peak_reserved_gib", details.get("source_memory_gib"))
        rows.append(
            {
                "id": run.id,
                "data": path.name,
                "source": run.source,
                "model": row.model,
                "gpu": row.gpu,
                "num_gpus": run.cluster.num_gpus,
                "params_b": run.model.num_params / 1e9,
                "stack": run_stack(run),
                "seq_len": row.seq_len,
                "offload": run.plan.offload_optimizer or run.plan.offload_params,
                "label": est.plan.short(),
                "approximate": row.approximate,
                "measured_tokens_per_s_per_gpu": round(measured, 1),
                "predicted_tokens_per_s_per_gpu": round(est.tokens_per_s_per_gpu, 1),
                "error": round(est.tokens_per_s_per_gpu / measured - 1, 4),
                "interval_80": [round(low, 1), round(high, 1)],
                "covered": bool(low <= measured <= high),
                "predicted_step_time_s": round(est.step_time_s, 4),
                "time_breakdown_s": {
                    k: round(v, 4)
                    for k, v in est.time_breakdown_s.model_dump().items()
                    if isinstance(v, (int, float)) and v
                },
                "predicted_memory_gib": round(est.memory_per_gpu_bytes.total / GIB, 1),
                "source_peak_reserved_gib": peak,
                "fits": est.fits,
            }
        )
    return rows, unpriced


def _kernel_bound(row: dict[str, Any]) -> bool:
    return row["seq_len"] <= 8192 and not row["offload"]


def _grouped(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    return {name: _summary(rs) for name, rs in groups.items()}


def score(params_path: str | None = None) -> dict[str, Any]:
    params = load_params(params_path)
    rows: list[dict[str, Any]] = []
    unpriced: dict[str, str] = {}
    for path in DATA_PATHS:
        priced, refused = _rows(path, params)
        rows += priced
        unpriced |= refused
    exact = [r for r in rows if not r["approximate"]]
    return {
        "params": params.name,
        "data": [str(path.relative_to(HERE.parent)) for path in DATA_PATHS],
        "overall": _summary(rows) if rows else {},
        "overall_not_approximate": _summary(exact) if exact else {},
        "sources": _grouped(rows, "source"),
        "gpus": _grouped(rows, "gpu"),
        # The kernel rates alone: no CPU offload, sequences of at most 8K tokens (where attention is a small
        # share of the FLOPs and the long-sequence attention kernels of the other rows do not weigh).
        "gpus_short_no_offload": _grouped([r for r in rows if _kernel_bound(r)], "gpu"),
        "rows": rows,
        "unpriced": unpriced,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="parameter set (default: the shipped one)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    add_checks_option(parser, "recent_runs.yaml")
    args = parser.parse_args(argv)
    result = score(args.params)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    save_checks(args.checks, args.params, result, CHECKS_NOTE)
    print(f"parameter set {result['params']}, {', '.join(result['data'])}")
    for r in result["rows"]:
        mem = f"mem {r['predicted_memory_gib']:.1f} GiB" + ("" if r["fits"] else " (predicted not to fit)")
        if r["source_peak_reserved_gib"] is not None:
            mem += f", source peak {r['source_peak_reserved_gib']} GiB"
        print(
            f"  {r['id']}: {r['label']} measured {r['measured_tokens_per_s_per_gpu']:,.0f} predicted "
            f"{r['predicted_tokens_per_s_per_gpu']:,.0f} ({r['error']:+.1%})"
            f"{' ~' if r['approximate'] else ''}; {mem}"
        )
    short = {f"{gpu} (<= 8K, no offload)": v for gpu, v in result["gpus_short_no_offload"].items()}
    for name, s in [*result["sources"].items(), *result["gpus"].items(), *short.items()]:
        print(
            f"{name}: {s['runs']} runs, mean log bias {s['mean_log_bias']:+.3f}, MAPE {s['mape']:.1%}, "
            f"median error {s['median_error']:+.1%}, 80 % interval covers {s['interval_coverage']:.0%}"
        )
    for key in ("overall", "overall_not_approximate"):
        s = result[key]
        if s:
            print(f"{key}: {s['runs']} runs, mean log bias {s['mean_log_bias']:+.3f}, MAPE {s['mape']:.1%}")
    print(
        f"unpriced {len(result['unpriced'])}"
        + "".join(f"\n  {k}: {v}" for k, v in result["unpriced"].items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
