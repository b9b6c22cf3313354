"""Async tensor parallelism: SP's all-gathers and reduce-scatters pipelined with their GEMMs.

Under sequence parallelism each layer meets two TP points per pass (before
attention and before the MLP): an all-gather of the sequence-split input
feeds the column-parallel GEMMs (QKV, MLP up/gate) and a reduce-scatter
takes the output of the row-parallel GEMMs (attention out, MLP down). Both
engines that overlap them split the collective into tp chunks and run the
GEMM chunk by chunk while the next chunk travels: torchtitan's
`enable_async_tensor_parallel` (an Inductor pass, `_micro_pipeline_tp`, over
symmetric memory) and Megatron-Core's `--tp-comm-overlap` (Transformer
Engine's userbuffers, in the forward and the backward).

So each collective hides under its own GEMM, up to the calibration's
`comm_overlap` share of that GEMM: exposed = max(0, comm - overlap * gemm)
per collective. In the backward the roles swap: the input gradient of the
column-parallel GEMMs is reduce-scattered chunk by chunk out of their
input-gradient GEMM, the output gradient of the row-parallel GEMMs is
all-gathered into theirs. The price of the chunking: each overlapped GEMM
runs as tp GEMMs of m/tp rows, at the efficiency of that smaller shape
(`planner.simulate.compute.gemm_time_s`'s knee), in the forward and in the
input-gradient pass that is chunked.

The price of the communication kernels: Transformer Engine's userbuffers
run some of the overlapped collectives on SMs taken from the GEMM
(planner.engines.TpOverlapSms, per collective: the forward reduce-scatters,
and the backward's bulk all-gather of the saved input under the
input-gradient GEMM and bulk reduce-scatter of the input gradient under the
weight-gradient GEMM). A GEMM launched with an SM margin runs on the
remaining SMs throughout, S / (S - sms) times as long; one that shares the
GPU loses sms / S of it while the collective runs (`sm_share_s`). The GPU's
SM count comes from topologies.hardware.

The GEMMs of routed experts are not chunked (their tokens come from the
expert dispatch, not from the TP all-gather): on MoE layers the MLP point
hides only under the shared experts. MLA's down projections read the
gathered input like QKV does.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines import CommSms, TpOverlapSms
from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import attention_gemms, gemm_time_s, mlp_gemms

Gemm = tuple[float, float, float, float]  # (count, m, n, k)


@dataclass(frozen=True)
class OverlapGemms:
    """Per TP point (attention, MLP): the GEMM time each collective can hide under, one forward pass."""

    gather_s: tuple[float, float]  # column-parallel GEMMs that read the all-gathered input
    scatter_s: tuple[float, float]  # row-parallel GEMMs whose output is reduce-scattered
    chunking_s: float  # extra time of running those GEMMs as tp chunks of m/tp rows, per pass


def _point_gemms(model: ModelSpec, m: float, layout: Layout) -> tuple[list[Gemm], list[Gemm]]:
    """(attention GEMMs, dense MLP GEMMs) of an average layer on one TP rank: the ones around a TP point."""
    dense, _ = mlp_gemms(model, m, layout)
    if model.moe is not None:  # the router reads the sequence-split tokens; no TP point around it
        dense = dense[:-1]
    return attention_gemms(model, m, layout.tp), dense


def overlap_gemms(model: ModelSpec, m: float, layout: Layout, peak: float, cal: CalibrationProfile,
                  fp8_peak: float = 0.0) -> OverlapGemms:
    """The GEMMs async TP pipelines its collectives with (module docstring), at the block GEMMs' rate."""
    rate, eff = (fp8_peak, cal.fp8_gemm_efficiency) if fp8_peak else (peak, None)
    h, t = model.hidden, layout.tp

    def time_s(gemms: list[Gemm], rows: float = 0.0) -> float:
        return sum(c * gemm_time_s(rows or gm, gn, gk, rate, cal, eff) for c, gm, gn, gk in gemms)

    gather, scatter, chunking = [], [], 0.0
    for gemms in _point_gemms(model, m, layout):
        reads = [g for g in gemms if g[3] == h]  # k = hidden: reads the gathered hidden state
        writes = [g for g in gemms if g[2] == h and g[3] != h]  # n = hidden: the row-parallel output
        gather.append(time_s(reads))
        scatter.append(time_s(writes))
        both = reads + writes
        chunking += t * time_s(both, m / t) - time_s(both)
    return OverlapGemms((gather[0], gather[1]), (scatter[0], scatter[1]), chunking)


def async_tp_exposed_s(gemms: OverlapGemms, all_gather_s: float, reduce_scatter_s: float,
                       overlap: float) -> tuple[float, float]:
    """Exposed TP communication of one layer's (forward, backward) points under async TP.

    Forward: the all-gather under the GEMMs reading it, the reduce-scatter
    under those writing it. Backward (input-gradient GEMMs, the same shapes):
    the gradient's all-gather under the row-parallel GEMMs, its
    reduce-scatter under the column-parallel ones.
    """
    fwd = bwd = 0.0
    for point in range(2):
        g, s = overlap * gemms.gather_s[point], overlap * gemms.scatter_s[point]
        fwd += max(0.0, all_gather_s - g) + max(0.0, reduce_scatter_s - s)
        bwd += max(0.0, all_gather_s - s) + max(0.0, reduce_scatter_s - g)
    return fwd, bwd


def _sm_cost_s(claim: CommSms, gemm_s: float, comm_s: float, sm_count: int) -> float:
    """Extra time of a GEMM of gemm_s whose overlapped collective (comm_s) holds claim.sms of sm_count SMs."""
    if not claim.sms or not sm_count:
        return 0.0
    if claim.sms >= sm_count:
        raise ValueError(f"a collective cannot hold {claim.sms} of the GPU's {sm_count} SMs")
    if claim.margin:  # launched on the other SMs for its whole run
        return gemm_s * claim.sms / (sm_count - claim.sms)
    return min(comm_s, gemm_s) * claim.sms / sm_count  # the SMs are shared only while the collective runs


def sm_share_s(gemms: OverlapGemms, sms: TpOverlapSms, sm_count: int, all_gather_s: float,
               reduce_scatter_s: float) -> tuple[float, float, float]:
    """Extra GEMM time of one layer from the SMs its overlapped TP collectives hold (module docstring).

    Returns (forward, backward input-gradient, backward weight-gradient) seconds:
    the forward reduce-scatters under the row-parallel GEMMs; in the backward
    the re-gather of the saved input under the column-parallel input-gradient
    GEMMs and the reduce-scatter of their output under the weight-gradient
    GEMMs (both the shape of the column-parallel forward GEMMs).
    """
    fwd = dgrad = wgrad = 0.0
    for point in range(2):
        fwd += _sm_cost_s(sms.fprop_rs[point], gemms.scatter_s[point], reduce_scatter_s, sm_count)
        dgrad += _sm_cost_s(sms.dgrad_ag[point], gemms.gather_s[point], all_gather_s, sm_count)
        wgrad += _sm_cost_s(sms.wgrad_rs[point], gemms.gather_s[point], reduce_scatter_s, sm_count)
    return fwd, dgrad, wgrad
