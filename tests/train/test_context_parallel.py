"""Ulysses context parallelism: a rank's chunked loss, averaged over the cp ranks, is the unsharded loss."""

from __future__ import annotations

import torch

from service.train import context_parallel as cpl
from service.train.model import causal_lm_loss


def test_chunked_losses_average_to_the_whole_sequence_loss(monkeypatch):
    torch.manual_seed(0)
    cp, batch, seq, vocab = 4, 2, 16, 11
    logits, ids = torch.randn(batch, seq, vocab), torch.randint(0, vocab, (batch, seq))
    monkeypatch.setattr(cpl.dist, "get_world_size", lambda group: cp)
    losses = []
    for rank in range(cp):  # each rank sees its chunk of the logits and the whole input_ids
        monkeypatch.setattr(cpl.dist, "get_rank", lambda group, r=rank: r)
        chunk = cpl.sequence_chunk(logits, None)
        assert chunk.shape == (batch, seq // cp, vocab)
        assert cpl.chunk_positions(seq // cp, None, torch.device("cpu"))[0, 0] == rank * seq // cp
        losses.append(cpl.context_parallel_loss(chunk, ids, None))
    # DeepSpeed averages gradients over the cp ranks; the mean of the ranks' losses is the whole loss
    torch.testing.assert_close(torch.stack(losses).mean(), causal_lm_loss(logits, ids))
