"""The proxy model: a `transformers` LlamaForCausalLM built from a `ModelSpec` (random weights, no download),
with activation checkpointing applied; with tp > 1 or pp > 1 the same layers as pipeline stages (embedding,
decoder layers, head), tensor-parallel when tp > 1 (`service.train.tensor_parallel`, Megatron-style,
optionally sequence-parallel), run as a `deepspeed.pipe.PipelineModule` when pp > 1 and as a plain stack
of the stages when pp = 1. `build_model` returns the model and the DeepSpeed `mpu` (a
`PipelineParallelGrid` over a pipe × data × model topology) that tells DeepSpeed its groups. A MoE
`ModelSpec`'s MoE blocks hold DeepSpeed's MoE layer instead of the Llama MLP (`service.train.moe`),
with this rank's share of the experts.

Recompute modes (Plan.recompute):
- `full`: every decoder layer is checkpointed (only its input is kept; the whole layer is recomputed in
  backward) — Hugging Face `activation_checkpointing_enable` on every layer, reentrant so that what the
  checkpoint keeps goes through `saved_tensors_hooks` and is measured.
- `selective`: the attention sub-block of each layer (q/k/v projections, RoPE, attention core, o_proj) is
  checkpointed; the MLP keeps its activations. Megatron's selective recompute checkpoints only the
  attention core (softmax(QKᵀ)V) because it holds the s² score matrix; with fused SDPA/flash attention
  (which this model uses) the core keeps no score matrix, so checkpointing just the core would save
  almost nothing. The attention sub-block is the nearest subset that still trades recompute for memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from service.spec.model import ModelSpec
from service.spec.plan import Plan
from service.train import tensor_parallel as tpl

ATTN_IMPLEMENTATION = "sdpa"  # fused attention on CPU and CUDA; causal without an explicit mask


def llama_config(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> Any:
    """A `LlamaConfig` with the spec's shape; dropout off so that runs are deterministic. A MoE spec's
    config is its dense blocks' (`ffn_hidden_size`); `build_causal_lm` puts the MoE blocks in."""
    from transformers import LlamaConfig

    if spec.mlp != "swiglu":
        raise ValueError("the proxy model is Llama (SwiGLU MLP); a gelu ModelSpec has no Llama equivalent")
    if spec.mla is not None:
        raise ValueError(
            "the proxy model is Llama: multi-head latent attention (mla) has no Llama equivalent"
        )
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=65536,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_dropout=0.0,
        attn_implementation=ATTN_IMPLEMENTATION,
        use_cache=False,
        dtype=dtype,
    )


def build_causal_lm(
    spec: ModelSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    plan: Plan | None = None,
) -> torch.nn.Module:
    """Random-initialised LlamaForCausalLM, built directly on `device` (a 13B-width layer initialises in
    milliseconds on a GPU, seconds on a CPU); the same seed gives the same weights on every rank. A MoE
    spec's MoE blocks are DeepSpeed MoE layers laid out for `plan` (its ep; service.train.moe), holding
    this rank's experts."""
    from transformers import LlamaForCausalLM

    if spec.moe is not None and plan is None:
        raise ValueError("a MoE proxy model needs the plan it runs (ep, expert_tp) to place its experts")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(spec, dtype))
    model.config.use_cache = False
    if spec.moe is not None and plan is not None:
        from service.train import moe

        moe.apply_moe(model, spec, plan, seed, _global_rank())
    return model.to(dtype)  # type: ignore[arg-type]


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _checkpointed_attention(attn: torch.nn.Module) -> None:
    """Makes `attn.forward` a reentrant checkpoint of itself (selective recompute)."""
    inner = attn.forward

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        cos, sin = position_embeddings

        def run(h: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return inner(h, position_embeddings=(c, s), attention_mask=attention_mask, **kwargs)[0]

        return checkpoint(run, hidden_states, cos, sin, use_reentrant=True), None

    attn.forward = forward  # type: ignore[method-assign]


def apply_recompute(model: torch.nn.Module, recompute: str) -> None:
    """Applies `none` / `selective` / `full` activation checkpointing to a LlamaForCausalLM in place."""
    if recompute == "full":
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (pinned here)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})  # type: ignore[operator]
        else:  # transformers 4's name, as on GPU images that bring their own transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # type: ignore[operator]
    elif recompute == "selective":
        for layer in model.model.layers:  # type: ignore[union-attr,assignment]
            _checkpointed_attention(layer.self_attn)
    elif recompute != "none":
        raise ValueError(f"unknown recompute mode {recompute!r}")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in fp32 as Hugging Face computes it."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1)
    )


