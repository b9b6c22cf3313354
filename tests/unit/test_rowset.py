"""Every accuracy bench predicts its rows as `meshplan simulate ROW.json` does: the same number, exactly.

For each bench, a few rows of its folder (first, middle, last expressible) are predicted by the bench's own
function with the shipped profiles and by the CLI in this process; no `traits=` side door is left in bench/.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, invoke_cli, load_bench


def _sample(rows):
    rows = [r for r in rows if getattr(r, "row", r).expressible]
    return [rows[0], rows[len(rows) // 2], rows[-1]]


def _cli_step_s(path) -> float:
    res = invoke_cli("simulate", str(path), "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)["step_time_s"]


def _bench_predictions():
    """(bench, row file, the bench's prediction) for each sampled row."""
    from planner.simulate.calibration import load_calibration

    vtrain = load_bench("accuracy_vtrain")
    for kind in ("single", "multi"):
        for row in _sample(vtrain.load_rows(kind)):
            yield "vtrain", row.path, lambda row=row: vtrain.predict(row, load_calibration(None, row.plan.cluster.gpu))
    published = load_bench("accuracy_published")
    for row in _sample(published.load_rows()):
        yield "published", row.row.path, lambda row=row: published.predict(
            row, load_calibration(None, row.row.plan.cluster.gpu))
    dgxc = load_bench("accuracy_dgxc")
    for row in _sample(load_bench("dgxc_rows").load_dense_rows()):
        yield "dgxc", row.row.path, lambda row=row: dgxc.predict(row, dgxc.profiles()[dgxc.FAMILY[row.gpu]])
    holdout = load_bench("accuracy_holdout")
    for row in _sample(holdout.load_rows()):
        yield "holdout", row.row.path, lambda row=row: holdout.simulate(row).step_time_s
    moe = load_bench("accuracy_moe")
    for row in _sample([r.row for r in moe.load_rows()]):
        yield "moe", row.path, lambda row=row: moe.predict(moe.MoERow(row), moe.base_profiles())
    titan = load_bench("accuracy_torchtitan_h100")
    for row in _sample(titan.ROWS):
        yield "torchtitan-h100", row.path, lambda row=row: titan.simulate(row).step_time_s
    papers = load_bench("accuracy_megatron_papers")
    for row in _sample(papers.load_rows()):
        yield "papers", row.path, lambda row=row: papers.predict(row)[0]


CASES = list(_bench_predictions())


@pytest.mark.parametrize(("bench", "path", "predict"), CASES,
                         ids=[f"{b}:{p.stem}" for b, p, _ in CASES])
def test_bench_prediction_is_the_clis(bench, path, predict):
    assert predict() == _cli_step_s(path)


def test_no_side_door_in_the_benches():
    for path in (REPO / "bench").glob("*.py"):
        assert not re.search(r"\btraits\s*=", path.read_text()), path
