"""executor.parallel.context against one process's causal attention: each cp rank's two head-tail chunks,
attending the keys before them under a lower-right causal bias, give that rank's slice of the full result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.parallel.context import ContextShard, attend_gathered, in_sequence_order, shard_sequence


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_gets_its_slice_of_full_causal_attention(cp):
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 16 * cp, 8  # GQA: K/V repeated to the query heads
    q, k, v = (torch.randn(batch, h, seq, dim) for h in (heads, kv_heads, kv_heads))
    rep = heads // kv_heads
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=True)
    for rank in range(cp):
        shard = ContextShard(None, rank, cp)
        shard.prepare(seq // cp)
        # what all_gather along the sequence returns: every rank's two chunks, rank by rank
        k_gathered, v_gathered = (torch.cat([shard_sequence(t, ContextShard(None, r, cp), dim=2) for r in range(cp)],
                                            dim=2) for t in (k, v))
        assert torch.equal(in_sequence_order(k_gathered, cp), k)
        out = attend_gathered(shard_sequence(q, shard, dim=2), k_gathered, v_gathered, shard)
        assert torch.allclose(out, shard_sequence(full, shard, dim=2), atol=1e-5)
