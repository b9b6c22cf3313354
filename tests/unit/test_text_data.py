"""Text --data: jsonl (text, prompt/completion, chat), txt and parquet become the token stream and loss mask an
independent tokenization gives; packed windows, the cache, and errors that name the line.

The reference here is the `tokenizers` library itself, driven independently of the executor: each
document encoded on its own (chat turns written out by hand in ChatML, prompts and completions as
TRL splits them: the prompt's tokens are a prefix of the whole's), EOS appended, documents
concatenated. tests/consumers/test_text_data_transformers.py checks the same against transformers.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from text_corpus import (
    chat_records,
    make_tokenizer,
    prompt_completion_records,
    text_records,
    write_jsonl,
    write_parquet,
)
from tokenizers import Tokenizer

from executor.components.data import IGNORE_INDEX, counted_targets, local_batch, open_source
from executor.components.data import cache as cache_module
from executor.components.data.cache import tokenized
from topologies.errors import UsageError

CPU = torch.device("cpu")
SEQ = 32
VOCAB = 256


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def reference(tok: Tokenizer, records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, counted) of the corpus, built without the executor's code (module docstring)."""
    eos = tok.token_to_id("</s>")
    ids: list[int] = []
    counted: list[bool] = []

    def add(text: str, count: bool, special: bool = False) -> None:
        piece = tok.encode(text, add_special_tokens=special).ids
        ids.extend(piece)
        counted.extend([count] * len(piece))

    for r in records:
        if "text" in r:
            add(r["text"], True, special=True)
            ids.append(eos), counted.append(True)
        elif "prompt" in r:
            whole = tok.encode(r["prompt"] + r["completion"]).ids
            prompt = tok.encode(r["prompt"]).ids
            assert whole[:len(prompt)] == prompt
            ids.extend(whole), counted.extend([False] * len(prompt) + [True] * (len(whole) - len(prompt)))
            ids.append(eos), counted.append(True)
        else:
            messages = r["messages"]
            if messages[0]["role"] != "system":
                add("<|im_start|>system\nyou are a small model<|im_end|>\n", False)
            for m in messages:
                add(f"<|im_start|>{m['role']}\n", False)
                add(m["content"] + "<|im_end|>\n", m["role"] == "assistant")
            ids.append(eos), counted.append(False)
    return np.array(ids), np.array(counted)


def check_corpus(path, tok_dir, tok, records, masked: bool) -> None:
    corpus = tokenized(path, tok_dir)
    want_ids, want_counted = reference(tok, records)
    np.testing.assert_array_equal(np.asarray(corpus.tokens), want_ids)
    if masked:
        np.testing.assert_array_equal(np.asarray(corpus.counted, dtype=bool), want_counted)
        assert 0 < want_counted.sum() < len(want_counted)
    else:
        assert corpus.counted is None
    assert corpus.meta["n_documents"] == len(records)
    # packed windows: sequence i is the window at a multiple of SEQ, its targets IGNORE_INDEX where not counted
    source = open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=tok_dir)
    indices = np.arange(source.n_windows)
    seqs = source.sequences(indices)
    x, y = local_batch(source, 0, source.n_windows, 1, 0, CPU)
    for row, seq, target in zip(indices, seqs, y.numpy(), strict=True):
        start = source._window(int(row)) * SEQ
        np.testing.assert_array_equal(seq, want_ids[start:start + SEQ + 1])
        keep = want_counted[start + 1:start + SEQ + 1]
        np.testing.assert_array_equal(target, np.where(keep, want_ids[start + 1:start + SEQ + 1], IGNORE_INDEX))
    assert counted_targets(source, 0, source.n_windows) == int((y != IGNORE_INDEX).sum())
    assert sorted(source._window(int(i)) for i in indices) == list(range(source.n_windows))  # each window once


def test_jsonl_text(tmp_path, tok_dir, tok):
    records = text_records(60)
    check_corpus(write_jsonl(tmp_path / "c.jsonl", records), tok_dir, tok, records, masked=False)


