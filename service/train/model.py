"""The proxy model: a `transformers` LlamaForCausalLM built from a `ModelSpec` (random weights, no download),
with activation checkpointing applied, or the same layers as a `deepspeed.pipe.PipelineModule` when pp > 1.

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

ATTN_IMPLEMENTATION = "sdpa"  # fused attention on CPU and CUDA; causal without an explicit mask


def llama_config(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> Any:
    """A `LlamaConfig` with the spec's shape; dropout off so that runs are deterministic."""
    from transformers import LlamaConfig

    if spec.mlp != "swiglu":
        raise ValueError("the proxy model is Llama (SwiGLU MLP); a gelu ModelSpec has no Llama equivalent")
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=65536,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_dropout=0.0,
        attn_implementation=ATTN_IMPLEMENTATION,
        use_cache=False,
        dtype=dtype,
    )


def build_causal_lm(
    spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Module:
    """Random-initialised LlamaForCausalLM, built directly on `device` (a 13B-width layer initialises in
    milliseconds on a GPU, seconds on a CPU); the same seed gives the same weights on every rank."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(spec, dtype))
    model.config.use_cache = False
    return model.to(dtype)  # type: ignore[arg-type]


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
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})  # type: ignore[operator]
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
    """Pipeline stage head: the token embedding."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.embed_tokens: torch.nn.Module = lm.model.embed_tokens  # type: ignore[union-attr,assignment]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class _Layer(torch.nn.Module):
    """One decoder layer; it recomputes the rotary tables (no parameters, a few µs) so that stages pass
    only the hidden state, the one tensor the pipeline engine needs a gradient for."""

    def __init__(self, lm: torch.nn.Module, index: int):
        super().__init__()
        self.layer: torch.nn.Module = lm.model.layers[index]  # type: ignore[union-attr,index,assignment]
        self.rotary_emb: torch.nn.Module = lm.model.rotary_emb  # type: ignore[union-attr,assignment]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
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


def build_pipeline(spec: ModelSpec, seed: int, pp: int, recompute: str, dtype: torch.dtype) -> Any:
    """The causal LM as a `deepspeed.pipe.PipelineModule` of `pp` stages, split evenly by layer.

    The full model is built on every rank with the same seed (so the weights equal a pp=1 run's) and
    each stage keeps only its own layers. `full` recompute is DeepSpeed's per-layer checkpointing
    (`activation_checkpoint_interval=1`, reentrant); `selective` wraps each layer's attention as above.
    Embedding and lm_head are separate matrices on the first and last stage (untied); a tied model
    would need a `TiedLayerSpec`, which this proxy does not build.
    """
    from deepspeed.pipe import PipelineModule

    if spec.tie_word_embeddings:
        raise ValueError("pipeline proxies of models with tied embeddings are not supported")
    lm = build_causal_lm(spec, seed, dtype)
    if recompute == "selective":
        apply_recompute(lm, "selective")
    layers = [_Embed(lm), *(_Layer(lm, i) for i in range(spec.num_layers)), _Head(lm)]
    return PipelineModule(
        layers=layers,
        num_stages=pp,
        loss_fn=causal_lm_loss,
        partition_method="type:_Layer",
        activation_checkpoint_interval=1 if recompute == "full" else 0,
        checkpointable_layers=["_Layer"],
        seed_layers=False,
    )


def forward_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Loss of a (non-pipeline) causal LM on one micro-batch; labels are the inputs shifted by one."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    return causal_lm_loss(logits, input_ids)
