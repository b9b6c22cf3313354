"""`meshplan execute --data TEXT --tokenizer T`: bad text is refused before any rank starts, in one line that
names the file and the line, with exit code 2."""

from __future__ import annotations

import json

import pytest
from conftest import invoke_cli as invoke
from test_bad_input import assert_clean_failure
from text_corpus import chat_records, make_tokenizer, text_records, write_jsonl
from tokenizers import Tokenizer
from torchrun_util import TEST_DATA

from planner.run_flags import RunFlags


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "p.json"
    r = invoke("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "2", "--dp", "2", *TEST_DATA, "-o", str(path))
    assert r.code == 0, r.stderr
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "t", extra_tokens=40)


def run(plan_file, tmp_path, data, *flags):
    return invoke("execute", plan_file, "--data", str(data), *flags, "--steps", "1", "--out", str(tmp_path / "out"))


def lines(*objects) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects)


CASES = {  # name -> (file name, content, what the one error line must say)
    "not json": ("c.jsonl", lines(*text_records(3), '{"text": "x"'), "c.jsonl line 4: not JSON"),
    "missing field": ("c.jsonl", lines(*text_records(5), {"content": "x"}), "c.jsonl line 6: no \"text\" field"),
    "beyond the vocabulary": ("c.jsonl", lines(*text_records(6), {"text": "the cat <extra_39> sat"}, *text_records(40)),
                              "c.jsonl line 7: token id {extra_39} from tokenizer"),
    "empty": ("c.jsonl", "\n\n", "holds no documents"),
    "shorter than a window": ("c.txt", "a cat\n", "tokens after tokenization (1 documents), fewer than one sequence"),
    "unknown format": ("c.csv", "text\nhello\n", "unknown format '.csv'"),
    "chat without assistant": ("c.jsonl", lines(*chat_records(2), {"messages": [{"role": "user", "content": "hi"}]}),
                               "c.jsonl line 3: no assistant message"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_text_is_one_line_exit_2(plan_file, tok, tmp_path, case):
    name, content, message = CASES[case]
    data = tmp_path / name
    data.write_text(content)
    r = run(plan_file, tmp_path, data, "--tokenizer", str(tok))
    assert r.code == 2, r.stderr
    assert_clean_failure(r)
    extra_39 = Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id("<extra_39>")
    assert extra_39 >= 256  # beyond the debug model's vocabulary
    assert message.format(extra_39=extra_39) in r.stderr and str(data) in r.stderr, r.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_text_needs_a_tokenizer(plan_file, tok, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", text_records(50))
    r = run(plan_file, tmp_path, data)
    assert r.code == 2 and "is text: give --tokenizer" in r.stderr, r.stderr
    assert_clean_failure(r)
    r = run(plan_file, tmp_path, data, "--tokenizer", str(tmp_path / "missing"))
    assert r.code == 2 and "--tokenizer" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert_clean_failure(r)


def test_a_missing_tokenizer_is_found_with_token_id_data(plan_file, tmp_path):
    import numpy as np

    data = tmp_path / "ids.npy"
    np.save(data, np.arange(4096, dtype=np.int32) % 256)
    r = run(plan_file, tmp_path, data, "--tokenizer", str(tmp_path / "typo"))
    assert r.code == 2 and "--tokenizer" in r.stderr and "typo" in r.stderr, r.stderr
    assert_clean_failure(r)


def test_launch_lines_carry_the_tokenizer(plan_file, tok, tmp_path):
    r = invoke("execute", plan_file, "--data", "c.jsonl", "--tokenizer", str(tok), "--print-launch", "torchrun")
    assert r.code == 0, r.stderr
    assert RunFlags.from_argv(r.stdout.split()[3:]).tokenizer == str(tok)