def test_jsonl_prompt_completion_counts_the_completion_and_its_eos(tmp_path, tok_dir, tok):
    records = prompt_completion_records(60)
    check_corpus(write_jsonl(tmp_path / "c.jsonl", records), tok_dir, tok, records, masked=True)


def test_jsonl_chat_counts_the_assistant_turns(tmp_path, tok_dir, tok):
    records = chat_records(40)
    check_corpus(write_jsonl(tmp_path / "c.jsonl", records), tok_dir, tok, records, masked=True)


def test_jsonl_mixed_kinds(tmp_path, tok_dir, tok):
    """Text before the first masked document: its counted flags are back-filled as ones."""
    records = text_records(10) + chat_records(10) + prompt_completion_records(10) + text_records(5, seed=9)
    check_corpus(write_jsonl(tmp_path / "c.jsonl", records), tok_dir, tok, records, masked=True)


def test_generation_tags_mark_the_same_tokens_as_prefixes(tmp_path, tok_dir, tok):
    """A template with {% generation %} blocks is read through them; here they mark what the prefix rule finds."""
    from text_corpus import CHAT_TEMPLATE_MARKED

    marked = make_tokenizer(tmp_path / "marked", template=CHAT_TEMPLATE_MARKED)
    records = chat_records(20, seed=5)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    a, b = tokenized(path, tok_dir), tokenized(path, marked)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.counted), np.asarray(b.counted))


def test_txt_is_a_document_per_line(tmp_path, tok_dir, tok):
    records = text_records(50)
    path = tmp_path / "c.txt"
    path.write_text("\n".join(r["text"] for r in records[:25]) + "\n\n  \n" + "\r\n".join(r["text"] for r in records[25:]))
    check_corpus(path, tok_dir, tok, records, masked=False)


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_parquet_rows_are_jsonl_objects(tmp_path, tok_dir, tok, kind):
    records = text_records(40) if kind == "text" else chat_records(30)
    check_corpus(write_parquet(tmp_path / "c.parquet", records), tok_dir, tok, records, masked=kind == "chat")


def test_bare_tokenizer_json_and_no_bos(tmp_path):
    """A tokenizer.json given as a file; a tokenizer whose post-processor adds no BOS (Qwen's way) adds none."""
    d = make_tokenizer(tmp_path / "nobos", bos=False)
    path = write_jsonl(tmp_path / "c.jsonl", text_records(30))
    corpus = tokenized(path, d / "tokenizer.json")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    first = tok.encode(text_records(1)[0]["text"]).ids
    assert list(corpus.tokens[:len(first) + 1]) == first + [tok.token_to_id("</s>")]
    assert tok.token_to_id("<s>") not in set(np.asarray(corpus.tokens).tolist())


def test_cache_reused_and_invalidated(tmp_path, tok_dir, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", text_records(40))
    first = tokenized(path, tok_dir)
    assert first.tokenized_s is not None and first.entry.parent == tmp_path / "c.jsonl.meshplan"
    calls = []
    real_build = cache_module._build
    monkeypatch.setattr(cache_module, "_build", lambda *a: (calls.append(a), real_build(*a)))
    again = tokenized(path, tok_dir)
    assert calls == [] and again.tokenized_s is None
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(first.tokens))
    # touched, same content: the sha256 matches, no tokenization
    path.write_bytes(path.read_bytes())
    assert tokenized(path, tok_dir).tokenized_s is None and calls == []
    # changed content of the same size: tokenized again
    data = path.read_bytes()
    path.write_bytes(data.replace(b"fox", b"cat", 1) if b"fox" in data else data.replace(b"dog", b"cat", 1))
    changed = tokenized(path, tok_dir)
    assert len(calls) == 1 and changed.tokenized_s is not None
    # more data: tokenized again, the old entry replaced
    write_jsonl(path, text_records(45))
    assert tokenized(path, tok_dir).meta["n_documents"] == 45 and len(calls) == 2
    assert [p.name for p in (tmp_path / "c.jsonl.meshplan").iterdir() if p.is_dir()] == [first.entry.name]
    # another tokenizer: its own entry
    other = tokenized(path, make_tokenizer(tmp_path / "other", vocab=200))
    assert other.entry != first.entry and len(calls) == 3


