"""`meshplan execute` without training: dry run, launch printing, refusals with the numbers.

Real runs live in test_executor_determinism.py (every layout, and the run
directory's contract) and in tests/multiproc/test_failures.py (failed workers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from conftest import REPO
from torchrun_util import TEST_DATA, make_plan

from executor.model import build_model
from executor.preflight import GIB, Found, check_hardware, predicted_peak_bytes
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, Prediction, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import UsageError


def test_dry_run_prints_mesh_modules_and_shards(cli, tmp_path):
    """ZeRO-3 over 4 ranks: rank 0 holds ceil(rows / 4) rows of every parameter."""
    plan = make_plan(tmp_path, "z3", "--dp-shard", "4", "--zero", "3")
    res = cli("execute", str(plan), "--dry-run")
    assert res.code == 0, res.stderr
    assert "mesh pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 1" in res.stdout
    assert "dp_shard [0, 1, 2, 3]" in res.stdout
    assert "ZeRO-3 with fully_shard" in res.stdout
    expected = sum(math.ceil(p.shape[0] / 4) * p[0].numel() for p in build_model(load_model("debug")).parameters())
    held = int(re.search(r"rank 0 holds ([\d,]+) parameter elements", res.stdout).group(1).replace(",", ""))
    assert held == expected
    assert not (tmp_path / "runs").exists()


def test_dry_run_pipeline_modules(cli, tmp_path):
    plan = make_plan(tmp_path, "pp", "--pp", "2", "--tp", "2", "--micro-batch", "2", "--pp-schedule", "1f1b")
    res = cli("execute", str(plan), "--dry-run")
    assert res.code == 0, res.stderr
    rows = re.findall(r"│ (\d) +│ (\d) +│ ([\d-]+) +│ ([a-z ,]*?) *│", res.stdout)
    assert rows == [("0", "0", "0-1", "embeddings"), ("1", "1", "2-3", "final norm, output")]
    assert "2 of 4 query heads, 1 of 2 KV heads" in res.stdout


def test_dry_run_shows_the_launch_batch_and_memory_like_for_like(cli, tmp_path):
    """Node 1 of a 2-node plan: its ranks, the c10d rendezvous, its torchrun line, the micro-batching, and
    rank 0's stored bytes equal to the memory model's params term (parameters + buffers, after TP/PP/ZeRO)."""
    two = make_plan(tmp_path, "two", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--pp-schedule", "1f1b",
                    gpus=16)  # cpu cluster: 8 ranks per node
    res = cli("execute", str(two), "--dry-run", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500",
              "--steps", "5", "--out", str(tmp_path / "r"))
    assert res.code == 0, res.stderr
    out = res.stdout
    assert "nodes: 2 x 8 ranks (CPU ranks on gloo) = 16 ranks; this is node 1 (global ranks 8-15)" in out
    assert re.search(r"rendezvous: c10d at head:29500, run id meshplan-[0-9a-f]{12} ", out)
    launch = re.search(r"this node would start: torchrun (.*)", out).group(1)
    assert launch.startswith("--nnodes=2 --nproc-per-node=8 --max-restarts=0 --shutdown-timeout=60 --rdzv-backend=c10d "
                             "--rdzv-endpoint=head:29500 --rdzv-id=meshplan-")
    assert launch.endswith(f"-m executor.worker {tmp_path / 'r' / 'plan.json'} --steps 5 --seed 0 --log-every 10 "
                           f"--out {tmp_path / 'r'}")
    plan = json.loads(two.read_text())["parallel"]
    dp = 16 // 4
    assert (f"batch: 8 sequences x 64 tokens = 512 tokens per optimizer step; dp {dp} x {8 // dp} sequences per "
            f"data-parallel rank = {plan['grad_accum_steps']} micro-batch(es) of 1") in out
    assert f"pipeline: the 1f1b schedule runs the {plan['grad_accum_steps']} micro-batches through 2 stages" in out
    assert "hardware: the plan expects 8 CPU ranks per node" in out
    like = re.search(r"like for like: parameters ([\d.]+) KiB \+ buffers ([\d.]+) KiB = ([\d.]+) KiB built here; "
                     r"the memory model's params term for this rank: ([\d.]+) KiB \(([+-][\d.]+)%\)", out)
    assert like, out
    assert float(like.group(1)) + float(like.group(2)) == pytest.approx(float(like.group(3)), abs=0.1)
    assert float(like.group(4)) == float(like.group(3)) and float(like.group(5)) == 0.0
    # a multi-node plan without an endpoint says what every node needs instead of a torchrun line
    res = cli("execute", str(two), "--dry-run")
    assert "rendezvous: none given; every node needs --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT" in res.stdout
    assert "this node would start" not in res.stdout


def test_dry_run_gives_the_preflight_verdict_on_this_machine():
    """A GPU plan's dry run says whether a run here would start, with the refusal execute would print."""
    from executor.dryrun import hardware_line

    plan = _plan("dgx-h100", 8)
    assert hardware_line(plan, 1, H100) == ("hardware: the plan expects 8 x h100-sxm (80.0 GiB, compute capability "
                                            "9.0, bf16 peak 989.4 TFLOP/s) per node; here: NVIDIA H100 80GB HBM3 "
                                            "(compute capability 9.0, 79.2 GiB); a run here would start")
    a100 = Found(8, int(79.2 * GIB), "NVIDIA A100-SXM4-80GB", capability=(8, 0))
    assert "a run here would be refused: the plan expects h100-sxm" in hardware_line(plan, 1, a100)
    assert "no CUDA device; a run here would be refused" in hardware_line(plan, 1, Found(0))