class _Embed(torch.nn.Module):
    """Pipeline stage head: the token embedding (whole on every TP rank, as the cost model counts it);
    with sequence parallelism it hands on this rank's chunk of the sequence."""

    def __init__(self, lm: torch.nn.Module, sp_group: Any = None, cp_group: Any = None):
        super().__init__()
        self.embed_tokens: torch.nn.Module = lm.model.embed_tokens  # type: ignore[union-attr,assignment]
        self.sp_group, self.cp_group = sp_group, cp_group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cp_group is not None:  # context parallelism: this rank's chunk of every sequence
            from service.train.context_parallel import sequence_chunk

            hidden = sequence_chunk(hidden, self.cp_group)
        return hidden if self.sp_group is None else tpl.scatter_to_sequence_region(hidden, self.sp_group)


class _Layer(torch.nn.Module):
    """One decoder layer; it recomputes the rotary tables (no parameters, a few µs) so that stages pass
    only the hidden state, the one tensor the pipeline engine needs a gradient for. With sequence
    parallelism over `seq_shards` ranks the hidden state is a chunk of the sequence; the tables cover
    the whole sequence, which the attention sees after its column-parallel projections gather it."""

    def __init__(self, lm: torch.nn.Module, index: int, seq_shards: int = 1, cp_group: Any = None):
        super().__init__()
        self.layer: torch.nn.Module = lm.model.layers[index]  # type: ignore[union-attr,index,assignment]
        self.rotary_emb: torch.nn.Module = lm.model.rotary_emb  # type: ignore[union-attr,assignment]
        self.seq_shards, self.cp_group = seq_shards, cp_group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cp_group is not None:  # a context-parallel chunk: its own positions in the sequence
            from service.train.context_parallel import chunk_positions

            positions = chunk_positions(hidden.shape[1], self.cp_group, hidden.device)
        else:
            positions = torch.arange(hidden.shape[1] * self.seq_shards, device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        return self.layer(hidden, position_embeddings=(cos, sin))


class _Head(torch.nn.Module):
    """Pipeline stage tail: final RMSNorm and the output projection."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.norm: torch.nn.Module = lm.model.norm  # type: ignore[union-attr,assignment]
        self.lm_head: torch.nn.Module = lm.lm_head  # type: ignore[assignment]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class _Stack(torch.nn.Module):
    """The stages in one module (pp = 1 with tp > 1): `forward(input_ids)` returns the logits; `full`
    recompute checkpoints every decoder layer (reentrant, so the meter sees what it keeps). With context
    parallelism the logits are this rank's chunk and `cp_group` tells `forward_loss` so."""

    def __init__(
        self,
        stages: list[torch.nn.Module],
        recompute_full: bool,
        cp_group: Any = None,
        hf_model: torch.nn.Module | None = None,
    ):
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)
        self.recompute_full, self.cp_group = recompute_full, cp_group
        # The LlamaForCausalLM whose modules the stages hold (its names and config are the checkpoint's,
        # for `weights.export_hf`); kept outside the module tree so parameter names stay the stages'.
        self.__dict__["hf_model"] = hf_model

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        hidden = input_ids
        for stage in self.stages:
            if self.recompute_full and isinstance(stage, _Layer):
                hidden = checkpoint(stage, hidden, use_reentrant=True)
            else:
                hidden = stage(hidden)
        return hidden


