"""Recent published DeepSpeed ZeRO runs (issue #32): how far the shipped cost model lands from them.

Each row of benchmarks/published/deepspeed_recent.yaml is a 2023-2026 measured training run of DeepSpeed
ZeRO (stages 1-3, with CPU optimizer offload where the source ran it) on a dense decoder LLM, read as a
runs file (service/calibrate/runs.py) and priced with the shipped parameter set. Nothing was fitted to
these rows: every one is out of sample. A row the model cannot price (its plan or specs are refused) is
listed as unpriced with the reason; the published sources that were checked and left out are in the
comment block at the end of the data file.

    python benchmarks/deepspeed_recent_check.py  # [--params P] [--out FILE.json]

Prints per row predicted vs measured tokens/s per GPU, the predicted memory against what the source
measured (where it did), and per source and overall the mean log bias (mean ln(pred/measured)) and the
MAPE. Informational: no goal, exit 0.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from service.calibrate.runs import load_dataset, measured_run
from service.costmodel import estimate
from service.spec.params import load_params

HERE = Path(__file__).resolve().parent
DATA_PATH = HERE / "published" / "deepspeed_recent.yaml"
RESULTS_PATH = HERE / "results" / "deepspeed_recent_check.json"
GIB = 2**30


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    logs = np.log([r["predicted_tokens_per_s_per_gpu"] / r["measured_tokens_per_s_per_gpu"] for r in rows])
    return {
        "runs": len(rows),
        "mean_log_bias": round(float(np.mean(logs)), 4),
        "mape": round(float(np.mean([abs(r["error"]) for r in rows])), 4),
        "median_error": round(float(np.median([r["error"] for r in rows])), 4),
    }


def score(params_path: str | None = None) -> dict[str, Any]:
    params = load_params(params_path)
    ds = load_dataset(DATA_PATH)
    raw = {m["id"]: m for m in yaml.safe_load(DATA_PATH.read_text())["measurements"]}
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
        peak = raw[row.id].get("details", {}).get("source_peak_reserved_gib")
        rows.append(
            {
                "id": run.id,
                "source": run.source,
                "model": row.model,
                "gpu": row.gpu,
                "label": est.plan.short(),
                "approximate": row.approximate,
                "measured_tokens_per_s_per_gpu": round(measured, 1),
                "predicted_tokens_per_s_per_gpu": round(est.tokens_per_s_per_gpu, 1),
                "error": round(est.tokens_per_s_per_gpu / measured - 1, 4),
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
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    return {
        "params": params.name,
        "data": str(DATA_PATH.relative_to(HERE.parent)),
        "overall": _summary(rows) if rows else {},
        "overall_not_approximate": _summary([r for r in rows if not r["approximate"]])
        if any(not r["approximate"] for r in rows)
        else {},
        "sources": {name: _summary(rs) for name, rs in by_source.items()},
        "rows": rows,
        "unpriced": unpriced,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="parameter set (default: the shipped one)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    result = score(args.params)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"parameter set {result['params']}, {result['data']}")
    for r in result["rows"]:
        mem = f"mem {r['predicted_memory_gib']:.1f} GiB" + ("" if r["fits"] else " (predicted not to fit)")
        if r["source_peak_reserved_gib"] is not None:
            mem += f", source peak {r['source_peak_reserved_gib']} GiB"
        print(
            f"  {r['id']}: {r['label']} measured {r['measured_tokens_per_s_per_gpu']:,.0f} predicted "
            f"{r['predicted_tokens_per_s_per_gpu']:,.0f} ({r['error']:+.1%})"
            f"{' ~' if r['approximate'] else ''}; {mem}"
        )
    for name, s in result["sources"].items():
        print(
            f"{name}: {s['runs']} runs, mean log bias {s['mean_log_bias']:+.3f}, MAPE {s['mape']:.1%}, "
            f"median error {s['median_error']:+.1%}"
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
