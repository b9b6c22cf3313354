"""Pipeline schedules as events: each rank runs its operations in order, waiting for inputs.

A model of pp * v chunks (v = virtual stages per rank) processes n
micro-batches. Operations are F (forward of a chunk), B (backward; it carries
the weight gradients too, except in zero-bubble schedules where W is its own
operation) for every (chunk, micro-batch). Dependencies:
  F(c, i) after F(c-1, i) has arrived: its end + the p2p time of boundary c-1 -> c
  B(c, i) after B(c+1, i) has arrived, and after F(c, i)
  W(c, i) after B(c, i)
The bubble is whatever idle time this produces: it is measured, never a
closed formula, so imbalanced stages (embedding on the first, output layer on
the last) and slow links show up where they really cost.

Schedules:
  gpipe            all forwards, then all backwards (micro-batch order)
  1f1b             pp - r - 1 warm-up forwards on rank r, then one forward one
                   backward, then the remaining backwards (Narayanan et al. 2021)
  interleaved-1f1b v chunks per rank, rank r holds chunks r, r + pp, ...;
                   micro-batches advance in groups of pp through the chunks,
                   warm-up (pp - r - 1) * 2 + (v - 1) * pp (Megatron-LM; the
                   micro-batch count must be a multiple of pp)
  zb-v             2 chunks per rank in a V (rank r holds r and 2pp - 1 - r),
                   B (input gradient) and W (weight gradient) split (Qi et
                   al. 2024), in the order torch.distributed.pipelining's
                   ScheduleZBVZeroBubble runs (planner.simulate.v_orders), which is
                   what `meshplan execute` runs; tests/unit/test_schedule_torch.py
                   compares every rank's order with torch's pipeline_order.
  dualpipev        the same V, in DualPipeV's order (DeepSeek-V3's DualPipe cut
                   in half: deepseek-ai/DualPipe dualpipev.py, torch's
                   ScheduleDualPipeV; planner.simulate.v_orders): in its steady
                   state the forward of one micro-batch runs overlapped with
                   the backward of another (F&B), each pass's expert
                   all-to-alls under the other's compute. Those passes are
                   the kinds FO and BO, priced without what the overlap hides
                   (planner.simulate.step); their dependencies are F's and
                   B's. At least 2 pp micro-batches (both implementations
                   assert it). Bubble (pp - 1)(F&B + B - 3W) in chunk passes,
                   the reference's (PP/2 - 1)(F&B + B - 3W) for PP = 2 pp
                   stages.

Every order is compiled once per (schedule, pp, v, n) into a topological list
(each rank's order merged so that every input comes before its consumer), in
O(operations): the per-rank orders are closed forms. Timing one layout is then a single pass over
the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np

from planner.layout import rank_chunks
from planner.simulate.v_orders import BASE_KIND, BO, FO, KIND_NAMES, B, F, W, dualpipev_rank_order, zbv_orders
from topologies.errors import PlanError

__all__ = ["B", "BASE_KIND", "BO", "F", "FO", "KIND_NAMES", "W", "chunk_owner", "dualpipev_rank_order",
           "simulate_pipeline", "zbv_orders"]


@dataclass(frozen=True)
class Op:
    """One executed operation of the timeline."""

    rank: int
    kind: int  # F, B or W
    chunk: int  # model chunk (virtual stage) index, 0 .. pp*v - 1
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    makespan_s: float  # last operation's end over all ranks
    rank_end_s: tuple[float, ...]  # when each rank finishes its last operation
    rank_busy_s: tuple[float, ...]  # time each rank spends in operations
    last_backward_s: tuple[float, ...]  # duration of each rank's final backward(s): DP overlap window
    ops: tuple[Op, ...] = ()  # every operation, when events were asked for


@lru_cache(maxsize=1024)
def chunk_owner(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    """Pipeline rank of every model chunk (the inverse of planner.layout.rank_chunks)."""
    owner = [0] * (pp * v)
    for r in range(pp):
        for c in rank_chunks(schedule, pp, v, r):
            owner[c] = r
    return tuple(owner)


# ---- fixed orders: per rank, (kind, chunk, micro-batch) -------------------------------


def _order_gpipe(rank: int, pp: int, v: int, n: int) -> list[tuple[int, int, int]]:
    chunks = rank_chunks("gpipe", pp, v, rank)
    fwd = [(F, c, i) for i in range(n) for c in chunks]
    bwd = [(B, c, i) for i in range(n) for c in reversed(chunks)]
    return fwd + bwd


def _order_1f1b(rank: int, pp: int, v: int, n: int) -> list[tuple[int, int, int]]:
    warmup = min(pp - rank - 1, n)
    order = [(F, rank, i) for i in range(warmup)]
    for i in range(n):
        if warmup + i < n:
            order.append((F, rank, warmup + i))
        order.append((B, rank, i))
    return order


def _interleaved_sequence(rank: int, pp: int, v: int, n: int, forward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in Megatron's interleaved order: groups of pp micro-batches per chunk."""
    local = list(range(v)) if forward else list(range(v - 1, -1, -1))
    seq = []
    for start in range(0, n, pp):
        group = range(start, min(start + pp, n))
        for j in local:
            seq.extend((rank + j * pp, i) for i in group)
    return seq


