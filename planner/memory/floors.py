"""Lower bounds of a layout's memory that cost a few look-ups, for the search (planner.search) to rule out
what cannot fit before it estimates it (planner.memory.estimate). Each floor is never above what
estimate_memory answers for the same layout, engine and fixed overhead (tests/unit/test_search_memory_agreement.py).
"""

from __future__ import annotations

from planner.engines import Engine, get_engine
from planner.layout import Layout
from planner.memory.estimate import _layer_bytes, busiest_ranks
from planner.memory.in_flight import in_flight_per_rank
from planner.memory.params import StageParams, pipeline_params
from planner.memory.states import stage_states
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec


def stage_state_floors(model: ModelSpec, training: TrainingSpec, layout: Layout, engine: str | Engine,
                       fp8_any_layout: bool = True) -> dict[StageParams, tuple[int, int, int]]:
    """{each distinct stage's StageParams: (parameters + compute copy + optimizer state, gradients,
    parameters + gradients + optimizer: planner.memory.states.ModelStates.total) on one rank}, what
    `peak_floor_bytes` adds to and the search's model-state check reads. None depends on the micro-batch;
    the compute copy is the smallest any recomputation keeps (full recomputation's, planner.memory.states)."""
    eng = get_engine(engine)
    least_copy = layout.trusted_replace(recompute="full", recompute_layers=0, recompute_modules=())
    out: dict[StageParams, tuple[int, int, int]] = {}
    for sp in pipeline_params(model, layout, eng):
        if sp not in out:
            states = stage_states(model, training, least_copy, sp, eng, fp8_any_layout)
            out[sp] = (states.params + states.compute_copy + states.optimizer, states.grads, states.total)
    return out


def peak_floor_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, engine: str | Engine,
                     other_bytes: int, state_floors: dict[StageParams, tuple[int, int, int]]) -> int:
    """A lower bound of `estimate_memory(...).peak_bytes` (same engine, attention kernel and fixed overhead)
    that costs a few look-ups, for the search to rule out what cannot fit before estimating it.

    Every rank's peak is at least its loss-backward phase (planner.memory.phases; the papers' one phase for
    megatron and deepspeed), which holds the rank's parameters, compute copy and optimizer state, the
    gradients of earlier micro-batches when there are several (every gradient in the papers' accounting),
    never less than the step's own sharded ones (`stage_state_floors`), and the kept activations of its
    in-flight micro-batches on the layers that stay on the GPU; every other term of that phase, and the
    allocator's reserve, are never negative.
    """
    eng = get_engine(engine)
    phased = eng.data_parallel.phased
    autocast = phased and eng.autocast(layout, training.dtype_bytes, training.lora)
    per_layer, _ = _layer_bytes(model, training, layout, eng, eng.fused_attention(training), autocast)
    params = pipeline_params(model, layout, eng)
    in_flight = in_flight_per_rank(layout.pp_schedule, layout.pp, layout.grad_accum_steps, layout.virtual_stages)
    offloaded = layout.activation_offload_layers * layout.virtual_stages
    with_grads = layout.grad_accum_steps > 1 or not phased
    floor = 0.0
    for rank in busiest_ranks(params, in_flight).values():
        sp = params[rank]
        on_gpu = sp.layers - min(offloaded, sp.layers - 1) if sp.layers else 0
        states, grads, _ = state_floors[sp]
        floor = max(floor, states + (grads if with_grads else 0) + in_flight[rank] * on_gpu * per_layer)
    return int(floor) + other_bytes
