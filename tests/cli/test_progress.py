"""Progress on the verbs that take more than ~2 s: drawn on a terminal's stderr, never under --json or in a pipe.

Each verb runs with stderr on a pseudo-terminal (tests/terminal_run.py), as a
person would see it; a bar announces itself by hiding the cursor (rich's live
display) and by its label. Under --json the same terminal gets no bar and
stdout stays one JSON document.
"""

from __future__ import annotations

import json

import pytest
from terminal_run import run_on_terminal

HIDE_CURSOR = "\x1b[?25l"

VERBS = {
    "sweep": (["plan", "--model", "debug", "--cluster", "cpu", "--gpus", "auto"], "GPU counts"),
    "compare": (["compare", "--model", "7B", "--gpus", "8", "--cluster", "dgx-a100-80g,dgx-h100"], "compare"),
    "no fit": (["plan", "--model", "70B", "--gpus", "4"], "looking for a count that does"),
}


@pytest.mark.parametrize("name", VERBS)
def test_a_bar_on_a_terminal_none_under_json(name):
    args, label = VERBS[name]
    seen = run_on_terminal(*args)
    assert seen.code in (0, 3), seen.stderr
    assert HIDE_CURSOR in seen.stderr and label in seen.stderr
    quiet = run_on_terminal(*args, "--json")
    assert quiet.code == seen.code
    assert HIDE_CURSOR not in quiet.stderr and label not in quiet.stderr
    json.loads(quiet.stdout)  # only JSON on stdout


def test_no_bar_in_a_pipe(cli):
    r = cli(*VERBS["sweep"][0])
    assert r.code == 0 and r.stderr == ""
    r = cli(*VERBS["no fit"][0])
    assert r.code == 3 and r.stderr.startswith("error: no layout fits") and "\x1b" not in r.stderr


def test_validate_memory_dry_run_and_simulate_show_what_they_do(tmp_path):
    plan = tmp_path / "p.json"
    made = run_on_terminal("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "2", "--dp", "2",
                           "--global-batch", "4", "--seq-len", "64", "-o", str(plan))
    assert made.code == 0, made.stderr
    seen = run_on_terminal("validate-memory", str(plan))
    assert seen.code == 0, seen.stderr
    assert HIDE_CURSOR in seen.stderr and "validate-memory" in seen.stderr
    assert "rank 0 (stage 0)" in seen.stdout  # the result itself went to stdout
    quiet = run_on_terminal("validate-memory", str(plan), "--json")
    assert quiet.code == 0 and HIDE_CURSOR not in quiet.stderr and json.loads(quiet.stdout)["ranks"]
    dry = run_on_terminal("execute", str(plan), "--dry-run")
    assert dry.code == 0, dry.stderr
    assert HIDE_CURSOR in dry.stderr and "dry run: " in dry.stderr and "dry run:" in dry.stdout
    png = tmp_path / "step.png"
    drawn = run_on_terminal("simulate", str(plan), "--png", str(png))
    assert drawn.code == 0 and HIDE_CURSOR in drawn.stderr and "simulate" in drawn.stderr and png.exists()
    quiet = run_on_terminal("simulate", str(plan), "--png", str(png), "--json")
    assert quiet.code == 0 and HIDE_CURSOR not in quiet.stderr and json.loads(quiet.stdout)["png"] == str(png)
