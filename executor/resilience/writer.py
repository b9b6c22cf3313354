"""DCP's FileSystemWriter that also leaves checksums.json (executor.resilience.integrity) in the checkpoint.

The checksums travel through DCP's own protocol, so they cost no extra
collective and are written exactly when the checkpoint is complete:

  write_data (every rank)  writes its files as FileSystemWriter does, then hashes
                           them and appends one marker WriteResult carrying
                           {file: {"bytes", "sha256"}};
  finish (coordinator)     receives every rank's results (DCP gathers them),
                           takes the markers out before FileSystemWriter.finish
                           writes .metadata, then hashes .metadata and the
                           step's run.json and writes the manifest.

Under async_save both run in DCP's background thread, so hashing never stalls
training.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from executor.resilience.integrity import file_digest, write_manifest

CHECKSUM_KEY = "__meshplan_checksums__"  # the marker's index; never a state-dict key
EXTRA_FILES = (".metadata", "run.json")  # coordinator-written files the manifest also covers


class ChecksumWriter(FileSystemWriter):
    """FileSystemWriter plus checksums.json (see the module docstring)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        names = sorted({r.storage_data.relative_path for r in results if hasattr(r.storage_data, "relative_path")})
        digests = {name: file_digest(Path(self.path) / name) for name in names}
        marker = WriteResult(index=MetadataIndex(CHECKSUM_KEY), size_in_bytes=0, storage_data=digests)
        done: Future[list[WriteResult]] = Future()
        done.set_result([*results, marker])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, dict] = {}
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if r.index.fqn != CHECKSUM_KEY])
            for r in rank_results:
                if r.index.fqn == CHECKSUM_KEY:
                    digests.update(r.storage_data)
        super().finish(metadata, kept)
        root = Path(self.path)
        for name in EXTRA_FILES:
            if (root / name).is_file():
                digests[name] = file_digest(root / name)
        write_manifest(root, digests)
