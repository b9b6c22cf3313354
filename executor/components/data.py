"""Training data: a global order of sequences, sharded by data-parallel rank.

Every step consumes the same global batch whatever the layout: sequences
[p, p + G) of the source, where p is the data position (sequences consumed so
far) and G the global batch size. Data-parallel rank d of D takes the
contiguous block [p + d*G/D, p + (d+1)*G/D) (DistributedSampler's idea: one
global order, split by rank, no overlap); the TP and PP ranks of a replica
share its dp coordinate and so read the same block. A sequence i is a pure
function of (seed, i), so a resumed run reads exactly what it would have.

Sources (`open_source`):
  * none: synthetic tokens from a fixed random Markov chain (each token has 4
    possible successors with probabilities 0.55/0.25/0.15/0.05), so the loss
    can fall from ln(V) towards the chain's entropy (about 1.16 nats) and
    "training works" is visible in a few steps;
  * `.npy`: a 1-D integer token array (loaded with allow_pickle=False);
  * `.bin`: raw token ids, uint16 when the vocabulary fits (< 65536), else
    uint32 (nanoGPT's convention);
  * any other file: text, one byte = one token (needs vocab >= 256).
Files are memory-mapped; sequence i is a window of seq_len + 1 tokens chosen
by a seeded permutation of the file's windows, reshuffled every epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from topologies.errors import UsageError

SUCCESSORS = 4
SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.15, 0.05])


class SyntheticTokens:
    """Sequences of a seeded Markov chain over the vocabulary (see module docstring)."""

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.table = table_rng.integers(0, vocab, size=(vocab, SUCCESSORS))

    def describe(self) -> str:
        return f"synthetic Markov tokens (vocab {self.vocab}, seed {self.seed})"

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        """(n, seq_len + 1) int64 tokens; row r is a function of (seed, indices[r]) only."""
        n, length = len(indices), self.seq_len + 1
        out = np.empty((n, length), dtype=np.int64)
        choices = np.empty((n, length - 1), dtype=np.int64)
        for r, index in enumerate(indices):
            rng = np.random.default_rng([self.seed, 1, int(index)])
            out[r, 0] = rng.integers(0, self.vocab)
            choices[r] = rng.choice(SUCCESSORS, size=length - 1, p=SUCCESSOR_PROBS)
        for j in range(length - 1):
            out[:, j + 1] = self.table[out[:, j], choices[:, j]]
        return out


class FileTokens:
    """Windows of seq_len + 1 tokens from a memory-mapped token file."""

    def __init__(self, path: Path, tokens: np.ndarray, vocab: int, seq_len: int, seed: int) -> None:
        self.path, self.tokens, self.vocab, self.seq_len, self.seed = path, tokens, vocab, seq_len, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def describe(self) -> str:
        return f"{self.path} ({len(self.tokens):,} tokens, {self.n_windows:,} windows of {self.seq_len + 1})"

    def _window(self, index: int) -> int:
        epoch, k = divmod(index, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 2, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[k])

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        length = self.seq_len + 1
        rows = []
        for index in indices:
            start = self._window(int(index)) * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + length], dtype=np.int64))
        out = np.stack(rows)
        if out.min() < 0 or out.max() >= self.vocab:
            bad = int(out.max()) if out.max() >= self.vocab else int(out.min())
            raise UsageError(
                f"data file {str(self.path)!r} holds token id {bad}, outside the model's vocabulary "
                f"[0, {self.vocab}): tokenize it for this model"
            )
        return out


def open_source(path: str | None, vocab: int, seq_len: int, seed: int) -> SyntheticTokens | FileTokens:
    """The token source for --data (None: synthetic). Raises UsageError for unusable files."""
    if path is None:
        return SyntheticTokens(vocab, seq_len, seed)
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"data file {path!r} does not exist or is not a file")
    try:
        tokens = _load_tokens(file, vocab)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read data file {path!r}: {exc}") from None
    if len(tokens) < seq_len + 1:
        raise UsageError(
            f"data file {path!r} holds {len(tokens)} tokens, fewer than one sequence of seq_len + 1 = "
            f"{seq_len + 1}: give a larger file or plan a shorter --seq-len"
        )
    return FileTokens(file, tokens, vocab, seq_len, seed)


def _load_tokens(file: Path, vocab: int) -> np.ndarray:
    suffix = file.suffix.lower()
    if file.stat().st_size == 0:
        return np.empty(0, dtype=np.uint8)
    if suffix == ".npy":
        tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"a .npy token file must hold a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        return tokens
    if suffix == ".bin":
        dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
        if file.stat().st_size % np.dtype(dtype).itemsize:
            raise ValueError(f"size {file.stat().st_size} bytes is not a multiple of {dtype.__name__}")
        return np.memmap(file, dtype=dtype, mode="r")
    if vocab < 256:
        raise ValueError(f"a text file is read as bytes (256 token ids) but the model's vocabulary is {vocab}")
    return np.memmap(file, dtype=np.uint8, mode="r")


def local_batch(source, position: int, global_batch: int, dp: int, dp_rank: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's (inputs, targets) for the step starting at sequence `position`.

    Shapes (G / dp, seq_len); targets are inputs shifted by one token.
    """
    local = global_batch // dp
    first = position + dp_rank * local
    seqs = torch.from_numpy(source.sequences(np.arange(first, first + local)))
    seqs = seqs.to(device, non_blocking=True)
    return seqs[:, :-1], seqs[:, 1:]