def test_print_launch_uses_the_export_module(cli, tmp_path):
    one = make_plan(tmp_path, "one", "--dp", "4")
    res = cli("execute", str(one), "--print-launch", "torchrun", "--steps", "7", "--out", "runs/x")
    assert res.code == 0, res.stderr
    assert res.stdout.strip().splitlines() == [
        f"meshplan execute {one} --steps 7 --seed 0 --log-every 10 --out runs/x"]
    two = make_plan(tmp_path, "two", gpus=16)  # cpu cluster: 8 ranks per node, so 2 nodes
    lines = cli("execute", str(two), "--print-launch", "torchrun").stdout.strip().splitlines()
    assert [re.search(r"--node-rank (\d)", line).group(1) for line in lines] == ["0", "1"]
    assert all("--nnodes 2" in line for line in lines)
    slurm = cli("execute", str(two), "--print-launch", "slurm")
    assert slurm.code == 0 and "#SBATCH --nodes=2" in slurm.stdout


def test_refuses_gpu_plan_without_gpus(cli, tmp_path):
    plan = tmp_path / "h100.json"
    res = cli("plan", "--model", "debug", "--cluster", "dgx-h100", "--gpus", "8", *TEST_DATA, "-o", str(plan))
    assert res.code == 0, res.stderr
    res = cli("execute", str(plan), "--steps", "1", "--out", str(tmp_path / "run"))
    assert res.code == 2
    assert res.stderr.strip() == ("error: the plan is for 8 x h100-sxm GPUs (8 ranks as 1 node(s) x 8) but this "
                                  "machine has no CUDA device: run it where the GPUs are, or plan CPU ranks with "
                                  "--cluster cpu")


def test_refuses_node_count_and_bad_data(cli, tmp_path):
    plan = make_plan(tmp_path, "p", "--dp", "4")
    res = cli("execute", str(plan), "--nnodes", "2", "--rdzv-endpoint", "localhost:1", "--out", str(tmp_path / "r"))
    assert res.code == 2 and "as 1 node(s) x 4, but --nnodes is 2" in res.stderr
    res = cli("execute", str(plan), "--data", str(tmp_path / "missing.bin"), "--out", str(tmp_path / "r"))
    assert res.code == 2 and "does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def _plan(gpu_cluster: str, gpus: int, overrides: dict | None = None) -> Plan:
    spec = load_model("debug")
    layout = with_stage_layers(spec, Layout(dp_replicate=gpus, micro_batch_size=1))
    return Plan(model=spec, cluster=load_cluster(gpu_cluster, gpus, overrides),
                training=TrainingSpec(seq_len=64, global_batch_size=gpus), layout=layout)


