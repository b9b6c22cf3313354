"""Work an engine's optimizer does on every micro-batch, outside the GEMMs: the bf16 gradient fold.

DeepSpeed's BF16_Optimizer (bf16 under ZeRO 0/1: planner.engines.bf16_optimizer_runs)
adds each micro-batch's bf16 gradients into fp32 accumulators after the backward
(BF16_OPTIMIZER_FOLD_BYTES per parameter); planner.simulate.step adds it to each chunk's
backward, so the pipeline carries it like the rest of the micro-batch.
"""

from __future__ import annotations

from planner.engines import BF16_OPTIMIZER_FOLD_BYTES, Engine, bf16_optimizer_runs
from planner.layout import Layout
from planner.memory.params import stage_params
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import memory_time_s
from planner.simulate.pipeline import B, chunk_owner
from planner.training import TrainingSpec
from topologies.cluster import Cluster


def add_grad_fold(model: ModelSpec, training: TrainingSpec, layout: Layout, cluster: Cluster,
                  cal: CalibrationProfile, engine: Engine, durations: list[list[float]],
                  compute: list[float]) -> None:
    """Add each micro-batch's gradient fold (DataParallel.bf16_optimizer) to its backward.

    The fold streams every parameter a rank holds once per micro-batch, after the
    backward (DeepSpeed's BF16_Optimizer, bf16 under ZeRO 0/1); a rank's share is
    split over its chunks by layers. Priced at every micro-batch: the first only
    casts (6 of the 18 bytes), within 1/m of the step.
    """
    if not engine.data_parallel.bf16_optimizer or not bf16_optimizer_runs(training.dtype, layout.zero_stage):
        return
    owner = chunk_owner(layout.pp_schedule, layout.pp, layout.virtual_stages)
    for r in range(layout.pp):
        chunks = [c for c in range(len(owner)) if owner[c] == r]
        fold_s = memory_time_s(stage_params(model, layout, r, engine).total * BF16_OPTIMIZER_FOLD_BYTES,
                               cluster.gpu, cal)
        weights = [layout.layers_per_stage[c] for c in chunks]
        if not sum(weights):  # a rank of no layers folds its ends' gradients in its first chunk
            weights = [1] + [0] * (len(chunks) - 1)
        for c, wt in zip(chunks, weights, strict=True):
            share = fold_s * wt / sum(weights)
            durations[B][c] += share
            compute[c] += share