def _order_interleaved(rank: int, pp: int, v: int, n: int) -> list[tuple[int, int, int]]:
    fwd = _interleaved_sequence(rank, pp, v, n, True)
    bwd = _interleaved_sequence(rank, pp, v, n, False)
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, len(fwd))
    order = [(F, c, i) for c, i in fwd[:warmup]]
    for k in range(len(bwd)):
        if warmup + k < len(fwd):
            order.append((F, *fwd[warmup + k]))
        order.append((B, *bwd[k]))
    return order


_ORDERS = {"gpipe": _order_gpipe, "1f1b": _order_1f1b, "interleaved-1f1b": _order_interleaved}


def _rank_arrays(schedule: str, rank: int, pp: int, v: int, n: int) -> np.ndarray:
    """`_ORDERS[schedule](rank, pp, v, n)` as an (operations, 3) array of (kind, chunk, micro-batch), built with
    numpy: the compiled orders of a 1T search's deep pipelines hold tens of thousands of operations each."""
    if schedule == "gpipe":
        chunks = np.array(rank_chunks("gpipe", pp, v, rank))
        i = np.repeat(np.arange(n), len(chunks))
        fwd = np.stack((np.full(len(i), F), np.tile(chunks, n), i), axis=1)
        bwd = np.stack((np.full(len(i), B), np.tile(chunks[::-1], n), i), axis=1)
        return np.concatenate((fwd, bwd))
    if schedule == "1f1b":
        fc = bc = np.full(n, rank)
        fm = bm = np.arange(n)
        warmup = min(pp - rank - 1, n)
    else:  # interleaved-1f1b: groups of pp micro-batches per chunk (n is a multiple of pp)
        groups = n // pp
        mb = (np.arange(groups)[:, None, None] * pp + np.arange(pp)[None, None, :]).repeat(v, axis=1).ravel()
        fc = np.broadcast_to((rank + np.arange(v) * pp)[None, :, None], (groups, v, pp)).ravel()
        bc = np.broadcast_to((rank + np.arange(v - 1, -1, -1) * pp)[None, :, None], (groups, v, pp)).ravel()
        fm = bm = mb
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, len(fc))
    total = len(fc)
    steady = total - warmup  # one forward, one backward
    kind = np.concatenate((np.full(warmup, F), np.tile([F, B], steady), np.full(warmup, B)))
    chunk = np.concatenate((fc[:warmup], np.stack((fc[warmup:], bc[:steady]), axis=1).ravel(), bc[steady:]))
    micro = np.concatenate((fm[:warmup], np.stack((fm[warmup:], bm[:steady]), axis=1).ravel(), bm[steady:]))
    return np.stack((kind, chunk, micro), axis=1)


