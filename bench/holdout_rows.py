"""The hold-out rows bench/accuracy_holdout.py scores: bench/rows/holdout, read as PerfRow.

Megatron-Bridge 25.09/25.11/26.02 and NeMo 24.07 performance summaries
(bench/data/nemo_perf_summary.json) and torchtitan's published tables
(bench/data/torchtitan_perf.json), one row file per run: the `meshplan plan`
flags that state it and what it measured (bench/rows/holdout/README.md says
how each source's statements became flags, and which runs cannot be stated).
PerfRow holds the row's plan (what `meshplan simulate ROW.json` simulates) and
the bench's grouping (source, release, GPU, precision, model).

A row is INCONSISTENT, and left out of the MAPE, when its Model TFLOP/s per
token differs by more than 3% from the median of the same model and
sequence length in the same source (a misprinted throughput or layout), or
when the table's GA disagrees with GBS / (dp * MBS).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import rowset  # noqa: E402

from planner.cli.row import Row  # noqa: E402
from planner.layout import Layout  # noqa: E402
from planner.model.spec import ModelSpec  # noqa: E402
from planner.training import TrainingSpec  # noqa: E402
from topologies.cluster import Cluster  # noqa: E402
from topologies.cluster_load import load_cluster  # noqa: E402

DATA = (REPO / "bench" / "data" / "nemo_perf_summary.json", REPO / "bench" / "data" / "torchtitan_perf.json")
CLUSTERS = {"a100": "dgx-a100-80g", "h100": "dgx-h100", "h200": "dgx-h200", "b200": "dgx-b200", "b300": "dgx-b300",
            "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
FLOPS_TOLERANCE = 0.03  # per-token Model TFLOP/s spread allowed within one model and sequence length


@dataclass(frozen=True)
class PerfRow:
    """A hold-out row: its plan (model, training, layout, engine: what its flags state) and its grouping."""

    row: Row
    id: str
    source: str
    release: str
    gpu: str  # the system's GPU: a100 | h100 | h200 | b200 | b300 | gb200 | gb300
    precision: str
    model: str
    moe: bool
    model_spec: ModelSpec | None
    training: TrainingSpec | None
    layout: Layout | None  # None: not expressible (reason)
    gpus: int
    measured_s: float
    tflops_per_token: float | None  # the source's Model TFLOP/s per GPU over its tokens/s per GPU
    engine: str = "megatron"
    memory_gib: float | None = None  # measured, where the source gives it
    unmodelled: str = ""  # recipe features the planner has no term for
    reason: str = ""
    ga_mismatch: bool = False  # the table's GA disagrees with GBS / (dp * MBS)
    moe_recipe: str = ""  # MoE recipe options of the row's Megatron-Bridge preset not modelled (bench/rows/holdout/README.md)

    @property
    def expressible(self) -> bool:
        return self.layout is not None

    def cluster(self) -> Cluster:
        """The row's --cluster; for a row that cannot be stated, its GPU's catalogued system."""
        return self.row.plan.cluster if self.expressible else load_cluster(CLUSTERS[self.gpu], self.gpus)


def _perf_row(row: Row) -> PerfRow:
    b = row.bench
    plan = row.plan if row.expressible else None
    gpus = b["gpus"]
    return PerfRow(row=row, id=row.id, source=b["source"], release=b["release"], gpu=b["gpu"], precision=b["precision"],
                   model=b["model"], moe=b["moe"], model_spec=plan.model if plan else None,
                   training=plan.training if plan else None, layout=plan.layout if plan else None, gpus=gpus,
                   measured_s=row.measured_s, tflops_per_token=b.get("tflops_per_token"),
                   engine=plan.engine if plan else "", memory_gib=row.measured.get("peak_memory_gib"),
                   unmodelled=b.get("unmodelled", ""), reason=row.not_expressible, ga_mismatch=b["ga_mismatch"],
                   moe_recipe=b.get("moe_recipe", ""))


def load_rows(tp_overlap: bool = True) -> list[PerfRow]:
    """Every row; tp_overlap False prices the Megatron-Bridge rows' TP collectives without the overlap their
    scripts ran (--no-tp-overlap, and the GB200 fit's inputs: bench/accuracy_dgxc.bridge_gb200_rows)."""
    rows = rowset.rows("holdout")
    return [_perf_row(r if tp_overlap else rowset.without_tp_overlap(r)) for r in rows]


def inconsistent(rows: list[PerfRow]) -> set[str]:
    """Rows whose Model TFLOP/s per token is off the median of their model, sequence length and source."""
    groups: dict[tuple[str, str, float], list[PerfRow]] = {}
    for r in rows:
        if r.tflops_per_token is not None:
            groups.setdefault((r.source, r.model, r.training.seq_len if r.training else 0), []).append(r)
    out = set()
    for rs in groups.values():
        mid = statistics.median(r.tflops_per_token for r in rs)
        out |= {r.id for r in rs if abs(r.tflops_per_token / mid - 1.0) > FLOPS_TOLERANCE}
    return out | {r.id for r in rows if r.ga_mismatch}


def fitted(row: PerfRow) -> bool:
    """Rows a shipped profile was fitted on: the GB200 profile's fit (bench/fit.py gb200) includes this source's
    dense GB200 rows, its Blackwell Ultra factor (part_sm_rate, bench/fit.py blackwell-ultra) the 25.11 dense
    GB300 rows; every other row is held out."""
    dense_bridge = row.source == "megatron-bridge" and not row.moe
    return dense_bridge and (row.gpu == "gb200" or (row.gpu == "gb300" and row.release == "25.11"))
