"""NVIDIA DGX Cloud Benchmarking's dense runs as bench/accuracy_dgxc.py scores them: bench/rows/dgxc.

185 measured pre-training runs transcribed from the dgxc-benchmarking READMEs
(shared/data/published/dgxc.json, releases v24.11.1-v25.05.04; bf16 and fp8,
H100 SXM and GB200 NVL72): one row file each, holding the `meshplan plan`
flags that state the run (bench/rows/dgxc/README.md says how each source's
statements became flags, and which runs cannot be stated) and what it
measured. This module reads them as DgxcRow, the view the bench groups by
(stack, model, GPU, precision); predictions go through `meshplan simulate`'s
path (bench/rowset.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "bench"))

import rowset  # noqa: E402

from planner.cli.row import Row  # noqa: E402

FAMILY = {"h100-sxm": "h100", "gb200": "gb200"}


@dataclass(frozen=True)
class DgxcRow:
    """A dense DGX Cloud row: its row file and the bench's grouping of it."""

    row: Row

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def source(self) -> str:  # nemo | maxtext | paxml
        return self.row.bench["source"]

    @property
    def model(self) -> str:  # the source's model name (the hold-out unit)
        return self.row.bench["model"]

    @property
    def gpu(self) -> str:  # h100-sxm | gb200
        return self.row.bench["gpu"]

    @property
    def precision(self) -> str:
        return self.row.bench["precision"]

    @property
    def tp_comm_overlap(self) -> bool:  # the recipe overlapped TP communication with its GEMMs
        return self.row.bench["tp_comm_overlap"]

    @property
    def inconsistent(self) -> str:
        return self.row.bench.get("inconsistent", "")

    @property
    def expressible(self) -> bool:
        return self.row.expressible

    @property
    def reason(self) -> str:
        return self.row.not_expressible

    @property
    def measured_s(self) -> float:
        return self.row.measured_s

    @property
    def training(self):
        return self.row.plan.training

    @property
    def layout(self):
        return self.row.plan.layout if self.expressible else None

    @property
    def engine(self) -> str:
        return self.row.plan.engine

    def cluster(self):
        return self.row.plan.cluster


def load_dense_rows(tp_overlap: bool = True) -> list[DgxcRow]:
    """Every dense row, expressible or not; tp_overlap False prices the NeMo rows' TP collectives plainly
    (their flags without --async-tp and its userbuffers config: bench/accuracy_dgxc.py --no-tp-overlap)."""
    rows = rowset.rows("dgxc")
    return [DgxcRow(r if tp_overlap else rowset.without_tp_overlap(r)) for r in rows]
