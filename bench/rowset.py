"""The published runs the accuracy benches score: bench/rows/SOURCE/*.json, predicted as a user predicts them.

Every row is a file holding the `meshplan plan` flags that state the run and
what it measured (planner.cli.row); `meshplan simulate bench/rows/SOURCE/ID.json`
prints the prediction any bench prints for it. A bench's what-ifs (a profile
being fitted, the TP overlap left out) are a calibration profile or flags
dropped from the row, nothing a user cannot pass. Folders:

  vtrain            vTrain's 1,549 measured Megatron-DeepSpeed A100 steps (MIT licence: vtrain/LICENSE)
  published         NeMo 24.09 DGX Cloud and LLM Foundry H100 tables (bench/accuracy_published.py)
  dgxc, dgxc-moe    NVIDIA DGX Cloud Benchmarking, dense and MoE (bench/accuracy_dgxc.py, accuracy_moe.py)
  holdout           Megatron-Bridge / NeMo performance summaries and torchtitan tables (bench/accuracy_holdout.py)
  torchtitan-h100   torchtitan's December 2024 H100 tables (bench/accuracy_torchtitan_h100.py)
  papers            the 2021-22 Megatron-LM papers and MT-NLG (bench/accuracy_megatron_papers.py)
  models            ModelSpec files the rows name with --model
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.cli.row import Row, load_rows, simulate_row  # noqa: E402

ROWS = REPO / "bench" / "rows"


def rows(source: str) -> list[Row]:
    """Every row of one source folder, in file order."""
    return load_rows(ROWS / source)


def predict(row: Row, profile=None, extra: tuple[str, ...] = ()):
    """The row's simulated step (planner.simulate.step.StepResult), as `meshplan simulate ROW.json` gives it."""
    return simulate_row(row, profile, extra)


def without_flags(row: Row, *flags: str) -> Row:
    """The row with `flags` dropped (a flag, or `--recipe KEY` for one recipe option, with its value): a what-if
    such as the TP overlap its recipe ran left out (`--async-tp`, `--recipe tp_overlap_cfg`)."""
    if row.flags is None:
        return row
    out, skip = [], False
    items = list(row.flags)
    for i, flag in enumerate(items):
        if skip:
            skip = False
            continue
        if flag in flags:
            continue
        if flag == "--recipe" and i + 1 < len(items) and f"--recipe {items[i + 1].split('=')[0]}" in flags:
            skip = True
            continue
        out.append(flag)
    return dataclasses.replace(row, flags=tuple(out))


def without_tp_overlap(row: Row) -> Row:
    """The row priced with plain TP collectives instead of the overlap its recipe ran (--no-tp-overlap)."""
    return without_flags(row, "--async-tp", "--recipe tp_overlap_cfg")
