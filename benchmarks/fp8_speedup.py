"""FP8 against bf16 on published pairs: does the cost model's FP8 mechanism hold?

Each pair in benchmarks/published/fp8_pairs.yaml is one published setup run twice, in bf16 and in FP8,
on the same software stack. Their stack (torch.compile) is one the cost model does not describe, so the
absolute tokens/s are shown for information only; what is scored is the speed-up, FP8 over bf16, which
cancels what the two runs share and leaves the FP8 terms (service/costmodel/fp8.py: block GEMMs at the
FP8 tensor-core rate, the casts, attention and the rest in bf16).

    python benchmarks/fp8_speedup.py  # --data D --params P --out benchmarks/results/fp8_speedup.json

Goal: the predicted speed-up within 10 % of the published one on every pair. Exit 1 when missed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from service.calibrate.runs import Dataset, Measurement, load_dataset, measured_run
from service.costmodel import estimate_table
from service.spec.params import ModelParams, load_params

HERE = Path(__file__).resolve().parent
DATA_PATH = HERE / "published" / "fp8_pairs.yaml"
RESULTS_PATH = HERE / "results" / "fp8_speedup.json"
GOAL = 0.10
PAIR_FREE = {"id", "ref", "precision", "measured"}  # the fields the two rows of a pair may differ in


def pairs(ds: Dataset) -> list[tuple[Measurement, Measurement]]:
    """(bf16 row, FP8 row) for every setup the file runs in both precisions; a setup with another
    number of rows is an error naming its first row."""
    groups: dict[str, list[Measurement]] = {}
    for row in ds.measurements:
        key = json.dumps(row.model_dump(exclude=PAIR_FREE, mode="json"), sort_keys=True)
        groups.setdefault(key, []).append(row)
    out = []
    for rows in groups.values():
        by_precision = {r.precision: r for r in rows}
        if len(rows) != 2 or set(by_precision) != {"bf16", "fp8"}:
            raise ValueError(f"{rows[0].id}: a pair is one bf16 and one fp8 row of the same setup")
        out.append((by_precision["bf16"], by_precision["fp8"]))
    return out


def tokens_per_s_per_gpu(ds: Dataset, row: Measurement, params: ModelParams) -> tuple[float, float]:
    """(published, predicted) tokens/s per GPU of one row."""
    run = measured_run(ds, row)
    table = estimate_table(run.model, run.cluster, run.workload, run.plan_table(), 0.0, params)
    assert run.tokens_per_s_per_gpu is not None  # every row of a runs file has a measurement
    return run.tokens_per_s_per_gpu, float(table.tokens_per_s_per_gpu[0])


def score(ds: Dataset, params: ModelParams) -> list[dict[str, Any]]:
    """One record per pair: published and predicted tokens/s of both rows, both speed-ups, the error."""
    results = []
    for bf16, fp8 in pairs(ds):
        both = {r.precision: tokens_per_s_per_gpu(ds, r, params) for r in (bf16, fp8)}
        measured = {k: v[0] for k, v in both.items()}
        predicted = {k: v[1] for k, v in both.items()}
        measured_speedup = measured["fp8"] / measured["bf16"]
        predicted_speedup = predicted["fp8"] / predicted["bf16"]
        results.append({
            "pair": [bf16.id, fp8.id],
            "measured_tokens_per_s_per_gpu": measured,
            "predicted_tokens_per_s_per_gpu": predicted,
            "measured_speedup": measured_speedup,
            "predicted_speedup": predicted_speedup,
            "speedup_error": predicted_speedup / measured_speedup - 1.0,
        })  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA_PATH)
    parser.add_argument("--params", default=None, help="parameter set (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)
    params = load_params(args.params)
    results = score(load_dataset(args.data), params)
    met = all(abs(r["speedup_error"]) <= GOAL for r in results)
    out = {"params": f"{params.name} v{params.version}", "goal_abs_speedup_error": GOAL, "met": met}
    out["pairs"] = results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for r in results:
        print(
            f"{r['pair'][0]:48s} FP8/bf16 published {r['measured_speedup']:.3f}"
            f" predicted {r['predicted_speedup']:.3f} ({100 * r['speedup_error']:+.1f} %)"
        )
    verdict = "met" if met else "NOT met"
    print(f"goal |error| <= {100 * GOAL:.0f} % on every pair: {verdict}; wrote {args.out}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
