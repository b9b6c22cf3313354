"""Checkpoints: atomic, resharding-friendly saves with torch.distributed.checkpoint (DCP).

On disk: OUT/checkpoints/step-N/ (one complete DCP checkpoint), OUT/checkpoints/latest
(one line, "step-N": what a resume loads), OUT/checkpoints/.tmp-step-N/ (a save in
progress, or one a crash interrupted).

Crash safety: every rank writes into .tmp-step-N/; DCP returns only once all data and
rank 0's .metadata are on disk (fsynced); a barrier; rank 0 renames the directory to
step-N/ (atomic on POSIX) and only then replaces `latest` (temporary file + os.replace).
A crash anywhere leaves `latest` naming the previous complete checkpoint; the next save
removes stale .tmp-* directories; `keep` prunes old checkpoints after the pointer moved.

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

Test-only fault hook between dcp.save and the rename: executor.faults.crash_in_save.
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
import torch.distributed as dist
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

from executor.faults import crash_in_save
from executor.parallel.expert import as_sharded_state
from topologies.errors import ExecutionError, UsageError
from topologies.hardware import GIB
from topologies.terminal import log

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointManager:
    """Save and restore {"model", "optim", "train"} under OUT/checkpoints/.

    `app_state["model"]` is a module or a list of modules (pipeline stages on
    this rank); `app_state["optim"]` an optimizer or a list, one per module
    (or absent); `app_state["train"]` a Stateful (or absent). save and
    load_latest are collective: every rank calls them.
    """

    def __init__(self, out_dir: str | Path, keep: int | None = None) -> None:
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise UsageError(f"--keep-checkpoints must be a positive integer, got {keep!r}")
        self.root = Path(out_dir) / CHECKPOINTS
        self.keep = keep
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

    def save(self, step: int, app_state: dict[str, Any]) -> Path:
        """Write step-N atomically; returns its path. Raises ExecutionError on every rank if any rank fails."""
        tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
        _agree(_on_rank0(lambda: self._prepare(tmp)), f"cannot prepare checkpoint {tmp}")
        state, _ = _collect(app_state)
        try:
            with _single_process_is_intended():
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
        except (CheckpointException, OSError) as exc:
            raise ExecutionError(
                f"cannot write checkpoint step-{step} to {str(self.root)!r}: {_reason(exc)}; "
                f"{_free_space(self.root)}: free space or pass another --out"
            ) from None
        crash_in_save(step, _rank())
        _barrier()
        _agree(_on_rank0(lambda: self._publish(step, tmp, final)), f"cannot publish checkpoint step-{step}")
        return final

    def _prepare(self, tmp: Path) -> None:
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        if final.exists():  # a step saved again after a restart: the old copy goes to the trash
            final.rename(self.root / f".tmp-old-step-{step}")
        tmp.rename(final)
        pointer = self.root / f".tmp-{LATEST}"
        with open(pointer, "w") as f:
            f.write(f"{final.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, self.root / LATEST)
        _fsync_dir(self.root)
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
        """Load the latest checkpoint into app_state in place; returns its step, or 0 when there is none."""
        step = _broadcast(self.latest_step() if _rank() == 0 else None)
        if step is None:
            if _rank() == 0:
                log(f"checkpoint: none under {str(self.root)!r}; starting from step 0")
            return 0
        path = self.root / f"step-{step}"
        state, parts = _collect(app_state)
        try:
            with _single_process_is_intended():
                dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=not _distributed())
        except CheckpointException as exc:
            raise UsageError(
                f"cannot resume from {str(path)!r}: {_reason(exc)}; a checkpoint of another model, or damaged? "
                "use a new --out, or run without --resume"
            ) from None
        _restore(state, parts)
        if _rank() == 0:
            log(f"checkpoint: resumed from {path}")
        return step


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under root (a step-N directory holding .metadata)."""
    found = [int(m.group(1)) for p in root.iterdir() if (m := STEP_RE.match(p.name))] if root.is_dir() else []
    return sorted(s for s in found if (root / f"step-{s}" / ".metadata").is_file())


def latest_step(root: Path) -> int | None:
    """The step root/latest names, or the newest complete one when the pointer is missing or stale."""
    complete = complete_steps(root)
    try:
        match = STEP_RE.match((root / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):
        match = None
    if match and int(match.group(1)) in complete:
        return int(match.group(1))
    if complete:
        log(f"checkpoint: pointer {root / LATEST} missing or stale; using step-{complete[-1]}")
    return complete[-1] if complete else None


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


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True)."""

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


# ---- process group helpers --------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's value on every rank (our own objects, never read from disk)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0(fn) -> str | None:
    """Run fn on rank 0 only; its OSError becomes a message instead of an exception."""
    if _rank() != 0:
        return None
    try:
        fn()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or ''})"
    return None


def _agree(error: str | None, what: str) -> None:
    """Every rank learns rank 0's outcome, so a failure there raises everywhere instead of hanging."""
    error = _broadcast(error)
    if error:
        raise ExecutionError(f"{what}: {error}")


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
