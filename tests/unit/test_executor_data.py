"""Training data: the same global batch for every layout, split by data-parallel rank; clear file errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.components.data import SUCCESSORS, SyntheticTokens, local_batch, open_source
from topologies.errors import UsageError

CPU = torch.device("cpu")


def test_a_sequence_depends_only_on_its_index():
    src = SyntheticTokens(vocab=256, seq_len=32, seed=7)
    batch = src.sequences(np.array([3, 4, 5]))
    alone = src.sequences(np.array([5]))
    assert np.array_equal(batch[2], alone[0])
    assert not np.array_equal(batch[0], batch[1])
    assert not np.array_equal(alone, SyntheticTokens(256, 32, seed=8).sequences(np.array([5])))


def test_synthetic_tokens_follow_the_markov_chain():
    """Every next token is one of its 4 allowed successors: the data is learnable."""
    src = SyntheticTokens(vocab=64, seq_len=50, seed=0)
    seqs = src.sequences(np.arange(20))
    for row in seqs:
        for a, b in zip(row[:-1], row[1:], strict=True):
            assert b in src.table[a]
    assert src.table.shape == (64, SUCCESSORS)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_dp_ranks_split_the_global_batch(dp):
    """Concatenating the dp ranks' batches gives the one global batch, without overlap."""
    src = SyntheticTokens(vocab=256, seq_len=16, seed=0)
    whole_x, whole_y = local_batch(src, 40, 8, 1, 0, CPU)
    parts = [local_batch(src, 40, 8, dp, r, CPU) for r in range(dp)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
    assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])  # targets are the next tokens


def test_npy_windows_and_epochs(tmp_path):
    """Sequences are aligned windows of seq_len + 1 tokens; each epoch visits every window once."""
    path = tmp_path / "tok.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    src = open_source(str(path), vocab=1000, seq_len=10, seed=0)
    assert src.n_windows == 99
    for epoch in range(2):
        seqs = src.sequences(np.arange(epoch * 99, (epoch + 1) * 99))
        starts = [int(s[0]) for s in seqs]
        assert sorted(starts) == list(range(0, 990, 10))
        assert all(np.array_equal(s, np.arange(s[0], s[0] + 11)) for s in seqs)
    assert not np.array_equal(src.sequences(np.arange(99)), src.sequences(np.arange(99, 198)))  # reshuffled


def test_bin_uint16(tmp_path):
    binf = tmp_path / "tok.bin"
    np.arange(300, dtype=np.uint16).tofile(binf)
    seqs = open_source(str(binf), vocab=1000, seq_len=8, seed=0).sequences(np.arange(3))
    assert all(np.array_equal(np.diff(s), np.ones(8)) for s in seqs)


@pytest.mark.parametrize("setup, match", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b""), "holds 0 tokens"),
    (lambda p: p.write_bytes(b"\x01\x00" * 3), "fewer than one sequence"),
    (lambda p: p.write_bytes(b"\x01\x00" * 100), None),
])
def test_bad_token_files(tmp_path, setup, match):
    path = tmp_path / "data.bin"
    setup(path)
    if match is None:
        open_source(str(path), vocab=256, seq_len=8, seed=0)
        return
    with pytest.raises(UsageError, match=match):
        open_source(str(path), vocab=256, seq_len=8, seed=0)


def test_token_outside_vocabulary(tmp_path):
    path = tmp_path / "tok.npy"
    np.save(path, np.full(100, 300, dtype=np.int64))
    src = open_source(str(path), vocab=256, seq_len=8, seed=0)
    with pytest.raises(UsageError, match="token id 300, outside the model's vocabulary"):
        src.sequences(np.array([0]))


def test_refuses_pickled_npy_and_unknown_formats(tmp_path):
    """No file is read as raw bytes any more: a JSON or CSV file would have trained on its syntax."""
    obj = tmp_path / "obj.npy"
    np.save(obj, np.array([{"a": 1}] * 20, dtype=object), allow_pickle=True)
    with pytest.raises(UsageError, match="cannot read data file"):
        open_source(str(obj), vocab=256, seq_len=4, seed=0)
    for name in ("t.json", "t.csv", "noext"):
        other = tmp_path / name
        other.write_text("x" * 100)
        with pytest.raises(UsageError, match="unknown format .* .jsonl .* .txt .* .parquet .* .npy or .bin"):
            open_source(str(other), vocab=256, seq_len=4, seed=0)
