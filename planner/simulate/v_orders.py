"""The per-rank orders of the V schedules (two chunks per rank, rank r holding r and 2 pp - 1 - r):
zb-v as torch.distributed.pipelining's ScheduleZBVZeroBubble runs it and dualpipev as DeepSeek's DualPipeV
(deepseek-ai/DualPipe dualpipev.py, torch's ScheduleDualPipeV) runs it; planner.simulate.pipeline compiles
and times them. Each order is a list of (kind, chunk, micro-batch).
"""

from __future__ import annotations

F, B, W = 0, 1, 2
KIND_NAMES = ("F", "B", "W")
# DualPipeV's overlapped passes: a forward (FO) and an input-gradient backward (BO) run as one F&B pair;
# durations[FO], durations[BO] price them, and they depend, and show in events, as F and B
FO, BO = 3, 4
BASE_KIND = (F, B, W, F, B)


def zbv_rank_order(rank: int, pp: int, n: int) -> list[tuple[int, int, int]]:
    """Rank `rank`'s order under ZB-V as torch.distributed.pipelining's ScheduleZBVZeroBubble runs it.

    The rank holds chunk `down` = rank (on the way down the V) and `up` =
    2 pp - 1 - rank (on the way up). Phases, for m = max(n, 2 pp - 1)
    micro-batches (torch fills the pipeline with 2 pp - 1 and drops the
    operations of micro-batches past n afterwards):
      1. 2 (pp - rank) - 1 forwards of `down`;
      2. rank pairs: forward `up`, forward `down`;
      3. pp - rank triples on `up`: forward, input gradient (B), weight gradient (W);
      4. steady state, until every forward ran: forward `down` (while any is
         left), B and W of `down`, then forward, B and W of `up`;
      5. cool-down: rank pairs of B (`down`, then `up`) with their W deferred,
         then pp - rank pairs of B `down` and the oldest deferred W of `down`,
         then the remaining W of `up`, then those of `down`.
    So every W outside the cool-down runs right after its B, and on rank 0
    (pp 2, 4 micro-batches) F(down, 3) runs before B(down, 0).
    """
    m = max(n, 2 * pp - 1)
    chunks = (rank, 2 * pp - 1 - rank)
    fwd, bwd = [0, 0], [0, 0]  # next forward / input-gradient micro-batch of chunks[0] and chunks[1]
    order: list[tuple[int, int, int]] = []

    def forward(k: int) -> None:
        order.append((F, chunks[k], fwd[k]))
        fwd[k] += 1

    def backward(k: int, with_weights: bool) -> None:
        order.append((B, chunks[k], bwd[k]))
        if with_weights:
            order.append((W, chunks[k], bwd[k]))
        bwd[k] += 1

    for _ in range(2 * (pp - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(pp - rank):
        forward(1)
        backward(1, True)
    while fwd[1] < fwd[0] or fwd[0] < m:
        if fwd[0] < m:
            forward(0)
        backward(0, True)
        forward(1)
        backward(1, True)
    weights = list(bwd)  # next deferred W of each chunk
    for _ in range(rank):
        backward(0, False)
        backward(1, False)
    for _ in range(pp - rank):
        backward(0, False)
        order.append((W, chunks[0], weights[0]))
        weights[0] += 1
    order += [(W, chunks[1], i) for i in range(weights[1], bwd[1])]
    order += [(W, chunks[0], i) for i in range(weights[0], bwd[0])]
    return [op for op in order if op[2] < n]


def zbv_orders(pp: int, n: int) -> list[list[tuple[int, int, int]]]:
    return [zbv_rank_order(r, pp, n) for r in range(pp)]


def dualpipev_rank_order(rank: int, pp: int, n: int) -> list[tuple[int, int, int]]:
    """Rank `rank`'s order under DualPipeV (deepseek-ai/DualPipe's DualPipeV.step, torch's ScheduleDualPipeV).

    Chunk `down` = rank, `up` = 2 pp - 1 - rank; n >= 2 pp micro-batches. A
    full backward is B then its W; a zero-bubble one (B only) queues its W,
    which a later W step pops, oldest first. Steps:
      1. 2 (pp - rank - 1) forwards of `down`;
      2. rank + 1 pairs: forward `down`, forward `up`;
      3. pp - rank - 1 triples: zero-bubble B of `up`, a queued W, forward `up`;
      4. n - 2 pp + rank + 1 pairs of F&B: forward `down` with the backward of
         `up`, then forward `up` with the backward of `down` (the last rank runs
         its first forward `down` and backward `up` without overlap);
      5. pp - rank - 1 pairs: backward `up`, then forward `up` with backward `down`;
      6. rank + 1 pairs: backward `up`, backward `down`, zero-bubble from the middle
         pair on (from its `up` backward on odd ranks, its `down` one on even ranks);
      7. pp - rank - 1 pairs: a queued W, zero-bubble backward `down`;
      8. rank + 1 queued Ws.
    """
    down, up = rank, 2 * pp - 1 - rank
    count = {(F, down): 0, (F, up): 0, (B, down): 0, (B, up): 0}
    queue: list[tuple[int, int]] = []
    order: list[tuple[int, int, int]] = []

    def forward(chunk: int, kind: int = F) -> None:
        order.append((kind, chunk, count[F, chunk]))
        count[F, chunk] += 1

    def backward(chunk: int, zero_bubble: bool = False, kind: int = B) -> None:
        i = count[B, chunk]
        order.append((kind, chunk, i))
        count[B, chunk] += 1
        if zero_bubble:
            queue.append((chunk, i))
        else:
            order.append((W, chunk, i))

    def weights() -> None:
        if queue:
            chunk, i = queue.pop(0)
            order.append((W, chunk, i))

    def overlapped(forward_chunk: int, backward_chunk: int) -> None:
        forward(forward_chunk, FO)
        backward(backward_chunk, kind=BO)

    for _ in range(2 * (pp - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(pp - rank - 1):
        backward(up, True)
        weights()
        forward(up)
    for i in range(n - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            forward(down)
            backward(up)
        else:
            overlapped(down, up)
        overlapped(up, down)
    for _ in range(pp - rank - 1):
        backward(up)
        overlapped(up, down)
    zero_bubble = False
    for i in range(rank + 1):
        zero_bubble = zero_bubble or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, zero_bubble)
        zero_bubble = zero_bubble or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, zero_bubble)
    for _ in range(pp - rank - 1):
        weights()
        backward(down, True)
    for _ in range(rank + 1):
        weights()
    return order