@dataclass(frozen=True)
class _Compiled:
    """A fixed schedule in topological order, as flat arrays."""

    rank: np.ndarray
    kind: np.ndarray  # F, B or W (DualPipeV's FO and BO as F and B)
    duration_kind: np.ndarray  # the row of the durations that prices it (FO, BO: their own)
    chunk: np.ndarray
    micro_batch: np.ndarray
    prev: list[int]  # 1 + index of the previous operation on the same rank (0: none)
    dep: list[int]  # 1 + index of the operation on another rank whose output this one consumes (0: none)
    boundary: np.ndarray  # chunk boundary that input crosses (-1: none)
    last_backward: np.ndarray  # indices of the backward (and W) operations of the final micro-batch


def _merge(starts: list[int], dep: list[int], consumer: list[int], rank: list[int]) -> list[int]:
    """A topological order of rank-major operations: each rank runs as far as its inputs allow.

    Operation g waits for dep[g] (len(dep) = none); when it completes, the
    rank of its consumer is woken if that consumer is next in line there.
    Every operation is visited once.
    """
    done = bytearray(len(dep) + 1)
    done[-1] = 1
    head, stops = starts[:-1], starts[1:]
    order: list[int] = []
    awake = list(range(len(head) - 1, -1, -1))
    while awake:
        r = awake.pop()
        g, stop = head[r], stops[r]
        first = g
        while g < stop and done[dep[g]]:
            done[g] = 1
            c = consumer[g]
            if c >= 0 and head[rank[c]] == c:
                awake.append(rank[c])
            g += 1
        head[r] = g
        order.extend(range(first, g))
    if len(order) != len(dep):
        raise PlanError(f"pipeline schedule deadlocks: {len(dep) - len(order)} of {len(dep)} operations never run")
    return order


