"""MoE blocks of the proxy model: DeepSpeed's own layer (`deepspeed.moe.layer.MoE`, DeepSpeed 0.19.8) in
place of the Llama MLP of every MoE block of the `ModelSpec` (`MoESpec.is_moe_layer`), its routed experts
split over `plan.ep` ranks that exchange the routed tokens by all-to-all (gloo runs it on CPU).

One block (`MoEBlock`) is:
- the routed experts: `MoE(hidden_size, expert=LlamaMLP of expert_ffn_hidden_size, num_experts,
  ep_size=ep, k=experts_per_token, ...)`, each rank holding num_experts/ep of them. The router is the
  spec's: top-k of the gate's softmax (DeepSpeed's default samples the second of two experts with Gumbel
  noise, `top2_2nd_expert_sampling`, GShard's policy; the spec's top-k is Mixtral's, so it is off), and
  `capacity` drops tokens over capacity_factor × the balanced share while `dropless` pads every expert to
  the busiest one's load (`drop_tokens=False`, moe/sharded_moe.py `topkgating`/`top2gating`);
- the shared experts, when `num_shared_experts`: one SwiGLU MLP of num_shared_experts × shared width added
  to the routed output, as DeepSeek-V2 builds them (`DeepseekV2MoE.shared_experts`, one MLP of
  `moe_intermediate_size * n_shared_experts`: the same parameters as the spec counts, no gate);
- the load-balancing loss DeepSpeed's gate returns (`l_aux`, GShard's), weighted AUX_LOSS_COEFFICIENT
  and added to what backward differentiates through the block's output (`_AuxLossScaler`); the loss a
  worker reports stays the language model's cross-entropy, comparable with a dense proxy's.

The load the experts ran at (`padded_load`): DeepSpeed sizes every expert's buffer to one capacity C per
forward, experts × C slots for the k × tokens routed ones; a capacity router's C follows the capacity
factor, a dropless one's is the busiest expert's count (all-reduced MAX over the EP group), so an
untrained router pads to several times the balanced share. The worker reports the busiest metered
forward's (`moe_load`), and the proxy's prediction is priced at it (service/train/proxy_scale.py
`proxy_workload`).

Weights: every tensor of a block is drawn from its own generator, seeded by (seed, block, tensor,
global expert id), with Hugging Face's Llama initialisation (normal, std `initializer_range`), so a model
is the same whatever ep splits it, and the rest of the proxy keeps the dense proxy's weights. DeepSpeed's
`Experts` deep-copies one expert module num_experts/ep times (moe/experts.py), which alone would start
every expert identical.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from service.spec.model import ModelSpec
from service.spec.plan import Plan

# DeepSpeed's "Mixture of Experts for NLG models" tutorial (docs/_tutorials/mixture-of-experts-nlg.md,
# `--moe-loss-coeff`): "In our experiments we find that 0.01 is a good setting."
AUX_LOSS_COEFFICIENT = 0.01


class _AuxLossScaler(torch.autograd.Function):
    """Returns `output` unchanged, and in backward gives `aux_loss` the gradient `scale`, as if `scale` ×
    `aux_loss` had been added to what backward differentiates (Megatron-Core moe_utils.py
    `MoEAuxLossAutoScaler`). The loss rides on the block's output instead of the loss tensor, so it reaches
    backward through activation checkpointing (a reentrant checkpoint runs the first forward without a
    graph) and through a pipeline's earlier stages, whose blocks never see the loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MoEBlock(torch.nn.Module):
    """A MoE block's MLP: DeepSpeed's MoE layer (`moe`) plus the shared experts (`shared_experts`).

    `forward(hidden)` returns the block's MLP output, as the Llama MLP it replaces does; the gate's
    balancing loss reaches backward with the weight `aux_loss_scale` (`set_aux_loss_scale`), and the
    last forward's tokens per expert are kept in `exp_counts`. While `counting` is on (`counting_slots`),
    each forward appends to `slots` the slots its experts ran, experts × the capacity C DeepSpeed's gate
    chose, and the k × tokens routed."""

    def __init__(self, moe: torch.nn.Module, shared_experts: torch.nn.Module | None):
        super().__init__()
        self.moe = moe
        self.shared_experts = shared_experts
        self.aux_loss_scale = AUX_LOSS_COEFFICIENT
        self.exp_counts: torch.Tensor | None = None
        self.counting = False
        self.slots: list[tuple[int, int]] = []  # (padded, routed) per counted forward
        moe.deepspeed_moe.gate.register_forward_hook(self._count_slots)  # type: ignore[union-attr]

    def _count_slots(self, gate: torch.nn.Module, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        """The gate's (l_aux, C, E, ...) (moe/sharded_moe.py `TopKGate.forward` with sparse routes, as
        `MOELayer` calls it) for `inputs[0]`, the tokens × h this rank routes. `MOELayer` reads C on the
        host right after (`C = int(C)`), so reading it here costs no extra device sync."""
        if self.counting:
            k: int = gate.k  # type: ignore[assignment]
            self.slots.append((int(output[2]) * int(output[1]), k * int(inputs[0].shape[0])))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out, l_aux, self.exp_counts = self.moe(hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return _AuxLossScaler.apply(out, l_aux, self.aux_loss_scale)  # type: ignore[no-any-return]


def expert_tensor_parallel(plan: Plan) -> bool:
    """Whether DeepSpeed splits each expert over the TP ranks: its only expert TP is the model's own
    (`enable_expert_tensor_parallelism`, moe/layer.py), so expert_tp is 1 or tp."""
    return plan.tp > 1 and plan.expert_tp == plan.tp


def expert_parallel_rank(rank: int, plan: Plan) -> int:
    """This rank's place in its expert-parallel group, as DeepSpeed lays the groups out (utils/groups.py):
    without expert TP, `_create_expert_and_data_parallel` makes groups of ep consecutive ranks; with it,
    `_get_expert_parallel_ranks` takes ep consecutive members of each data-parallel group, whose members
    are tp apart inside a pipeline stage. `check_expert_parallel_rank` holds the engine to it."""
    if expert_tensor_parallel(plan):
        stage_ranks = plan.dp * plan.cp * plan.tp
        return (rank % stage_ranks) // plan.tp % plan.ep
    return rank % plan.ep


def _seeded_normal_(tensor: torch.Tensor, std: float, *key: object) -> None:
    """Fills `tensor` from a generator of its own, seeded by `key` (a stable hash: Python's `hash` of a
    string differs between processes)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
    with torch.no_grad():
        tensor.copy_(values)


def _init_mlp(mlp: torch.nn.Module, std: float, *key: object) -> None:
    for name, param in mlp.named_parameters():
        _seeded_normal_(param, std, *key, name)


def _mlp(config: Any, width: int) -> torch.nn.Module:
    """A Llama SwiGLU MLP `width` wide (gate, up and down projections, no biases)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    narrow = copy.copy(config)
    narrow.intermediate_size = width
    return LlamaMLP(narrow)


def moe_block(spec: ModelSpec, plan: Plan, config: Any, layer: int, seed: int, ep_rank: int) -> MoEBlock:
    """Block `layer`'s MoE MLP for a rank at `ep_rank` of its expert-parallel group (see module doc)."""
    from deepspeed.moe.layer import MoE

    moe = spec.moe
    assert moe is not None
    std = config.initializer_range
    layer_moe = MoE(
        spec.hidden_size,
        expert=_mlp(config, moe.expert_ffn_hidden_size),
        num_experts=moe.num_experts,
        ep_size=plan.ep,
        k=moe.experts_per_token,
        capacity_factor=moe.capacity_factor or 1.0,
        eval_capacity_factor=moe.capacity_factor or 1.0,
        drop_tokens=moe.router == "capacity",
        use_residual=False,
        enable_expert_tensor_parallelism=expert_tensor_parallel(plan),
        top2_2nd_expert_sampling=False,
    )
    _seeded_normal_(layer_moe.deepspeed_moe.gate.wg.weight, std, seed, layer, "router")
    local = layer_moe.num_local_experts
    for j, expert in enumerate(layer_moe.deepspeed_moe.experts.deepspeed_experts):
        _init_mlp(expert, std, seed, layer, "expert", ep_rank * local + j)
    shared = None
    if moe.num_shared_experts:
        shared = _mlp(config, moe.num_shared_experts * moe.shared_width)
        _init_mlp(shared, std, seed, layer, "shared")
    return MoEBlock(layer_moe, shared)


def apply_moe(lm: torch.nn.Module, spec: ModelSpec, plan: Plan, seed: int, rank: int) -> None:
    """Replaces the MLP of every MoE block of a LlamaForCausalLM (whose config is `llama_config(spec)`)
    with a `MoEBlock`, in place, in the model's dtype and on its device."""
    moe = spec.moe
    assert moe is not None
    config = lm.config
    ep_rank = expert_parallel_rank(rank, plan)
    layers = lm.model.layers  # type: ignore[union-attr]
    for index, layer in enumerate(layers):  # type: ignore[arg-type]
        if moe.is_moe_layer(index):
            old = layer.mlp.down_proj.weight
            with torch.device(old.device):
                block = moe_block(spec, plan, config, index, seed, ep_rank)
            layer.mlp = block.to(old.dtype)


def moe_blocks(module: torch.nn.Module) -> list[MoEBlock]:
    return [m for m in module.modules() if isinstance(m, MoEBlock)]


@contextlib.contextmanager
def counting_slots(module: torch.nn.Module) -> Iterator[None]:
    """Counts the routed and padded slots of every MoE block's forwards inside the block."""
    blocks = moe_blocks(module)
    for block in blocks:
        block.counting = True
    try:
        yield
    finally:
        for block in blocks:
            block.counting = False


def forward_loads(module: torch.nn.Module) -> list[float]:
    """The load the routed experts ran at in each counted forward (a micro-batch's pass through this
    rank's MoE blocks): slots padded over slots routed, summed over the blocks, i.e. num_experts·C /
    (k·tokens) averaged over the blocks. Dropless: the max/mean of DeepSpeed's `exp_counts` (over the EP
    group); capacity: ceil(tokens·k/E · capacity factor) (at least `min_capacity`) over tokens·k/E.
    Empty where nothing was counted (no MoE block on this rank)."""
    passes = zip(*(b.slots for b in moe_blocks(module)), strict=False)  # every block sees every micro-batch
    return [sum(p for p, _ in f) / sum(r for _, r in f) for f in passes]


def padded_load(module: torch.nn.Module) -> float | None:
    """The busiest counted forward's load (`forward_loads`), or None where nothing was counted.

    The busiest, not the mean: saved activations peak in one micro-batch's forward (backward frees
    them before the next), at that forward's load. The tiny dropless proxy's metered forwards (tests/
    train/test_moe_proxy.py, 16 experts, top-2) ran at 3.0, 2.88, 2.81 and 2.66: its activations priced at
    the busiest were 0.3 % over the measurement, at the mean 3.1 % under; the Qwen3-30B-A3B proxy's (128
    experts, top-8, 256 tokens a rank, ep 2) at 12.9-13.8 of at most 16: +0.8 % at the busiest (−80 % at
    the default imbalance 1.5). With a pipeline several micro-batches are in flight at once, and the
    busiest forward's load bounds theirs."""
    loads = forward_loads(module)
    return max(loads) if loads else None


def optimizer_param_groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    """The trainable parameters as DeepSpeed's optimizers need them with MoE layers: the experts' in
    groups of their own, marked `moe` and named after their expert-parallel group, which ZeRO-1/2 shard
    over the expert-data-parallel group instead of the data-parallel one
    (`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`; stage_1_and_2.py
    `_configure_moe_settings` refuses a MoE model without them)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = [p for p in module.parameters() if p.requires_grad]
    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})


def set_aux_loss_scale(engine: Any) -> None:
    """Weights every block's balancing loss as the engine's backward weights the training loss:
    AUX_LOSS_COEFFICIENT / gradient_accumulation_steps (DeepSpeed divides the loss by them: engine.py
    `backward`, `scale_wrt_gas`; the pipeline engine's micro-batches are them too), × the fp16 loss scale
    (the loss scaler multiplies the loss before backward, and ZeRO divides the gradients by it after).
    Called before each optimizer step: a dynamic loss scale changes between steps."""
    scale = AUX_LOSS_COEFFICIENT / engine.gradient_accumulation_steps()
    if engine.fp16_enabled():
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        scale *= float(scaler.loss_scale if scaler is not None else engine.optimizer.cur_scale)
    for block in moe_blocks(engine.module):
        block.aux_loss_scale = scale


def check_expert_parallel_rank(engine: Any, plan: Plan, rank: int) -> None:
    """Raises if DeepSpeed's expert-parallel groups differ from `expert_parallel_rank`'s layout (the
    experts' weights were drawn for it)."""
    import torch.distributed as dist

    expected = expert_parallel_rank(rank, plan)
    for block in moe_blocks(engine.module):
        group: Any = block.moe.deepspeed_moe.ep_group  # type: ignore[union-attr]
        got = dist.get_rank(group=group)
        if got != expected:
            raise RuntimeError(
                f"rank {rank} is expert-parallel rank {got} in DeepSpeed's groups, not {expected}: "
                "the experts' weights were drawn for another layout"
            )