def test_an_incomplete_entry_is_rebuilt(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "c.jsonl", text_records(20))
    entry = tokenized(path, tok_dir).entry
    with open(entry / "tokens.bin", "r+b") as f:
        f.truncate(10)
    again = tokenized(path, tok_dir)
    assert again.tokenized_s is not None and again.meta["n_tokens"] * 2 == (entry / "tokens.bin").stat().st_size


def test_same_order_after_reopening(tmp_path, tok_dir):
    """Window i is a function of (seed, i): a second open (from the cache) reads the same sequences."""
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(30))
    a = open_source(str(path), VOCAB, SEQ, seed=3, tokenizer=tok_dir)
    b = open_source(str(path), VOCAB, SEQ, seed=3, tokenizer=tok_dir)
    idx = np.arange(5, 5 + 3 * a.n_windows, 7)
    np.testing.assert_array_equal(a.sequences(idx), b.sequences(idx))
    np.testing.assert_array_equal(a.target_mask(idx), b.target_mask(idx))


# ---- errors: one line, the file and the line number --------------------------------------------------------

BAD_LINES = {
    "not json": ('{"text": "a b c"}\n{"text": "oops",}\n', r"c.jsonl line 2: not JSON \(.* at column 17\)"),
    "no field": ('{"text": "a"}\n\n{"body": "x", "id": 3}\n', r"c.jsonl line 3: no \"text\" field .* keys: body, id"),
    "not a string": ('{"text": 5}\n', r"line 1: \"text\" is a int, not a string"),
    "completion missing": ('{"prompt": "a"}\n', r"line 1: \"completion\" is missing"),
    "not an object": ('["a", "b"]\n', r"line 1: a JSON list, not an object"),
    "bad messages": ('{"messages": [{"content": "hi"}]}\n', r"line 1: messages\[0\] is not an object with a string"),
    "no assistant": ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"line 1: no assistant message"),
    "not utf-8": (b'{"text": "ok"}\n{"text": "\xff"}\n', r"line 2: not UTF-8 text \(byte 0xff at column 11\)"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_lines_name_their_line(tmp_path, tok_dir, case):
    content, match = BAD_LINES[case]
    path = tmp_path / "c.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UsageError, match=match):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=tok_dir)
    assert not [p for p in (tmp_path / "c.jsonl.meshplan").iterdir() if p.is_dir()]  # nothing half-written kept


def test_token_ids_beyond_the_vocabulary_name_the_line(tmp_path, tok_dir, tok):
    records = [{"text": "a"}] * 3 + [{"text": "the quick brown fox"}] + text_records(20)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    small = 1 + max(max(tok.encode(r["text"]).ids) for r in records[:3])  # the first lines fit, line 4 does not
    small = max(small, tok.token_to_id("</s>") + 1)
    assert max(tok.encode(records[3]["text"]).ids) >= small
    with pytest.raises(UsageError, match=rf"c.jsonl line 4: token id \d+ from tokenizer .* outside the model's "
                                         rf"vocabulary \[0, {small}\)"):
        open_source(str(path), small, 8, seed=0, tokenizer=tok_dir)


@pytest.mark.parametrize("content, match", [
    ("\n\n   \n", "holds no documents"),
    ('{"text": "a b"}\n', r"holds \d+ tokens after tokenization \(1 documents\), fewer than one sequence"),
])
def test_empty_and_short_corpora(tmp_path, tok_dir, content, match):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=match):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=tok_dir)


def test_what_a_text_corpus_needs(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(5))
    with pytest.raises(UsageError, match="is text: give --tokenizer"):
        open_source(str(path), VOCAB, SEQ, seed=0)
    plain = make_tokenizer(tmp_path / "plain", template=None)
    with pytest.raises(UsageError, match="c.jsonl line 1 holds \"messages\" but tokenizer .* has no chat template"):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=plain)
    with pytest.raises(UsageError, match="has no tokenizer.json"):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=tmp_path / "nope")
    other = tmp_path / "c.csv"
    other.write_text("text\nhello\n")
    with pytest.raises(UsageError, match=r"unknown format '.csv'; --data takes text as .jsonl"):
        open_source(str(other), VOCAB, SEQ, seed=0, tokenizer=tok_dir)


