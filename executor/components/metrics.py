"""What a run reports: metrics.jsonl, summary.json and the progress line (rank 0 only).

metrics.jsonl holds one JSON object per optimizer step with the keys of
ARCHITECTURE.md: step (1-based), loss (global-batch mean), lr, step_time_s,
tokens_per_s, mfu, peak_memory_bytes; plus grad_norm (before clipping).
A resumed run appends; a step run twice appears twice and the last entry
counts (`read_metrics`).

MFU = model FLOPs per token * tokens/s / (world size * dense peak FLOP/s of
the planned device for the compute dtype). Model FLOPs per token are
`ModelSpec.model_flops_per_token` (6N + attention, PaLM appendix B; no
recomputation); the peak is the spec-sheet number in topologies/hardware.py.
peak_memory_bytes is the worst rank's: torch.cuda.max_memory_allocated on
GPUs, the process's peak resident set (getrusage ru_maxrss) on CPU ranks.
GPU records also carry peak_reserved_bytes (torch.cuda.max_memory_reserved),
the figure planner.memory.reserved predicts and torchtitan reports.

Records are read back from the device in windows (MetricsWindow): a step
keeps its loss and gradient norm on the device, and the loop reads every
pending step at once on the steps it reads at (the logging steps, checkpoint
steps and the last step: executor.train), so a GPU's queue never waits for
the host in between. The read waits for the window's kernels, so the
window's wall time is what its steps took; each step of a window gets the
window's mean step time (the first step of a run, warm-up and compilation
included, is a window of its own, as it logs).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from planner.plan import Plan
from topologies.terminal import dumps_json

METRIC_KEYS = ("step", "loss", "lr", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes this rank has used so far (see module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak bytes the CUDA caching allocator has reserved (torch.cuda.max_memory_reserved; what torchtitan
    logs as its memory); None on CPU ranks, which have no caching allocator."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


class MetricsWindow:
    """Steps whose records still hold device values, read back together (module docstring)."""

    def __init__(self, plan: Plan, device: torch.device, peak_flops: float) -> None:
        self.plan, self.device, self.peak_flops = plan, device, peak_flops
        self.pending: list[tuple[int, float, torch.Tensor, torch.Tensor, int, int | None]] = []
        self.started: float | None = None
        self.mean_step_s: float | None = None  # of the last window read, the same on every rank

    def begin_step(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A finished step: its global loss and gradient norm on the device; this rank's allocator peaks so
        far (host-side counters, no device read)."""
        self.pending.append((step, lr, loss.detach(), grad_norm.detach(), peak_memory_bytes(self.device),
                             peak_reserved_bytes(self.device)))

    def read(self) -> list[dict[str, Any]]:
        """Every pending step's record, in step order (collective: every rank reads at the same steps).

        One host read of the device values (it waits for the window's kernels), then one all-reduce MAX of
        the worst rank's peaks and the window's wall time (so every rank agrees on both) and its read.
        """
        if not self.pending:
            return []
        import torch.distributed as dist

        values = torch.stack([torch.stack([loss.double(), norm.double().to(loss.device)])
                              for _, _, loss, norm, _, _ in self.pending]).tolist()
        elapsed_us = int((time.perf_counter() - (self.started or time.perf_counter())) * 1e6)
        local = [[peak, reserved or 0, elapsed_us] for _, _, _, _, peak, reserved in self.pending]
        agreed = torch.tensor(local, dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        agreed = agreed.tolist()
        step_time_s = agreed[0][2] / 1e6 / len(self.pending)
        tokens_per_s = self.plan.training.tokens_per_step / step_time_s if step_time_s > 0 else 0.0
        records = []
        for (step, lr, _, _, _, reserved), (loss, norm), (peak, reserved_max, _) in zip(self.pending, values, agreed,
                                                                                           strict=True):
            record = {"step": step, "loss": loss, "lr": lr, "step_time_s": step_time_s,
                      "tokens_per_s": tokens_per_s, "mfu": mfu(self.plan, tokens_per_s, self.peak_flops),
                      "peak_memory_bytes": peak, "grad_norm": norm}
            if reserved is not None:  # GPUs: the caching allocator's high-water mark (planner.memory.reserved)
                record["peak_reserved_bytes"] = reserved_max
            records.append(record)
        self.pending, self.started, self.mean_step_s = [], None, step_time_s
        return records


def mfu(plan: Plan, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization of the whole job (see module docstring)."""
    per_token = plan.model.model_flops_per_token(plan.training.seq_len)
    return per_token * tokens_per_s / (plan.world_size * peak_flops)


class MetricsLog:
    """Appends one JSON line per step to OUT/metrics.jsonl (truncated first unless resuming).

    The first record after a resume carries `"resumed": true`: that step pays
    the warm-up again, and the measurement leaves it out.
    """

    def __init__(self, out_dir: Path, append: bool) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.mark_resume = append
        if not append:
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.mark_resume:
            record = {**record, "resumed": True}
            self.mark_resume = False
        try:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk or a lost mount: one line naming the file, not a traceback
            from topologies.errors import ExecutionError

            raise ExecutionError(f"cannot append step {record.get('step')} to {self.path}: "
                                 f"{exc.strerror or exc} (errno {exc.errno}); free space or pass another --out; "
                                 "the run resumes from its last checkpoint with --resume") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records by step, the last entry of a step winning (see executor.components.measure)."""
    from executor.components.measure import read_metrics as read

    return read(path)


def summarize(plan: Plan, records: list[dict[str, Any]], device: str,
              interrupted_at_step: int | None = None) -> dict[str, Any]:
    """Measured figures next to the plan's prediction, and their ratios.

    The figures are `executor.components.measure.measure`'s, with the warm-up
    rule `meshplan report` uses, so summary.json and the report agree.
    """
    from executor.components.measure import measure, warmup_steps

    skip = warmup_steps(len(records), None)
    measured = measure(plan, records, skip)
    measured["warmup_steps"] = skip
    summary: dict[str, Any] = {"device": device, "world_size": plan.world_size, "measured": measured,
                               "predicted": None, "measured_over_predicted": None}
    if interrupted_at_step is not None:
        summary["interrupted_at_step"] = interrupted_at_step
    if plan.prediction is not None:
        pred = plan.prediction
        predicted = {"step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu,
                     "peak_memory_bytes": pred.peak_memory_bytes}
        summary["predicted"] = predicted
        summary["measured_over_predicted"] = {k: (measured[k] / v if v and measured[k] is not None else None)
                                              for k, v in predicted.items()}
    return summary


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    from topologies.files import write_text

    write_text(out_dir / "summary.json", dumps_json(summary) + "\n", what="summary")


class ProgressLine:
    """Rank 0's console: a live rich bar on a terminal, plus a line every `log_every` steps."""

    def __init__(self, total_steps: int, first_step: int, log_every: int) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.total, self.log_every, self.start = total_steps, max(1, log_every), time.perf_counter()
        self.first = first_step
        self.progress = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                     console=self.console, transient=True)
            self.task = self.progress.add_task("train", total=total_steps, completed=first_step - 1, info="")
            self.progress.start()

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"]
        done = step - self.first + 1
        eta_s = (time.perf_counter() - self.start) / done * (self.total - step)
        loss = f"{record['loss']:.4f}" if record.get("loss") is not None else "non-finite (update skipped)"
        info = f"loss {loss}  {record['tokens_per_s']:,.0f} tok/s"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=info)
        if step % self.log_every == 0 or step == self.total or step == self.first:
            self.console.print(
                f"step {step}/{self.total}  {info}  lr {record['lr']:.2e}  mfu {record['mfu']:.2%}  "
                f"grad norm {_number(record['grad_norm'], '.3f')}  ETA {eta_s:.0f}s", soft_wrap=True
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        sys.stderr.flush()


def _number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
