"""Export a plan to the engines people already run.

Many users keep their training stack and want meshplan's answer in its
language. `export_plan(plan, target)` turns a Plan into one file for one
engine, plus the list of what that engine cannot express: an export never
silently drops part of a plan. Each target is a module of its own:

  torchtitan  job config TOML (0.2) or Python config module (0.3) (planner.export.torchtitan)
  megatron    Megatron-LM arguments (planner.export.megatron)
  deepspeed   ds_config.json + mpu module (+ hostfile with hosts) (planner.export.deepspeed)
  accelerate  accelerate config YAML (planner.export.accelerate)
  torchrun    per-node launch script running `meshplan execute` (planner.export.launch)
  slurm       sbatch script running `meshplan execute` (planner.export.launch)

A target whose file format or option names changed between releases takes a
`target_version` (`meshplan export --target-version`): torchtitan 0.2 / 0.3,
DeepSpeed before / from 0.19.7 (MiCS removed), Megatron-Core releases.
What a target cannot run at all is refused with ExportRefused (exit 2);
what it can run only in a nearby form is exported in that form, with a note
that says what changed and what simulate_step predicts it costs.

Nothing here imports torch: exporting is part of the planning path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan
from topologies.errors import UsageError, nearest

TARGETS: tuple[str, ...] = ("torchtitan", "megatron", "deepspeed", "accelerate", "torchrun", "slurm")
# The release each target's export is written for when no --target-version is given,
# and the oldest / first-unsupported releases accepted (the versions tests/consumers installs).
DEFAULT_VERSIONS = {"torchtitan": "0.2", "megatron": "0.16", "deepspeed": "0.19.8", "accelerate": "1.15"}
VERSION_RANGES = {"torchtitan": ((0, 2), (0, 4)), "megatron": ((0, 12), (1,)),
                  "deepspeed": ((0, 16, 4), (1,)), "accelerate": ((1, 10), (2,))}


class ExportRefused(UsageError):
    """The target cannot run this plan in any nearby form; the message says why and what to use. Exit 2."""


@dataclass(frozen=True)
class ExportResult:
    """One exported file, the files that go with it, and what could not be expressed."""

    target: str
    text: str  # the main file's content
    filename: str  # suggested file name for the main file
    notes: tuple[str, ...] = ()  # "could not express" sentences, each naming the plan's values
    extra_files: tuple[tuple[str, str], ...] = ()  # (suggested name, content), e.g. DeepSpeed's hostfile

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise UsageError(f"export target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if not self.filename or "/" in self.filename:
            raise UsageError(f"export file name must be a plain, non-empty name, got {self.filename!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "filename": self.filename,
            "text": self.text,
            "notes": list(self.notes),
            "extra_files": [{"filename": name, "text": text} for name, text in self.extra_files],
        }


def check_hosts(plan: Plan, hosts: Sequence[str] | None) -> tuple[str, ...]:
    """Validate --hosts: one non-empty name per node of the plan's cluster, no repeats."""
    if not hosts:
        return ()
    names = tuple(h.strip() for h in hosts)
    n_nodes = plan.cluster.n_nodes
    if any(not h or any(c.isspace() for c in h) for h in names):
        raise UsageError(f"--hosts must be names without spaces separated by commas, got {list(hosts)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--hosts lists a host twice: {list(names)}")
    if len(names) != n_nodes:
        raise UsageError(
            f"--hosts names {len(names)} hosts but the plan runs on {n_nodes} nodes "
            f"({plan.cluster.n_nodes} x {plan.cluster.gpus_per_node} GPUs): give exactly {n_nodes}"
        )
    return names


def target_version(target: str, version: str | None) -> tuple[int, ...]:
    """The release `target` is exported for: `version` checked against VERSION_RANGES, or the default."""
    from planner.export.common import parse_version

    if target not in DEFAULT_VERSIONS:
        if version is not None:
            raise UsageError(f"--target-version applies to {', '.join(DEFAULT_VERSIONS)}; the {target} export "
                             "runs `meshplan execute`, which has no versions: drop the flag")
        return ()
    parsed = parse_version(version if version is not None else DEFAULT_VERSIONS[target])
    low, high = VERSION_RANGES[target]
    if not low <= parsed < high:
        show = ".".join
        raise UsageError(f"--target-version {version} for {target}: meshplan writes {target} "
                         f"{show(map(str, low))} up to (not including) {show(map(str, high))}")
    return parsed


def export_plan(plan: Plan, target: str, hosts: Sequence[str] | None = None,
                plan_path: str = "plan.json", version: str | None = None) -> ExportResult:
    """Export `plan` for `target` (one of TARGETS), for release `version` of it (default DEFAULT_VERSIONS).

    `hosts` names the nodes in order (node 0 first); it fills DeepSpeed's
    hostfile and the rendezvous address of the launch scripts. `plan_path`
    is the plan file the torchrun/slurm scripts pass to `meshplan execute`.
    Raises ExportRefused when the target cannot run the plan in any form.
    """
    from planner.export import accelerate, deepspeed, launch, megatron, torchtitan

    if target not in TARGETS:
        raise UsageError(f"unknown export target {target!r}{nearest(target, TARGETS)}; use one of {', '.join(TARGETS)}")
    names = check_hosts(plan, hosts)
    release = target_version(target, version)
    if target == "torchtitan":
        return torchtitan.export(plan, release)
    if target == "megatron":
        return megatron.export(plan, release)
    if target == "deepspeed":
        return deepspeed.export(plan, names, release)
    if target == "accelerate":
        return accelerate.export(plan, names)
    if target == "torchrun":
        return launch.export_torchrun(plan, plan_path, names)
    if target == "slurm":
        return launch.export_slurm(plan, plan_path, names)
    raise UsageError(f"unknown export target {target!r}{nearest(target, TARGETS)}; use one of {', '.join(TARGETS)}")
