"""Checkpoints: atomic, verified, resharding-friendly saves with torch.distributed.checkpoint (DCP).

On disk (executor.resilience.checkpoints): OUT/checkpoints/step-N/ (one complete DCP
checkpoint, its run.json and checksums.json), OUT/checkpoints/latest (one line, "step-N":
what a resume loads first), OUT/checkpoints/.tmp-step-N/ (a save in progress, or one a
crash interrupted), step-N.damaged/ (one that failed verification, set aside).

Crash safety: rank 0 writes run.json into .tmp-step-N/; every rank writes its files there
through executor.resilience.writer.ChecksumWriter (DCP's FileSystemWriter that also records
a sha256 per file); DCP returns only once all data, .metadata and checksums.json are on
disk (fsynced); a barrier; rank 0 renames the directory to step-N/ (atomic on POSIX) and
only then replaces `latest`. A crash anywhere leaves `latest` naming the previous complete
checkpoint; the next save removes stale .tmp-* directories; `keep` prunes old checkpoints
after the pointer moved. Nothing non-finite is saved: a state holding NaN or inf on any
rank raises NonFiniteError instead (exit 4) and `latest` stays where it was.

Asynchronous saves (`save(..., asynchronous=True)`): DCP's async_save copies the state to
host memory, then writes (and hashes) in a background thread over a separate gloo group,
as torchtitan does; `wait()` (collective) finishes it and publishes it as above. One save
is in flight at a time: the next save waits for the previous one first.

Loading (`load`): the newest checkpoint that verifies against its checksums, the older ones
after it (executor.resilience.fallback).

Resharding: keys are the single-process model's parameter FQNs (kept under every
layout); get_model_state_dict strips DDP/FSDP wrappers and the optimizer state is
flattened per parameter (state.<fqn>.<name>, param_groups.<fqn>.<key>), so a pipeline
stage or a ZeRO-1 rank (via ZeroRedundancyOptimizer's local `.optim`, which holds the
whole parameters it owns) saves and loads only its keys, and DCP moves chunks between
DTensor shardings (FSDP, TP) and replicas. `train` (step, data position, LR schedule,
RNG) is one replicated Stateful: rank 0's copy is written, every rank gets it back.

No code runs on load: DCP's reader unpickles .metadata with plain pickle and values
with torch.load(weights_only=False); here the metadata goes through an allow-list of
DCP's classes, torch.Size and dtypes, and every value through weights_only=True.

Test-only fault hook between DCP's write and the rename: executor.faults.crash_in_save.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from executor.faults import crash_in_save, disarm
from executor.parallel.expert import as_sharded_state
from executor.resilience import checkpoints as dirs
from executor.resilience.agree import agree as _agree
from executor.resilience.agree import barrier as _barrier
from executor.resilience.agree import distributed as _distributed
from executor.resilience.agree import on_rank0 as _on_rank0
from executor.resilience.agree import rank as _rank
from executor.resilience.agree import refuse_non_finite as _refuse_non_finite
from executor.resilience.checkpoints import CHECKPOINTS, LATEST, STEP_RE, complete_steps  # noqa: F401 (re-exported)
from executor.resilience.contract import write_run_info
from executor.resilience.fallback import load_newest_valid
from executor.resilience.writer import ChecksumWriter
from topologies.errors import ExecutionError, UsageError
from topologies.hardware import GIB
from topologies.terminal import log

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointManager:
    """Save and restore {"model", "optim", "train"} under OUT/checkpoints/.

    `app_state["model"]` is a module or a list of modules (pipeline stages on
    this rank); `app_state["optim"]` an optimizer or a list, one per module
    (or absent); `app_state["train"]` a Stateful (or absent). save, wait and
    load are collective: every rank calls them. `run_info` is written as each
    checkpoint's run.json (executor.resilience.contract); `create` makes the
    directory now (a run that checkpoints), else at the first save.
    """

    def __init__(self, out_dir: str | Path, keep: int | None = None, run_info: dict | None = None,
                 create: bool = True) -> None:
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise UsageError(f"--keep-checkpoints must be a positive integer, got {keep!r}")
        self.root = Path(out_dir) / CHECKPOINTS
        self.keep = keep
        self.run_info = run_info
        self.pending: tuple[int, Path, Path, Any] | None = None  # (step, tmp, final, future) of an async save
        self.last_saved: int | None = None  # the newest step this process saved or loaded
        if not create:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"cannot create the checkpoint directory {str(self.root)!r}: {exc.strerror}; "
                "pass a writable --out"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise UsageError(f"checkpoint directory {str(self.root)!r} is not writable; pass a writable --out")

    # ---- save -------------------------------------------------------------

    def save(self, step: int, app_state: dict[str, Any], asynchronous: bool = False, group=None) -> Path:
        """Write step-N atomically; returns its path. Raises ExecutionError on every rank if any rank fails.

        asynchronous: start DCP's async_save over `group` (a gloo group) and return once the state is copied
        to host memory; `wait()` publishes it.
        """
        self.wait()
        tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
        _agree(_on_rank0(lambda: self._prepare(tmp, step)), f"cannot prepare checkpoint {tmp}")
        state, _ = _collect(app_state)
        _refuse_non_finite(state, step)
        writer = ChecksumWriter(tmp)
        try:
            with _single_process_is_intended():
                if asynchronous and _distributed():
                    future = dcp.async_save(state, storage_writer=writer, process_group=group)
                    self.pending = (step, tmp, final, future)
                    return final
                dcp.save(state, storage_writer=writer, no_dist=not _distributed())
        except (CheckpointException, OSError) as exc:
            raise self._write_error(step, exc) from None
        self._publish_everywhere(step, tmp, final)
        return final

    def wait(self) -> None:
        """Finish the async save in flight (if any) and publish it; collective."""
        if self.pending is None:
            return
        step, tmp, final, future = self.pending
        self.pending = None
        try:
            future.result()
        except (CheckpointException, OSError) as exc:
            raise self._write_error(step, exc) from None
        self._publish_everywhere(step, tmp, final)

    def pending_done(self) -> bool:
        """True when an async save is in flight and this rank's part of it has finished (no collective)."""
        return self.pending is not None and self.pending[3].done()

    def _write_error(self, step: int, exc: BaseException) -> ExecutionError:
        return ExecutionError(f"cannot write checkpoint step-{step} to {str(self.root)!r}: {_reason(exc)}; "
                              f"{_free_space(self.root)}: free space or pass another --out")

    def _publish_everywhere(self, step: int, tmp: Path, final: Path) -> None:
        crash_in_save(step, _rank())
        _barrier()
        _agree(_on_rank0(lambda: self._publish(step, tmp, final)), f"cannot publish checkpoint step-{step}")
        self.last_saved = step

    def _prepare(self, tmp: Path, step: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        if self.run_info is not None:
            write_run_info(tmp, self.run_info, step)

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        if final.exists():  # a step saved again after a restart: the old copy goes to the trash
            final.rename(self.root / f".tmp-old-step-{step}")
        tmp.rename(final)
        dirs.point_latest(self.root, step)
        self._prune(step)

    def _prune(self, latest: int) -> None:
        if self.keep is None:
            return
        steps = [s for s in complete_steps(self.root) if s != latest]
        for old in steps[: max(0, len(steps) - (self.keep - 1))]:
            shutil.rmtree(self.root / f"step-{old}", ignore_errors=True)

    # ---- load -------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The step `latest` names; the newest complete checkpoint if the pointer is missing or stale."""
        return latest_step(self.root)

    def load_latest(self, app_state: dict[str, Any]) -> int:
        """load() of the newest valid checkpoint."""
        return self.load(app_state)

    def load(self, app_state: dict[str, Any], step: int | None = None, say_none: bool = True) -> int:
        """Load the newest valid checkpoint (or exactly step-`step`) into app_state in place.

        Returns its step, or 0 when there is none (said on the console when `say_none`). Which checkpoints
        are tried, and what happens to one that fails verification: executor.resilience.fallback.
        """
        loaded = load_newest_valid(self.root, lambda path: self._try_load(path, app_state), step, say_none)
        if loaded:
            self.last_saved = loaded
            disarm()  # test-only fault hooks fire in a run's first life only
        return loaded

    def _try_load(self, path: Path, app_state: dict[str, Any]) -> str | None:
        """Load path into app_state (collective); None, or why DCP could not."""
        state, parts = _collect(app_state)
        try:
            with _single_process_is_intended():
                dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=not _distributed())
        except (CheckpointException, UsageError) as exc:
            return _reason(exc) if isinstance(exc, CheckpointException) else str(exc)
        _restore(state, parts)
        return None


