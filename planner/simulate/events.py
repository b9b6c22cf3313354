"""What one simulated step leaves for its pictures: every pipeline operation, the exposed
communication inside it by kind, the hops between chunks, and each rank's tail after the pipeline.

`planner.simulate.step.simulate_step(..., events=True)` fills a StepEvents;
`planner.simulate.timeline` turns it into lanes (the Perfetto trace and the
step chart read those). Kept apart from the step's arithmetic, which needs none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout
from planner.simulate.pipeline import B, F, Op, PipelineResult

# The exposed communication a layer pass can carry, as time_breakdown_s names it.
LAYER_COMM_KEYS = ("tp_comm", "cp_comm", "ep_comm", "fsdp_comm", "offload_comm")
# What a rank does after its last backward, in the order it runs (planner.simulate.step._tail).
TAIL_KEYS = ("dp_comm", "embedding_sync", "optimizer", "param_gather")


@dataclass(frozen=True)
class StepEvents:
    """What a trace needs: every pipeline operation and each rank's tail after it."""

    ops: tuple[Op, ...]
    # (kind, chunk) -> exposed communication inside that F or B operation, by LAYER_COMM_KEYS kind
    op_comm_s: dict[tuple[int, int], dict[str, float]]
    p2p_s: tuple[float, ...]  # transfer time across each chunk boundary
    tails: tuple[tuple[tuple[str, float, float], ...], ...]  # per rank: (name, start, end) after the pipeline


def step_events_of(layout: Layout, pipe: PipelineResult, layer_comm: tuple[dict[str, float], dict[str, float]],
                   ends_comm: dict[str, tuple[float, float, float, float]], scale: list[float], p2p: list[float],
                   tails: list[dict[str, float]]) -> StepEvents:
    """The events of a simulated step.

    layer_comm: one layer's exposed communication by kind in its forward and its
    backward; ends_comm: the embedding's and output layer's (forward, backward of
    each), carried by the first and last chunks; scale: each chunk's re-pricing
    (calibration solo_speedup), applied as to its durations.
    """
    last = layout.pp * layout.virtual_stages - 1
    op_comm: dict[tuple[int, int], dict[str, float]] = {}
    for c, layers in enumerate(layout.layers_per_stage):
        for kind, per_layer, (at_first, at_last) in ((F, layer_comm[0], (0, 2)), (B, layer_comm[1], (1, 3))):
            by_kind = {}
            for k in LAYER_COMM_KEYS:
                ends = ends_comm.get(k, (0.0,) * 4)
                s = layers * per_layer[k] + (ends[at_first] if c == 0 else 0.0) + (ends[at_last] if c == last else 0.0)
                if s > 0:
                    by_kind[k] = s * scale[c]
            op_comm[(kind, c)] = by_kind
    return StepEvents(pipe.ops, op_comm, tuple(p2p), tuple(_tail_segments(pipe.rank_end_s, tails)))


def _tail_segments(rank_end: tuple[float, ...], tails: list[dict[str, float]]
                   ) -> list[tuple[tuple[str, float, float], ...]]:
    out = []
    for end, tail in zip(rank_end, tails, strict=True):
        segments, t = [], end
        for name in TAIL_KEYS:
            if tail[name] > 0:
                segments.append((name, t, t + tail[name]))
                t += tail[name]
        out.append(tuple(segments))
    return out
