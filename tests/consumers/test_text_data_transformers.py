"""Text --data against transformers: the token stream and loss mask equal what `AutoTokenizer` gives.

transformers is the reference users train with (TRL's SFT builds on it), so every kind of
document is tokenized here with `AutoTokenizer.from_pretrained` on the same tokenizer directory:
  * text: `tokenizer(text)` (special tokens added by its post-processor), then EOS;
  * prompt + completion: `tokenizer(prompt + completion)`, a token counted when `char_to_token`
    maps a completion character to it, then EOS (counted);
  * chat: `apply_chat_template(..., return_assistant_tokens_mask=True)` on the same template with
    `{% generation %}` around the assistant's part, then EOS (not counted). The executor's corpus
    is built with the unmarked template (its prefix rule) and with the marked one (the tags).
The corpora live in `.jsonl`, `.txt` and `.parquet` files; the executor reads them through its cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from text_corpus import (
    CHAT_TEMPLATE_MARKED,
    chat_records,
    make_tokenizer,
    prompt_completion_records,
    text_records,
    write_jsonl,
    write_parquet,
)

from executor.components.data.cache import tokenized


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    where = tmp_path_factory.mktemp("tok")
    return make_tokenizer(where / "plain"), make_tokenizer(where / "marked", template=CHAT_TEMPLATE_MARKED)


def hf_reference(tok_dir, records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, counted) of the corpus as transformers tokenizes it (module docstring)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tok.eos_token_id
    ids: list[int] = []
    counted: list[bool] = []
    for r in records:
        if "text" in r:
            piece = tok(r["text"])["input_ids"]
            ids += piece + [eos]
            counted += [True] * (len(piece) + 1)
        elif "prompt" in r:
            enc = tok(r["prompt"] + r["completion"])
            marks = [False] * len(enc["input_ids"])
            for char in range(len(r["prompt"]), len(r["prompt"]) + len(r["completion"])):
                token = enc.char_to_token(char)
                if token is not None:
                    marks[token] = True
            ids += enc["input_ids"] + [eos]
            counted += marks + [True]
        else:
            out = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids += list(out["input_ids"]) + [eos]
            counted += [bool(m) for m in out["assistant_masks"]] + [False]
    return np.array(ids), np.array(counted)


def check(path, tok_dir, want_ids, want_counted, masked: bool) -> None:
    corpus = tokenized(path, tok_dir)
    np.testing.assert_array_equal(np.asarray(corpus.tokens), want_ids)
    if masked:
        np.testing.assert_array_equal(np.asarray(corpus.counted, dtype=bool), want_counted)
        assert 0 < want_counted.sum() < len(want_counted)
    else:
        assert corpus.counted is None and want_counted.all()


def test_jsonl_text_and_txt(tmp_path, dirs):
    plain, marked = dirs
    records = text_records(80)
    want = hf_reference(marked, records)
    check(write_jsonl(tmp_path / "c.jsonl", records), plain, *want, masked=False)
    txt = tmp_path / "c.txt"
    txt.write_text("".join(r["text"] + "\n" for r in records))
    check(txt, plain, *want, masked=False)
    check(write_parquet(tmp_path / "c.parquet", records), plain, *want, masked=False)


def test_prompt_completion(tmp_path, dirs):
    plain, marked = dirs
    records = prompt_completion_records(80)
    check(write_jsonl(tmp_path / "c.jsonl", records), plain, *hf_reference(marked, records), masked=True)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_assistant_tokens(tmp_path, dirs, fmt):
    plain, marked = dirs
    records = chat_records(60)
    want = hf_reference(marked, records)
    path = write_jsonl(tmp_path / "c.jsonl", records) if fmt == "jsonl" else write_parquet(tmp_path / "c.parquet",
                                                                                          records)
    check(path, plain, *want, masked=True)  # the prefix rule on the unmarked template
    check(path, marked, *want, masked=True)  # the generation tags


def test_mixed_corpus(tmp_path, dirs):
    plain, marked = dirs
    records = text_records(20) + chat_records(20) + prompt_completion_records(20) + text_records(10, seed=7)
    check(write_jsonl(tmp_path / "c.jsonl", records), plain, *hf_reference(marked, records), masked=True)
