"""Extrapolation on CPU: calibrate on small proxies, predict a bigger run, then run it and compare.

Calibration runs: the tiny-cpu Llama with 1 and 2 layers on ONE worker (the plan's ZeRO stage, micro-
batch and recompute kept). Target: the same model with 4 layers on TWO workers (data parallel). All
run for real under Ray Train + DeepSpeed on this machine's CPU, so time terms may be fitted too (the
proxies ran on the target's device type):

- memory terms: `service.calibrate.fit(runs, names=MEMORY_PARAMS)` on the measured saved activations
  (the loss's logits taken off: the cost model keeps them as their own term);
- time terms: `fit(runs, names=TIME_PARAMS)` on the measured tokens/s per worker.

Reported (errors = predicted / measured − 1, goal |error| ≤ 10 %):
- step time: the worker's in-loop optimizer-step time (mean of the steps after warm-up);
- a diagnostic run, not fit on: the target's 4 layers on 1 worker, which splits the step-time error
  into the depth extrapolation (1-2 → 4 layers) and the second worker (gloo all-reduces per bucket);
- peak memory: (a) what the cost model counts per rank — model state + saved activations — against
  the tensors the worker counted (DeepSpeed's own buffers, autograd's saved tensors); (b) the process's
  peak RSS (VmHWM) against the cost model's total, which adds the catalog's CPU framework overhead;
  (c) the same RSS against model-state + activations + the runtime overhead measured on the
  proxies (RSS − counted tensors), i.e. with that term calibrated too. On CPU the RSS counts the
  Python runtime, torch and DeepSpeed libraries: (b) and (c) show how much of the peak is tensors.

    python benchmarks/extrapolation.py          # --steps 16 --out benchmarks/results/extrapolation.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from service.calibrate import MeasuredRun, fit
from service.costmodel import estimate
from service.spec import Plan, load_experiment
from service.spec.param_bands import MEMORY_PARAMS, TIME_PARAMS
from service.spec.params import ModelParams
from service.train.proxy_scale import proxy_cluster, proxy_model, proxy_plan, proxy_workload
from service.train.proxy_trial import run_proxy

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.10
PLAN = dict(zero_stage=1, micro_batch=4, grad_accum=1, recompute="none", precision="fp32")
CALIBRATION = ((1, 1), (2, 1))  # (layers, workers)
TARGET = (4, 2)
# Not used to fit: the target's layers on the calibration runs' one worker, which splits the target's
# error into what extrapolating the depth costs and what adding a data-parallel worker costs.
DIAGNOSTIC = (4, 1)


# Steps timed after WARMUP: a proxy's first steps run 1.5-3x slower than its steady state (allocator
# and cache warm-up; measured under torchrun on the 4-layer proxy: 222, 174, 105, 111 ms, then ~95-105),
# and the machine drifts ±20 % from run to run, so a 6-step run with 2 warm-up steps mis-measures.
WARMUP = 4


def experiment_for(base, layers: int, workers: int, steps: int):  # type: ignore[no-untyped-def]
    update = {"num_layers": layers, "num_workers": workers, "steps": steps, "warmup_steps": WARMUP}
    proxy = base.proxy.model_copy(update=update)
    return base.model_copy(update={"proxy": proxy})


def predict(exp, plan: Plan, params: ModelParams) -> dict[str, float]:  # type: ignore[no-untyped-def]
    est = estimate(
        proxy_model(exp),
        proxy_cluster(exp, plan.num_gpus),
        proxy_plan(exp, plan),
        proxy_workload(exp, plan),
        memory_headroom=0.0,
        params=params,
    )
    m = est.memory_per_gpu_bytes
    state = m.params + m.grads + m.optimizer + m.cpu_offload
    return {
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "state_bytes": state,
        "activation_bytes": m.activations + m.logits,
        "logits_bytes": m.logits,
        "tensor_bytes": state + m.activations + m.logits,
        "peak_bytes": m.total,
    }


def measure(exp, plan: Plan, storage: str, name: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    r = run_proxy(exp, plan, storage_path=storage, run_name=name)
    if r.status != "ok":
        raise SystemExit(f"{name}: {r.status}: {r.reason}")
    m = r.measured
    state, act = m["model_state_bytes_per_rank"], m["activation_bytes_per_rank"]
    return {
        "step_time_s": m["step_time_s"],
        "tokens_per_s": m["tokens_per_s"],
        "state_bytes": state,
        "activation_bytes": act,
        "tensor_bytes": state + act,
        "peak_bytes": m["peak_memory_bytes_per_rank"],
        "wall_s": r.wall_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extrapolation.json"))
    args = ap.parse_args()
    base = load_experiment(ROOT / "experiments" / "tiny-cpu.yaml")
    storage = tempfile.mkdtemp(prefix="extrapolation-")
    prior = ModelParams()
    started = time.time()
    runs, calib = [], []
    for layers, workers in CALIBRATION:
        exp = experiment_for(base, layers, workers, args.steps)
        plan = Plan(dp=workers, **PLAN)  # type: ignore[arg-type]
        measured = measure(exp, plan, storage, f"calib-{layers}l-{workers}w")
        logits = predict(exp, plan, prior)["logits_bytes"]
        runs.append(
            MeasuredRun(
                id=f"{layers}l-{workers}w",
                source="cpu-proxies",
                model=proxy_model(exp),
                cluster=proxy_cluster(exp, workers),
                workload=proxy_workload(exp, plan),
                plan=proxy_plan(exp, plan),
                tokens_per_s_per_gpu=measured["tokens_per_s"] / workers,
                activations_bytes=measured["activation_bytes"] - logits,
                model_state_bytes=measured["state_bytes"],
            )
        )
        calib.append(
            {
                "layers": layers,
                "workers": workers,
                "measured": measured,
                "predicted_prior": predict(exp, plan, prior),
            }
        )
    memory_fit = fit(runs, prior=prior, names=MEMORY_PARAMS)
    time_fit = fit(runs, prior=memory_fit.params, names=TIME_PARAMS)
    params = time_fit.params
    for c in calib:  # in-sample: how well the fitted set reproduces the runs it was fit on
        e = experiment_for(base, c["layers"], c["workers"], args.steps)
        c["predicted_calibrated"] = predict(e, Plan(dp=c["workers"], **PLAN), params)  # type: ignore[arg-type]
    runtime = [c["measured"]["peak_bytes"] - c["measured"]["tensor_bytes"] for c in calib]
    runtime_bytes = sum(runtime) / len(runtime)

    layers, workers = TARGET
    exp = experiment_for(base, layers, workers, args.steps)
    plan = Plan(dp=workers, **PLAN)  # type: ignore[arg-type]
    pred_prior, pred = predict(exp, plan, prior), predict(exp, plan, params)
    measured = measure(exp, plan, storage, f"target-{layers}l-{workers}w")
    d_layers, d_workers = DIAGNOSTIC
    d_exp = experiment_for(base, d_layers, d_workers, args.steps)
    d_plan = Plan(dp=d_workers, **PLAN)  # type: ignore[arg-type]
    d_pred = predict(d_exp, d_plan, params)
    d_measured = measure(d_exp, d_plan, storage, f"diagnostic-{d_layers}l-{d_workers}w")
    added = {
        "measured_s": measured["step_time_s"] - d_measured["step_time_s"],
        "predicted_s": pred["step_time_s"] - d_pred["step_time_s"],
    }

    def err(p: float, m: float) -> float:
        return p / m - 1.0

    errors = {
        "step_time": {
            "prior": err(pred_prior["step_time_s"], measured["step_time_s"]),
            "calibrated": err(pred["step_time_s"], measured["step_time_s"]),
        },
        "memory_tensors": {
            "prior": err(pred_prior["tensor_bytes"], measured["tensor_bytes"]),
            "calibrated": err(pred["tensor_bytes"], measured["tensor_bytes"]),
        },
        "peak_rss_catalog_overhead": {"calibrated": err(pred["peak_bytes"], measured["peak_bytes"])},
        "peak_rss_runtime_from_proxies": {
            "calibrated": err(pred["tensor_bytes"] + runtime_bytes, measured["peak_bytes"])
        },
    }
    result = {
        "plan": PLAN,
        "calibration_runs": calib,
        "fitted": {
            "memory": {n: params[n] for n in MEMORY_PARAMS},
            "time": {n: params[n] for n in TIME_PARAMS},
            "time_at_bounds": params.at_bounds(),
        },
        "runtime_overhead_bytes_from_proxies": runtime_bytes,
        "target": {
            "layers": layers,
            "workers": workers,
            "measured": measured,
            "predicted_prior": pred_prior,
            "predicted_calibrated": pred,
        },
        "diagnostic": {
            "layers": d_layers,
            "workers": d_workers,
            "measured": d_measured,
            "predicted_calibrated": d_pred,
            "step_time_error": err(d_pred["step_time_s"], d_measured["step_time_s"]),
            "second_worker_adds_step_time": added,
        },
        "errors": errors,
        "goal": GOAL,
        "met": {k: abs(v.get("calibrated", 1.0)) <= GOAL for k, v in errors.items()},
        "wall_s": time.time() - started,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for k, v in errors.items():
        line = ", ".join(f"{side} {x:+.1%}" for side, x in v.items())
        print(f"{k:<32} {line}   {'met' if result['met'][k] else 'NOT met'} (goal ±{GOAL:.0%})")
    diag = result["diagnostic"]
    ms_measured, ms_predicted = added["measured_s"] * 1e3, added["predicted_s"] * 1e3
    print(
        f"diagnostic {d_layers} layers, {d_workers} worker: step time {diag['step_time_error']:+.1%}; "
        f"the second worker adds {ms_measured:.1f} ms measured, {ms_predicted:.1f} ms predicted"
    )
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0 if all(result["met"][k] for k in ("step_time", "memory_tensors")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
