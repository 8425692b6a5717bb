"""The per-worker training loop: builds the proxy model under DeepSpeed, trains, measures, checkpoints.

`train_loop_per_worker(config)` is what Ray Train runs on every worker; `run_worker(config, reporter)`
is the same loop for any launcher (the torchrun benchmark and the GPU check use it without Ray).
`config` is a `WorkerConfig` dumped to a dict (Ray sends it to each worker).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from service.spec.model import ModelSpec
from service.spec.plan import Plan
from service.spec.proxy import ProxySpec
from service.train import checkpoint, cpu_layout, hf_data, measure, moe, rank_memory
from service.train.data import ShardedLoader, token_source
from service.train.device import apply_collective_timeout, cap_memory, pick_device, seed_everything
from service.train.ds_config import deepspeed_config, with_settings
from service.train.model import apply_recompute, build_causal_lm, build_model, forward_loss
from service.train.startup import import_deepspeed
from service.train.weights import FineTune, export_hf, load_causal_lm
from service.train.weights_pp import evaluate_pipeline, pipeline_micro_batches

FAILURE_MARKER = "injected_failure.done"
LOG_FILE = "proxy_log.jsonl"


class WorkerConfig(BaseModel):
    """Everything a worker needs, sent by the driver."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    plan: Plan
    proxy: ProxySpec
    seq_len: int
    steps: int
    checkpoint_every: int = 0
    save_final: bool = False  # a checkpoint after the last step too: the production run's trained weights
    inject_failure_at_step: int | None = None
    run_dir: str  # shared directory for the step log and the failure marker
    predicted: dict[str, float] = {}
    stall: dict[str, float] | None = None  # test hook: {"rank", "step", "seconds"}, see `_maybe_stall`
    finetune: FineTune | None = None  # the user's weights and data (service.train.weights, hf_data)
    # The production run's DeepSpeed settings beyond the proxies' (ds_config.production_settings)
    ds_settings: dict[str, Any] = {}


# A reporter takes (metrics, checkpoint directory or None) and returns nothing. Metrics are floats,
# plus `device_fallback` (a string) when the worker ran on CPU although a GPU was asked for.
Reporter = Callable[[dict[str, Any], str | None], None]


def build_engine(cfg: WorkerConfig, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """DeepSpeed engine for the plan: a PipelineEngine when pp > 1, an engine around the tensor-parallel
    stages when tp > 1 (with their topology as `mpu`; fine-tuning: the checkpoint's slices), else an
    engine around the HF model."""
    import deepspeed

    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    ds_config = deepspeed_config(cfg.plan, cfg.proxy, cfg.model, bf16_supported=bf16_ok)
    ds_config = with_settings(ds_config, cfg.ds_settings)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
    dtype = torch.float16 if ds_config["fp16"]["enabled"] else dtype
    mpu = None
    if cfg.plan.pp > 1 or cfg.plan.tp > 1 or cfg.plan.cp > 1:
        weights = cfg.finetune.weights if cfg.finetune is not None else None
        model, mpu = build_model(cfg.model, cfg.proxy.seed, cfg.plan, dtype, weights, ds_config)
    elif cfg.finetune is not None:  # the user's checkpoint (partitioned at load under ZeRO-3)
        model = load_causal_lm(cfg.finetune.weights, ds_config, dtype)
        apply_recompute(model, cfg.plan.recompute)
    else:
        model = build_causal_lm(cfg.model, cfg.proxy.seed, dtype, device, plan=cfg.plan)
        apply_recompute(model, cfg.plan.recompute)
    model = model.to(device)
    if cfg.model.moe is not None:  # expert parameters in groups of their own (service.train.moe)
        params: list[Any] = moe.optimizer_param_groups(model)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config, mpu=mpu)
    if cfg.model.moe is not None:
        import torch.distributed as dist

        moe.check_expert_parallel_rank(engine, cfg.plan, dist.get_rank())
    return engine, ds_config


