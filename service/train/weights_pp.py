"""Fine-tuning the user's weights under a pipeline-parallel plan (pp > 1, with or without tp).

- `PipelineCheckpoint`: the checkpoint's LlamaForCausalLM on the meta device (no memory, no random
  initialisation), which `service.train.model.build_model` makes tensor-parallel and cuts into stages,
  each stage given to `deepspeed.pipe.PipelineModule` as a `LayerSpec`. The module builds only the specs
  of its own stage (`PipelineModule._build` over the partition it chose), and building one reads that
  stage's tensors from the safetensors file(s) lazily (`weights.CheckpointReader`: with tp > 1 only this
  rank's slices): the embedding on the first stage, the decoder layers the partition gave the stage, the
  final norm and lm_head on the last. The partition is the module's own; nothing here recomputes it.
- `pipeline_state_dict`: the export's state dict: each stage's parameters (tensor-parallel ones
  all-gathered over their TP group) named as in the checkpoint, gathered onto global rank 0 from the
  first data-parallel replica's TP rank 0 of every stage.
- `pipeline_logits`, `evaluate_pipeline`, `pipeline_micro_batches`: the probe logits, the evaluation
  loss and the training micro-batches through the pipeline engine (a `PipelineEngine` only runs whole
  batches: `train_batch`, `eval_batch`).

A tied embedding would need the first and last stages to share a weight (a `TiedLayerSpec`), which the
service's pipeline does not build: `checkpoint_checks.check_layout` refuses it before the run starts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from service.train.weights import CheckpointReader, meta_causal_lm, tensor_parallel_shards


@functools.cache
def _stage_spec() -> Any:
    """The `LayerSpec` subclass of the stages (made on first use: DeepSpeed is imported after the worker
    has pinned its cores, service/train/worker.py)."""
    from deepspeed.pipe import LayerSpec

    class StageSpec(LayerSpec):  # type: ignore[misc]
        """A stage that `PipelineModule` builds only on the ranks that run it, filled from the checkpoint."""

        def __init__(self, source: PipelineCheckpoint, typename: type, *args: Any):
            super().__init__(typename, *args)
            self.source = source

        def __repr__(self) -> str:  # DeepSpeed prints the partition; the default repr is the whole model's
            return str(self.typename.__name__)

        def build(self, log: bool = False) -> torch.nn.Module:
            stage: torch.nn.Module = super().build(log)
            self.source.fill(stage)
            return stage

    return StageSpec


class PipelineCheckpoint:
    """The checkpoint as a meta-device LlamaForCausalLM (`lm`) and stage specs (`spec`) that read it."""

    def __init__(self, weights: str, dtype: torch.dtype):
        lm = meta_causal_lm(weights, "pipeline-parallel")
        self.weights, self.lm, self.dtype = weights, lm, dtype
        self.reader = CheckpointReader(weights)

    def spec(self, typename: type, *args: Any) -> Any:
        """A `LayerSpec` of `typename(*args)` (a stage over `lm`'s modules), built and filled where run."""
        return _stage_spec()(self, typename, *args)

    def fill(self, stage: torch.nn.Module) -> None:
        """Replaces the meta parameters of `stage` by the checkpoint's tensors (a tensor-parallel one:
        this rank's slice), keeping each parameter's gradient hooks (`apply_tensor_parallel`'s
        sequence-parallel sums) and `requires_grad`."""
        import torch.distributed as dist

        names = {id(module): prefix for prefix, module in self.lm.named_modules()}
        shards = tensor_parallel_shards(self.lm)  # after build_model made `lm` tensor-parallel
        for module in stage.modules():
            prefix = names.get(id(module))
            if prefix is None:  # the stage wrappers (model.py's _Embed, _Layer, _Head)
                continue
            for leaf, meta in list(module.named_parameters(recurse=False)):
                name = f"{prefix}.{leaf}"
                if name in shards:
                    dim, group = shards[name]
                    rank, parts = dist.get_rank(group=group), dist.get_world_size(group=group)
                    value = self.reader.read(name, self.dtype, dim, rank, parts)
                else:
                    value = self.reader.read(name, self.dtype)
                if value.shape != meta.shape:
                    raise ValueError(
                        f"{self.weights}: {name} is {tuple(value.shape)}, not {tuple(meta.shape)}"
                    )
                param = torch.nn.Parameter(value, requires_grad=meta.requires_grad)
                if name in shards:
                    param.tensor_model_parallel = True  # type: ignore[attr-defined]
                for hook in (meta._backward_hooks or {}).values():
                    param.register_hook(hook)
                setattr(module, leaf, param)
        left = [n for n, t in (*stage.named_parameters(), *stage.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"{self.weights}: not loaded into the pipeline stage: {', '.join(left)}")


def pipeline_state_dict(pipeline: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The full parameters and persistent buffers of a pipeline built from a checkpoint, on global rank 0
    (CPU copies, the checkpoint's names); other ranks return {} (every rank must call it: tensor-parallel
    parameters are all-gathered over their TP group, then every stage's are gathered onto rank 0)."""
    import torch.distributed as dist

    lm: torch.nn.Module = pipeline.hf_model  # type: ignore[assignment]
    shards = tensor_parallel_shards(lm)
    mine: dict[str, torch.Tensor] = {}
    for name, param in lm.named_parameters():
        if param.is_meta:  # another stage's
            continue
        value = param.detach()
        if name in shards:
            dim, group = shards[name]
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group=group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=dim)
        mine[name] = value.to("cpu", copy=True)
    persistent = lm.state_dict(keep_vars=True).keys()
    mine.update(
        {
            n: b.detach().to("cpu", copy=True)
            for n, b in lm.named_buffers()
            if n in persistent and not b.is_meta
        }
    )
    coord = pipeline.topology().get_coord(rank)  # type: ignore[operator]
    sends = coord.data == 0 and getattr(coord, "model", 0) == 0  # one copy of each stage
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine if sends else {}, gathered if rank == 0 else None, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if rank == 0 else {}


def pipeline_micro_batches(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) micro-batches from a `ShardedLoader` for the pipeline engine: a packed fine-tuning
    batch `(b, 2, s)` splits into its ids and labels (prompt tokens −100, which `causal_lm_loss`'s
    cross-entropy ignores); a token batch `(b, s)` is its own labels (the loss shifts)."""
    while True:
        batch = loader.next_micro_batch()
        yield (batch, batch) if batch.dim() == 2 else (batch[:, 0].contiguous(), batch[:, 1].contiguous())


def pipeline_logits(engine: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits of the pipeline on `input_ids` (one sequence) on global rank 0, None on the other ranks
    (every rank must call it). The sequence is repeated to a training micro-batch, the shape the engine's
    stage-to-stage buffers have."""
    import torch.distributed as dist

    rows = engine.train_micro_batch_size_per_gpu()
    batch = input_ids[:1].expand(rows, -1).contiguous().to(engine.device)
    # eval_batch adds each micro-batch's "loss" (here the logits: compute_loss=False) to the engine's running
    # total, which only train_batch resets: after an evaluation it is a scalar, and the add fails.
    engine.total_loss = engine.total_additional_losses = None
    _, outputs = engine.eval_batch(
        iter([(batch, batch)]),
        return_logits=True,
        compute_loss=False,
        reduce_output=None,
        num_micro_batches=1,
    )
    last = engine.grid.stage_to_global(stage_id=engine.num_stages - 1, data=0, model=0)  # never rank 0
    rank = dist.get_rank()
    if rank == last:
        dist.send(outputs[:1].float().contiguous(), dst=0)
    if rank != 0:
        return None
    vocab = engine.module.hf_model.config.vocab_size
    logits = torch.empty(1, input_ids.shape[-1], vocab, device=engine.device)
    dist.recv(logits, src=last)
    return logits.cpu()


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over a micro-batch's target tokens (labels −100 ignored)."""
    shift = logits[:, :-1, :].float()
    return torch.nn.functional.cross_entropy(
        shift.reshape(-1, shift.size(-1)), labels[:, 1:].reshape(-1), reduction="sum"
    )


def evaluate_pipeline(engine: Any, split: Any, dp_rank: int, dp_size: int, micro_batch: int) -> float:
    """`hf_data.evaluate` through the pipeline engine: mean loss per target token over the whole evaluation
    split, identical on every rank. Data-parallel rank `r` takes blocks `r, r + dp, …` in micro-batches
    of the training shape (padded with rows whose labels are all ignored), evaluated in one `eval_batch`
    with the module's loss summed instead of averaged."""
    import torch.distributed as dist

    from service.train.hf_data import IGNORE_INDEX

    n = len(split)
    per_rank = -(-n // dp_size)
    batches = -(-per_rank // micro_batch)  # the same on every rank
    mine = list(range(dp_rank, n, dp_size))
    padding = split.block(0).copy()
    padding[1] = IGNORE_INDEX  # a row that weighs nothing

    def rows(b: int) -> torch.Tensor:
        blocks = [split.block(i) for i in mine[b * micro_batch : (b + 1) * micro_batch]]
        blocks += [padding] * (micro_batch - len(blocks))
        return torch.from_numpy(np.stack(blocks)).to(engine.device)

    micro = ((x[:, 0].contiguous(), x[:, 1].contiguous()) for x in map(rows, range(batches)))
    targets = sum(int((split.block(i)[1, 1:] != IGNORE_INDEX).sum()) for i in mine)
    module = engine.module
    mean_loss, module.loss_fn = module.loss_fn, _summed_loss
    try:
        # avg: the micro-batches' sums averaged over the micro-batches and the data-parallel ranks
        average = engine.eval_batch(micro, num_micro_batches=batches)
    finally:
        module.loss_fn = mean_loss
    loss = float(average) * batches * engine.grid.get_data_parallel_world_size()
    tokens = torch.tensor([targets], dtype=torch.float64, device=engine.device)
    dist.all_reduce(tokens, group=engine.grid.get_data_parallel_group())
    return loss / max(float(tokens), 1.0)
