"""The collectives a real optimizer step issues, against the simulator's list for the same plan.

Each layout is one torchrun of the real `executor.worker` on 4 CPU ranks (gloo, the debug
model, 3 steps) under torch's profiler (tests/collective_worker.py: every ProcessGroup
collective, DDP's C++ reducer included, with its input's size and dtype). The last step is
compared, rank by rank, with `planner.simulate.collectives.dp_collectives` for the rank's
pipeline stage: the data-parallel gradient reductions and parameter gathers must agree in
kind, count, bytes and dtype exactly. What each layout issues per step (debug model: 4
blocks; L blocks, n micro-batches, N ranks of the ZeRO group):

- ddp: one all-reduce of all gradients (one 25 MiB DDP bucket);
- zero1: the same, then each of the N owners broadcasts its fp32 parameters as one bucket
  (ZeroRedundancyOptimizer with parameters_as_bucket_view; one broadcast per tensor before);
  owners hold whole tensors, so the buckets are compared by count and total bytes;
- zero2 (n = 2): per micro-batch every unit (L blocks, the embedding, final norm + output)
  all-gathers once (FSDP2 reshards after each backward) and reduce-scatters once;
- zero3: per micro-batch the blocks all-gather 2L - 1 times (the last block stays gathered
  into its backward), the embedding twice, final norm + output once; one reduce-scatter each;
- hsdp (2 x 2, n = 2): ZeRO-3 on the shard pairs, and each unit's shard all-reduced across
  the replicas once per step (FSDP2's set_requires_all_reduce on the last micro-batch only;
  every micro-batch before);
- tp2_dp2 (ZeRO-1): FSDP2's replicate all-reduces each unit's local (TP-split) gradient
  (L blocks and the part's root), then Zero1Optimizer's 2 owners broadcast one bucket each;
- pp2_dp2 (1F1B, n = 4): each stage's replicate all-reduces (its blocks, its root).

gloo has no reduce-scatter: FSDP2 all-reduces the whole unit gradient in its place (the
same input bytes; a GPU's NCCL reduce-scatters), so the comparison reads a listed
reduce_scatter as a recorded all_reduce of the same size. An all-gather's recorded input is
its shard: size_bytes / group_size.

Beside the data-parallel entries, every other collective of the step must be one named
here, counted exactly:
- LOSS_NORM: the loss and the gradient norm, reduced in one all-reduce of 2 float64;
- PP send/recv: each stage sends and receives n activations or gradients of m*h values
  (planner.simulate.step._p2p prices one per boundary, micro-batch and direction);
- TP (no sequence parallel): forward 2 all-reduces per block plus the vocabulary-split
  embedding's, backward 2 per block (one input gradient per attention and per MLP: their
  inputs are one Replicate DTensor each, torchtitan's PrepareModuleInput; without it q, k, v
  and w1, w3 all-reduced theirs one by one, 5 per block) plus the output layer's, as
  planner.simulate.step._layer_comm and ends_tp_comm_s price them;
  and the loss-parallel cross-entropy's 3 all-reduces of m values (max, sum of exponentials,
  target logit).
Steps 1 and 2 may add one-time integer messages only (DDP's bucket order, the pipeline's
shape exchange), named ONE_TIME.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO
from torchrun_util import make_plan

from planner.engines import get_engine
from planner.memory.params import pipeline_params
from planner.plan import load_plan
from planner.simulate.collectives import dp_collectives
from planner.simulate.compute import tokens_per_micro_batch

RANKS, STEPS = 4, 3
LAYOUTS = {
    "ddp": ["--dp", "4", "--zero", "0", "--micro-batch", "2"],
    "zero1": ["--dp-shard", "4", "--zero", "1", "--micro-batch", "2"],
    "zero2": ["--dp-shard", "4", "--zero", "2", "--micro-batch", "1"],
    "zero3": ["--dp-shard", "4", "--zero", "3", "--micro-batch", "2"],
    "hsdp": ["--dp", "4", "--dp-shard", "2", "--zero", "3", "--micro-batch", "1"],
    "tp2_dp2": ["--tp", "2", "--dp", "2", "--zero", "1", "--micro-batch", "4"],
    "pp2_dp2": ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"],
}
DTYPE_BYTES = {"float": 4, "double": 8, "int": 4, "long int": 8, "unsigned char": 1}
LOSS_NORM = ("all_reduce", 2, "double")
ONE_TIME_DTYPES = ("int", "long int", "unsigned char")


def _run(tmp: Path, name: str) -> tuple[Path, list[dict]]:
    plan = make_plan(tmp, name, *LAYOUTS[name], gpus=RANKS)
    prefix = tmp / f"{name}-collectives"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(REPO / "tests" / "collective_worker.py"), str(prefix), str(plan), "--out", str(tmp / name),
         "--steps", str(STEPS), "--log-every", "100"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return plan, [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("collectives")
    return {name: _run(tmp, name) for name in LAYOUTS}


def _listed(plan, rank: int) -> Counter:
    """The simulator's data-parallel entries for `rank`, as gloo records them: (kind, numel, dtype) -> count."""
    layout = plan.layout
    sp = pipeline_params(plan.model, layout)[rank // (RANKS // layout.pp)]
    want: Counter = Counter()
    for c in dp_collectives(plan.model, plan.training, layout, sp, get_engine("meshplan")):
        assert c.dtype_bytes == 4, c  # CPU ranks: fp32 parameters, gradients and compute
        kind, numel = c.kind, c.size_bytes / c.dtype_bytes
        if kind == "reduce_scatter":  # gloo: FSDP2 all-reduces the whole gradient instead
            kind = "all_reduce"
        if kind == "all_gather":  # recorded input: this rank's shard
            numel /= c.group_size
        assert numel == int(numel), c
        want[kind, int(numel), "float"] += c.count
    return _owners_pooled(want)


def _owners_pooled(counts: Counter) -> Counter:
    """ZeRO-1's broadcasts as one entry (total numel, count): owners hold whole tensors, so their buckets
    differ in size around the list's even split."""
    out = Counter({k: v for k, v in counts.items() if k[0] != "broadcast"})
    casts = [(numel, dtype, count) for (kind, numel, dtype), count in counts.items() if kind == "broadcast"]
    for dtype in {d for _, d, _ in casts}:
        same = [(numel, count) for numel, d, count in casts if d == dtype]
        out["broadcast", sum(n * c for n, c in same), dtype] += sum(c for _, c in same)
    return out


def _named_extras(plan) -> Counter:
    """Every non-data-parallel collective of a step (module docstring), by (kind, numel, dtype)."""
    layout, model = plan.layout, plan.model
    m_h = tokens_per_micro_batch(plan.training.seq_len, layout) * model.hidden
    n = layout.grad_accum_steps
    extras = Counter({LOSS_NORM: 1})
    if layout.pp > 1:
        extras["send", m_h // (layout.tp if layout.sequence_parallel else 1), "float"] += n
        extras["recv", m_h // (layout.tp if layout.sequence_parallel else 1), "float"] += n
    if layout.tp > 1:
        assert not layout.sequence_parallel and not model.tie_embeddings
        blocks = model.n_layers // layout.pp
        simulator_points = n * (4 * blocks + 2)  # 2 per block and pass; the embedding's forward, output's backward
        extras["all_reduce", m_h, "float"] += simulator_points
        extras["all_reduce", m_h // model.hidden, "float"] += 3 * n  # loss parallel: max, sum of exp, target
    return extras


@pytest.mark.parametrize("name", LAYOUTS)
def test_last_step_matches_the_simulators_list(runs, name):
    plan_path, per_rank = runs[name]
    plan = load_plan(plan_path)
    for rank, report in enumerate(per_rank):
        got = _owners_pooled(Counter(tuple(c) for c in report["steps"][str(STEPS)]))
        listed = _listed(plan, rank)
        assert listed, (name, "the simulator lists no data-parallel collective")
        dp_part = got & listed
        assert dp_part == listed, (name, rank, "listed but not issued", listed - got)
        rest = got - listed
        assert rest == _named_extras(plan), (name, rank, "issued beyond the list", rest - _named_extras(plan),
                                             "named but not issued", _named_extras(plan) - rest)


@pytest.mark.parametrize("name", LAYOUTS)
def test_first_steps_add_only_one_time_messages(runs, name):
    _, per_rank = runs[name]
    for rank, report in enumerate(per_rank):
        last = Counter(tuple(c) for c in report["steps"][str(STEPS)])
        for step in range(1, STEPS):
            got = Counter(tuple(c) for c in report["steps"][str(step)])
            assert last - got == Counter(), (name, rank, step, "missing on an earlier step", last - got)
            extra = got - last
            assert all(dtype in ONE_TIME_DTYPES for _, _, dtype in extra), (name, rank, step, extra)


def test_bytes_per_step_as_listed(runs):
    """The bytes each layout's gradient reduction and gathers move on rank 0 are the list's (figures in failures)."""
    for name, (plan_path, per_rank) in runs.items():
        plan = load_plan(plan_path)
        got = _owners_pooled(Counter(tuple(c) for c in per_rank[0]["steps"][str(STEPS)])) & _listed(plan, 0)
        def size(kind: str, numel: int, count: int) -> int:  # a pooled broadcast entry's numel is its total
            return numel if kind == "broadcast" else numel * count

        moved = sum(size(k, numel, count) * DTYPE_BYTES[dtype] for (k, numel, dtype), count in got.items())
        listed = sum(size(k, numel, count) * 4 for (k, numel, _), count in _listed(plan, 0).items())
        assert moved == listed > 0, (name, moved, listed)