def data_parallel_rank(engine: Any) -> tuple[int, int]:
    """(rank, size) of this worker in its data-parallel group (TP and PP peers share a rank)."""
    import torch.distributed as dist

    group = engine.data_parallel_group if hasattr(engine, "data_parallel_group") else None
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _train_step(
    engine: Any, loader: ShardedLoader, cfg: WorkerConfig, meter: measure.ActivationMeter | None
) -> float:
    """One optimizer step (grad_accum micro-batches); returns the mean loss over its micro-batches.

    `meter` counts saved activations (its autograd hooks cost host time per saved tensor), or None on
    steps that are timed and need no counting."""
    if cfg.model.moe is not None:
        moe.set_aux_loss_scale(engine)
    with contextlib.ExitStack() as metering:
        if meter is not None:
            metering.enter_context(meter)
            if cfg.model.moe is not None:  # the experts' load on the steps whose activations are counted
                metering.enter_context(moe.counting_slots(engine.module))
        if cfg.plan.pp > 1:
            return float(engine.train_batch(data_iter=pipeline_micro_batches(loader)))
        total = 0.0
        for _ in range(cfg.plan.grad_accum):
            batch = loader.next_micro_batch().to(engine.device)
            loss = forward_loss(engine, batch) if batch.dim() == 2 else hf_data.labelled_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / cfg.plan.grad_accum


def _mean_over_ranks(value: float) -> float:
    """Loss averaged over all ranks (data-parallel replicas see different data), identical on every rank."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _process_start_time() -> float:
    """When this process was started (Linux /proc), to split start-up time into launch and set-up."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return float("nan")


