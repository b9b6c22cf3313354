"""The search's own picks run: layouts `meshplan plan` returns for the debug models, executed on 4 CPU ranks.

The determinism test pins every option; here the search chooses. Each request below asks the search
as `meshplan plan --model M --cluster cpu --gpus 4 --global-batch 8 --seq-len 64 PINS` does, and its
best layout runs for 4 steps, every step's loss and gradient norm against the determinism test's
single-process reference within 1e-3. The requests are a representative few: nothing pinned (dense and
MoE), tp 2 x pp 2 (which picks sequence parallel under GPipe: the second stage receives sequence shards),
zb-v and interleaved schedules, expert parallelism over every rank. bench/planned_layouts.py runs the
best 5 of many more requests (every schedule, ZeRO stage, sequence parallel, ep).
"""

from __future__ import annotations

import pytest
from conftest import load_bench
from test_executor_determinism import reference_run

REQUESTS = {
    "debug": ("debug", {}),
    "debug_tp2_pp2": ("debug", {"tp": 2, "pp": 2}),
    "debug_pp2_zbv": ("debug", {"pp": 2, "pp_schedule": "zb-v"}),
    "moe": ("debug-moe", {}),
    "moe_tp2_pp2": ("debug-moe", {"tp": 2, "pp": 2}),
    "moe_pp2_interleaved": ("debug-moe", {"pp": 2, "pp_schedule": "interleaved-1f1b"}),
    "moe_ep4": ("debug-moe", {"ep": 4}),
}


@pytest.fixture(scope="module")
def bench():
    return load_bench("planned_layouts")


@pytest.fixture(scope="module")
def references():
    return {}


def test_tp2_pp2_is_planned_with_sequence_parallel_under_gpipe(bench):
    """The layout that used to crash every rank is still what the search picks, so the run below covers it."""
    lay = bench.planned("debug", {"tp": 2, "pp": 2}, 1)[0].layout
    assert (lay.tp, lay.pp, lay.sequence_parallel, lay.pp_schedule) == (2, 2, True, "gpipe")


@pytest.mark.parametrize("name", REQUESTS)
def test_best_planned_layout_trains_the_single_process_model(name, bench, references, tmp_path):
    model, pins = REQUESTS[name]
    plan = bench.planned(model, pins, 1)[0]
    records, error = bench.execute(plan, tmp_path)
    assert records is not None, f"{bench.describe(plan)}: {error}"
    if model not in references:
        references[model] = reference_run(model)
    assert [r["step"] for r in records] == list(range(1, bench.STEPS + 1))
    assert bench.mismatch(records, references[model]) == "", bench.describe(plan)