@lru_cache(maxsize=256)
def _compiled(schedule: str, pp: int, v: int, n: int) -> _Compiled:
    """Merge the per-rank orders of a schedule into one topological list (once per shape).

    Only inputs from another rank constrain the merge: an input from the same
    rank is earlier in that rank's own order, so it ends before the
    operation's predecessor there and never delays it.
    """
    if schedule in ("zb-v", "dualpipev"):
        orders = zbv_orders(pp, n) if schedule == "zb-v" else [dualpipev_rank_order(r, pp, n) for r in range(pp)]
        sizes = [len(o) for o in orders]
        flat = chain.from_iterable(chain.from_iterable(orders))  # (kind, chunk, micro-batch) of every operation
        kind, chunk, mb = np.fromiter(flat, dtype=np.int64, count=3 * sum(sizes)).reshape(-1, 3).T
    else:
        arrays = [_rank_arrays(schedule, r, pp, v, n) for r in range(pp)]
        sizes = [len(a) for a in arrays]
        kind, chunk, mb = np.concatenate(arrays).astype(np.int64).T
    priced, kind = kind, np.array(BASE_KIND, dtype=np.int64)[kind]
    rank = np.repeat(np.arange(pp), sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    n_chunks, total = pp * v, int(starts[-1])
    owner = np.array(chunk_owner(schedule, pp, v))
    where = np.full(3 * n_chunks * n, -1, dtype=np.int64)  # (kind, chunk, micro-batch) -> position
    where[(kind * n_chunks + chunk) * n + mb] = np.arange(total)
    src = np.where(kind == F, chunk - 1, chunk + 1)  # the chunk whose output an F or B consumes
    has_src = (kind != W) & (src >= 0) & (src < n_chunks)
    src = np.where(has_src, src, 0)
    remote = has_src & (owner[src] != rank)
    dep = np.where(remote, where[(kind * n_chunks + src) * n + mb], total)
    consumer = np.full(total + 1, -1, dtype=np.int64)
    consumer[dep[remote]] = np.flatnonzero(remote)
    order = np.array(_merge(starts.tolist(), dep.tolist(), consumer[:-1].tolist(), rank.tolist()), dtype=np.int64)
    position = np.empty(total + 1, dtype=np.int64)  # rank-major index -> 1 + topological index; `total` -> 0
    position[order] = np.arange(1, total + 1)
    position[total] = 0
    prev = np.where(np.arange(total) == starts[rank], total, np.arange(total) - 1)
    boundary = np.where(remote, np.minimum(chunk, src), -1)
    kind, mb = kind[order], mb[order]
    return _Compiled(rank[order], kind, priced[order], chunk[order], mb, position[prev[order]].tolist(),
                     position[dep[order]].tolist(), boundary[order], np.flatnonzero((kind != F) & (mb == n - 1)))


def _run_fixed(schedule: str, pp: int, v: int, n: int, durations: list[list[float]],
               p2p_s: list[float], events: bool) -> PipelineResult:
    """end[i] = max(end[prev], end[dep] + lag) + duration, in topological order.

    Durations and lags are gathered with numpy; only the max-plus recurrence
    itself runs as a Python loop (about 0.1 us per operation).
    """
    sched = _compiled(schedule, pp, v, n)
    dur = np.asarray(durations, dtype=float)[sched.duration_kind, sched.chunk]
    lag = np.append(np.asarray(p2p_s, dtype=float), 0.0)[sched.boundary]
    end = [0.0]  # end[0] is the sentinel for "none"; operation i ends at end[i + 1]
    append = end.append
    for p, d, lg, du in zip(sched.prev, sched.dep, lag.tolist(), dur.tolist(), strict=True):
        start, arrival = end[p], end[d] + lg
        append((start if start > arrival else arrival) + du)
    ends = np.array(end[1:])
    rank_end = np.zeros(pp)
    np.maximum.at(rank_end, sched.rank, ends)
    busy = np.bincount(sched.rank, weights=dur, minlength=pp)
    last_b = np.bincount(sched.rank[sched.last_backward], weights=dur[sched.last_backward], minlength=pp)
    ops: tuple[Op, ...] = ()
    if events:
        ops = tuple(Op(*row) for row in zip(sched.rank.tolist(), sched.kind.tolist(), sched.chunk.tolist(),
                                            sched.micro_batch.tolist(), (ends - dur).tolist(), ends.tolist(), strict=True))
    return PipelineResult(float(rank_end.max()), tuple(rank_end.tolist()), tuple(busy.tolist()),
                          tuple(last_b.tolist()), ops)


def simulate_pipeline(schedule: str, pp: int, v: int, n_micro: int, durations: list[list[float]],
                      p2p_s: list[float], events: bool = False) -> PipelineResult:
    """Time one step's forward and backward passes over the pipeline.

    durations[kind][chunk] is the time of one operation (F, B, W; and FO, BO
    under dualpipev) of a chunk for one micro-batch; for schedules without a W
    phase, B must already include the weight gradients and durations[W] is ignored. p2p_s[c] is the
    transfer time across the boundary between chunk c and c + 1.
    """
    if n_micro < 1:
        raise PlanError(f"a step needs at least one micro-batch, got {n_micro}")
    if schedule == "interleaved-1f1b" and n_micro % pp:
        raise PlanError(f"interleaved-1f1b runs micro-batches in groups of pp ({pp}); {n_micro} micro-batches "
                        "per step is not a multiple: change the micro-batch size or the global batch")
    if schedule not in (*_ORDERS, "zb-v", "dualpipev"):
        raise PlanError(f"unknown pipeline schedule {schedule!r}; known: {sorted((*_ORDERS, 'zb-v', 'dualpipev'))}")
    if schedule == "dualpipev" and n_micro < 2 * pp:
        raise PlanError(f"dualpipev runs at least 2 x pp ({2 * pp}) micro-batches per step, got {n_micro}: "
                        "lower the micro-batch size or raise the global batch")
    if events:
        return _run_fixed(schedule, pp, v, n_micro, durations, p2p_s, events)
    # a search simulates many layouts whose pipelines run the same durations (data-parallel splits and ZeRO
    # stages that leave every chunk's F, B, W and hops unchanged): the same inputs give the same result
    key = (schedule, pp, v, n_micro, tuple(tuple(row) for row in durations), tuple(p2p_s))
    hit = _RESULTS.get(key)
    if hit is None:
        if len(_RESULTS) >= _RESULTS_LIMIT:
            _RESULTS.clear()
        hit = _RESULTS[key] = _run_fixed(schedule, pp, v, n_micro, durations, p2p_s, events)
    return hit


_RESULTS: dict[tuple, PipelineResult] = {}  # simulate_pipeline's results without events, by their inputs
_RESULTS_LIMIT = 4096