def _reentrant_checkpoint(function: Any, *args: torch.Tensor) -> Any:
    """The pipeline's per-layer checkpoint: torch's reentrant checkpoint, which keeps what DeepSpeed's
    does (each layer's input) but through `save_for_backward`, where the activation meter sees it.
    DeepSpeed's `CheckpointFunction` keeps its inputs in a ctx attribute (`ctx.deepspeed_saved_tensors`,
    runtime/activation_checkpointing/checkpointing.py), invisible to `saved_tensors_hooks`: full-recompute
    pipeline proxies measured 8 % (tp 1) to 22 % (tp 2) under the model, by exactly those inputs."""
    return checkpoint(function, *args, use_reentrant=True)


def build_model(
    spec: ModelSpec,
    seed: int,
    plan: Plan,
    dtype: torch.dtype,
    weights: str | None = None,
    ds_config: dict[str, Any] | None = None,
) -> tuple[torch.nn.Module, Any]:
    """The proxy model of `plan` as stages, and the DeepSpeed `mpu` that names its groups (tp > 1 or pp > 1;
    None for a `PipelineModule`, whose engine reads them from the module).

    With `weights` (a local Hugging Face checkpoint; tp, pp or cp > 1) the model is the checkpoint's,
    each rank reading only its slices (`weights.load_tensor_parallel`), with cp > 1 and tp = 1 the whole
    model, or, with pp > 1, only its stage's layers (`weights_pp.PipelineCheckpoint`: the stages are
    `LayerSpec`s that the `PipelineModule` builds and fills where they run), and the stack or pipeline
    keeps the LlamaForCausalLM (`hf_model`) for the export.

    The full model is built on every rank with the same seed (so the weights equal a tp = pp = 1 run's);
    each TP rank keeps its slices (`tensor_parallel.apply_tensor_parallel`) and, with pp > 1, each stage
    its own layers (`deepspeed.pipe.PipelineModule`, split evenly by layer). The ranks form DeepSpeed's
    `PipeModelDataParallelTopology` (axes pipe, data, model: TP peers adjacent, as Megatron-DeepSpeed
    lays them out). `full` recompute is per-layer checkpointing (`activation_checkpoint_interval=1` in a
    pipeline) with torch's reentrant checkpoint (see `_reentrant_checkpoint`);
    `selective` wraps each layer's attention. Embedding and lm_head are separate matrices (untied); a tied
    model would need a `TiedLayerSpec` and a tied TP head, which this proxy does not build.
    """
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    if spec.tie_word_embeddings:
        raise ValueError(
            "pipeline or tensor-parallel proxies of models with tied embeddings are not supported"
        )
    if weights is not None and plan.tp == 1 and plan.pp == 1 and plan.cp == 1:
        raise ValueError(f"weights load into tp, pp or cp stages; not {plan.short()}")
    if plan.cp > 1:
        return _build_context_parallel(spec, seed, plan, dtype, weights, ds_config or {})
    topology = PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=plan.tp, num_dp=plan.dp)
    grid = PipelineParallelGrid(topology=topology)
    sp_group = grid.get_slice_parallel_group() if plan.tp > 1 and plan.sequence_parallel else None
    stage: Any = _built_here
    if weights is not None and plan.pp > 1:  # a meta model; each stage read where the pipeline builds it
        from service.train.weights_pp import PipelineCheckpoint

        source = PipelineCheckpoint(weights, dtype)
        lm, stage = source.lm, source.spec
        if plan.tp > 1:
            tpl.apply_tensor_parallel(lm, grid.get_slice_parallel_group(), plan.sequence_parallel)
    elif weights is not None:  # the checkpoint's slices, already tensor-parallel
        from service.train.weights import load_tensor_parallel

        lm = load_tensor_parallel(weights, grid.get_slice_parallel_group(), plan.sequence_parallel, dtype)
    else:
        lm = build_causal_lm(spec, seed, dtype, plan=plan)
        if plan.tp > 1:
            tpl.apply_tensor_parallel(lm, grid.get_slice_parallel_group(), plan.sequence_parallel)
    if plan.recompute == "selective":
        apply_recompute(lm, "selective")
    shards = plan.tp if sp_group is not None else 1
    layers = (stage(_Layer, lm, i, shards) for i in range(spec.num_layers))
    stages = [stage(_Embed, lm, sp_group), *layers, stage(_Head, lm)]
    if plan.pp == 1:
        hf_model = lm if weights is not None else None
        return _Stack(stages, recompute_full=plan.recompute == "full", hf_model=hf_model), grid
    pipeline = PipelineModule(
        layers=stages,
        topology=topology,
        loss_fn=causal_lm_loss,
        partition_method="type:_Layer",
        activation_checkpoint_interval=1 if plan.recompute == "full" else 0,
        activation_checkpoint_func=_reentrant_checkpoint,
        checkpointable_layers=["_Layer"],
        seed_layers=False,
    )
    if weights is not None:  # outside the module tree, as `_Stack.hf_model`
        pipeline.__dict__["hf_model"] = lm
    return pipeline, None  # DeepSpeed takes a PipelineModule's groups from the module itself