def latest_step(root: Path) -> int | None:
    """The step root/latest names, or the newest complete one when the pointer is missing or stale."""
    return dirs.latest_step(root, log)


# ---- state dicts ------------------------------------------------------------


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _local_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state to save: for ZeroRedundancyOptimizer, its local `.optim`.

    ZeRO-1 keeps this rank's whole parameters in a plain optimizer and copies
    its own param_groups' hyperparameters (which an LR scheduler changes) into
    it only at the next step(); they are copied here too, or the saved lr
    would be one scheduler step behind.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer  # imported lazily: it jit-compiles on import

    from executor.components.zero1 import Zero1Optimizer

    if not isinstance(optim, (ZeroRedundancyOptimizer, Zero1Optimizer)):
        return optim
    for outer, inner in zip(optim.param_groups, optim.optim.param_groups, strict=True):
        inner.update({k: v for k, v in outer.items() if k != "params"})
    return optim.optim


def _collect(app_state: dict[str, Any]) -> tuple[dict[str, Any], list[tuple]]:
    """The DCP state dict {"model", "optim", "train"} and, per module, (module, optimizer, its keys).

    Before a load this is the template DCP fills in place; an optimizer that
    has not stepped yet gets its state created by a zero-lr step
    (get_optimizer_state_dict), which the load then overwrites.
    """
    unknown = set(app_state) - {"model", "optim", "train"}
    if unknown or "model" not in app_state:
        raise ExecutionError(f"app_state needs 'model' and may hold 'optim', 'train'; got {sorted(app_state)}")
    models, optims = _as_list(app_state["model"]), _as_list(app_state.get("optim"))
    if optims and len(optims) != len(models):
        raise ExecutionError(f"app_state has {len(models)} model parts but {len(optims)} optimizers; pass one per part")
    state: dict[str, Any] = {"model": {}}
    parts = []
    for i, module in enumerate(models):
        optim = optims[i] if optims else None
        msd = get_model_state_dict(module)
        osd = get_optimizer_state_dict(module, _local_optimizer(optim), options=_FLAT) if optim is not None else {}
        msd, experts = as_sharded_state(module, msd)  # expert parallel: each rank's experts, not replicas
        osd, expert_moments = as_sharded_state(module, osd, prefix="state.")
        state["model"].update(msd)
        if optim is not None:
            state.setdefault("optim", {}).update(osd)
        parts.append((module, optim, list(msd), list(osd), experts | expert_moments))
    if app_state.get("train") is not None:
        state["train"] = app_state["train"]
    return state, parts


