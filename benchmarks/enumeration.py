"""The whole plan space at pre-training scale, ranked on one core, against the scalar path.

Llama-3-70B and Llama-3-405B on 1,024, 4,096 and 16,384 H100s (seq 8192, a 16 M-token batch as
Llama 3 used; Dubey et al. 2024, §3.4), and the 671B mixture of experts DeepSeek-V3 on 2,048 and
16,384 (its own workload, with expert parallelism and expert tensor parallelism) over every engine
(deepspeed, megatron, fsdp), every dp·tp·pp·cp with cp ≤ 16, megatron's interleaved chunks,
ZeRO 0-3, optimizer / parameter offload, power-of-two micro-batches ≤ 64, three recompute policies,
sequence parallelism and the precisions the GPU runs. Each scenario is timed end to end, pinned to
one core, as the planner ranks it with `prune` (`rank_plans(prune=True, keep_top=10)`: enumerate +
vectorised rule filter + a lower bound per layout + `estimate_table` on the layouts that can still win +
selection, service/plans/bound.py). The in-run baselines: the exhaustive ranking (every valid plan
scored), which must select the same plan, and the scalar path (`plan_problem` + `estimate()` one plan
at a time) on a sample of the valid plans, extrapolated.
It also prints the 70B / 1,024-GPU answer, per engine and overall, with its MFU.

Usage: python benchmarks/enumeration.py [--repeats 3] [--scalar-sample 100] [--out PATH]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: no BLAS threads (set before numpy is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from service.catalog import load_model  # noqa: E402
from service.costmodel import estimate  # noqa: E402
from service.planner import rank_plans  # noqa: E402
from service.spec import Budget, ClusterSpec, ModelSpec, Workload, plan_problem  # noqa: E402
from service.spec.plan import Precision  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "enumeration.json"
ENGINES = ("deepspeed", "megatron", "fsdp")
TARGET_S = 1.0
# Llama 3.1 405B (HF meta-llama/Llama-3.1-405B config.json): not in the catalog, so inline here.
LLAMA3_405B = ModelSpec(
    name="llama3-405b",
    num_layers=126,
    hidden_size=16384,
    num_attention_heads=128,
    num_key_value_heads=8,
    ffn_hidden_size=53248,
    vocab_size=128256,
    mlp="swiglu",
    tie_word_embeddings=False,
)


def precisions(gpu: str) -> tuple[Precision, ...]:
    """The precisions the planner compares on `gpu` (fp8 where the catalog gives an FP8 rate)."""
    from service.catalog import load_gpu

    has_fp8 = getattr(load_gpu(gpu), "peak_tflops_fp8", None)
    return ("bf16", "fp8") if has_fp8 else ("bf16",)  # type: ignore[return-value]


def scenario(model: ModelSpec, gpus: int) -> tuple[ModelSpec, ClusterSpec, Workload]:
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=gpus // 8, gpus_per_node=8)  # type: ignore[arg-type]
    if model.moe is not None:
        # DeepSeek-V3's pre-training: 4,096-token sequences, a batch that ramps to 15,360 sequences,
        # 14.8 T tokens (DeepSeek-AI 2024, arXiv:2412.19437, §4.2).
        workload = Workload(seq_len=4096, global_batch_sequences=15360, tokens_to_train=14.8e12)
    else:
        workload = Workload(seq_len=8192, global_batch_tokens=16 * 2**20, tokens_to_train=15e12)
    return model, cluster, workload


# (model, GPU counts): the dense Llama 3 pair, and a 671B mixture of experts (DeepSeek-V3: 256 routed
# experts, top-8, one shared expert, multi-head latent attention) on 2,048 GPUs (its own run's size)
# and 16,384, where expert parallelism multiplies the layouts (ep and expert tp on top of dp·tp·pp·cp).
SCENARIOS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("llama3-70b", (1024, 4096, 16384)),
    ("llama3-405b", (1024, 4096, 16384)),
    ("deepseek-v3", (2048, 16384)),
)


def rank(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    engines: tuple[str, ...],
    precision: tuple[Precision, ...] | None = None,
    prune: bool = True,
) -> Any:
    budget = Budget(objective="throughput")
    chosen = precision or precisions(cluster.gpu.name)
    return rank_plans(
        model,
        cluster,
        workload,
        budget,
        precision=chosen,
        engines=engines,
        prune=prune,
        keep_top=10,  # type: ignore[arg-type]
    )


def scalar_s_per_plan(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, ranking: Any, n: int
) -> float:
    """Seconds per plan of the scalar path (validate + estimate one plan) on `n` of the valid plans."""
    plans = ranking.enumeration.plans
    rows = range(0, len(plans), max(1, len(plans) // n))
    started = time.perf_counter()
    for i in rows:
        plan = plans.row(i)
        assert plan_problem(plan, model, cluster, workload) is None
        estimate(model, cluster, plan, workload)
    return (time.perf_counter() - started) / len(rows)


def best(ranking: Any) -> dict[str, Any]:
    return best_row(ranking, int(ranking.selection.order[0]))


def best_row(ranking: Any, row: int) -> dict[str, Any]:
    est = ranking.estimates
    return {
        "plan": ranking.enumeration.plans.row(row).short(),
        "precision": ranking.enumeration.plans.row(row).precision,
        "tokens_per_s_per_gpu": round(float(est.tokens_per_s_per_gpu[row]), 1),
        "mfu": round(float(est.mfu[row]), 4),
        "memory_gib": round(float(est.total_bytes[row]) / 2**30, 1),
    }


# One ranking in a fresh process (a process's earlier arrays change what its allocator and the kernel
# do for the next ones): argv = benchmarks folder, model, GPUs, "ordinary" | "huge".
ONE_RANKING = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import enumeration
from service.catalog import load_model
from service.plans import pages
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
pages.ENABLED = sys.argv[4] == "ordinary"
m, c, w = enumeration.scenario(load_model(sys.argv[2]), int(sys.argv[3]))
started = time.perf_counter()
enumeration.rank(m, c, w, enumeration.ENGINES, prune=False)
print(time.perf_counter() - started)
"""


