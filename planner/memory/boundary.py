"""Stage-boundary tensors of torch.distributed.pipelining on one pipeline rank (meshplan's executor).

torch 2.13's PipelineStage receives each micro-batch's input, and each
micro-batch's output gradient, into buffers of its own allocated at the first
step and kept (`boundary_buffers`); how many micro-batches of the first stage
rank 0 holds at its peak follows from the schedule's order
(planner.memory.in_flight.first_stage_alive).
`meshplan validate-memory` replays these stages (executor.validate.memory_pipeline).
The torchtitan engine prices the same buffers: torch's PipelineStage of late
2024 (torchtitan 9dec370's benchmarks) made them per micro-batch at its first
step too (`_prepare_forward_infra` / `_prepare_backward_infra`, the design
pytorch/pytorch#136380 describes) and kept each stage output in fwd_cache until
its backward. Torch of that time also appended every stage's outputs to
output_chunks for the whole step (only the last stage's from pytorch/pytorch#153383,
May 2025; none with torch 2.13's return_outputs=False): not counted, it
changes no first rank of 1F1B or interleaved 1F1B whose micro-batches are
all in flight at once (m <= pp), and the last stage's logits it keeps (one
micro-batch's more at each of its forwards) are not in the phases either.
"""

from __future__ import annotations


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
