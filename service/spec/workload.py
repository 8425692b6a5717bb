"""`Workload` (what is trained) and `Budget` (what the run may cost)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.errors import SpecError

# What a plan's selective recompute checkpoints (Workload.selective_recompute; costmodel/recompute.py).
# Bounds on sizes a typo can reach (`seq_len: 1e12`): well past any real run, small enough that the cost
# model's arithmetic stays finite.
MAX_SEQ_LEN = 2**24

SelectiveRecompute = Literal["attention_block", "every_other_block", "every_other_matmul"]
# Megatron-Core's --recompute-modules (TransformerConfig.recompute_modules, default ["core_attn"]): what
# its selective recompute re-runs (costmodel/recompute.py `megatron_modules_*`).
RecomputeModule = Literal["core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts"]
MEGATRON_DEFAULT_RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = ("core_attn",)
# How a megatron plan's MoE blocks exchange tokens (Megatron-Core's --moe-token-dispatcher-type alltoall,
# or flex with DeepEP; costmodel/moe.py `dispatch_combine_time_s`).
MoEDispatcher = Literal["alltoall", "deepep", "hybridep"]
# Megatron-Core's CUDA-graph capture regions (--cuda-graph-scope with --cuda-graph-impl transformer_engine,
# megatron/core/transformer/enums.py CudaGraphModule; full_iteration: --cuda-graph-impl full_iteration).
CudaGraphScope = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration"]


# Busiest expert's tokens over its balanced share with an auxiliary balancing loss (Wang et al. 2024,
# Table 2, the 3B model's 1.52); see service/costmodel/moe.py `load_factor`.
DEFAULT_MOE_LOAD_IMBALANCE = 1.5
MAX_MOE_LOAD_IMBALANCE = 64.0  # its bound: every token of a top-1 router on one expert of 64


class Workload(BaseModel):
    """Sequence length, global batch and how many tokens to train.

    Give the global batch as `global_batch_sequences` or `global_batch_tokens` (a multiple of
    `seq_len`); the other is derived.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN, description="Tokens per sequence.")
    global_batch_sequences: int | None = Field(None, gt=0, description="Sequences per optimizer step.")
    global_batch_tokens: int | None = Field(None, gt=0, description="Tokens per optimizer step.")
    tokens_to_train: float = Field(
        gt=0,
        le=1e16,  # a thousand times the largest published pre-training run (Llama 3: 15.6 T)
        allow_inf_nan=False,
        description="Tokens the whole run processes (all epochs).",
    )
    flash_attention: bool = Field(
        True,
        description="Fused attention that keeps no s×s scores (FlashAttention / SDPA); false = materialised "
        "scores and dropout masks, as in Megatron-LM 2021-22 (Korthikanti et al.'s formulas).",
    )
    cudnn_attention: bool = Field(
        True,
        description="Attention runs cuDNN's fused kernel on GPUs that have one (catalog "
        "fused_attention_efficiency: Hopper, Blackwell): torch's SDPA picks it by default from torch 2.11, "
        "whose bundled cuDNN passes the >= 9.15 gate of check_prefer_cudnn_attention (aten sdp_utils.cpp), "
        "and this service pins torch 2.13; false = FlashAttention-2, SDPA's default before (cuDNN was "
        "opt-in after pytorch/pytorch#138522) and what the published runs ran. Transformer Engine stacks "
        "run cuDNN's kernel whatever this says; FlashAttention-3, as fast on Hopper, is priced by true.",
    )
    fused_elementwise: bool = Field(
        False,
        description="The model's element-wise ops run as fused kernels, one read and one write each (fused "
        "norms, rotary and SwiGLU: Apex / Transformer Engine, Liger, torch.compile); false = eager PyTorch "
        "modules (Hugging Face Llama: RMSNorm alone is seven kernels). Megatron-Core plans are fused "
        "whatever this says (their engine builds Transformer Engine layers).",
    )
    fused_cross_entropy: bool = Field(
        False,
        description="The loss never materialises the logits: Liger-Kernel's fused linear cross-entropy "
        "(Hugging Face `use_liger_kernel`, TRL, Axolotl) computes them in chunks of about tokens x hidden "
        "elements, keeps the input's gradient instead of the log-softmax, and accumulates the output "
        "layer's gradient in one buffer of its size (liger_kernel/ops/fused_linear_cross_entropy.py). The "
        "same matmuls, so the time is unchanged. This service's proxies and its `train` compute the loss "
        "from materialised logits: `train` refuses it (use your own script, launch.sh).",
    )
    grad_reduce_in_fp32: bool = Field(
        False,
        description="A Megatron-Core plan in bf16/fp8 keeps its gradients in an fp32 main_grad buffer and "
        "reduces them in fp32: 4 bytes per parameter, not 2, and twice the gradient traffic. Megatron-LM's "
        "own bf16 default (arguments.py accumulate_allreduce_grads_in_fp32) and NeMo's / Megatron-Bridge's "
        "bf16_mixed recipes; false = NVIDIA's performance recipes, the published runs this is fit on (NeMo "
        "scripts/performance/helpers.py sets grad_reduce_in_fp32 False). Other engines: no effect.",
    )
    overlap_comm: bool = Field(
        True,
        description="Data-parallel collectives run behind compute (DeepSpeed `overlap_comm`, FSDP's "
        "prefetch); false = each collective stalls the step, as in the proxies' DeepSpeed config.",
    )
    zero3_collectives: Literal["flat", "per_tensor_lists"] = Field(
        "flat",
        description="How ZeRO-3 calls its collectives. flat: one flat buffer per module gather and per "
        "gradient bucket (DeepSpeed >= 0.6, FSDP). per_tensor_lists: DeepSpeed before 0.6 (2021), which "
        "reduce-scattered every parameter tensor's gradient on its own and passed both its gathers and its "
        "reduce-scatters to torch.distributed as lists of per-rank slices, which PyTorch copies one kernel "
        "per rank (costmodel/data_parallel.py).",
    )

    selective_recompute: SelectiveRecompute = Field(
        "attention_block",
        description="What a plan's selective recompute checkpoints. attention_block: each block's "
        "attention sub-block (this service's worker; Megatron-style). every_other_block: every second "
        "whole block (torchtitan's 'selective layer' AC, option 2; fms-fsdp's selective_checkpointing 0.5). "
        "every_other_matmul: every op of a block "
        "but its matmuls and attention, and every second matmul too (torchtitan's 'selective op' AC, "
        "torch.utils.checkpoint's selective policy in parallelize_llama.py, 2024).",
    )

    recompute_modules: tuple[RecomputeModule, ...] = Field(
        MEGATRON_DEFAULT_RECOMPUTE_MODULES,
        min_length=1,
        description="What a megatron plan's selective recompute re-runs (Megatron-Core's "
        "--recompute-modules, default core_attn): core_attn, layernorm (both norms' outputs), moe_act (the "
        "experts' activation function), mla_up_proj (MLA's up-projections and rope), mlp (the dense MLP), "
        "moe (the whole MoE layer, its all-to-alls included), shared_experts. Other engines' selective "
        "recompute is selective_recompute's.",
    )

    moe_dispatcher: MoEDispatcher = Field(
        "alltoall",
        description="How a megatron plan's MoE blocks send tokens to their experts. alltoall: NCCL's "
        "all-to-all, every routed copy on its own (Megatron-Core's alltoall dispatcher). deepep: DeepSeek's "
        "DeepEP (Megatron-Core's flex dispatcher), a token crosses the network once per remote node its "
        "experts are on and reaches them over NVLink there (arXiv 2412.19437 §3.2.2), its kernels on 20 SMs. "
        "hybridep: NVIDIA's HybridEP (the flex dispatcher's hybridep backend, DeepEP's hybrid-ep branch), "
        "which moves tokens the same way, on the 32 SMs Megatron-Bridge's recipes give it.",
    )

    cuda_graph_scope: tuple[CudaGraphScope, ...] = Field(
        (),
        description="What a megatron plan replays from CUDA graphs (Megatron-Core's --cuda-graph-scope with "
        "--cuda-graph-impl transformer_engine; full_iteration: the whole step). Empty (Megatron's default): "
        "eager, as the other engines always are: each MoE block pass takes at least the host time its "
        "router, dispatcher preprocessing and expert launches need (ModelParams moe_block_host_s, "
        "costmodel/compute.py `moe_host_floor_s`). moe_preprocess (which needs moe_router), moe or "
        "full_iteration replay that part from a graph, and no floor is priced.",
    )

    moe_load_imbalance: float = Field(
        DEFAULT_MOE_LOAD_IMBALANCE,
        ge=1.0,
        le=MAX_MOE_LOAD_IMBALANCE,
        allow_inf_nan=False,
        description="MoE models with a dropless router: tokens the busiest expert receives over its "
        "balanced share (default: Wang et al. 2024, arXiv 2408.15664, Table 2, 1.52 with an auxiliary "
        "balancing loss; about 1.04-1.1 with DeepSeek's loss-free balancing). It sets the pace of the "
        "expert GEMMs and the all-to-alls (costmodel/moe.py `load_factor`); capacity routers pad to their "
        "capacity factor instead.",
    )

    @model_validator(mode="after")
    def _one_selective_policy(self) -> Workload:
        if set(self.recompute_modules) != set(MEGATRON_DEFAULT_RECOMPUTE_MODULES) and (
            self.selective_recompute != "attention_block"
        ):
            raise SpecError(
                "recompute_modules",
                f"{list(self.recompute_modules)} is Megatron-Core's selective recompute, and "
                f"selective_recompute {self.selective_recompute!r} is another framework's; allowed: one of "
                "the two (recompute_modules with selective_recompute attention_block)",
            )
        return self

    @model_validator(mode="after")
    def _derive_batch(self) -> Workload:
        seqs, toks = self.global_batch_sequences, self.global_batch_tokens
        if seqs is None and toks is None:
            raise ValueError("give global_batch_sequences or global_batch_tokens")
        if toks is not None:
            if toks % self.seq_len:
                raise ValueError(f"global_batch_tokens {toks} is not a multiple of seq_len {self.seq_len}")
            if seqs is not None and seqs * self.seq_len != toks:
                raise ValueError("global_batch_sequences × seq_len must equal global_batch_tokens")
            object.__setattr__(self, "global_batch_sequences", toks // self.seq_len)
        else:
            assert seqs is not None
            object.__setattr__(self, "global_batch_tokens", seqs * self.seq_len)
        if self.tokens_to_train < self.batch_tokens:
            # Less than one optimizer step: hours and dollars would be a fraction of one step's time.
            raise SpecError(
                "tokens_to_train",
                f"{self.tokens_to_train:g} is less than one optimizer step "
                f"(global_batch_sequences × seq_len = {self.batch_tokens:,} tokens); "
                f"allowed: at least {self.batch_tokens:,}",
            )
        return self

    @property
    def batch_sequences(self) -> int:
        assert self.global_batch_sequences is not None
        return self.global_batch_sequences

    @property
    def batch_tokens(self) -> int:
        return self.batch_sequences * self.seq_len

    @property
    def steps_to_train(self) -> float:
        return self.tokens_to_train / self.batch_tokens


class Budget(BaseModel):
    """Limits on the production run, and what to optimise within them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_dollars: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Most the run may cost (USD); none = no limit."
    )
    max_hours: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Longest the run may take (wall-clock hours)."
    )
    objective: Literal["throughput", "cost"] = Field(
        "throughput", description="Rank plans by tokens/s (throughput) or by dollars (cost)."
    )
    memory_headroom: float = Field(
        0.10, ge=0, lt=1, description="Fraction of GPU memory kept free for fragmentation and spikes."
    )