def pages_baseline(model_name: str, gpus: int) -> dict[str, Any]:
    """The scenario ranked exhaustively in fresh processes with ordinary pages (the planner's way) and
    with NumPy's huge pages (its default), one after the other: seconds each and their ratio."""
    import subprocess
    import sys

    seconds = {}
    for pages in ("ordinary", "huge"):
        cmd = [sys.executable, "-c", ONE_RANKING, str(Path(__file__).parent), model_name, str(gpus), pages]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
        seconds[f"{pages}_pages_s"] = round(float(out.strip().splitlines()[-1]), 3)
    ratio = round(seconds["huge_pages_s"] / seconds["ordinary_pages_s"], 2)
    print(f"{model_name} {gpus} GPUs, fresh processes: {seconds}, huge pages / ordinary {ratio}")
    return {"scenario": f"{model_name}-{gpus}xh100", **seconds, "huge_over_ordinary": ratio}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scalar-sample", type=int, default=100)
    ap.add_argument("--out", type=Path, default=RESULTS_PATH)
    ap.add_argument(
        "--pages-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also rank the largest space with NumPy's huge pages, as a baseline (service/plans/pages.py)",
    )
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    results: dict[str, Any] = {"one_core": hasattr(os, "sched_setaffinity"), "target_s": TARGET_S}
    speed = {}
    for name, counts in SCENARIOS:
        model = LLAMA3_405B if name == "llama3-405b" else load_model(name)
        for gpus in counts:
            m, c, w = scenario(model, gpus)
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                ranking = rank(m, c, w, ENGINES)
                times.append(time.perf_counter() - started)
            started = time.perf_counter()
            exhaustive = rank(m, c, w, ENGINES, prune=False)
            exhaustive_s = time.perf_counter() - started
            scalar = scalar_s_per_plan(m, c, w, exhaustive, args.scalar_sample)
            valid = len(exhaustive.enumeration.plans)
            speed[f"{model.name}-{gpus}xh100"] = {
                "candidates": ranking.enumeration.candidates,
                "valid_plans": valid,
                "plans_scored": len(ranking.enumeration.plans),
                "layouts_skipped": ranking.pruning.structures if ranking.pruning else 0,
                "rank_s_best": round(min(times), 4),
                "exhaustive_s": round(exhaustive_s, 3),
                "speedup_vs_exhaustive": round(exhaustive_s / min(times), 1),
                "scalar_s_extrapolated": round(scalar * valid, 2),
                "speedup_vs_scalar": round(scalar * valid / min(times), 1),
                "same_choice_as_exhaustive": best(ranking)["plan"] == best(exhaustive)["plan"],
                "meets_target": min(times) < TARGET_S,
                "best": best(ranking),
            }
            print(f"{model.name:12s} {gpus:6d} GPUs: {speed[f'{model.name}-{gpus}xh100']}")
    results["speed"] = speed
    if args.pages_baseline:
        results["ordinary_pages"] = pages_baseline("deepseek-v3", 2048)
    m, c, w = scenario(load_model("llama3-70b"), 1024)
    answers: dict[str, Any] = {}
    for precision in ("bf16", "fp8"):
        for engines in [(e,) for e in ENGINES] + [ENGINES]:
            key = f"{engines[0] if len(engines) == 1 else 'all_engines'} {precision}"
            answers[key] = best(rank(m, c, w, engines, (precision,)))  # type: ignore[arg-type]
    # The best 3D layout (tp > 1 and pp > 1) of the DeepSpeed bf16 ranking, and its gap to the best.
    ranking = rank(m, c, w, ("deepspeed",), ("bf16",), prune=False)  # every 3D layout scored
    plans = ranking.enumeration.plans
    rows = [int(r) for r in ranking.selection.order if plans.tp[r] > 1 and plans.pp[r] > 1]
    if rows:
        first = int(ranking.selection.order[0])
        answers["deepspeed bf16 3D"] = {
            **best_row(ranking, rows[0]),
            "behind_best": round(
                1 - float(ranking.estimates.tokens_per_s[rows[0]] / ranking.estimates.tokens_per_s[first]), 4
            ),
        }
    results["answer_llama3_70b_1024xh100"] = answers
    print("70B / 1,024 H100, seq 8192:", json.dumps(results["answer_llama3_70b_1024xh100"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    met = all(s["meets_target"] and s["same_choice_as_exhaustive"] for s in speed.values())
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
