"""Token sources: what `--data` names, as sequences of seq_len + 1 tokens addressed by a global index.

Sources (`open_source`):
  * none: synthetic tokens from a fixed random Markov chain (each token has 4
    possible successors with probabilities 0.55/0.25/0.15/0.05), so the loss
    can fall from ln(V) towards the chain's entropy (about 1.16 nats) and
    "training works" is visible in a few steps;
  * text: `.jsonl`, `.txt`, `.parquet` (executor/components/data/documents.py),
    tokenized with --tokenizer once and cached next to the data
    (executor/components/data/cache.py); prompt/completion and chat documents
    carry which targets the loss counts;
  * token ids: `.npy`, a 1-D integer array (loaded with allow_pickle=False), or
    `.bin`, raw ids, uint16 when the vocabulary fits (< 65536), else uint32
    (nanoGPT's convention).
Any other file is refused, naming these formats. Files are memory-mapped;
sequence i is a window of seq_len + 1 tokens, the windows aligned at multiples
of seq_len in the token stream and chosen by a seeded permutation, reshuffled
every epoch: sequence i is a pure function of (seed, i), so a resumed run reads
exactly what it would have.

Documents are packed: a window may hold the end of one document, its EOS and
the start of the next, and attention runs across that boundary (the executor's
SDPA attention takes no document mask).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from executor.components.data.documents import TEXT_SUFFIXES, where
from topologies.errors import UsageError

SUCCESSORS = 4
SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.15, 0.05])
TOKEN_SUFFIXES = (".npy", ".bin")


class SyntheticTokens:
    """Sequences of a seeded Markov chain over the vocabulary (see module docstring)."""

    counted = None  # every target counts

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

    def target_mask(self, indices: np.ndarray) -> None:
        return None

    def counted_targets(self, indices: np.ndarray) -> int:
        return len(indices) * self.seq_len


class FileTokens:
    """Windows of seq_len + 1 tokens from a memory-mapped token stream, with the targets the loss counts.

    `counted` (one byte per token, 1 where the loss counts that token as a
    target) comes with prompt/completion and chat corpora; None: all count.
    """

    def __init__(self, path: Path, tokens: np.ndarray, vocab: int, seq_len: int, seed: int,
                 counted: np.ndarray | None = None, about: str | None = None) -> None:
        self.path, self.tokens, self.vocab, self.seq_len, self.seed = path, tokens, vocab, seq_len, seed
        self.counted, self.about = counted, about
        self.n_windows = (len(tokens) - 1) // seq_len
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def describe(self) -> str:
        about = f"{self.about}, " if self.about else ""
        return f"{self.path} ({about}{len(self.tokens):,} tokens, {self.n_windows:,} windows of {self.seq_len + 1})"

    def _window(self, index: int) -> int:
        epoch, k = divmod(index, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, 2, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[k])

    def _starts(self, indices: np.ndarray) -> list[int]:
        return [self._window(int(index)) * self.seq_len for index in indices]

    def sequences(self, indices: np.ndarray) -> np.ndarray:
        length = self.seq_len + 1
        out = np.stack([np.asarray(self.tokens[s:s + length], dtype=np.int64) for s in self._starts(indices)])
        if out.min() < 0 or out.max() >= self.vocab:
            bad = int(out.max()) if out.max() >= self.vocab else int(out.min())
            raise UsageError(
                f"data file {str(self.path)!r} holds token id {bad}, outside the model's vocabulary "
                f"[0, {self.vocab}): tokenize it for this model"
            )
        return out

    def target_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """(n, seq_len) bool: which targets (tokens 1..seq_len of each window) the loss counts; None: all."""
        if self.counted is None:
            return None
        return np.stack([np.asarray(self.counted[s + 1:s + 1 + self.seq_len], dtype=bool)
                         for s in self._starts(indices)])

    def counted_targets(self, indices: np.ndarray) -> int:
        """How many targets of these sequences the loss counts."""
        if self.counted is None:
            return len(indices) * self.seq_len
        return sum(int(np.count_nonzero(self.counted[s + 1:s + 1 + self.seq_len])) for s in self._starts(indices))


def open_source(path: str | None, vocab: int, seq_len: int, seed: int, tokenizer: Path | None = None,
                log=None) -> SyntheticTokens | FileTokens:
    """The token source for --data (None: synthetic); text is tokenized with `tokenizer` (cached).

    Raises UsageError for unusable files, naming the file (and the line, for text).
    """
    if path is None:
        return SyntheticTokens(vocab, seq_len, seed)
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"data file {path!r} does not exist or is not a file")
    suffix = file.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _text_source(file, vocab, seq_len, seed, tokenizer, log)
    if suffix not in TOKEN_SUFFIXES:
        raise UsageError(
            f"data file {path!r}: unknown format {suffix or '(no suffix)'!r}; --data takes text as .jsonl "
            "({\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"} per line), .txt (a document per line) or "
            ".parquet (the same fields as columns), tokenized with --tokenizer, or token ids as .npy or .bin")
    try:
        tokens = _load_tokens(file, vocab)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read data file {path!r}: {exc}") from None
    _check_length(path, len(tokens), seq_len)
    return FileTokens(file, tokens, vocab, seq_len, seed)


def _check_length(path: str, n_tokens: int, seq_len: int, what: str = "") -> None:
    if n_tokens < seq_len + 1:
        raise UsageError(
            f"data file {path!r} holds {n_tokens} tokens{what}, fewer than one sequence of seq_len + 1 = "
            f"{seq_len + 1}: give a larger file or plan a shorter --seq-len"
        )


def _text_source(file: Path, vocab: int, seq_len: int, seed: int, tokenizer: Path | None, log) -> FileTokens:
    from executor.components.data.cache import tokenized

    if tokenizer is None:
        raise UsageError(f"data file {str(file)!r} is text: give --tokenizer (a tokenizer.json or a Hugging Face "
                         "model directory), or --init-from a model directory whose tokenizer is used")
    corpus = tokenized(file, tokenizer, log=log)
    meta = corpus.meta
    if meta["n_documents"] == 0:
        raise UsageError(f"data file {str(file)!r} holds no documents (every line is blank): nothing to train on")
    if meta["max_token_id"] >= vocab:
        first = int(np.argmax(corpus.tokens >= vocab))
        raise UsageError(
            f"{where(file, corpus.line_of(first))}: token id {int(corpus.tokens[first])} from tokenizer "
            f"{str(tokenizer)!r} is outside the model's vocabulary [0, {vocab}): use the model's own tokenizer")
    _check_length(str(file), meta["n_tokens"], seq_len, f" after tokenization ({meta['n_documents']} documents)")
    if meta["masked"] and meta["n_counted"] == 0:
        raise UsageError(f"data file {str(file)!r}: no token counts in the loss (no completion or assistant text)")
    kinds = ", ".join(f"{n:,} {kind.replace('_', '/')}" for kind, n in meta["kinds"].items() if n)
    counted = f", {meta['n_counted'] / meta['n_tokens']:.0%} of tokens counted in the loss" if meta["masked"] else ""
    return FileTokens(file, corpus.tokens, vocab, seq_len, seed, corpus.counted, f"{kinds} documents{counted}")


def _load_tokens(file: Path, vocab: int) -> np.ndarray:
    suffix = file.suffix.lower()
    if file.stat().st_size == 0:
        return np.empty(0, dtype=np.uint8)
    if suffix == ".npy":
        tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"a .npy token file must hold a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        return tokens
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    if file.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"size {file.stat().st_size} bytes is not a multiple of {dtype.__name__}")
    return np.memmap(file, dtype=dtype, mode="r")
