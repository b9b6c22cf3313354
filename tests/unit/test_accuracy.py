"""Accuracy against measured step times (vTrain's Megatron-DeepSpeed runs on A100).

Targets (bench/accuracy_vtrain.py TARGETS): MAPE <= 8% on one node, <= 10% across nodes (vTrain
itself reports 14.7% on the multi-node set). Same evaluation as
`bench/accuracy_vtrain.py`, with the shipped A100 profile and nothing fitted.
"""

from __future__ import annotations

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("accuracy_vtrain")


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_mape_meets_the_target(bench, kind):
    from planner.simulate.calibration import load_calibration
    from topologies.hardware import get_gpu

    profile = load_calibration(None, get_gpu("a100-80g-sxm"))
    rows = bench.load_rows(kind)
    assert len(rows) == {"single": 1440, "multi": 109}[kind]
    errors = bench.errors(rows, profile)
    assert bench.mape(errors) <= bench.TARGETS[kind]
    assert abs(sum(errors) / len(errors)) < 0.05  # no systematic bias either way
