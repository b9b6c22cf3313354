"""A text corpus tokenized once and kept next to the data, so every later run (and every rank) memory-maps it.

Layout: `corpus.jsonl` gets `corpus.jsonl.meshplan/tok-<key>/` beside it (or, where that directory
cannot be written, `$XDG_CACHE_HOME/meshplan/tokens/...`, default `~/.cache`), where the key hashes
the tokenizer's files (executor/components/data/tokenizer.py) and CACHE_VERSION. The entry holds
  tokens.bin   every document's token ids, EOS after each, in file order (uint16 below 65,536 ids,
               else uint32);
  counted.bin  one byte per token: 1 where the loss counts it as a target (only when some document
               is a prompt/completion or a conversation);
  docs.npy     (documents, 2) int64: each document's first token and its line (or row) number;
  meta.json    the data file's size, mtime and sha256, the tokenizer's hash, counts, the largest id.
An entry is reused when the data file's size and mtime match meta.json, or, when only the mtime
moved, its sha256 does; anything else tokenizes again.

Concurrency: every `meshplan execute` (one per node) tokenizes before its ranks start, so each node
has the cache whether the data sits on a shared or a node-local filesystem; a rank that still finds
none tokenizes itself. An exclusive lock (flock) beside the entry makes others on the node wait for
the first; the entry is written under a temporary name and renamed into place, so a reader never sees
half of one, and two writers that race anyway (a filesystem without flock) write identical files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.components.data.documents import KINDS, read_records
from executor.components.data.tokenizer import TextTokenizer, tokenizer_sha256
from topologies.errors import UsageError

CACHE_VERSION = 1
BATCH_DOCUMENTS = 512
HASH_CHUNK_BYTES = 1 << 22


@dataclass
class Corpus:
    """A tokenized corpus, memory-mapped from its cache entry."""

    data: Path
    entry: Path
    meta: dict
    tokens: np.ndarray  # (n_tokens,) uint16 or uint32
    counted: np.ndarray | None  # (n_tokens,) uint8, None when every token counts
    docs: np.ndarray  # (n_documents, 2) int64: first token, line number
    tokenized_s: float | None = None  # seconds spent tokenizing now; None when the cache was reused

    def line_of(self, token_index: int) -> int:
        """The line (or row) of the document holding token `token_index`."""
        doc = int(np.searchsorted(self.docs[:, 0], token_index, side="right")) - 1
        return int(self.docs[max(doc, 0), 1])


def tokenized(data: Path, tokenizer_path: Path, log=None) -> Corpus:
    """The corpus of `data` under this tokenizer: from the cache, or tokenized now and cached."""
    key = hashlib.sha256(f"{CACHE_VERSION}\0{tokenizer_sha256(tokenizer_path)}".encode()).hexdigest()[:16]
    root = _cache_root(data)
    entry = root / f"tok-{key}"
    with _locked(root / f"tok-{key}.lock"):
        if _reusable(entry, data):
            return _load(data, entry)
        start = time.perf_counter()
        _build(data, TextTokenizer(tokenizer_path), entry, key)
        corpus = _load(data, entry)
        corpus.tokenized_s = time.perf_counter() - start
    if log is not None:
        log(f"tokenized {data}: {corpus.meta['n_documents']:,} documents, {corpus.meta['n_tokens']:,} tokens in "
            f"{corpus.tokenized_s:.1f} s; cached in {entry}")
    return corpus


def _cache_root(data: Path) -> Path:
    beside = data.parent / f"{data.name}.meshplan"
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshplan" / "tokens"
    where_from = hashlib.sha256(str(data.resolve()).encode()).hexdigest()[:16]
    root = base / f"{where_from}-{data.name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot cache the tokens of {str(data)!r}: neither {str(beside)!r} nor {str(root)!r} "
                         f"can be written ({exc.strerror})") from None
    return root


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock on `path` (no lock where the filesystem has none: the atomic rename still holds)."""
    import fcntl

    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_meta(entry: Path) -> dict | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == CACHE_VERSION else None