H100 = Found(8, int(79.2 * GIB), "NVIDIA H100 80GB HBM3", capability=(9, 0))  # what CUDA reports


def test_hardware_checks_name_the_numbers():
    plan = _plan("dgx-h100", 8)
    assert check_hardware(plan, H100, nnodes=1) == []
    with pytest.raises(UsageError, match="needs 8 GPUs per node .* but this node has 4: re-plan with --gpus 4"):
        check_hardware(plan, dataclasses.replace(H100, n_devices=4), nnodes=1)
    check_hardware(_plan("cpu", 4), Found(0), nnodes=1)  # CPU ranks run anywhere...


def test_another_gpu_model_is_refused_with_both_peaks():
    """An H100 plan on an A100-80GB: same memory, a third of the peak; MFU would divide by the H100's."""
    a100 = Found(8, int(79.2 * GIB), "NVIDIA A100-SXM4-80GB", capability=(8, 0))
    with pytest.raises(UsageError) as err:
        check_hardware(_plan("dgx-h100", 8), a100, nnodes=1)
    assert str(err.value) == (
        "the plan expects h100-sxm (80.0 GiB, compute capability 9.0, bf16 peak 989.4 TFLOP/s) but GPU 0 here is "
        "NVIDIA A100-SXM4-80GB (compute capability 8.0, 79.2 GiB), the catalog's a100-80g-sxm (bf16 peak 312.0 "
        "TFLOP/s): the plan's step time, memory and MFU would not hold; re-plan for this GPU with --cluster "
        "dgx-a100-80g")
    # the same die with more memory is another plan too (bandwidth, memory): H100 plan on an H200
    with pytest.raises(UsageError, match="the catalog's h200 .*--cluster dgx-h200"):
        check_hardware(_plan("dgx-h100", 8), Found(8, int(140.4 * GIB), "NVIDIA H200", capability=(9, 0)), nnodes=1)
    # the device's name and its compute capability must agree with the catalog
    with pytest.raises(UsageError, match="reports the name of h100-sxm but compute capability 8.0, not h100-sxm's 9.0"):
        check_hardware(_plan("dgx-h100", 8), dataclasses.replace(H100, capability=(8, 0)), nnodes=1)


def test_uncatalogued_gpu_runs_only_on_the_planned_capability():
    plan = _plan("dgx-h100", 8)
    other = Found(8, int(93 * GIB), "NVIDIA Hopper Engineering Sample", capability=(9, 0))
    notes = check_hardware(plan, other, nnodes=1)
    assert len(notes) == 1 and "which the catalog does not name; its compute capability is h100-sxm's" in notes[0]
    with pytest.raises(UsageError, match="does not name and whose compute capability is not 9.0"):
        check_hardware(plan, dataclasses.replace(other, name="NVIDIA TITAN RTX", capability=(7, 5)), nnodes=1)


def test_set_modified_plans_say_what_they_expect():
    """A plan made with `--set gpu_memory_gib=94` names the change when the GPU found has less."""
    plan = _plan("dgx-h100", 8, {"gpu_memory_gib": "94", "gpu_bf16_tflops": "800"})
    with pytest.raises(UsageError) as err:
        check_hardware(plan, H100, nnodes=1)
    assert str(err.value) == (
        "the plan expects h100-sxm (94.0 GiB, compute capability 9.0, bf16 peak 800.0 TFLOP/s; by --set "
        "gpu_memory_gib=94 (catalog 80), gpu_bf16_tflops=800 (catalog 989.4)): 94.0 GiB per GPU, but this NVIDIA "
        "H100 80GB HBM3 has 79.2 GiB: re-plan for this GPU")
    assert check_hardware(_plan("dgx-h100", 8, {"gpu_memory_gib": "76"}), H100, nnodes=1) == []


