"""torchrun / slurm launch scripts, run for real by bash against stub `meshplan`, `srun` and
`scontrol` programs, and `meshplan export` smoke tests through the CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from test_export import make_plan, plan_3d, plan_13b

from planner.export import TARGETS, export_plan
from planner.export.launch import slurm_script, torchrun_commands, torchrun_script
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.run_flags import RunFlags
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError

STUB_MESHPLAN = '#!/bin/bash\n{ printf "%s\\0" "$@"; printf "\\n"; } >> "$STUB_LOG"\n'
# srun stub: skip srun's own options, then run the command once per node with SLURM_NODEID set
STUB_SRUN = ('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
             'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done\n')
STUB_SCONTROL = ('#!/bin/bash\nif [[ "$1 $2" == "show hostnames" ]]; then printf "%s\\n" $FAKE_NODES; '
                 'else echo "scontrol $*" >> "$STUB_LOG.scontrol"; fi\n')


def execute_parser() -> argparse.ArgumentParser:
    """The `meshplan execute` flags the launch lines use (executor/cli/execute.py; run flags: planner.run_flags)."""
    p = argparse.ArgumentParser(prog="meshplan execute", allow_abbrev=False)
    p.add_argument("plan")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--log-every", type=int)
    p.add_argument("--nnodes", type=int)
    p.add_argument("--node-rank", type=int)
    p.add_argument("--rdzv-endpoint")
    return p


@pytest.fixture
def stubs(tmp_path):
    """A PATH with stub meshplan/srun/scontrol; returns (env, read_log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("meshplan", STUB_MESHPLAN), ("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log)}

    def calls() -> list[list[str]]:
        if not log.exists():
            return []
        return [line.split("\0")[:-1] for line in log.read_text().splitlines()]

    return env, calls


def run_script(tmp_path: Path, text: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "launch.sh"
    script.write_text(text)
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=30)


def test_torchrun_commands_one_per_node():
    cmds = torchrun_commands(plan_3d(), "p.json", rdzv_endpoint="h0:29500", run=RunFlags(steps=5))
    assert len(cmds) == 4 and all(c[:2] == ["meshplan", "execute"] for c in cmds)
    parsed = [execute_parser().parse_args(c[2:]) for c in cmds]
    assert [a.node_rank for a in parsed] == [0, 1, 2, 3]
    assert {(a.plan, a.nnodes, a.rdzv_endpoint, a.steps) for a in parsed} == {("p.json", 4, "h0:29500", 5)}


def test_single_node_plan_has_no_rendezvous_flags():
    model = load_model("debug")
    plan = Plan(model=model, cluster=load_cluster("cpu", 4), training=TrainingSpec(seq_len=64, global_batch_size=8,
                dtype="fp32"), layout=with_stage_layers(model, Layout(tp=2, dp_replicate=2, grad_accum_steps=4)))
    assert torchrun_commands(plan, "p.json") == [["meshplan", "execute", "p.json"]]
    assert "--gpus-per-node" not in slurm_script(plan, "p.json")  # CPU ranks ask SLURM for no GPUs


def test_wrong_node_count_is_refused():
    with pytest.raises(UsageError, match="--nnodes 3 does not match the plan"):
        torchrun_commands(plan_13b(), "p.json", nnodes=3)


def test_torchrun_script_runs_the_same_commands_on_every_node(tmp_path, stubs):
    env, calls = stubs
    plan = plan_3d()
    hosts = ["n0", "n1", "n2", "n3"]
    text = torchrun_script(plan, "my plan.json", hosts, run=RunFlags(steps=5))
    for rank in range(4):
        assert run_script(tmp_path, text, env, str(rank)).returncode == 0
    expected = torchrun_commands(plan, "my plan.json", rdzv_endpoint="n0:29500", run=RunFlags(steps=5))
    assert calls() == [argv[1:] for argv in expected]  # the stub sees the arguments after its name
    bad = run_script(tmp_path, text, env, "4")
    assert bad.returncode == 2 and "node rank must be 0..3" in bad.stderr


def test_torchrun_script_without_hosts_needs_head_node(tmp_path, stubs):
    env, calls = stubs
    text = torchrun_script(plan_13b(), "p.json")
    assert run_script(tmp_path, text, env, "1").returncode != 0 and calls() == []
    assert run_script(tmp_path, text, {**env, "HEAD_NODE": "10.0.0.7"}, "1").returncode == 0
    assert execute_parser().parse_args(calls()[0][1:]).rdzv_endpoint == "10.0.0.7:29500"


def test_slurm_script_starts_one_execute_per_node(tmp_path, stubs):
    env, calls = stubs
    plan = plan_3d()
    text = slurm_script(plan, "p.json", run=RunFlags(steps=5))
    directives = dict(line[len("#SBATCH --"):].partition("=")[::2] for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["nodes"] == "4" and directives["ntasks-per-node"] == "1"
    assert directives["gpus-per-node"] == "8"
    slurm_env = {**env, "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]",
                 "FAKE_NODES": "gpu07 gpu08 gpu09 gpu10"}
    proc = run_script(tmp_path, text, slurm_env)
    assert proc.returncode == 0, proc.stderr
    expected = torchrun_commands(plan, "p.json", rdzv_endpoint="gpu07:29500", run=RunFlags(steps=5))
    assert calls() == [argv[1:] for argv in expected]


def test_slurm_script_asks_for_sigterm_requeues_on_preemption_and_resumes(tmp_path, stubs):
    """SIGTERM --preempt-grace-s + 30 s before the time limit; exit 75 requeues; a requeued start resumes."""
    env, calls = stubs
    plan = plan_3d()
    run = RunFlags(steps=5, max_restarts=2, preempt_grace_s=100)
    text = slurm_script(plan, "p.json", run=run)
    assert "#SBATCH --signal=TERM@130\n" in text and "#SBATCH --requeue\n" in text
    slurm_env = {**env, "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "77",
                 "FAKE_NODES": "gpu07 gpu08 gpu09 gpu10"}
    first = run_script(tmp_path, text, slurm_env)
    assert first.returncode == 0, first.stderr
    parsed = execute_parser()
    parsed.add_argument("--max-restarts", type=int)
    parsed.add_argument("--preempt-grace-s", type=float)
    parsed.add_argument("--resume", action="store_true")
    args = [parsed.parse_args(c[1:]) for c in calls()]
    assert {(a.max_restarts, a.preempt_grace_s, a.resume) for a in args} == {(2, 100.0, False)}
    scontrol_log = Path(env["STUB_LOG"] + ".scontrol")
    assert not scontrol_log.exists()

    Path(env["STUB_LOG"]).unlink()
    (tmp_path / "bin" / "srun").write_text("#!/bin/bash\nexit 75\n")  # every node: preempted, checkpoint written
    preempted = run_script(tmp_path, text, slurm_env)
    assert preempted.returncode == 75 and scontrol_log.read_text() == "scontrol requeue 77\n"

    (tmp_path / "bin" / "srun").write_text(STUB_SRUN)
    again = run_script(tmp_path, text, {**slurm_env, "SLURM_RESTART_COUNT": "1"})
    assert again.returncode == 0 and all(parsed.parse_args(c[1:]).resume for c in calls())


def test_slurm_script_pins_hosts():
    assert "#SBATCH --nodelist=a,b\n" in slurm_script(plan_13b(), "p.json", hosts=["a", "b"])


# ---- the CLI --------------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    plan_13b().save(path)
    return path


def test_cli_exports_every_target(cli, plan_file, tmp_path):
    for target in TARGETS:
        r = cli("export", str(plan_file), "--to", target)
        if target == "torchtitan":  # llama2-13b is no flavor torchtitan registers: refused, exit 2, one line
            assert r.code == 2 and "registered flavors" in r.stderr and r.stdout == "", r.stderr
            continue
        assert r.code == 0, (target, r.stderr)
        assert r.stdout.strip() and "Traceback" not in r.stderr
    path = tmp_path / "8b.json"
    make_plan(16, "llama3-8b", tp=8, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=128).save(path)
    r = cli("export", str(path), "--to", "torchtitan")
    assert r.code == 0 and "could not express: ZeRO-1" in r.stderr  # notes go to stderr, the file to stdout
    r = cli("export", str(path), "--to", "torchtitan", "--target-version", "0.3")
    assert r.code == 0 and "def meshplan_plan():" in r.stdout
    r = cli("export", str(path), "--to", "torchrun", "--target-version", "0.3")
    assert r.code == 2 and "--target-version" in r.stderr


def test_cli_writes_files_and_hostfile(cli, plan_file, tmp_path):
    out = tmp_path / "ds_config.json"
    r = cli("export", str(plan_file), "--to", "deepspeed", "-o", str(out), "--hosts", "a,b")
    assert r.code == 0 and r.stdout == ""
    assert json.loads(out.read_text())["train_batch_size"] == 256
    assert (tmp_path / "hostfile").read_text() == "a slots=8\nb slots=8\n"
    script = tmp_path / "run.sbatch"
    assert cli("export", str(plan_file), "--to", "slurm", "-o", str(script)).code == 0
    assert os.access(script, os.X_OK)


def test_cli_json(cli, plan_file):
    r = cli("export", str(plan_file), "--to", "accelerate", "--json")
    assert r.code == 0
    data = r.json()
    assert data["target"] == "accelerate" and data["filename"] == "accelerate_config.yaml"
    assert yaml.safe_load(data["text"])["num_processes"] == 16


def test_cli_usage_errors_exit_2_in_one_line(cli, plan_file, tmp_path):
    for args in (["--to", "deepspeeed"], ["--to", "slurm", "--hosts", "a"]):
        r = cli("export", str(plan_file), *args)
        assert r.code == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "did you mean 'deepspeed'" in cli("export", str(plan_file), "--to", "deepspeeed").stderr
    assert cli("export", str(tmp_path / "missing.json"), "--to", "megatron").code == 2


def test_cli_exports_the_real_plan_verb_output(cli, tmp_path):
    path = tmp_path / "plan.json"
    r = cli("plan", "--model", "llama3-8b", "--gpus", "16", "--json", "-o", str(path))
    assert r.code == 0, r.stderr
    for target in TARGETS:
        r = cli("export", str(path), "--to", target)
        assert r.code == 0, (target, r.stderr)


def test_export_3d_plan_through_cli(cli, tmp_path):
    path = tmp_path / "plan3d.json"
    make_plan(32, tp=4, pp=4, dp_shard=2, zero_stage=1, micro_batch_size=1, grad_accum_steps=128,
              pp_schedule="interleaved-1f1b", virtual_stages=2).save(path)
    r = cli("export", str(path), "--to", "megatron")
    assert r.code == 0 and "--num-layers-per-virtual-pipeline-stage 5" in r.stdout


def test_launch_exports_state_the_executor_refusal_and_the_engine_to_use():
    from planner.engines import executor_refusal

    # the executor offloads only optimizer+params under ZeRO-3 (FSDP2's CPUOffloadPolicy)
    refused = make_plan(16, tp=4, dp_shard=4, zero_stage=2, offload="optimizer", micro_batch_size=1,
                        grad_accum_steps=64)
    reason = executor_refusal(refused.model, refused.layout)
    assert reason
    for target in ("torchrun", "slurm"):
        result = export_plan(refused, target)
        (note,) = result.notes
        assert reason in note and "meshplan export --to megatron" in note
        assert "could not express: nothing" not in result.text and reason in result.text
        assert export_plan(plan_13b(), target).notes == ()
