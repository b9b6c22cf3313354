"""Collective benchmark for `meshplan calibrate`: all_reduce, all_gather, reduce_scatter, send/recv.

`measure_collectives` launches this module under torchrun with N local ranks
(gloo on CPU, NCCL on GPUs) and reads back one JSON file. Inside, one launch
covers every group size 2..N: group n is ranks 0..n-1 (a `new_group`), the
others wait at a world barrier, so torchrun's start-up is paid once.

Sizes follow nccl-tests (and `topologies.collectives`): all_reduce the buffer,
all_gather the FULL gathered output, reduce_scatter the FULL input, send_recv
the message. A sample's time is the slowest rank's median over timed
repetitions after one warm-up (nccl-tests reports a mean; on a shared host a
median is robust to one descheduled repetition); send_recv is half of a
ping-pong round trip between ranks 0 and 1. CPU ranks run with the thread
count the executor gives them (`threads`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
PROGRESS_PREFIX = "calibrate-comm-progress"


@dataclass(frozen=True)
class CommSample:
    op: str
    n_ranks: int
    size_bytes: int  # nccl-tests convention, see the module docstring
    time_s: float


def measure_collectives(device: str, sizes_bytes: list[int], max_ranks: int, reps: int = 9,
                        threads: int = 1, on_progress: Callable[[int, int], None] | None = None,
                        block: tuple[Any, int, int] | None = None,
                        ) -> tuple[list[CommSample], int | None, dict[str, Any] | None]:
    """Run the benchmark under torchrun with max_ranks local ranks: (samples, other_bytes, blocks).

    block: (ModelSpec, micro-batch, sequence length) to also time one executor
    block plain, under TP and under FSDP on all ranks (`executor.calibrate.blocks`,
    CPU only); blocks is then rank 0's times, else None.

    other_bytes (CUDA only, else None): device memory rank 0 uses beyond
    PyTorch's allocator after the collectives ran: CUDA context + NCCL buffers.
    Nothing is measured when max_ranks < 2.
    """
    from topologies.errors import ExecutionError

    if max_ranks < 2:
        return [], None, None
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as tmp:
        out = Path(tmp) / "comm.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={max_ranks}",
               "-m", "executor.calibrate.comm", "--device", device, "--out", str(out), "--reps", str(reps),
               "--sizes", ",".join(str(s) for s in sizes_bytes)]
        if block is not None and device == "cpu":
            spec_path = Path(tmp) / "model.json"
            spec_path.write_text(json.dumps(block[0].to_json()))
            cmd += ["--block", f"{spec_path}:{block[1]}:{block[2]}"]
        env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(PROGRESS_PREFIX) and on_progress:
                done, total = (int(x) for x in line.split()[1:3])
                on_progress(done, total)
        stderr = proc.stderr.read()  # type: ignore[union-attr]
        if proc.wait() != 0 or not out.exists():
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            raise ExecutionError(f"collective benchmark with {max_ranks} ranks on {device} failed "
                                 f"(exit {proc.returncode}): {tail}")
        result = json.loads(out.read_text())
        return [CommSample(**row) for row in result["samples"]], result["other_bytes"], result.get("blocks")


# ---- the torchrun worker ---------------------------------------------------


def _op_runner(op: str, size_bytes: int, n: int, rank: int, group, device):  # noqa: ANN001
    """A closure running one collective of size_bytes (nccl-tests convention) in group."""
    import torch
    import torch.distributed as dist

    elems = max(n, size_bytes // 4 // n * n)
    if op == "all_reduce":
        buf = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        full, part = torch.empty(elems, device=device), torch.ones(elems // n, device=device)
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    if op == "reduce_scatter":
        full, part = torch.ones(elems, device=device), torch.empty(elems // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full, group=group)
    msg = torch.ones(elems, device=device)

    def ping_pong() -> None:  # ranks 0 and 1 only; the others sit at the barrier
        if rank == 0:
            dist.send(msg, 1, group=group)
            dist.recv(msg, 1, group=group)
        elif rank == 1:
            dist.recv(msg, 0, group=group)
            dist.send(msg, 0, group=group)

    return ping_pong


def _time_collective(fn, reps: int, group, device) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    dist.barrier(group=group)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median.item())


def _worker(device_kind: str, sizes: list[int], reps: int, out: str, block: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples: list[CommSample] = []
    total, done = (world - 1) * len(COMM_OPS) * len(sizes), 0
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))
        for op in COMM_OPS:
            for size in sizes:
                if rank < n and not (op == "send_recv" and n > 2):
                    fn = _op_runner(op, size, n, rank, group, device)
                    t = _time_collective(fn, reps, group, device)
                    t = t / 2 if op == "send_recv" else t
                    samples.append(CommSample(op, n, max(n, size // 4 // n * n) * 4, t))
                done += 1
                if rank == 0:
                    print(f"{PROGRESS_PREFIX} {done} {total}", flush=True)
        dist.barrier()
    blocks = None
    if block:
        from executor.calibrate.blocks import time_blocks

        path, micro_batch, seq_len = block.rsplit(":", 2)
        blocks = time_blocks(path, int(micro_batch), int(seq_len), reps, world)
    if rank == 0:
        other = None
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            other = int(total - free - torch.cuda.memory_reserved(device))
        Path(out).write_text(json.dumps({"samples": [asdict(s) for s in samples], "other_bytes": other,
                                         "blocks": blocks}))
    dist.barrier()  # no rank tears gloo down while another still uses it
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="meshplan calibrate: collective benchmark worker (torchrun)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--block", default=None, help="MODEL_JSON:MICRO_BATCH:SEQ_LEN: also time one block")
    args = parser.parse_args(argv)
    _worker(args.device, [int(s) for s in args.sizes.split(",")], args.reps, args.out, args.block)


if __name__ == "__main__":
    main()