def _built_here(typename: type, *args: Any) -> torch.nn.Module:
    """A stage made now, on every rank (`PipelineModule` keeps the ones of its own stage)."""
    return typename(*args)  # type: ignore[no-any-return]


def _build_context_parallel(
    spec: ModelSpec,
    seed: int,
    plan: Plan,
    dtype: torch.dtype,
    weights: str | None = None,
    ds_config: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """`build_model` for cp > 1: DeepSpeed-Ulysses attention (service.train.context_parallel) in every
    layer, tensor-parallel layers when tp > 1; pp = 1 and no Megatron SP (the proxy runs neither with
    Ulysses; DeepSpeed's `PipelineParallelGrid` has no sequence axis). With `weights`, the checkpoint:
    each TP rank's slices, or the whole model (Ulysses splits the sequence, not the weights), partitioned
    at load under ZeRO-3 (`ds_config`: `weights.load_causal_lm`'s zero.Init path)."""
    from service.train.context_parallel import UlyssesGroups, ulysses_attention_forward

    if plan.pp > 1 or plan.sequence_parallel:
        raise ValueError("context-parallel proxies run with pp = 1 and without sequence_parallel")
    groups = UlyssesGroups(plan.dp, plan.cp, plan.tp)
    cp_group = groups.get_sequence_parallel_group()
    if weights is not None and plan.tp > 1:
        from service.train.weights import load_tensor_parallel

        lm = load_tensor_parallel(weights, groups.get_model_parallel_group(), False, dtype)
    elif weights is not None:
        from service.train.weights import load_causal_lm

        # Under ZeRO-3, zero.Init partitions at load over every rank, as ZeRO-3 then does over the
        # dp·cp ranks (tp = 1 here); without the `mpu` DeepSpeed's batch check would count the cp ranks
        # as data-parallel, so the global batch is left for it to derive.
        config = {k: v for k, v in (ds_config or {}).items() if k != "train_batch_size"}
        lm = load_causal_lm(weights, config, dtype)
    else:
        lm = build_causal_lm(spec, seed, dtype, plan=plan)
        if plan.tp > 1:
            tpl.apply_tensor_parallel(lm, groups.get_model_parallel_group(), sequence_parallel=False)
    for layer in lm.model.layers:  # type: ignore[union-attr]
        layer.self_attn.forward = ulysses_attention_forward(layer.self_attn, cp_group)
    if plan.recompute == "selective":
        apply_recompute(lm, "selective")
    stages = [
        _Embed(lm, cp_group=cp_group),
        *(_Layer(lm, i, cp_group=cp_group) for i in range(spec.num_layers)),
    ]
    hf_model = lm if weights is not None else None
    return _Stack([*stages, _Head(lm)], plan.recompute == "full", cp_group, hf_model), groups


def forward_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Loss of a (non-pipeline) causal LM on one micro-batch; labels are the inputs shifted by one."""
    out = model(input_ids=input_ids, use_cache=False)
    from service.train.context_parallel import context_parallel_loss, cp_group_of

    cp_group = cp_group_of(model)
    if cp_group is not None:
        return context_parallel_loss(out, input_ids, cp_group)
    return causal_lm_loss(out if isinstance(out, torch.Tensor) else out.logits, input_ids)
