"""Measured vs predicted on one real GPU: 13B-width Llama proxies (2-4 layers) over a few plans, ≤ 5 min.

No Ray (the GPU image has none): each plan runs the same `run_worker` loop the Ray workers run, as a
single-rank DeepSpeed job in this process (dp = tp = pp = 1 on one GPU; ZeRO stages, recompute,
micro-batch and layer count vary). For each plan it writes the cost model's prediction at the same scale
next to what the GPU held and how fast it ran:
model-state bytes (DeepSpeed's tensors), saved-activation bytes (autograd hooks), peak memory
(`torch.cuda.max_memory_allocated`), step time and tokens/s.

Prerequisites on the GPU machine (it has torch, transformers and numpy): DeepSpeed (a pure-Python wheel
built with `pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation`), `hjson`, `pydantic`, `pyyaml`,
`psutil`, and this package (`pip install --no-deps -e .`). The optimizer is torch's AdamW
(`torch_adam`), so no DeepSpeed CUDA op is compiled.

    python benchmarks/gpu_proxy_check.py                 # writes benchmarks/results/gpu_proxy_check.json
    python benchmarks/gpu_proxy_check.py --gpu h100-sxm-80gb --plans 2

`--device cpu --experiment experiments/tiny-cpu.yaml` is a smoke run of the same flow on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `service` from this checkout, installed or not (the GPU image has it not)

# (layers, plan fields): dp = tp = pp = 1 on one GPU; bf16 as production.
PLANS: list[tuple[int, dict]] = [
    (2, {"zero_stage": 0, "micro_batch": 1, "grad_accum": 2, "recompute": "none"}),
    (2, {"zero_stage": 1, "micro_batch": 1, "grad_accum": 2, "recompute": "selective"}),
    (2, {"zero_stage": 2, "micro_batch": 2, "grad_accum": 1, "recompute": "full"}),
    (2, {"zero_stage": 3, "micro_batch": 1, "grad_accum": 2, "recompute": "none"}),
    (4, {"zero_stage": 1, "micro_batch": 1, "grad_accum": 2, "recompute": "none"}),
]
# `--set depth`: one plan over 1-8 layers, and 8 layers at micro-batch 2, to split the step time into a
# per-layer and a fixed part (embedding, lm_head, loss, optimizer step, framework) as measured and as
# predicted: the proxies' promise is that what they measure at 1-8 layers extrapolates to 40.
DEPTH_PLANS: list[tuple[int, dict]] = [
    (layers, {"zero_stage": 1, "micro_batch": 1, "grad_accum": 2, "recompute": "none"})
    for layers in (1, 2, 4, 8)
] + [(8, {"zero_stage": 1, "micro_batch": 2, "grad_accum": 1, "recompute": "none"})]
PLAN_SETS = {"plans": PLANS, "depth": DEPTH_PLANS}


def catalog_gpu_name() -> str:
    """The catalog entry for the GPU in this machine."""
    import torch

    name = torch.cuda.get_device_name(0).lower()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if "h200" in name:
        return "h200-sxm-141gb"
    if "h100" in name:
        return "h100-sxm-80gb"
    if "a100" in name:
        return "a100-sxm-80gb" if total_gib > 50 else "a100-sxm-40gb"
    raise SystemExit(f"no catalog entry for {name!r}; pass --gpu")


def experiment_for(base, layers: int, gpu: str, steps: int, device: str = "cuda"):
    """The 13B experiment as a one-GPU, `layers`-layer bf16 proxy on this machine's GPU.

    `device="cpu"` is the smoke run of this script on a machine without a GPU (the experiment's own
    precision, one CPU rank): it checks the flow, not the numbers.
    """
    from service.spec import ClusterSpec

    proxy = base.proxy.model_copy(
        update={
            "num_layers": layers,
            "num_workers": 1,
            "device": device,
            "precision": "bf16" if device == "cuda" else base.proxy.precision,
            "steps": steps,
            "warmup_steps": 2,
            "checkpoint_every": 0,
        }
    )
    cluster = ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=1)  # type: ignore[arg-type]
    return base.model_copy(update={"proxy": proxy, "cluster": cluster})


def run_one(experiment, plan, steps: int) -> dict:
    import torch

    from service.train.proxy_scale import predict_proxy
    from service.train.trainer import worker_config
    from service.train.worker import LOG_FILE, run_worker

    run_dir = tempfile.mkdtemp(prefix="gpu-proxy-")
    predicted = predict_proxy(experiment, plan)
    reported = predicted.prefixed("predicted_")  # the names the worker reports them under
    cfg = worker_config(
        experiment, plan, run_dir=run_dir, steps=steps, checkpoint_every=0, predicted=reported
    )
    reports: list[dict] = []
    t0 = time.time()
    losses = run_worker(cfg.model_dump(mode="json"), lambda m, _d: reports.append(m))
    wall_s = time.time() - t0
    log = [json.loads(line) for line in (Path(run_dir) / LOG_FILE).read_text().splitlines()]
    detail: dict = next((r["detail"] for r in log if "detail" in r), {})
    last = reports[-1]
    measured = {k.removeprefix("measured_"): v for k, v in last.items() if k.startswith("measured_")}
    measured.update(step_time_s=last["step_time_s"], tokens_per_s=last["tokens_per_s"])
    pred = predicted.as_dict()
    ratios = {
        k: measured[k] / pred[k]
        for k in (
            "model_state_bytes_per_rank",
            "activation_bytes_per_rank",
            "peak_memory_bytes_per_rank",
            "step_time_s",
        )
        if pred.get(k)
    }
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "plan": plan.short(),
        "layers": cfg.model.num_layers,
        "losses": losses,
        "measured": measured,
        "predicted": pred,
        "measured_over_predicted": ratios,
        "detail": detail,
        "wall_s": wall_s,
    }


def write_results(out: str, results: list[dict], gpu: str, base, started: float, cuda: bool) -> None:
    import torch

    doc = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (smoke run)",
        "catalog_gpu": gpu,
        "model": base.model.name,
        "seq_len": base.workload.seq_len,
        "total_s": time.time() - started,
        "results": results,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default=str(ROOT / "experiments/llama2-13b-32xh100.yaml"))
    parser.add_argument("--gpu", help="catalog GPU name (default: detected)")
    parser.add_argument(
        "--set", choices=sorted(PLAN_SETS), default="plans", help="which plans (default: plans)"
    )
    parser.add_argument("--plans", type=int, default=99, help="run the first N plans of the set")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plan-index", type=int, help=argparse.SUPPRESS)  # internal: the child process
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no plan after this many seconds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_proxy_check.json"))
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a smoke run of the flow without a GPU (use with --experiment experiments/tiny-cpu.yaml)",
    )
    args = parser.parse_args()
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29741"),
    ):
        os.environ.setdefault(key, value)
    import torch

    from service.spec import Plan, load_experiment

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this check needs one (tests never do; --device cpu is a smoke run)")
    gpu = args.gpu or (catalog_gpu_name() if cuda else "cpu")
    base = load_experiment(args.experiment)
    precision = "bf16" if cuda else base.proxy.precision
    if args.plan_index is not None:  # the child: one plan, in a process of its own
        layers, fields = PLAN_SETS[args.set][args.plan_index]
        experiment = experiment_for(base, layers, gpu, args.steps, args.device)
        plan = Plan(dp=1, tp=1, pp=1, precision=precision, **fields)
        try:
            result = run_one(experiment, plan, args.steps)
        except torch.OutOfMemoryError as err:
            result = {"plan": plan.short(), "layers": layers, "status": "oom", "reason": str(err)[:300]}
        Path(args.out).write_text(json.dumps(result, default=str))
        return 0
    # Each plan in a fresh process: DeepSpeed engines keep references (and CUDA memory) after a plan
    # ends, so a second plan in the same process measured 1.7-1.9x its peak (first H200 run).
    results, started = [], time.time()
    for index, (layers, fields) in enumerate(PLAN_SETS[args.set][: args.plans]):
        child_out = Path(tempfile.mkdtemp(prefix="gpu-proxy-plan-")) / "result.json"
        cmd = [sys.executable, __file__, "--plan-index", str(index), "--out", str(child_out)]
        cmd += ["--experiment", args.experiment, "--gpu", gpu, "--steps", str(args.steps)]
        cmd += ["--device", args.device, "--set", args.set]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if child_out.exists():
            results.append(json.loads(child_out.read_text()))
        else:
            plan_name = Plan(dp=1, tp=1, pp=1, precision=precision, **fields).short()
            tail = (proc.stdout + proc.stderr)[-1500:]
            print(tail, flush=True)
            results.append(
                {
                    "plan": plan_name,
                    "layers": layers,
                    "status": "error",
                    "rc": proc.returncode,
                    "log_tail": tail,
                }
            )
        print(json.dumps(results[-1].get("measured_over_predicted", results[-1]), default=str), flush=True)
        write_results(args.out, results, gpu, base, started, cuda)  # after every plan: a timeout keeps them
        if time.time() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(results)} plans ran", flush=True)
            break
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
