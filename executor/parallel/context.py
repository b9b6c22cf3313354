"""Context parallelism: each cp rank holds two load-balanced chunks of every sequence.

torch's `context_parallel` (ring attention by DTensor dispatch) handles only
the CUDA SDPA kernels: on CPU the flash-for-CPU op has no sharding strategy
and the math kernel mixes DTensor with Tensor (torch 2.13). So the executor
does what Llama 3 did for long context: every rank all-gathers K and V over
the cp group and attends its own queries to the whole sequence with an
explicit causal mask. K/V memory is O(S) per rank, the activations O(S/cp).

Sharding: the sequence is cut into 2*cp equal chunks and rank r keeps chunks
r and 2cp-1-r (the head-tail "zigzag" of torch's _HeadTailLoadBalancer), so
every rank gets the same amount of causal attention work. Inputs and
targets are cut alike (`shard_sequence`); the loss mean over a rank's
tokens, averaged over the cp ranks by the gradient reduction (cp is folded
into the data-parallel group, as torchtitan's dp_shard_cp), is the mean over
the sequence.

K and V are gathered in ONE autograd collective (stacked): two same-shaped
gathers can run their backward reduce-scatters in a different order on each
rank, and gloo would then pair K's gradients with V's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class ContextShard:
    """This rank's place in the cp group; caches the positions and mask of the last sequence length."""

    group: object  # the cp ProcessGroup
    rank: int
    size: int
    _cache: dict = field(default_factory=dict, repr=False)

    def chunk_ids(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, local_seq: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `local_seq` tokens (two chunks of local_seq / 2)."""
        return self._rank_positions(self.rank, local_seq, device)

    def _rank_positions(self, rank: int, local_seq: int, device: torch.device) -> torch.Tensor:
        half = local_seq // 2
        first, second = rank, 2 * self.size - 1 - rank
        return torch.cat([torch.arange(first * half, (first + 1) * half, device=device),
                          torch.arange(second * half, (second + 1) * half, device=device)])

    def mask(self, local_seq: int, device: torch.device) -> torch.Tensor:
        """Boolean (local_seq, cp * local_seq) mask, True where a local query may attend a gathered key."""
        key = (local_seq, str(device))
        if key not in self._cache:
            q_pos = self.positions(local_seq, device)
            k_pos = torch.cat([self._rank_positions(r, local_seq, device) for r in range(self.size)])
            self._cache = {key: q_pos[:, None] >= k_pos[None, :]}
        return self._cache[key]


def shard_sequence(t: torch.Tensor, cp: ContextShard, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks (r and 2cp-1-r of 2cp) of `t` along `dim`."""
    n = t.shape[dim]
    if n % (2 * cp.size):
        from topologies.errors import PlanError

        raise PlanError(f"seq_len ({n}) must be a multiple of 2 * cp ({2 * cp.size}) for load-balanced "
                        "context parallelism; plan with another --seq-len or --cp")
    chunks = t.chunk(2 * cp.size, dim=dim)
    first, second = cp.chunk_ids()
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """Causal attention of local queries (B, a, s, d) over K/V gathered from every cp rank."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    kv = all_gather_tensor_autograd(torch.stack([k, v]), gather_dim=3, group=cp.group)
    k_all, v_all = kv[0], kv[1]
    mask = cp.mask(q.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k_all.shape[1])
