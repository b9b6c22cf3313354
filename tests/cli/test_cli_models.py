"""Smoke tests of `meshplan models` run as a subprocess."""

from __future__ import annotations


def test_models_show_13b(cli):
    r = cli("models", "show", "13B")
    assert r.code == 0, r.stderr
    assert "llama2-13b" in r.stdout and "13.02B" in r.stdout


def test_models_show_json(cli):
    r = cli("models", "show", "llama3-8b", "--json")
    assert r.code == 0
    data = r.json()
    assert data["total_params"] == 8030261248
    assert data["n_kv_heads"] == 8


def test_models_list_json(cli):
    r = cli("models", "list", "--json")
    assert r.code == 0
    names = {m["name"] for m in r.json()}
    assert {"llama2-13b", "gpt3-175b", "mixtral-8x7b", "debug"} <= names


def test_unknown_model_is_one_line_exit_2(cli):
    r = cli("models", "show", "llama9-13b")
    assert r.code == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "unknown model" in r.stderr


def test_version(cli):
    r = cli("--version")
    assert r.code == 0 and "meshplan" in r.stdout
