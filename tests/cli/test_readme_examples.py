"""The README's plan, compare and advice examples are real output: re-run here, figure for figure."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()


def block_after(command: str) -> list[str]:
    """The lines the README shows under `$ COMMAND` (up to the closing fence), '...' and rules left out."""
    start = README.index(f"$ {command}\n") + len(command) + 3
    body = README[start:README.index("```", start)].splitlines()
    return [line for line in body if line.strip() and line.strip() != "..." and not set(line.strip()) <= {"─", " "}]


def words(text: str) -> str:
    """Whitespace collapsed: rich wraps long sentences at its console width, the README at another."""
    return " ".join(text.split())


@pytest.mark.parametrize("command", [
    "meshplan plan --model 13B --gpus 16",
    "meshplan compare --model 70B --gpus 64 --cluster dgx-a100-80g,dgx-h100 --price-per-gpu-hour 1.8,3.0",
    "meshplan plan --model llama3-8b --gpus 8 --cluster dgx-a100-40g --pp 4 --pp-schedule 1f1b",
    "meshplan plan --model tests/data/hf_configs/qwen2.5-7b.json --gpus 4 --cluster rtx4090-pcie --offload auto",
    "meshplan plan --model llama3-8b --cluster rtx4090-pcie --gpus 1 --seq-len 2048 --finetune lora",
    "meshplan plan --model llama2-7b --cluster t4-pcie --gpus 2 --precision fp16 --finetune lora --lora-targets q,k,v,o",
])
def test_readme_example_is_what_the_cli_prints(cli, command):
    r = cli(*command.split()[1:])
    assert r.code == 0, r.stderr
    shown = [line for line in block_after(command) if not line.startswith("search:")]  # its time varies
    printed = words("\n".join(line for line in r.stdout.splitlines() if not set(line.strip()) <= {"─", " "}))
    # sentence by sentence (tables run into the next sentence): each as the CLI prints it
    for piece in re.split(r"(?<=[.)])\s(?=[A-Z])", words("\n".join(shown))):
        assert piece in printed, f"README: {piece!r}\nprinted: {printed[:3000]}"


def test_readme_simulate_example_is_what_the_cli_prints(cli, tmp_path):
    """`meshplan simulate plan.json` on the README's 13B plan: every line it shows is printed (rules aside)."""
    command = "meshplan simulate plan.json --trace step.json --png step.png"
    assert cli("plan", "--model", "13B", "--gpus", "16", "-o", "plan.json", cwd=tmp_path).code == 0
    r = cli(*command.split()[1:], cwd=tmp_path, env={"COLUMNS": "120"})
    assert r.code == 0, r.stderr
    assert (tmp_path / "step.json").stat().st_size > 0 and (tmp_path / "step.png").stat().st_size > 0
    printed = words(r.stdout)
    for line in block_after(command):
        if not set(line.strip()) <= set("┏━┳┓┡╇┩└┴┘ "):
            assert words(line) in printed, f"README: {line!r}\nprinted: {r.stdout[:3000]}"
