"""torchtitan 0.3 loads the Python config modules of `--target-version 0.3`.

torchtitan 0.2 and 0.3 share a distribution name, so 0.3 lives in its own
venv (`make test-consumers` builds .venv-consumers-tt03, or point
MESHPLAN_TT03_PYTHON at another interpreter). Every plan of
test_consumers.PLANS is exported here and loaded there in one process by
torchtitan's ConfigManager (`--module M --config meshplan_plan`), whose
Trainer.Config checks run; the degrees and batch it reads back must equal
the plan's (or the FSDP2 mapping the notes state).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from test_consumers import PLANS, plan_of

from planner.export import ExportRefused, export_plan
from planner.export.torchtitan import FLAVORS

TT03_PYTHON = Path(os.environ.get("MESHPLAN_TT03_PYTHON", REPO / ".venv-consumers-tt03" / "bin" / "python"))

# Runs under torchtitan 0.3: load each (folder, module) and print what Trainer.Config holds.
LOADER = """
import json, sys
from torchtitan.config import ConfigManager
out = {}
for folder, module in json.loads(sys.argv[1]):
    sys.path.insert(0, folder)
    try:
        cfg = ConfigManager().parse_args(["--module", module, "--config", "meshplan_plan"])
    except SystemExit as exc:  # tyro reports a rejected config by exiting
        out[folder] = {"rejected": str(exc)}
        continue
    finally:  # every export's module has the model's name: forget the last one
        sys.path.remove(folder)
        sys.modules.pop(module, None)
    p, t = cfg.parallelism, cfg.training
    ac = cfg.activation_checkpoint
    out[folder] = {"kind": type(cfg).__qualname__, "flavor": cfg.model_spec.flavor,
                   "degrees": [p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                               p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree],
                   "batch": [t.local_batch_size, t.global_batch_size, t.seq_len],
                   "schedule": p.pipeline_parallel_schedule, "ac": type(ac).__qualname__ if ac else "None"}
print(json.dumps(out))
"""
AC_CLASSES = {"none": "None", "full": "FullAC.Config", "selective": "SelectiveAC.Config"}


def test_torchtitan_03_loads_every_python_config(tmp_path):
    assert TT03_PYTHON.exists(), (f"no torchtitan 0.3 interpreter at {TT03_PYTHON}: run `make test-consumers` "
                                  "(it builds .venv-consumers-tt03) or set MESHPLAN_TT03_PYTHON")
    jobs, expected = [], {}
    for name in PLANS:
        plan = plan_of(name)
        m = plan.model
        if (m.hidden, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab) not in FLAVORS:
            with pytest.raises(ExportRefused, match="registered flavors"):
                export_plan(plan, "torchtitan", version="0.3")
            continue
        result = export_plan(plan, "torchtitan", version="0.3")
        folder = tmp_path / name
        folder.mkdir()
        (folder / result.filename).write_text(result.text)
        jobs.append([str(folder), result.filename.removesuffix(".py")])
        lay = plan.layout
        local = lay.micro_batch_size * (lay.grad_accum_steps if lay.pp > 1 else 1)
        expected[str(folder)] = {"degrees": [lay.dp_replicate, lay.dp_shard, lay.tp, lay.cp, lay.pp],
                                 "batch": [local, plan.training.global_batch_size, plan.training.seq_len],
                                 "ac": AC_CLASSES[lay.recompute]}
    assert jobs, "no plan of PLANS has a shape torchtitan registers"
    run = subprocess.run([str(TT03_PYTHON), "-c", LOADER, json.dumps(jobs)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for folder, want in expected.items():
        values = got[folder]
        assert "rejected" not in values, (folder, values)
        assert values["kind"] == "Trainer.Config"
        assert {k: values[k] for k in want} == want, folder