def test_templates_that_hide_the_assistant_are_refused(tmp_path):
    """A template whose rendering of a prefix is not a prefix of the whole cannot be masked by prefixes."""
    odd = make_tokenizer(tmp_path / "odd", template=(
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] + '\n' }}{% endfor %}"
        "{% if not add_generation_prompt %}{{ 'end' }}{% endif %}"))
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(3))
    with pytest.raises(UsageError, match=r"line \d: the chat template does not render this conversation prefix by "
                                         r"prefix \(at messages\[\d\]\)"):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=odd)
    raising = make_tokenizer(tmp_path / "raising", template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(UsageError, match="line 1: the chat template refused the conversation: roles must alternate"):
        open_source(str(path), VOCAB, SEQ, seed=0, tokenizer=raising)


def test_a_broken_template_stops_only_chat_data(tmp_path):
    broken = make_tokenizer(tmp_path / "broken", template="{% for m in messages %}{{ m['content'] }")
    text = write_jsonl(tmp_path / "t.jsonl", text_records(40))
    assert tokenized(text, broken).meta["n_documents"] == 40
    chat = write_jsonl(tmp_path / "c.jsonl", text_records(2) + chat_records(3))
    with pytest.raises(UsageError, match="c.jsonl line 3: the chat template does not compile"):
        tokenized(chat, broken)


def test_byte_order_mark_and_crlf(tmp_path, tok_dir, tok):
    records = text_records(30)
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in records).encode())
    check_corpus(path, tok_dir, tok, records, masked=False)


def test_eos_from_the_config_and_without_one(tmp_path):
    d = make_tokenizer(tmp_path / "t")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}  # an AddedToken as transformers saves it
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "c.jsonl", text_records(20))
    corpus = tokenized(path, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert corpus.meta["tokenizer"]["eos_id"] == tok.token_to_id("<|im_end|>") == corpus.tokens[-1]
    (d / "tokenizer_config.json").unlink()  # a bare tokenizer.json: the first known EOS name in its vocabulary
    assert tokenized(path, d).meta["tokenizer"]["eos_id"] == tok.token_to_id("</s>")


def _tokenize_in_child(args) -> tuple[int, str]:
    path, tok_dir = args
    corpus = tokenized(path, tok_dir)
    return int(corpus.tokenized_s is not None), hashlib.sha256(np.asarray(corpus.tokens).tobytes()).hexdigest()


def test_concurrent_openers_tokenize_once(tmp_path, tok_dir):
    """Ranks (processes) opening an uncached corpus together: one tokenizes under the lock, the others reuse it."""
    import multiprocessing

    path = write_jsonl(tmp_path / "c.jsonl", chat_records(300))
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_tokenize_in_child, [(path, tok_dir)] * 3)
    assert sum(made for made, _ in results) == 1, results
    assert len({digest for _, digest in results}) == 1
    assert sorted(p.name for p in (tmp_path / "c.jsonl.meshplan").iterdir()) == [
        tokenized(path, tok_dir).entry.name, tokenized(path, tok_dir).entry.name + ".lock"]


def test_cache_falls_back_when_the_data_directory_is_read_only(tmp_path, tok_dir, monkeypatch):
    """Where FILE.meshplan/ cannot be written (root ignores permissions, so access() says so here), the
    user's cache directory holds the entry, one folder per data file."""
    path = write_jsonl(tmp_path / "c.jsonl", text_records(20))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real_access = cache_module.os.access
    monkeypatch.setattr(cache_module.os, "access",
                        lambda p, mode: False if str(p).endswith(".meshplan") else real_access(p, mode))
    corpus = tokenized(path, tok_dir)
    assert corpus.entry.parent.parent == tmp_path / "xdg" / "meshplan" / "tokens"
    assert corpus.entry.parent.name.endswith("-c.jsonl")
    assert tokenized(path, tok_dir).tokenized_s is None
