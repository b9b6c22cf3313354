"""How many micro-batches a pipeline rank holds at once, by schedule: the counts the memory model multiplies.

`in_flight_microbatches`: a rank's activations at its peak, in units of its
layers; `output_in_flight`: the last stage's output-layer tensors;
`first_stage_alive`: rank 0's first-stage micro-batches while its live chunks
peak under torch's interleaved order (torch.distributed.pipelining's receive
buffers, planner.memory.boundary).
"""

from __future__ import annotations

from functools import lru_cache


def output_in_flight(schedule: str, pp: int) -> float:
    """Micro-batches whose output-layer tensors the last stage holds at its peak; 0: as many as its layers'.

    Interleaved 1F1B (Megatron-Core's forward_backward_pipelining_with_interleaving,
    get_model_chunk_id; torch's ScheduleInterleaved1F1B alike): the last rank's
    warm-up ends before its last chunk, and from then on each forward of that
    chunk is followed by the backward of the same micro-batch, so the logits of
    one micro-batch are alive at a time, though the rank's other chunks hold
    (v - 1) pp more. The other schedules hold the output with their layers
    (1F1B's last rank: one micro-batch already).
    """
    return 1.0 if schedule == "interleaved-1f1b" and pp > 1 else 0.0


@lru_cache(maxsize=4096)  # per pipeline shape, for the search's thousands of memory checks
def in_flight_per_rank(schedule: str, pp: int, grad_accum_steps: int, virtual_stages: int) -> tuple[float, ...]:
    """`in_flight_microbatches` of every pipeline rank."""
    return tuple(in_flight_microbatches(schedule, pp, rank, grad_accum_steps, virtual_stages) for rank in range(pp))


def in_flight_microbatches(schedule: str, pp: int, rank: int, grad_accum_steps: int, virtual_stages: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of its layers.

    pp = 1: micro-batches run one after another (gradient accumulation): 1.
    gpipe: every forward runs before any backward: all m micro-batches.
    1f1b: rank r warms up with pp - r forwards before its first backward: min(pp - r, m).
    interleaved-1f1b (Megatron's schedule): rank r runs 2(pp - r - 1) + (v - 1)pp
      warm-up chunk forwards, so 2(pp-r-1) + (v-1)pp + 1 chunks (of 1/v of its
      layers) are alive, capped by the m*v chunks of the step. On rank 0 that
      is pp*(1 + (pp-1)/(pp*v)) micro-batches' worth, Korthikanti's factor.
    zb-v (torch's ScheduleZBVZeroBubble order, planner.simulate.pipeline): a
      chunk's activations live from its F to its W; rank r peaks at
      min(2 pp, 2m, m + 1 + r) chunks of half its layers, so pp micro-batches'
      worth once m >= 2 pp - 1 (the V shape matches 1F1B's first stage, Qi et
      al. 2024), less on the low ranks of a short step.
    dualpipev (planner.simulate.v_orders.dualpipev_rank_order): every rank runs
      2 pp chunk forwards before its first backward and keeps that count through
      the steady state, where the forward of an F&B pair runs before its backward
      frees a chunk: 2 pp + 1 chunks of half its layers, the reference's PP + 1
      stages' activations for PP = 2 pp stages (deepseek-ai/DualPipe README).
    """
    m = grad_accum_steps
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved-1f1b":
        v = virtual_stages
        chunks = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
        return chunks / v
    if schedule == "zb-v":
        return min(2 * pp, 2 * m, m + 1 + rank) / 2
    if schedule == "dualpipev":
        return min(2 * pp + 1, 2 * m) / 2
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


@lru_cache(maxsize=4096)  # the search asks for the same few schedules thousands of times
def first_stage_alive(schedule: str, pp: int, grad_accum_steps: int, virtual_stages: int) -> int:
    """Most micro-batches of stage 0 pipeline rank 0 holds at once while its in-flight chunks peak.

    1f1b / gpipe: its in-flight micro-batches. interleaved-1f1b (torch's
    ScheduleInterleaved1F1B._calculate_single_rank_operations): micro-batches
    run in rounds of g = m // max(1, m // pp) (g = pp when pp divides m, as the
    planner's layouts have it), the k-th forward runs chunk (k // g) % v, the
    k-th backward of the 1F1B phase chunk v - 1 - (k // g) % v after
    (v - 1) g + 2 (pp - 1) warm-up forwards; counted over the rank's F/B order at
    every moment its live chunks peak.
    """
    m = grad_accum_steps
    if schedule != "interleaved-1f1b":
        return int(in_flight_microbatches(schedule, pp, 0, m, virtual_stages))
    v, total = virtual_stages, m * virtual_stages
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1), total)
    alive = [0] * v
    live = best_total = best = 0  # live: sum(alive), kept as the order runs
    forwards = backwards = 0
    while backwards < total:
        if forwards < total and (forwards < warmup or forwards - warmup == backwards):
            alive[(forwards // per_round) % v] += 1
            forwards += 1
            live += 1
        else:
            alive[v - 1 - (backwards // per_round) % v] -= 1
            backwards += 1
            live -= 1
        if live > best_total or (live == best_total and alive[0] > best):
            best_total, best = live, alive[0]
    return best
