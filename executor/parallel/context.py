"""Context parallelism: each cp rank holds two load-balanced chunks of every sequence.

torch's `context_parallel` (ring attention by DTensor dispatch) handles only
the CUDA SDPA kernels: on CPU the flash-for-CPU op has no sharding strategy
and the math kernel mixes DTensor with Tensor (torch 2.13). So the executor
does what Llama 3 did for long context: every rank all-gathers K and V over
the cp group and attends its own queries to the keys before them. K/V memory
is O(S) per rank, the activations O(S/cp).

Each of the rank's two query chunks attends the keys up to its own end under a
lower-right causal bias (torch.nn.attention.bias.causal_lower_right): on CUDA
that is the flash (or memory-efficient) kernel's own causal mode, no mask
tensor, half the scores of a full rectangle; elsewhere SDPA materializes the
chunk's mask. GQA's K/V are repeated to the query heads first, since the
lower-right flash path takes equal head counts (an explicit boolean mask with
enable_gqa would leave only the math kernel, which materializes every score).

Sharding: the sequence is cut into 2*cp equal chunks and rank r keeps chunks
r and 2cp-1-r (the head-tail "zigzag" of torch's _HeadTailLoadBalancer), so
every rank gets the same amount of causal attention work. Inputs and
targets are cut alike (`shard_sequence`); the loss mean over a rank's
tokens, averaged over the cp ranks by the gradient reduction (cp is folded
into the data-parallel group, as torchtitan's dp_shard_cp), is the mean over
the sequence.

K and V are gathered in ONE autograd collective (concatenated along the
head width, so MLA's wider keys travel with its values): two gathers can
run their backward reduce-scatters in a different order on each rank, and
gloo would then pair K's gradients with V's.

A sliding-window layer (Mistral) attends only the keys within the window of
each query: its chunks get an explicit boolean mask over the global
positions (`window_mask`) and the keys before the window
are left out of the chunk's SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class ContextShard:
    """This rank's place in the cp group; keeps the causal biases its chunks attend under."""

    group: object  # the cp ProcessGroup
    rank: int
    size: int
    _biases: dict = field(default_factory=dict, repr=False)

    def prepare(self, local_seq: int) -> None:
        """Make the lower-right causal biases this rank's two chunks attend under, outside the blocks and outside
        any dispatch mode: a CausalBias is a tensor subclass (holding only its sizes), which a mode that makes
        tensors itself (per-op SAC's, FakeTensorMode of validate-memory) cannot create."""
        from torch.nn.attention.bias import causal_lower_right
        from torch.utils._python_dispatch import _disable_current_modes

        half = local_seq // 2
        for chunk in self.chunk_ids():
            key = (half, (chunk + 1) * half)
            if key not in self._biases:
                with _disable_current_modes():
                    self._biases[key] = causal_lower_right(*key)

    def causal_bias(self, n_queries: int, n_keys: int):
        """The bias `prepare` made for a chunk of n_queries queries over the first n_keys keys."""
        return self._biases[(n_queries, n_keys)]

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


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (queries, keys) mask, True where query position i may attend key j: i - window < j <= i
    (transformers' sliding_window_overlay on the causal mask); executor.attention uses it without cp too."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)


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


def in_sequence_order(t: torch.Tensor, size: int) -> torch.Tensor:
    """K or V gathered rank by rank (rank r's chunks r and 2cp-1-r, along dim 2) put back in sequence order."""
    b, h, n, d = t.shape
    pairs = t.view(b, h, size, 2, n // (2 * size), d)  # (rank, first or second chunk)
    return torch.cat([pairs[:, :, :, 0], pairs[:, :, :, 1].flip(2)], dim=2).reshape(b, h, n, d)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextShard, window: int = 0,
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of local queries (B, a, s, d) over K/V gathered from every cp rank."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    width = k.shape[-1]
    kv = all_gather_tensor_autograd(torch.cat([k, v], dim=-1), gather_dim=2, group=cp.group)
    return attend_gathered(q, kv[..., :width], kv[..., width:], cp, window, scale)


def attend_gathered(q: torch.Tensor, k_gathered: torch.Tensor, v_gathered: torch.Tensor,
                    cp: ContextShard, window: int = 0, scale: float | None = None) -> torch.Tensor:
    """The local queries' causal attention over K/V as all-gathered along the sequence (rank by rank)."""
    k_all, v_all = (in_sequence_order(t, cp.size) for t in (k_gathered, v_gathered))
    if q.shape[1] != k_all.shape[1]:
        k_all, v_all = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k_all, v_all))
    half = q.shape[2] // 2
    outs = []
    for i, chunk in enumerate(cp.chunk_ids()):
        end = (chunk + 1) * half  # this chunk's last key position + 1
        q_chunk = q[:, :, i * half:(i + 1) * half]
        if window and end > window:  # keys from the first query's window on, under the window's mask
            start = max(0, chunk * half - window + 1)
            mask = window_mask(torch.arange(chunk * half, end, device=q.device),
                               torch.arange(start, end, device=q.device), window)
            outs.append(F.scaled_dot_product_attention(q_chunk, k_all[:, :, start:end], v_all[:, :, start:end],
                                                       attn_mask=mask, scale=scale))
            continue
        outs.append(F.scaled_dot_product_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end],
                                                   attn_mask=cp.causal_bias(half, end), scale=scale))
    return torch.cat(outs, dim=2)
