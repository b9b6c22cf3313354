"""The run options of `meshplan execute`, one codec for every place that writes or reads them.

`meshplan execute` takes them as click options (executor/cli/execute.py),
repeats them on every node of a multi-node launch (planner/export/launch.py:
`--print-launch`, `export torchrun|slurm`), hands them to every worker on
the torchrun command line (executor/launch.py), and the worker reads them
back (executor/worker.py) into the options training runs with
(executor.train). All of them go through `RunFlags.to_argv` and
`RunFlags.from_argv`, so a flag is spelled, defaulted and checked once.

It lives in the planner because the launch exporters need it and the
planner never imports the executor; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from topologies.errors import UsageError


@dataclass(frozen=True)
class RunFlags:
    """What one run of a plan does besides the layout: steps, data, seed, logging, checkpoints, resilience."""

    steps: int = 100
    out: str | None = None  # run directory; `execute` defaults it to runs/<plan name>, workers always get one
    seed: int = 0  # seeds initialization and data: same seed, same model and data on every layout
    data: str | None = None  # text (.jsonl/.txt/.parquet) or token ids (.npy/.bin); None: synthetic tokens
    tokenizer: str | None = None  # tokenizer.json or HF directory for text --data; None: the --init-from directory
    lr: float | None = None  # None: executor.components.optim.default_lr(hidden)
    log_every: int = 10
    checkpoint_every: int = 0  # 0: never
    keep_checkpoints: int | None = None  # None: keep all
    resume: bool = False
    compile: bool = False  # torch.compile each block (executor.parallel.parallelize.apply_compile)
    init_from: str | None = None  # Hugging Face directory to start from; RANDOM_INIT: none; None: the plan's
    save_hf_every: int = 0  # write RUN/hf/step-K/ every K steps and at the last step (0: never)
    # Resilience (executor.resilience): restarts, integrity, preemption, re-planning.
    max_restarts: int = 0  # torchrun restarts of the worker group after a failure (every node repeats it)
    resume_from: str | None = None  # "step-K": resume from that checkpoint instead of the newest valid one
    allow_plan_change: bool = False  # resume with another seq_len / global batch / --steps (LR schedule rebuilt)
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a non-finite loss or gradient norm
    preempt_grace_s: float = 60.0  # after SIGTERM: finish the step, checkpoint, exit within this many seconds
    async_checkpoint: bool = False  # checkpoints through DCP's async_save (written while training goes on)
    replan: bool = False  # re-plan for the ranks present when they differ from the plan's, then resume resharded

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("log_every", 1), ("checkpoint_every", 0), ("keep_checkpoints", 1),
                          ("save_hf_every", 0), ("max_restarts", 0), ("max_nonfinite_steps", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if self.resume_from is not None and not self.resume:  # resuming from a named checkpoint is resuming
            object.__setattr__(self, "resume", True)
        if not 0 < self.preempt_grace_s < float("inf"):  # NaN fails both comparisons
            raise UsageError(f"--preempt-grace-s must be a finite number of seconds > 0, got {self.preempt_grace_s}")

    @property
    def out_dir(self) -> Path:
        if self.out is None:
            raise UsageError("no run directory: pass --out DIR")
        return Path(self.out)

    def replace(self, **changes) -> RunFlags:
        return dataclasses.replace(self, **changes)

    def with_plan_defaults(self, plan) -> RunFlags:
        """The flags whose defaults come from the plan, filled in: the one place for them.

        init_from: the weights `plan --model DIR` recorded (plan.json weights_dir) unless --init-from
        names a directory or `none`. --tokenizer's default, the --init-from directory, follows from it
        (`weights_source`; executor.components.data.run_tokenizer).
        """
        init_from = self.init_from if self.init_from is not None else getattr(plan, "weights_dir", None)
        return self.replace(init_from=init_from)

    @property
    def weights_source(self) -> str | None:
        """The directory a run starts from, or None for meshplan's random initialization."""
        return None if self.init_from in (None, RANDOM_INIT) else self.init_from

    def to_argv(self) -> list[str]:
        """The flags as `meshplan execute` and `executor.worker` read them (steps, seed, log-every always)."""
        argv = ["--steps", str(self.steps), "--seed", str(self.seed), "--log-every", str(self.log_every)]
        for name in ("out", "data", "tokenizer", "lr", "keep_checkpoints", "init_from", "resume_from"):
            value = getattr(self, name)
            if value is not None:
                argv += [_flag(name), str(value)]
        for name in ("checkpoint_every", "save_hf_every", "max_restarts", "max_nonfinite_steps", "preempt_grace_s"):
            value = getattr(self, name)
            if value != getattr(DEFAULT_RUN, name):
                argv += [_flag(name), str(value)]
        return argv + [_flag(name) for name in _SWITCHES if getattr(self, name)]

    @classmethod
    def from_argv(cls, argv: list[str]) -> RunFlags:
        """Parse what `to_argv` wrote (unknown arguments are a UsageError)."""
        parser = argparse.ArgumentParser(prog="meshplan execute", add_help=False, exit_on_error=False)
        for f in dataclasses.fields(cls):
            if f.name in _SWITCHES:
                parser.add_argument(_flag(f.name), action="store_true")
            else:
                parser.add_argument(_flag(f.name), dest=f.name, type=_TYPES[f.name], default=f.default)
        try:
            args, rest = parser.parse_known_args(argv)
        except argparse.ArgumentError as exc:
            raise UsageError(f"run flags: {exc}") from None
        if rest:
            raise UsageError(f"run flags: unknown arguments {rest}")
        return cls(**vars(args))


_TYPES = {"steps": int, "out": str, "seed": int, "data": str, "tokenizer": str, "lr": float, "log_every": int,
          "checkpoint_every": int, "keep_checkpoints": int, "init_from": str, "save_hf_every": int,
          "max_restarts": int, "resume_from": str, "max_nonfinite_steps": int, "preempt_grace_s": float}
_SWITCHES = ("resume", "compile", "allow_plan_change", "async_checkpoint", "replan")  # on/off flags, off by default
RANDOM_INIT = "none"  # --init-from none: meshplan's random initialization even when the plan names weights


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


DEFAULT_RUN = RunFlags()