def _local_values(group: dict[str, Any], keys: list[str], experts: dict[str, Any]) -> dict[str, Any]:
    """The values of `keys`, the expert weights as the module holds them (executor.parallel.expert.as_sharded_state:
    the DTensors DCP filled share their storage)."""
    return {k: experts[k] if k in experts else group[k] for k in keys}


def _restore(state: dict[str, Any], parts: list[tuple]) -> None:
    """Hand each module and optimizer its own keys back (DCP filled `state` in place)."""
    for module, optim, model_keys, optim_keys, experts in parts:
        set_model_state_dict(module, _local_values(state["model"], model_keys, experts))
        if optim is None:
            continue
        local = _local_optimizer(optim)
        set_optimizer_state_dict(module, local, _local_values(state["optim"], optim_keys, experts), options=_FLAT)
        if local is not optim:  # ZeRO steps with its own param_groups: give them the loaded lr, betas...
            for outer, inner in zip(optim.param_groups, local.param_groups, strict=True):
                if inner["params"]:
                    outer.update({k: v for k, v in inner.items() if k != "params"})


# ---- reading without executing code ---------------------------------------


_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when saved with a Path
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only the classes DCP's .metadata is made of (see the docs' "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise UsageError(f"{str(path.parent)!r} is not a checkpoint: it has no .metadata") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise UsageError(f"checkpoint metadata {str(path)!r} is corrupt or not DCP's: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise UsageError(f"checkpoint metadata {str(path)!r} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# Train-state keys added after checkpoints were first written (WarmupCosine's rescheduling fields): a
# checkpoint without them meant the plain warm-up cosine, which is what the template already holds.
OPTIONAL_KEYS = re.compile(r"^train\.lr_scheduler\.lr_lambdas\.\d+\.(decay_from|decay_factor)$")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True), and leaves the
    template's value for an OPTIONAL_KEYS key the checkpoint does not hold."""

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            known = metadata.state_dict_metadata
            self.state_dict = {k: v for k, v in self.state_dict.items() if k in known or not OPTIONAL_KEYS.match(k)}

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def consolidate(step_dir: str | Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict (FQN -> tensor) of a checkpoint, or only `keys` of it, read on one process."""
    step_dir = Path(step_dir)
    reader = SafeReader(step_dir)
    metadata = reader.read_metadata()
    wanted = None if keys is None else {f"model.{k}" for k in keys}
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata) and (wanted is None or key in wanted)
    }
    if not state:
        raise UsageError(f"checkpoint {str(step_dir)!r} holds no model tensors")
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        raise UsageError(f"cannot read checkpoint {str(step_dir)!r}: {_reason(exc)}") from None
    return {key[len("model."):]: tensor for key, tensor in state.items()}


def _reason(exc: BaseException) -> str:
    """One line for a (CheckpointException of) OSError: which rank, what the OS said."""
    if isinstance(exc, CheckpointException):
        rank, (inner, _trace) = sorted(exc.failures.items())[0]
        return f"rank {rank}: {_reason(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})"
    first = str(exc).splitlines()[0] if str(exc) else "no details: a file is probably truncated or damaged"
    if "unexpected pos" in first:  # torch.save's zip writer after a short write: the OS error is lost
        return f"a write was cut short ({first.split('] ')[-1].strip(' .')})"
    return f"{type(exc).__name__}: {first}"


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / GIB:.2f} GiB free there"
    except OSError:
        return "free space unknown"


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns on every no_dist call; one process (world of 1, export) is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield

