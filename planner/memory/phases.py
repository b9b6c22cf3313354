"""The phases of one training step on one rank: what coexists at each; the largest is the peak.

Summing every category's own maximum counts tensors that never meet: the
gradients are freed between steps (zero_grad(set_to_none=True)), the
activations are gone before the optimizer steps, and FSDP's gathered units
and reduce-scatter buffers come and go during the backward. PyTorch's
memory tracker (`meshplan validate-memory`) sees the meshplan executor's
peak at one of the moments below. Symbols, for one rank of a pipeline stage:
W parameter storage (+ RoPE buffers), C compute copy kept from forward to
backward, O optimizer state, Gs the step's gradients, Ga gradients of earlier
micro-batches (grad_accum_steps > 1: FSDP2 reduce-scatters every micro-batch,
so only the fp32 gradient shards stay; DDP's and replicate's no-sync
accumulation keeps every gradient unsharded in fp32, 4 B per parameter), K DDP's gradient buckets (persistent), X activation-time
communication (PP, CP, EP, Megatron-style SP; planner.memory.estimate; CP's K/V
exchange only in the block phases, where attention runs), A the kept
activations of every in-flight micro-batch, A1 one layer's, R the recompute
transient of one layer (planner.memory.activations) plus its backward
gradients (`layer_backward_transient`), L4 / L8 4 and 8 B per logit (saved
log-probabilities; the loss backward's extra fp32 gradients), D / G compute /
reduction dtype bytes, root, block, head the stage's FSDP root unit, one block
and the output matrix (planner.memory.params); "ZeRO-3" gathers exist only
under FSDP2 with reshard_after_forward=True and no pipeline:

  backward_start   W + C + Ga + O + A + L8 + K + X: the loss backward of the last
                   micro-batch, every activation alive. With the loss the root
                   unit resharded after its forward; without it (PP), ZeRO-3
                   gathers D(root + 2 block) as the stage's backward starts.
  output_backward  the larger of two moments. With FSDP2 the head unit (final norm +
                   output, its own unit, not resharded after forward: D x head at
                   backward_start too) is reduced right after its backward:
                   W + C + Ga + O + A + K + X + head gathered + its all-gather
                   buffer and reduce-scatter input ((D + G) head) + its shard;
                   the other, the logits' gradient:
                   W + C + Ga + O + A - L4 + D*logits + K + X + head gradient:
                   log-probabilities freed, the D-byte logits gradient alive;
                   the head's gradient (D, in the FSDP2 root unit until its
                   reduction: comm_buffers; 4 (+ D under autocast) into .grad:
                   grads); ZeRO-3 + D(root + block).
  block_backward   the largest of four moments of the blocks' backward (A' = A
                   without the output tensors; P = the first weight gradient,
                   the MLP's down projection, D*h*f/t under FSDP2, else 4 (+D)):
                   first block      A' + R + P + head gradient + ZeRO-3 gathers
                   second block     A' - A1 + R + P + G block (the previous
                                    reduce-scatter input, kept until the next)
                   FSDP2 copy-in    A' - A1 + (D + G) block (its unsharded
                                    gradient into a new reduce-scatter input)
                   last block       the stage's first layer: A' - (layers - 1)
                                    A1 + R + P, gradients nearly all there
                                    (Gs but the block's and embedding's)
                   with autocast and full recomputation, the recomputed
                   block's D-byte weight copies (D x block) too; a block's
                   share of C (D x block) is gone once its backward is done.
  backward_end     W + Gs + O + K + the root's reduction, activations freed:
                   FSDP2 max( D root gathered + D root gradients (+ 2 D matrix
                   for a tied one: its second gradient and their sum) + G block
                   (the previous reduce-scatter input), (D + G) root gradients
                   at the copy-in (replicate: G + max(D, G), the all-reduce
                   output too) ); the root's own gradient shard not there yet.
  optimizer_step   W + Gs + O + K: nothing on top (executor.components.optim:
                   clipping reduces each gradient in place and scales it in
                   place; AdamW runs fused, one kernel updating parameters and
                   moments in place, with no temporaries, on plain and DTensor
                   parameters alike).

Against the tracker (tests/test_memory_phases.py, bench/validate_memory_1b.py):
backward_start is the peak of every FSDP, HSDP, TP x FSDP and ZeRO-1 layout of
the ~100M test model and Llama 3.2 1B, within 0.1%; short sequences, a small
vocabulary, full recomputation or one GPU move the peak to the other phases.
`breakdown_bytes` is the breakdown AT the peak phase; temporaries go to the
category of what they are made from (clipping's to grads, AdamW's to
optimizer, unsharded gradients and reduction buffers to comm_buffers).

megatron and deepspeed keep the published accounting, one phase with every
model state, buffer and activation at once (`backward_start`): their
gradients live in persistent contiguous buffers and their executors are not
ours to measure.
"""

from __future__ import annotations

from typing import NamedTuple

from planner.engines import DDP_BUCKET_BYTES, Engine
from planner.layout import Layout
from planner.memory.activations import FP32_BYTES
from planner.memory.lora import stage_adapter_params
from planner.memory.params import StageParams, ceil_div
from planner.memory.states import ModelStates
from planner.model.spec import ModelSpec
from planner.training import DTYPE_BYTES, TrainingSpec

PHASES = ("backward_start", "output_backward", "block_backward", "backward_end", "optimizer_step")

Phase = tuple[int, int, int, int, int]  # params, grads, optimizer, activations, comm_buffers


class Activations(NamedTuple):
    """One micro-batch's activation bytes on one rank, by where they sit (planner.memory.activations).

    NamedTuples rather than frozen dataclasses here: built on every call of
    estimate_memory, they must be cheap.
    """

    per_layer: float  # A1: kept per layer (with the rotary table copies)
    recomputed: float  # one layer's recompute transient (once per rank)
    backward_temp: float  # one layer's backward gradients beyond its saved tensors (once per rank)
    embedding: float  # embedding dropout mask (first stage)
    output: float  # final norm + output-layer inputs (last stage)
    logits_saved: float  # saved fp32 log-probabilities (last stage)
    loss_transient: float  # the loss backward's extra fp32 gradients, once (last stage)
    logits_grad: float  # the D-byte gradient of the logits in the output layer's backward, once
    loss_hole: float = 0.0  # D per local logit the loss backward cannot reuse (planner.memory.reserved)
    stage_output: float = 0.0  # pipelining: one micro-batch's stage output (Pipeline.stage_outputs)
    offloaded_layers: int = 0  # layers per rank whose kept activations sit in host memory (activation offload)
    # micro-batches whose output-layer tensors (final norm and output inputs, logits) the last stage holds at
    # once; 0: as many as its layers' (planner.memory.in_flight.output_in_flight)
    output_flight: float = 0.0
    # stage outputs and receive buffers kept, in stage outputs, on (the first rank, a middle one, the last rank)
    # (planner.memory.boundary.boundary_buffers); None under the V schedules (zb-v, dualpipev)
    boundary: tuple[float, float, float] | None = (0.0, 0.0, 0.0)


def on_gpu_layers(sp: StageParams, acts: Activations) -> int:
    """The stage's layers whose kept activations stay on the GPU: activation offload moves the others' to the
    host after their forward and brings each back one layer ahead of its backward (Transformer Engine's CPU
    offload context prefetches one group), and at least one layer, the last, never leaves."""
    if not sp.layers:
        return 0
    return sp.layers - min(acts.offloaded_layers, sp.layers - 1)


class StageBytes(NamedTuple):
    """A stage's per-rank amounts that do not depend on its pipeline position (computed once per placement)."""

    params: int  # W (+ buffers)
    copy: int  # C
    grads: int  # Gs
    optimizer: int  # O
    buckets: int  # K (published engines: every data-parallel buffer)
    comm: int  # X (without CP's: attention_comm)
    accumulated: int = 0  # Ga
    fsdp2: bool = False  # unsharded gradients wait in FSDP2 units (comm_buffers), not in .grad (grads)
    head_grad: int = 0  # the output matrix's gradient from the output layer's backward on
    partial_grad: int = 0  # P: a block's first weight gradient
    gathered_start: int = 0  # ZeRO-3: root + block in use + prefetched block
    gathered_output: int = 0  # ZeRO-3: root + prefetched block
    block_rs: int = 0  # G block: one reduce-scatter input
    block_grad: int = 0  # D block: a block's unsharded gradient at its copy-in
    last_grads: int = 0  # gradients present at the stage's last block backward
    recompute_copy: int = 0  # autocast's weight copies of the block being recomputed
    block_copy: int = 0  # a block's share of C, released once its backward is done
    end_transient: int = 0  # FSDP2 root reduction (backward_end)
    root_grads: int = 0  # the root unit's share of Gs, not there yet during its reduction
    clip: int = 0  # gradient clipping temporaries
    adamw: int = 0  # the optimizer's step temporaries (none for fused AdamW: module docstring)
    head_kept: int = 0  # FSDP2 head unit (final norm + output) gathered from its forward to its backward
    head_reduce: int = 0  # the head unit's reduction: its all-gather buffer and reduce-scatter input
    head_shard: int = 0  # the head unit's reduced gradient shard, there from its reduction on
    # planner.memory.reserved: the caching allocator's pools (PyTorch engines)
    reserve_model: bool = False
    ag_pool: int = 0  # FSDP2 all-gather stream: two consecutive units' all-gather outputs
    reduce_out: int = 0  # reduce-scatter stream: one unit's fresh output while micro-batches accumulate
    accumulated_default: bool = False  # Ga lives on the default stream (replicate's unsharded no-sync sums)
    # CP's K/V exchange buffers (planner.memory.estimate): alive only while a block's attention runs, so only
    # in the block phases, not at the loss or output layer's backward
    attention_comm: int = 0


def step_phases(sb: StageBytes, sp: StageParams, acts: Activations, in_flight: float) -> dict[str, Phase]:
    """Bytes by category (no `other`) at each phase of the step this stage goes through (module docstring)."""
    kept = in_flight * on_gpu_layers(sp, acts) * acts.per_layer + \
        (in_flight * acts.embedding if sp.has_embedding else 0.0)
    if acts.boundary is not None:  # torch.distributed.pipelining's stage outputs and receive buffers
        kept += acts.boundary[0 if sp.has_embedding else 2 if sp.has_output else 1] * acts.stage_output
    elif not sp.has_output:  # V schedules: each in-flight micro-batch's output, and the output gradient received for one
        kept += (in_flight + 1) * acts.stage_output
    out = (acts.output_flight or in_flight) * (acts.output + acts.logits_saved) if sp.has_output else 0.0
    fwd = sb.params + sb.copy
    base = sb.buckets + sb.comm
    start_act = kept + out + (acts.loss_transient if sp.has_output else 0.0)
    head_kept = sb.head_kept if sp.has_output else 0
    phases = {"backward_start": (fwd, sb.accumulated, sb.optimizer, int(start_act),
                                 base + head_kept + (0 if sp.has_output else sb.gathered_start))}
    head = sb.head_grad if sp.has_output else 0
    head_comm, head_grads = (head, 0) if sb.fsdp2 else (0, head)
    if sp.has_output:
        act = kept + out - acts.logits_saved + acts.logits_grad
        logits_moment = (fwd, sb.accumulated + head_grads, sb.optimizer, int(act),
                         base + head_comm + head_kept + sb.gathered_output)
        # the head unit's own reduction, logits gone: gathered weights, all-gather and reduce-scatter buffers
        head_shard = 0 if sb.accumulated else sb.head_shard  # accumulated: the shard is already there
        reduce_moment = (fwd, sb.accumulated + head_shard, sb.optimizer, int(kept),
                         base + head_kept + sb.head_reduce)
        phases["output_backward"] = max(logits_moment, reduce_moment, key=sum)
    if sb.head_shard and sp.has_output:  # the head unit is reduced before the blocks' backward
        head_comm, head_grads = 0, (0 if sb.accumulated else sb.head_shard)
    if sp.layers:
        phases["block_backward"] = _block_backward(sb, sp, acts, kept, head_comm, head_grads)
    phases["backward_end"] = (sb.params, sb.grads - sb.root_grads, sb.optimizer, 0, sb.buckets + sb.end_transient)
    clip, adamw = (sb.clip, 0) if sb.clip >= sb.adamw else (0, sb.adamw)
    phases["optimizer_step"] = (sb.params, sb.grads + clip, sb.optimizer + adamw, 0, sb.buckets)
    return phases


def _block_backward(sb: StageBytes, sp: StageParams, acts: Activations, kept: float, head_comm: int,
                    head_grads: int) -> Phase:
    """The largest of the four block-backward moments of the module docstring."""
    fwd, base = sb.params + sb.copy, sb.buckets + sb.comm + sb.attention_comm + head_comm + sb.gathered_start
    partial_comm, partial_grads = (sb.partial_grad, 0) if sb.fsdp2 else (0, sb.partial_grad)
    grads = sb.accumulated + head_grads + partial_grads
    rebuilt = kept + acts.recomputed + acts.backward_temp  # the block in backward: rebuilt, its gradients
    rebuilt_params = fwd + sb.recompute_copy
    moments = [(rebuilt_params, grads, sb.optimizer, int(rebuilt), base + partial_comm)]
    if sp.layers > 1:
        moments.append((rebuilt_params - sb.block_copy, grads, sb.optimizer, int(rebuilt - acts.per_layer),
                        base + partial_comm + sb.block_rs))
        done = sp.layers - 1  # blocks whose backward is over when the stage's first layer runs its own
        moments.append((rebuilt_params - done * sb.block_copy, sb.last_grads + partial_grads, sb.optimizer,
                        int(rebuilt - done * acts.per_layer), base + partial_comm + sb.block_rs))
    if sb.fsdp2:
        moments.append((fwd - sb.block_copy, sb.accumulated + head_grads, sb.optimizer, int(kept - acts.per_layer),
                        base + sb.block_grad + sb.block_rs))
    return max(moments, key=sum)


def peak_phase(phases: dict[str, Phase]) -> tuple[str, Phase]:
    """The phase with the most bytes (the first of equal ones) and its bytes."""
    name, peak = "", -1
    for phase_name, phase in phases.items():
        total = sum(phase)
        if total > peak:
            name, peak = phase_name, total
    return name, phases[name]


def published_phase(sb: StageBytes, sp: StageParams, acts: Activations, in_flight: float) -> dict[str, Phase]:
    """megatron / deepspeed: every state, buffer and activation at once (the papers' accounting)."""
    act = in_flight * on_gpu_layers(sp, acts) * acts.per_layer + (acts.recomputed if sp.layers else 0.0)
    if sp.has_embedding:
        act += in_flight * acts.embedding
    if sp.has_output:
        act += (acts.output_flight or in_flight) * (acts.output + acts.logits_saved) + acts.loss_transient
    return {"backward_start": (sb.params + sb.copy, sb.grads, sb.optimizer, int(act), sb.buckets + sb.comm)}


def torch_stage_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams,
                      states: ModelStates, comm: int, *, engine: Engine) -> StageBytes:
    """The buffers and temporaries of a PyTorch engine's data-parallel path (module docstring formulas).

    The path is the engine's (Engine.dp_path): torch DDP keeps bucket copies of every gradient
    (gradient_as_bucket_view=False, the default meshplan's executor and torchtitan's DDP keep), FSDP2's
    units hold unsharded gradients and reduce-scatter inputs. A MoE block's units (its dense part,
    router and shared experts, and its routed experts) are gathered together for its compute: one block
    unit here. torchao's float8 all-gathers (Fp8Recipe.fp8_all_gather) gather the blocks' linear
    weights in one byte each, norms in the compute dtype.
    """
    d, g = training.dtype_bytes, DTYPE_BYTES[training.grad_dtype]
    fp8_all_gather = engine.fp8.fp8_all_gather
    path = engine.dp_path(layout)
    fsdp2 = path in ("fsdp", "replicate")
    autocast = engine.autocast(layout, d, training.lora)
    grad_bytes = d if fsdp2 else FP32_BYTES + (d if autocast else 0)  # a fresh weight gradient, per parameter
    zero3 = path == "fsdp" and layout.zero_stage == 3 and states.compute_copy == 0
    sharded = layout.zero_stage >= 2
    shards = layout.dp_shard * layout.cp  # the executor folds cp into FSDP's group
    grad_share = (lambda n: ceil_div(FP32_BYTES * n, shards)) if sharded else (lambda n: FP32_BYTES * n)
    pending = sp.block + sp.uncast  # gradients the stage's last block backward has not made yet
    unit = sp.block  # a block's FSDP units
    # bytes of one block unit gathered, expressed in compute-dtype elements (float8 weights: 1 byte of d)
    norms = model.norms_per_layer * model.hidden
    gunit = (norms + (unit - norms) / d) if fp8_all_gather and training.fp8 and unit > norms else unit
    # FSDP2 reduces every micro-batch: earlier ones leave the sharded fp32 gradients; DDP and replicate skip
    # the sync and keep every gradient unsharded, and so does FSDP2 under torch.distributed.pipelining, whose
    # stages turn the sync off for every backward and reduce once after the last (PipelineStage
    # backward_maybe_with_nosync, perform_reduce_grad)
    nosync = path == "replicate" or (path == "fsdp" and layout.pp > 1)
    accumulated = (FP32_BYTES * sp.total if nosync else states.grads) if layout.grad_accum_steps > 1 else 0
    # FSDP2 units of executor.parallel.parallelize.apply_fsdp: embeddings, each block, final norm + output
    # (kept gathered from its forward to its backward), an empty root; tied weights stay in the root
    split = path == "fsdp" and not model.tie_embeddings
    head_unit = sp.head + model.norm_params if split and sp.has_output else 0
    root = sp.root - head_unit
    if path == "fsdp" and accumulated and not nosync:
        last_grads = states.grads
    elif nosync and accumulated:
        last_grads = accumulated
    elif sharded:
        last_grads = states.grads - min(states.grads, grad_share(pending)) + \
            (FP32_BYTES * pending if accumulated else 0)
    else:
        last_grads = max(accumulated, states.grads - min(states.grads, grad_share(pending)))
    # ZeRO-3 gathers: the block in use and the prefetched one (the embedding unit, prefetched by the
    # first layer's backward, when larger), and the root if it holds the embeddings (FSDP2 never
    # reshards a root)
    if not zero3:
        gathered = 0
    elif split:
        gathered = int(d * (gunit + max(gunit, root)))
    else:
        gathered = int(d * (root + 2 * gunit))
    end_transient = root_grads = 0
    if fsdp2:
        root_grads = min(states.grads, grad_share(root))
        root_copy = d * root if path == "fsdp" or d < FP32_BYTES else 0
        tied = 2 * d * sp.head if model.tie_embeddings and sp.has_embedding and sp.has_output else 0
        last = root or unit  # the unit reduced last: the root, or the first block of a middle stage
        copy_in = (g + (max(d, g) if path == "replicate" else d)) * last
        previous_rs = g * unit if root and sp.layers else 0
        end_transient = max(copy_in, root_copy + d * root + tied + previous_rs)
    # planner.memory.reserved: FSDP2 all-gathers each unit in the forward (ZeRO-2 and 3) when its shard group
    # has more than one rank; the previous unit's output is kept until the next one's is waited on
    ag_pool = 0
    if path == "fsdp" and shards > 1:
        units = ([root] if root else []) + ([gunit] if sp.layers else []) + ([head_unit] if head_unit else [])
        pairs = [a + b for a, b in zip(units, units[1:], strict=False)] + ([2 * gunit] if sp.layers > 1 else [])
        ag_pool = int(d * max(pairs or units or [0]))
    biggest_unit = max(root, unit, head_unit)
    # FSDP2 reduces every micro-batch and adds the fresh output in; replicate reduces once, after the last
    reduce_out = grad_share(biggest_unit) if path == "fsdp" and not nosync and layout.grad_accum_steps > 1 else 0
    out = StageBytes(
        params=states.params, copy=states.compute_copy, grads=states.grads, optimizer=states.optimizer,
        buckets=g * sp.total if path == "ddp" else 0, comm=comm, accumulated=accumulated, fsdp2=fsdp2,
        head_grad=grad_bytes * sp.head,
        partial_grad=grad_bytes * ceil_div(model.hidden * model.ffn_hidden, layout.tp),
        gathered_start=gathered, gathered_output=int(d * gunit if split else gathered - d * gunit) if zero3 else 0,
        block_rs=g * unit if fsdp2 else 0, block_grad=d * unit if fsdp2 else 0, last_grads=last_grads,
        recompute_copy=d * sp.block if autocast and layout.recompute == "full" else 0,
        block_copy=int(d * (sp.block - unit + gunit)) if states.compute_copy and not (autocast and layout.recompute == "full")
        else 0,  # (a float8-gathered unit's linears in 1 byte: planner.memory.states)
        end_transient=end_transient, root_grads=root_grads, clip=0,
        head_kept=int(d * (head_unit + (gunit if sp.layers else 0))) if zero3 and split else 0, head_reduce=(d + g) * head_unit,
        # (parameter offload: the reduced shard goes to the host with every other gradient shard)
        head_shard=grad_share(head_unit) if split and layout.offload != "optimizer+params" else 0,
        reserve_model=True, ag_pool=ag_pool,
        reduce_out=reduce_out if states.grads else 0, accumulated_default=nosync)
    return _lora_stage_bytes(model, training, layout, sp, out, path) if training.lora else out


def _lora_stage_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams, sb: StageBytes,
                      path: str) -> StageBytes:
    """A LoRA stage (planner.memory.lora): only the adapters have gradients, so every gradient buffer, bucket
    and reduction of torch_stage_bytes is the adapters' size; the frozen head makes no gradient."""
    d, g = training.dtype_bytes, DTYPE_BYTES[training.grad_dtype]
    adapters = stage_adapter_params(model, training, layout.tp, sp)
    block = adapters // sp.layers if sp.layers else 0
    shards = layout.dp_shard * layout.cp if layout.zero_stage >= 2 else 1
    nosync = path == "replicate" or (path == "fsdp" and layout.pp > 1)
    accumulated = (FP32_BYTES * adapters if nosync else sb.grads) if layout.grad_accum_steps > 1 else 0
    reduce_out = ceil_div(FP32_BYTES * block, shards) if sb.reduce_out else 0
    return sb._replace(buckets=g * adapters if path == "ddp" else 0, accumulated=accumulated, head_grad=0,
                       partial_grad=0, block_rs=g * block if sb.fsdp2 else 0, block_grad=d * block if sb.fsdp2 else 0,
                       last_grads=max(accumulated, sb.grads), root_grads=0, head_reduce=0, head_shard=0,
                       reduce_out=reduce_out)


def published_stage_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams,
                          states: ModelStates, comm: int, block_gather_bytes: float = 0.0) -> StageBytes:
    """megatron / deepspeed: their data-parallel buffers (planner.memory.estimate docstring), all counted at once.

    block_gather_bytes: bytes per parameter of a gathered block under ZeRO-3 where they are not the
    compute dtype's (8-bit parameters: Megatron FSDP all-gathers their uint8 row-wise data).
    """
    d, g = training.dtype_bytes, DTYPE_BYTES[training.grad_dtype]
    w = block_gather_bytes or d
    if layout.zero_stage <= 1:
        dp = DDP_BUCKET_BYTES if layout.dp > 1 else 0
    else:
        dp = (d + g) * sp.block + (int(d * max(sp.root, sp.block) + w * 2 * sp.block) if layout.zero_stage == 3 else 0)
    return StageBytes(states.params, states.compute_copy, states.grads, states.optimizer, dp, comm)
