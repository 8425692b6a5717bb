"""DeepSpeed-Ulysses context parallelism for the proxy (Jacobs et al. 2023, arXiv:2309.14509).

Each of the cp ranks of a context-parallel group holds a contiguous chunk of every sequence: the
embedding, norms, projections, MLP and loss run on s/cp tokens. Attention needs the whole sequence:
`deepspeed.sequence.layer.DistributedAttention` all-to-alls q, k and v from (sequence chunk, all heads)
to (whole sequence, heads/cp), runs the local attention, and all-to-alls the output back.

Gradients are averaged over data × context ranks (DeepSpeed's `seq_data_parallel_group`, which the
`UlyssesGroups` mpu names), so the loss of a rank is its chunk's share of the whole sequence's mean
(`context_parallel_loss`), and the average over the cp ranks is the unsharded loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import ProcessTopology


class UlyssesGroups:
    """DeepSpeed `mpu` for dp × cp × tp ranks (axes data, sequence, model; TP peers adjacent).

    DeepSpeed reads the data-parallel group (the batch split), the sequence-parallel group (Ulysses) and
    the sequence-data-parallel group (gradient averaging and ZeRO partitioning, utils/groups.py
    `_get_sequence_data_parallel_group`) from it; model parallel means tensor parallel here (pp = 1).
    """

    def __init__(self, dp: int, cp: int, tp: int):
        self.topology = ProcessTopology(axes=["data", "sequence", "model"], dims=[dp, cp, tp])
        rank = dist.get_rank()
        me = self.topology.get_coord(rank)
        self.groups: dict[str, tuple[Any, list[int]]] = {}
        lists = {axis: self.topology.get_axis_comm_lists(axis) for axis in ("data", "sequence", "model")}
        lists["sequence_data"] = [
            self.topology.filter_match(model=m) for m in range(tp)
        ]  # every data × sequence rank of one TP slice
        for name, comm_lists in lists.items():  # every rank creates every group, in the same order
            for ranks in comm_lists:
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    self.groups[name] = (group, ranks)
        self.coord = me

    def _group(self, name: str) -> Any:
        return self.groups[name][0]

    def _size(self, name: str) -> int:
        return len(self.groups[name][1])

    def _rank(self, name: str) -> int:
        return self.groups[name][1].index(dist.get_rank())

    def get_data_parallel_group(self) -> Any:
        return self._group("data")

    def get_data_parallel_world_size(self) -> int:
        return self._size("data")

    def get_data_parallel_rank(self) -> int:
        return self._rank("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.groups["data"][1]

    def get_sequence_parallel_group(self) -> Any:
        return self._group("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self._size("sequence")

    def get_sequence_parallel_rank(self) -> int:
        return self._rank("sequence")

    def get_sequence_data_parallel_group(self) -> Any:
        return self._group("sequence_data")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("sequence_data")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank("sequence_data")

    def get_model_parallel_group(self) -> Any:
        return self._group("model")

    def get_model_parallel_world_size(self) -> int:
        return self._size("model")

    def get_model_parallel_rank(self) -> int:
        return self._rank("model")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_rank = get_model_parallel_rank


def sequence_chunk(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along the sequence (dim 1). The backward pass needs no
    communication: the other chunks' gradients flow on their own ranks."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=1)[rank].contiguous()


def chunk_positions(local_len: int, group: Any, device: torch.device) -> torch.Tensor:
    """Positions of this rank's tokens in the whole sequence (for the rotary tables)."""
    start = dist.get_rank(group) * local_len
    return torch.arange(start, start + local_len, device=device).unsqueeze(0)


def ulysses_attention_forward(attn: Any, group: Any) -> Any:
    """Hugging Face's `LlamaAttention.forward` with the attention core wrapped in DeepSpeed's
    `DistributedAttention` (layout batch, sequence, heads, head_dim: scatter heads, gather sequence)."""
    from deepspeed.sequence.layer import DistributedAttention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> torch.Tensor:
        out, _ = sdpa_attention_forward(
            attn,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            dropout=0.0,
            scaling=attn.scaling,
        )
        return out  # (batch, sequence, heads/cp, head_dim)

    core = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)
    cp = dist.get_world_size(group)

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        query = attn.q_proj(hidden_states)
        shape = (*query.shape[:-1], -1, attn.head_dim)
        query = query.view(shape)
        key = attn.k_proj(hidden_states).view(shape)
        value = attn.v_proj(hidden_states).view(shape)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
        key, value = _repeat_kv_heads(key, cp), _repeat_kv_heads(value, cp)
        out = core(query, key, value, 0)
        return attn.o_proj(out.reshape(*shape[:2], -1).contiguous()), None

    return forward


def _repeat_kv_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """KV heads repeated up to cp when a rank holds fewer (GQA with tp·cp > KV heads): DeepSpeed's
    all-to-all needs at least one KV head per rank (sequence/layer.py asserts it), and a repeated head
    serves the same query heads as the original, as Megatron's GQA repeats KV heads when tp > groups."""
    heads = x.shape[2]
    return x if heads >= cp else x.repeat_interleave(cp // heads, dim=2)


def cp_group_of(model: Any) -> Any:
    """The context-parallel group of a model (a DeepSpeed engine or its module), or None."""
    return getattr(getattr(model, "module", model), "cp_group", None)


def chunk_targets(labels: torch.Tensor, local: int, group: Any) -> torch.Tensor:
    """The next-token labels of this rank's chunk of `local` positions, from the whole sequence's
    `labels`: a chunk's last position predicts the next chunk's first token; the last chunk has one
    label fewer."""
    start = dist.get_rank(group) * local
    return labels[:, start + 1 : start + local + 1]


def context_parallel_loss(logits: torch.Tensor, input_ids: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's share of the next-token loss of the whole sequence: the cross-entropy summed over its
    chunk's positions (labels from the whole `input_ids`, so a chunk's last position predicts the next
    chunk's first token), divided by the whole sequence's positions, times cp (DeepSpeed averages the
    gradients over the cp ranks; their mean is then the unsharded loss)."""
    size = dist.get_world_size(group)
    batch, seq = input_ids.shape
    labels = chunk_targets(input_ids, logits.shape[1], group)
    predicted = logits[:, : labels.shape[1], :].float()
    total = torch.nn.functional.cross_entropy(
        predicted.reshape(-1, predicted.size(-1)), labels.reshape(-1), reduction="sum"
    )
    return total * size / (batch * (seq - 1))