def _log(run_dir: str, record: dict[str, Any]) -> None:
    with open(Path(run_dir) / LOG_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def _maybe_fail(cfg: WorkerConfig, step: int, rank: int, world: int) -> None:
    """Kills this process once at `inject_failure_at_step` (the last rank; the marker makes it once)."""
    if cfg.inject_failure_at_step != step or rank != world - 1:
        return
    marker = Path(cfg.run_dir) / FAILURE_MARKER
    if marker.exists():
        return
    marker.write_text(f"killed rank {rank} at step {step}\n")
    os._exit(17)


def _maybe_stall(cfg: WorkerConfig, step: int, rank: int) -> None:
    """Test hook: rank `stall["rank"]` (every rank when it is -1 or absent) sleeps before `stall["step"]`."""
    if not cfg.stall or int(cfg.stall["step"]) != step:
        return
    if int(cfg.stall.get("rank", -1)) in (-1, rank):
        time.sleep(cfg.stall["seconds"])


def _metrics(
    cfg: WorkerConfig,
    step: int,
    loss: float,
    times: list[float],
    memory_rows: list[list[float]],
    moe_load: float = math.nan,
) -> dict[str, float]:
    warm = times[cfg.proxy.warmup_steps :] or times
    step_time_s = sum(warm) / len(warm)
    samples = cfg.plan.sequences_per_step
    out = {
        "step": float(step),
        "loss": loss,
        "step_time_s": step_time_s,
        "tokens_per_s": samples * cfg.seq_len / step_time_s,
        "samples_per_s": samples / step_time_s,
        **rank_memory.busiest_rank_memory(memory_rows),
        "done": float(step == cfg.steps),
    }
    if cfg.model.moe is None:  # a dense model has no experts' share or load to report
        del out["measured_expert_state_bytes_per_rank"]
    elif math.isfinite(moe_load):
        out["measured_moe_load"] = moe_load
    out.update(cfg.predicted)
    return out


def _detail(
    cfg: WorkerConfig, probe: rank_memory.StateProbe, meter: measure.ActivationMeter
) -> dict[str, Any]:
    """What rank 0 holds, by source (model state) and by module (saved activations per micro-batch)."""
    micro_batches = cfg.plan.grad_accum
    by_module = sorted(meter.by_module.items(), key=lambda kv: -kv[1])
    out: dict[str, Any] = {
        "model_state_by_source": probe.detail,
        "activation_bytes_by_module_per_micro_batch": {k: v / micro_batches for k, v in by_module},
    }
    if cfg.model.moe is not None:  # the routed experts' padded load of each metered forward
        out["moe_load_by_forward"] = moe.forward_loads(probe.engine.module)
    return out


def run_worker(config: dict[str, Any], reporter: Reporter, resume_dir: str | None = None) -> list[float]:
    """Trains `config["steps"]` steps (from `resume_dir`'s step if given), reporting each; returns losses."""
    import torch.distributed as dist

    # Off the core a local Ray keeps for its own processes, if any, before the heavy imports below
    # (DeepSpeed, transformers: seconds of CPU each) rather than after them.
    cpu_layout.pin_to_worker_cores()
    deepspeed = import_deepspeed()

    cfg = WorkerConfig.model_validate(config)
    device, choice = pick_device(cfg.proxy)
    apply_collective_timeout(cfg.proxy.collective_timeout_s)
    phases = {"process_start": _process_start_time(), "worker_enter": time.time()}
    import transformers.models.llama.modeling_llama  # noqa: F401  (timed here, used by build_engine)

    phases["imports_done"] = time.time()
    # Under Ray (or any launcher that made the process group) DeepSpeed adopts the existing group;
    # it must still be told, or `deepspeed.comm` (used by PipelineModule) has no backend.
    deepspeed.init_distributed(
        dist_backend=choice.backend,
        timeout=timedelta(seconds=cfg.proxy.collective_timeout_s),
    )
    phases["distributed_ready"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.proxy.seed)
    cap_memory(cfg.proxy.memory_limit_gib, device)
    measure.reset_peak_memory(device)
    engine, _ = build_engine(cfg, device)
    phases["engine_ready"] = time.time()
    dp_rank, dp_size = data_parallel_rank(engine)
    source = token_source(cfg.proxy.data, cfg.model.vocab_size, cfg.seq_len, cfg.proxy.seed)
    held_out = None  # the fine-tuning data's evaluation split
    if cfg.finetune is not None and cfg.finetune.data_dir is not None:
        source, held_out = hf_data.splits(cfg.finetune.data_dir, cfg.proxy.seed)
    loader = ShardedLoader(source, dp_rank, dp_size, cfg.plan.micro_batch)
    start = 0
    if resume_dir is not None:
        state = checkpoint.load(engine, resume_dir, rank)
        loader.load_state_dict(state["data"])
        start = state["step"]
    if rank == 0:
        record: dict[str, Any] = {"event": "start", "step": start, "time": time.time(), "phases": phases}
        _log(cfg.run_dir, {**record, "device": device.type, "device_fallback": choice.fallback})
    probe, meter = rank_memory.StateProbe(engine), measure.ActivationMeter(engine.module)
    times: list[float] = []
    losses: list[float] = []
    for step in range(start + 1, cfg.steps + 1):
        _maybe_fail(cfg, step, rank, world)
        _maybe_stall(cfg, step, rank)
        probe.armed = meter.tally = step == min(start + 2, cfg.steps)  # optimizer states exist after step 1
        # Saved activations are the same every step: count them on the warm-up steps (and the armed one)
        # and keep the timed steps free of the meter's hooks.
        metered = step <= start + max(cfg.proxy.warmup_steps, 2)
        t0 = time.perf_counter()
        loss = _mean_over_ranks(_train_step(engine, loader, cfg, meter if metered else None))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        rows = rank_memory.memory_rows(probe, meter, device)
        load = rank_memory.moe_load(engine) if cfg.model.moe is not None else math.nan
        metrics: dict[str, Any] = _metrics(cfg, step, loss, times, rows, load)
        if choice.fallback:  # a string among the floats only when there is something to say
            metrics["device_fallback"] = choice.fallback
        every = cfg.finetune.eval_every if cfg.finetune is not None else 0
        if held_out is not None and (step == cfg.steps or (every and step % every == 0)):
            evaluate = evaluate_pipeline if cfg.plan.pp > 1 else hf_data.evaluate
            metrics["eval_loss"] = evaluate(engine, held_out, dp_rank, dp_size, cfg.plan.micro_batch)
        if rank == 0:
            record = {"event": "step", "step": step, "loss": loss, "time": time.time(), "metrics": metrics}
            if meter.tally:
                record["detail"] = {**_detail(cfg, probe, meter), "memory_by_rank": rows}
            _log(cfg.run_dir, record)
        meter.tally = False
        periodic = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 and step < cfg.steps
        if periodic or (cfg.save_final and step == cfg.steps):
            with tempfile.TemporaryDirectory(prefix="proxy-ckpt-") as tmp:
                checkpoint.save(engine, tmp, step, rank, loader.state_dict())
                reporter(metrics, tmp)
        else:
            reporter(metrics, None)
    if cfg.finetune is not None:  # the trained weights in Hugging Face format, on the run's storage
        first = held_out.block(0)[0] if held_out is not None else source.sample(0)  # logits to compare
        export_hf(engine, cfg.finetune, rank, torch.from_numpy(first.reshape(-1, cfg.seq_len)[:1]))
    return losses


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train (V2) entry point: resumes from `ray.train.get_checkpoint()` when there is one."""
    import ray.train

    def report(metrics: dict[str, float], directory: str | None) -> None:
        ckpt = ray.train.Checkpoint.from_directory(directory) if directory else None
        ray.train.report(metrics, checkpoint=ckpt)

    latest = ray.train.get_checkpoint()
    if latest is None:
        run_worker(config, report)
        return
    with latest.as_directory() as directory:
        run_worker(config, report, resume_dir=directory)