def _reusable(entry: Path, data: Path) -> bool:
    """The entry exists, is whole, and was made from the data file as it is now (module docstring)."""
    meta = _read_meta(entry)
    if meta is None:
        return False
    n, itemsize = meta["n_tokens"], np.dtype(meta["dtype"]).itemsize
    try:
        files_whole = (entry / "tokens.bin").stat().st_size == n * itemsize and (
            not meta["masked"] or (entry / "counted.bin").stat().st_size == n) and (entry / "docs.npy").is_file()
    except OSError:
        return False
    if not files_whole:
        return False
    st, recorded = data.stat(), meta["data"]
    if st.st_size != recorded["size_bytes"]:
        return False
    if st.st_mtime_ns == recorded["mtime_ns"]:
        return True
    if file_sha256(data) != recorded["sha256"]:
        return False
    recorded["mtime_ns"] = st.st_mtime_ns  # same content, touched or copied: reuse and remember the new mtime
    _write_json(entry / "meta.json", meta)
    return True


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _load(data: Path, entry: Path) -> Corpus:
    meta = _read_meta(entry)
    n = meta["n_tokens"]
    tokens = np.memmap(entry / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(n,)) if n else np.empty(0, np.uint32)
    counted = None
    if meta["masked"]:
        counted = np.memmap(entry / "counted.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else np.empty(0, np.uint8)
    docs = np.load(entry / "docs.npy", allow_pickle=False)
    return Corpus(data, entry, meta, tokens, counted, docs)


class _Writer:
    """Appends documents' tokens (and counted flags, once any document has a mask) to an entry being built."""

    def __init__(self, tmp: Path, dtype: np.dtype) -> None:
        self.tmp, self.dtype = tmp, dtype
        self.tokens = open(tmp / "tokens.bin", "wb")
        self.counted = None
        self.n_tokens = self.n_counted = self.max_id = 0
        self.starts, self.lines = array("q"), array("q")
        self.kinds = dict.fromkeys(KINDS, 0)

    def add(self, records: list, encoded: list) -> None:
        """Append a batch of documents (records and their Encoded tokens, in order)."""
        lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
        self.starts.extend((self.n_tokens + np.cumsum(lengths) - lengths).tolist())
        self.lines.extend(r.line for r in records)
        for r in records:
            self.kinds[r.kind] += 1
        ids = np.concatenate([e.ids for e in encoded])
        self.tokens.write(ids.astype(self.dtype).tobytes())
        masked = [e.counted is not None for e in encoded]
        if any(masked) and self.counted is None:  # the first masked document: back-fill ones before it
            self.counted = open(self.tmp / "counted.bin", "wb")
            for done in range(0, self.n_tokens, HASH_CHUNK_BYTES):
                self.counted.write(b"\1" * min(HASH_CHUNK_BYTES, self.n_tokens - done))
        if self.counted is not None:
            flags = np.concatenate([e.counted if e.counted is not None else np.ones(len(e.ids), dtype=bool)
                                    for e in encoded])
            self.counted.write(flags.astype(np.uint8).tobytes())
            self.n_counted += int(np.count_nonzero(flags))
        else:
            self.n_counted += len(ids)
        self.n_tokens += len(ids)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> None:
        for f in (self.tokens, self.counted):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        docs = np.stack([np.frombuffer(self.starts, dtype=np.int64), np.frombuffer(self.lines, dtype=np.int64)],
                        axis=1) if self.starts else np.empty((0, 2), dtype=np.int64)
        np.save(self.tmp / "docs.npy", docs)


def _build(data: Path, tokenizer: TextTokenizer, entry: Path, key: str) -> None:
    """Tokenize every document of `data` into a temporary entry, then rename it into place."""
    from topologies.terminal import Progress

    before = data.stat()
    sha = file_sha256(data)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _Writer(tmp, dtype)
        mib = before.st_size / 2**20
        with Progress(f"tokenizing {data.name}", total=mib, unit="MiB") as bar:
            done_mib, batch = 0.0, []
            for record, done_bytes in read_records(data):
                batch.append(record)
                if len(batch) == BATCH_DOCUMENTS:
                    _write_batch(writer, tokenizer, batch, data)
                    bar.advance(done_bytes / 2**20 - done_mib)
                    done_mib, batch = done_bytes / 2**20, []
            _write_batch(writer, tokenizer, batch, data)
            bar.advance(mib - done_mib)
        writer.close()
        after = data.stat()
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise UsageError(f"data file {str(data)!r} changed while it was being tokenized: run again once it is "
                             "written")
        meta = {"version": CACHE_VERSION, "key": key,
                "data": {"path": str(data.resolve()), "size_bytes": before.st_size, "mtime_ns": before.st_mtime_ns,
                         "sha256": sha},
                "tokenizer": {"path": str(tokenizer.path), "eos_id": tokenizer.eos_id,
                              "vocab_size": tokenizer.vocab_size},
                "dtype": dtype.name, "n_tokens": writer.n_tokens, "n_documents": len(writer.starts),
                "n_counted": writer.n_counted, "masked": writer.counted is not None, "max_token_id": writer.max_id,
                "kinds": writer.kinds}
        _write_json(tmp / "meta.json", meta)
        _install(tmp, entry, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_batch(writer: _Writer, tokenizer: TextTokenizer, batch: list, data: Path) -> None:
    if batch:
        writer.add(batch, tokenizer.encode(batch, data))


def _install(tmp: Path, entry: Path, data: Path) -> None:
    """Rename the finished entry into place, replacing a stale one; keep a valid one another writer installed."""
    old = entry.parent / f".old-{entry.name}-{os.getpid()}"
    if entry.exists():
        os.rename(entry, old)
    try:
        os.rename(tmp, entry)
    except OSError:
        if not _reusable(entry, data):
            raise
    shutil.rmtree(old, ignore_errors=True)
