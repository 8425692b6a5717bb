"""Plan → DeepSpeed JSON config: the one function that decides how DeepSpeed runs a plan.

Keys follow DeepSpeed's config reference (https://www.deepspeed.ai/docs/config-json/) for the installed
0.19.8: `zero_optimization` (stage, offload_optimizer, offload_param), `bf16` / `fp16`,
`gradient_clipping`, `activation_checkpointing`, `pipeline`.
Tensor and pipeline parallelism are not config keys: the worker builds Megatron-style tensor-parallel
layers (service.train.tensor_parallel) and, with pp > 1, a `deepspeed.pipe.PipelineModule`, and hands
DeepSpeed their topology as `mpu`; the config carries the batch split, which DeepSpeed checks against
the data-parallel size it reads from that `mpu`. Expert parallelism is not a config key either: each MoE
layer takes its ep_size (service.train.moe) and `deepspeed.initialize` builds the expert groups from it;
ZeRO-1/2 then shard the experts' states over the expert-data-parallel group, and with MoE layers ZeRO-2
requires `contiguous_gradients` (stage_1_and_2.py `_configure_moe_settings`), which `_zero_section` sets.
"""

from __future__ import annotations

from typing import Any

from service.spec.experiment import ExperimentSpec
from service.spec.model import ModelSpec
from service.spec.plan import Plan
from service.spec.proxy import ProxySpec
from service.spec.zero import ZeroKnobs, hierarchical_zero_config

GRADIENT_CLIPPING = 1.0
LEARNING_RATE = 3e-4
# Proxies run ZeRO's collectives unoverlapped (overlap needs CUDA streams; off keeps CPU and GPU proxies
# alike); the cost model prices proxy steps the same way (train/proxy_scale.py `proxy_workload`).
PROXY_OVERLAP_COMM = False


def proxy_precision(plan: Plan, proxy: ProxySpec) -> str:
    """Precision the proxy computes in.

    A CPU proxy runs `proxy.precision` (fp32 by default: CPU bf16 GEMMs are slow and fp16 is not
    supported by DeepSpeed's CPU accelerator); a CUDA proxy runs the plan's own precision, as production.
    """
    return proxy.precision if proxy.device == "cpu" else plan.precision


def _zero_section(plan: Plan, knobs: ZeroKnobs, pin_memory: bool = False) -> dict[str, Any]:
    """ZeRO settings. Bucket sizes and the ZeRO-3 persistence threshold are `knobs`, the values the cost
    model prices (`service.spec.zero.ZeroKnobs`, scaled with the model instead of DeepSpeed's fixed
    5e8-element defaults, which would dwarf a small proxy): one source for what runs and what is
    predicted."""
    zero: dict[str, Any] = {
        "stage": plan.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": PROXY_OVERLAP_COMM,
        "reduce_bucket_size": knobs.reduce_bucket_elements,
        "allgather_bucket_size": knobs.allgather_bucket_elements,
    }
    if plan.zero_stage == 3:
        zero.update(
            {
                "stage3_param_persistence_threshold": knobs.stage3_param_persistence_threshold,
                "stage3_prefetch_bucket_size": knobs.stage3_prefetch_bucket_elements,
                "stage3_max_live_parameters": knobs.stage3_max_live_parameters,
                "stage3_max_reuse_distance": knobs.stage3_max_reuse_distance,
            }
        )
    zero.update(hierarchical_zero_config(plan))  # ZeRO++ hpZ/qwZ/qgZ (stage 3)
    # Pinned host buffers on a GPU (DeepSpeed's default, and what costmodel/offload.py prices); a CPU
    # proxy has no device to pin for.
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if plan.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return zero


def _optimizer_section(plan: Plan) -> dict[str, Any]:
    """AdamW. With optimizer offload DeepSpeed swaps in DeepSpeedCPUAdam (a JIT-built C++ op); without,
    `torch_adam` makes it torch's AdamW rather than DeepSpeed's FusedAdam, whose CUDA kernel would have to
    be compiled (nvcc) on the GPU machine first. Same state (two fp32 moments), same update rule."""
    params: dict[str, Any] = {"lr": LEARNING_RATE, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    if plan.offload_optimizer:
        params["adam_w_mode"] = True  # DeepSpeedCPUAdam's decoupled weight decay
    else:
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def deepspeed_config(
    plan: Plan,
    proxy: ProxySpec,
    model: ModelSpec,
    *,
    bf16_supported: bool = True,
) -> dict[str, Any]:
    """The DeepSpeed config that runs `plan` at proxy scale.

    Args:
        plan: the parallel layout; dp·tp·pp must equal the world size the config is used with.
        proxy: the proxy settings (precision, device).
        model: the model the config trains (the proxy model); its `ZeroKnobs` set ZeRO's buffers.
        bf16_supported: whether the device can compute in bf16 (a CUDA worker passes
            `torch.cuda.is_bf16_supported()`); a bf16 plan falls back to fp16 when it cannot.

    `train_batch_size` = micro_batch · grad_accum · dp: DeepSpeed checks this identity at start-up.
    Activation checkpointing for `full`/`selective` is applied to the model by the worker
    (service.train.model); the `activation_checkpointing` section configures DeepSpeed's own
    checkpoint function, which the pipeline engine uses.
    """
    precision = proxy_precision(plan, proxy)
    # FP8 is the GEMMs' business (Transformer Engine or torchao in the model); DeepSpeed's own mixed
    # precision around them is bf16, as in NVIDIA's FP8 recipes.
    precision = "bf16" if precision == "fp8" else precision
    if precision == "bf16" and not bf16_supported:
        precision = "fp16"
    zero = _zero_section(plan, ZeroKnobs.for_model(model), pin_memory=proxy.device == "cuda")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "optimizer": _optimizer_section(plan),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12, "loss_scale_window": 100},
        "steps_per_print": 10**9,  # the worker reports every step itself
        "wall_clock_breakdown": False,
    }
    if plan.zero_stage > 0 and precision == "fp32":
        # ZeRO 1-2 refuse an fp32 model with a "client optimizer" check unless this is set.
        config["zero_allow_untested_optimizer"] = True
    config["train_batch_size"] = plan.micro_batch * plan.grad_accum * plan.dp
    if plan.pp > 1 and plan.tp > 1 and plan.sequence_parallel:
        # The pipeline engine sends 1/tp of each activation per TP rank and all-gathers it on the next
        # stage (`pipe_partitioned`, `grad_partitioned`), which assumes the TP ranks hold the same
        # tensor; with sequence parallelism each holds its own chunk of the sequence and sends it whole.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if plan.recompute != "none":
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return config


def production_settings(experiment: ExperimentSpec, total_steps: int) -> dict[str, Any]:
    """What the production run's DeepSpeed config sets beyond the proxies': the experiment's AdamW
    learning rate and weight decay with its warmup-cosine schedule over `total_steps`, ZeRO's
    communication overlap on (the cost model prices it on), and a progress line every 100 steps. The
    written ds_config.json and the `service train` workers both take it (`with_settings`), so what runs
    is what the memo hands over."""
    opt = experiment.optimizer
    return {
        "optimizer": {"params": {"lr": opt.lr, "weight_decay": opt.weight_decay}},
        "scheduler": opt.scheduler(max(1, int(total_steps))),
        "zero_optimization": {"overlap_comm": True},
        "steps_per_print": 100,
    }


def with_settings(config: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`config` with `settings` merged in, section by section (nested dicts merged, values replaced)."""
    out = dict(config)
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = with_settings(out[key], value)
        else:
            out[key] = value
    return out
