"""What the explanation may claim and suggest: each figure is the simulator's, each change re-simulated.

The pipeline idle time of a step (`time_breakdown_s["bubble"]`, on the rank that finishes
last) has two causes. The schedule's own bubble: warm-up and cool-down, which a larger
batch of micro-batches amortizes (about (p - 1) / (m + p - 1) of the step under 1F1B).
And stage imbalance: the first stage also runs the embedding, the last the output layer and
the loss, so the other stages wait for the slowest one on every micro-batch, and more
micro-batches do not amortize it. `bubble_split` separates the two the way the simulator
times the step: it takes every operation's duration from the simulated schedule
(`simulate_step(events=True)`) and runs the same schedule again with each kind of operation
(forward, backward, weight gradient) set to its mean over the model chunks, the same total
work perfectly balanced; that run's idle time is the schedule's bubble, the rest is imbalance.

A suggested change (a larger global batch, a layout that spends GPUs on data parallelism) is
simulated as a layout of its own and its memory checked against the plan's limit; the
explanation shows it only when it fits and is faster per token, with the predicted gain.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines import get_engine
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.plan import validate, with_stage_layers
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.pipeline import B, F, W, simulate_pipeline
from planner.simulate.step import StepResult, simulate_step, step_memory
from planner.training import TrainingSpec
from topologies.cluster import Cluster
from topologies.errors import MeshplanError

# A change must gain at least this share of tokens/s to be worth suggesting (below it the
# prediction's own error decides, see planner.accuracy).
WORTH_SUGGESTING = 0.01


@dataclass(frozen=True)
class BubbleSplit:
    """Pipeline idle time on the critical rank, split into the schedule's bubble and stage imbalance."""

    bubble_s: float  # the step's time_breakdown_s["bubble"]
    schedule_s: float  # idle of the same schedule with every chunk at the mean duration
    imbalance_s: float  # bubble_s - schedule_s (never negative)
    heavy_chunk: int  # model chunk with the most forward + backward time per micro-batch
    heavy_s: float  # its forward + backward (+ weight gradient) per micro-batch
    mean_s: float  # the mean over chunks
    n_chunks: int


@dataclass(frozen=True)
class Context:
    """What re-simulating a layout needs besides the layout: the search's own inputs."""

    model: ModelSpec
    cluster: Cluster
    calibration: CalibrationProfile | None
    engine: str
    capacity_bytes: int  # memory a plan may use (the search's usable fraction of the GPU)


def bubble_split(ctx: Context, training: TrainingSpec, layout: Layout) -> BubbleSplit | None:
    """The critical rank's pipeline idle time split as the module docstring says; None without a pipeline."""
    if layout.pp == 1:
        return None
    result = simulate_step(ctx.model, training, layout, ctx.cluster, ctx.calibration, ctx.engine)
    durations, p2p_s = result.pipeline_inputs
    n_chunks = layout.pp * layout.virtual_stages
    mean = [[sum(row) / n_chunks] * n_chunks for row in durations]
    balanced = simulate_pipeline(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.grad_accum_steps,
                                 mean, list(p2p_s))
    last = max(range(layout.pp), key=lambda r: balanced.rank_end_s[r])
    schedule = balanced.rank_end_s[last] - balanced.rank_busy_s[last]
    bubble = result.time_breakdown_s.get("bubble", 0.0)
    per_chunk = [durations[F][c] + durations[B][c] + durations[W][c] for c in range(n_chunks)]
    heavy = max(range(n_chunks), key=per_chunk.__getitem__)
    return BubbleSplit(bubble, min(schedule, bubble), max(0.0, bubble - schedule), heavy, per_chunk[heavy],
                       sum(per_chunk) / n_chunks, n_chunks)


def chunk_words(split: BubbleSplit) -> str:
    """How the explanation names the heavy chunk: 'the last stage, which also runs the output layer and the loss,'."""
    if split.heavy_chunk == split.n_chunks - 1:
        return "the last stage, which also runs the output layer and the loss,"
    if split.heavy_chunk == 0:
        return "the first stage, which also runs the embedding,"
    return f"stage {split.heavy_chunk + 1} of {split.n_chunks}"


@dataclass(frozen=True)
class Suggestion:
    """A change the explanation proposes, with the simulator's numbers for it."""

    change: str  # what to pass, e.g. "--global-batch 512"
    layout: Layout
    training: TrainingSpec
    result: StepResult
    gain: float  # tokens/s over the plan's, minus 1


def resimulate(ctx: Context, training: TrainingSpec, layout: Layout) -> StepResult | None:
    """The step of a layout the explanation would suggest, None when it is invalid, refused or does not fit."""
    layout = with_stage_layers(ctx.model, layout.replace(layers_per_stage=()))
    try:
        validate(ctx.model, ctx.cluster, training, layout)
        refusal = get_engine(ctx.engine).refusal(ctx.model, layout, training.dtype, ctx.cluster.gpu.kind != "cpu",
                                                 training)
        if refusal:
            return None
        if step_memory(ctx.model, training, layout, ctx.cluster, ctx.calibration, ctx.engine).peak_bytes > \
                ctx.capacity_bytes:
            return None
        return simulate_step(ctx.model, training, layout, ctx.cluster, ctx.calibration, ctx.engine)
    except MeshplanError:
        return None


def best_suggestion(ctx: Context, base: StepResult, options: list[tuple[str, TrainingSpec, Layout]]
                    ) -> Suggestion | None:
    """The fastest option (per token) that fits and gains at least WORTH_SUGGESTING, else None."""
    found = None
    for change, training, layout in options:
        result = resimulate(ctx, training, layout)
        if result is None:
            continue
        gain = result.tokens_per_s / base.tokens_per_s - 1.0
        if gain >= WORTH_SUGGESTING and (found is None or gain > found.gain):
            found = Suggestion(change, with_stage_layers(ctx.model, layout.replace(layers_per_stage=())), training,
                               result, gain)
    return found


def larger_batch_options(training: TrainingSpec, layout: Layout, factor: int = 2
                         ) -> list[tuple[str, TrainingSpec, Layout]]:
    """The same layout with `factor` times the micro-batches per step (a larger global batch)."""
    batch = training.global_batch_size * factor
    return [(f"--global-batch {batch}", training.replace(global_batch_size=batch),
             layout.replace(grad_accum_steps=layout.grad_accum_steps * factor))]


def wider_dp_options(training: TrainingSpec, layout: Layout) -> list[tuple[str, TrainingSpec, Layout]]:
    """Twice the global batch on twice the data parallelism, the GPUs taken from pp or tp."""
    batch = training.global_batch_size * 2
    wider = training.replace(global_batch_size=batch)
    grow = {"dp_shard": layout.dp_shard * 2} if layout.zero_stage > 0 else {"dp_replicate": layout.dp_replicate * 2}
    changes = []
    if layout.pp % 2 == 0:
        pp = layout.pp // 2
        changes.append({"pp": pp, **({} if pp > 1 else {"pp_schedule": "1f1b", "virtual_stages": 1})})
    if layout.tp % 2 == 0:
        tp = layout.tp // 2
        changes.append({"tp": tp, **({} if tp > 1 else {"sequence_parallel": False})})
    out = []
    for change in changes:
        try:
            out.append((f"--global-batch {batch}", wider, layout.replace(**change, **grow)))
        except MeshplanError:  # a layout the rules refuse (the experts' grid, the schedule's chunks) is no option
            continue
    return out