def test_every_catalog_gpu_has_a_compute_capability():
    from topologies.hardware import GPUS
    from topologies.smi_topo import COMPUTE_CAPABILITY

    assert sorted(COMPUTE_CAPABILITY) == sorted(name for name, gpu in GPUS.items() if gpu.kind == "gpu")


def test_cpu_ranks_must_fit_in_host_memory():
    """... where the memory model's peak for the plan, in fp32 on CPU ranks, fits in what the host has free."""
    plan = _plan("cpu", 4)
    per_rank = predicted_peak_bytes(plan) * (1 if plan.training.dtype == "fp32" else 2)
    check_hardware(plan, Found(0, host_available_bytes=4 * per_rank + 1), nnodes=1)
    with pytest.raises(UsageError, match=r"x 4 ranks = .* GiB, but this machine has"):
        check_hardware(plan, Found(0, host_available_bytes=4 * per_rank - 1), nnodes=1)


def test_stale_prediction_does_not_hide_a_plan_too_big_for_the_host():
    """A plan edited by hand keeps its old prediction: the check re-estimates from the plan itself."""
    plan = _plan("cpu", 4)
    tiny = Prediction(step_time_s=1.0, tokens_per_s=1.0, model_tflops_per_gpu=1.0, mfu=0.1,
                      peak_memory_bytes=1, memory_breakdown_bytes={}, time_breakdown_s={})
    bigger = dataclasses.replace(plan, prediction=tiny,
                                 training=dataclasses.replace(plan.training, seq_len=256, global_batch_size=4096),
                                 layout=plan.layout.replace(micro_batch_size=4096 // plan.layout.dp,
                                                            grad_accum_steps=1))
    with pytest.raises(UsageError, match="GiB per rank"):
        check_hardware(bigger, Found(0, host_available_bytes=1 * GIB), nnodes=1)


def test_refuses_what_the_executor_does_not_run(cli, tmp_path):
    spec = load_model("debug-moe")
    layout = with_stage_layers(spec, Layout(tp=2, dp_replicate=2, micro_batch_size=2, sequence_parallel=True))
    path = tmp_path / "moe_sp.json"
    Plan(model=spec, cluster=load_cluster("cpu", 4), training=TrainingSpec(seq_len=64, global_batch_size=4),
         layout=layout).save(path)
    res = cli("execute", str(path), "--dry-run")
    assert res.code == 2 and "with tp (2) and sequence parallel" in res.stderr
    # Plans for another engine may hold what meshplan's executor refuses (its own engine never does).
    offload = Path(make_plan(tmp_path, "offload", "--dp-shard", "4", "--zero", "2", "--engine", "megatron"))
    doc = json.loads(offload.read_text())
    doc["parallel"]["offload"] = "optimizer"
    offload.write_text(json.dumps(doc))
    res = cli("execute", str(offload), "--dry-run")
    assert res.code == 2 and "offload 'optimizer' with zero_stage 2" in res.stderr


def test_readme_dry_run_example_is_real_output(cli, tmp_path):
    """The README's `execute --dry-run` block, re-run: every line it shows (host memory aside) is printed."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("$ meshplan execute p.json --dry-run\n"):]
    shown = block[block.index("\n") + 1:block.index("```")].splitlines()
    res = cli("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "4", "--tp", "2", "--dp", "2", "-o", "p.json",
              cwd=tmp_path)
    assert res.code == 0, res.stderr
    res = cli("execute", "p.json", "--dry-run", cwd=tmp_path)
    assert res.code == 0, res.stderr
    printed = res.stdout.splitlines()
    host = re.compile(r"here: [\d.]+ GiB of host memory available")
    for line in shown:
        if line == "...":
            continue
        assert host.sub("here: X", line) in [host.sub("here: X", p) for p in printed], line
