"""Stage-boundary tensors of torch.distributed.pipelining on one pipeline rank (meshplan's executor).

torch 2.13's PipelineStage receives each micro-batch's input, and each
micro-batch's output gradient, into buffers of its own allocated at the first
step and kept (`boundary_buffers`); how many micro-batches of the first stage
rank 0 holds at its peak follows from the schedule's order (`first_stage_alive`).
`meshplan validate-memory` replays these stages (executor.validate.memory_pipeline).
"""

from __future__ import annotations

from functools import lru_cache

from planner.memory.activations import in_flight_microbatches


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


def boundary_buffers(schedule: str, pp: int, grad_accum_steps: int, virtual_stages: int, *, first: bool,
                     last: bool, first_alive: int) -> float:
    """Stage-boundary tensors torch.distributed.pipelining keeps on one pipeline rank, in stage outputs.

    torch 2.13's PipelineStage allocates, at its first step, one receive buffer
    per micro-batch for a non-first stage's input and one for a non-last
    stage's output gradient (stage.py `_setup_forward_recv_info`,
    `_setup_backward_recv_info`; pytorch/pytorch#136380), reused by every later
    step: m of each. A non-last stage also keeps each live micro-batch's output
    for its backward (fwd_cache). The inputs of live micro-batches are the first
    block's saved input (counted with the layers), so over the rank's v chunks:
    outputs C - a_last, gradient buffers m (v - last), input buffers beyond the
    live ones m (v - first) - (C - a_first), C the live chunks: the sum
    m (2v - first - last) + a_first [first] - a_last [last] does not depend on C;
    a_last = 1 (the last stage's backward follows its forward in 1F1B and
    interleaved 1F1B). Not for zb-v, whose same-rank boundary passes locally
    (planner.memory.phases keeps its own rule).
    """
    m, v = grad_accum_steps, virtual_stages
    if pp == 1:
        return 0.0
    return float(m * (2 * v - first - last) + (first_alive if first else 0) - (1 if last else 0))
