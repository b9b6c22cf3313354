"""One codec for the run flags: `meshplan execute`'s options, the launch lines and the worker agree."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner
from test_export import plan_3d

from executor.cli.execute import execute
from executor.worker import parse_args
from planner.export.launch import torchrun_commands
from planner.run_flags import DEFAULT_RUN, RunFlags
from topologies.errors import UsageError

FLAG_SETS = [
    RunFlags(),
    RunFlags(steps=3, out="runs/a b", seed=7, data="chat.jsonl", tokenizer="models/qwen tok", lr=2.5e-4,
             log_every=1, checkpoint_every=2, keep_checkpoints=3, resume=True),
    RunFlags(steps=1, lr=1e-3),
    RunFlags(steps=9, max_restarts=2, resume_from="step-4", allow_plan_change=True, max_nonfinite_steps=5,
             preempt_grace_s=12.5, async_checkpoint=True, replan=True),
]


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_to_argv_and_back(flags):
    assert RunFlags.from_argv(flags.to_argv()) == flags


@pytest.mark.parametrize("flags", FLAG_SETS)
def test_worker_reads_what_the_launcher_writes(flags):
    flags = flags.replace(out=flags.out or "runs/x")
    plan, parsed = parse_args(["plan.json", *flags.to_argv()])
    assert (plan, parsed) == ("plan.json", flags)


def test_worker_refuses_a_missing_run_directory():
    with pytest.raises(UsageError, match="--out"):
        parse_args(["plan.json", *RunFlags().to_argv()])


def test_execute_options_are_the_run_flags_with_their_defaults():
    """Every RunFlags field is an `execute` option of the same name (its long flag) and default."""
    params = {p.opts[0].lstrip("-").replace("-", "_"): p for p in execute.params}
    for name, default in DEFAULT_RUN.__dict__.items():
        assert name in params, name
        if isinstance(default, bool):  # an on/off flag: off unless given
            assert params[name].is_flag and default is False, name
        else:
            assert params[name].default == default, (name, params[name].default)
        assert params[name].opts[0] == "--" + name.replace("_", "-")


@pytest.mark.parametrize("flags", FLAG_SETS[1:])
def test_print_launch_lines_carry_the_run_flags(tmp_path, flags):
    """`execute --print-launch torchrun` repeats exactly the codec's flags on every node."""
    plan = plan_3d()
    path = tmp_path / "p.json"
    plan.save(path)
    res = CliRunner().invoke(execute, [str(path), "--print-launch", "torchrun", "--rdzv-endpoint", "h0:29500",
                                       *flags.to_argv()])
    assert res.exit_code == 0, res.output
    expected = torchrun_commands(plan, str(path), rdzv_endpoint="h0:29500", run=flags)
    assert [shlex.split(line) for line in res.output.splitlines()] == expected


def test_bad_values_are_usage_errors():
    with pytest.raises(UsageError, match="--steps"):
        RunFlags(steps=0)
    with pytest.raises(UsageError, match="--lr"):
        RunFlags(lr=-1.0)
    with pytest.raises(UsageError, match="unknown"):
        RunFlags.from_argv(["--stepz", "3"])
    with pytest.raises(UsageError, match="--preempt-grace-s"):
        RunFlags(preempt_grace_s=float("nan"))
    with pytest.raises(UsageError, match="--max-nonfinite-steps"):
        RunFlags(max_nonfinite_steps=0)
