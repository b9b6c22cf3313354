"""Export to Megatron-LM: its command-line arguments, as a bash array.

Argument names follow megatron/training/arguments.py of Megatron-Core 0.14
(2025), which 0.15, 0.16 and main still accept. `--target-version` below
0.14 writes the older names (checked against the core_v0.12.0 and
core_v0.13.0 trees): Megatron-FSDP was `--use-custom-fsdp` and had no
fsdp_dtensor checkpoint format; 0.12 has no --pipeline-model-parallel-layout,
only --decoder-first/last-pipeline-num-layers for a split whose middle
stages are even. Megatron builds its groups in the order tp-cp-ep-dp-pp (tp fastest),
the same rank grid as meshplan's (pp, dp_replicate, dp_shard, cp, tp), so
the degrees carry over one to one.

ZeRO in Megatron terms:
  ZeRO-1     --use-distributed-optimizer (optimizer state and fp32 master
             weights sharded over DP); with dp_replicate > 1 also
             --num-distributed-optimizer-instances dp_replicate, which shards
             within dp_shard and replicates across replicas, as HSDP does.
  ZeRO-2/3   Megatron-FSDP: --use-megatron-fsdp
             --data-parallel-sharding-strategy optim_grads | optim_grads_params
             (documented with TP, CP and EP, not with PP).

Pipeline split: an even split needs no argument (interleaved: one
--num-layers-per-virtual-pipeline-stage); any other split is written as
--pipeline-model-parallel-layout, whose stages are listed in model order
(chunk k on pipeline rank k % pp): "E" embedding, "t" a transformer layer,
"L" the loss, "|" between stages.
"""

from __future__ import annotations

import shlex

from planner.engines.refusals import BUILT_FAMILIES as _BUILT_FAMILIES
from planner.export import ExportRefused, ExportResult
from planner.export.common import (
    comment_block,
    lora_notes,
    notes_lines,
    predicted_change,
    stage_layers,
    summary_lines,
)
from planner.plan import Plan

Arg = tuple[str, ...]  # one option and its values, e.g. ("--micro-batch-size", "1")


MEGATRON_FSDP_RENAMED = (0, 14)  # --use-custom-fsdp became --use-megatron-fsdp (+ --ckpt-format fsdp_dtensor)
LAYOUT_ADDED = (0, 13)  # first release with --pipeline-model-parallel-layout


def export(plan: Plan, version: tuple[int, ...] = (0, 16)) -> ExportResult:
    args, notes = build_args(plan, version)
    lay = plan.layout
    shown = ".".join(map(str, version))
    header = [f"Megatron-LM arguments (Megatron-Core {shown}, megatron/training/arguments.py) written by "
              "`meshplan export`"]
    text = "#!/usr/bin/env bash\n" + comment_block(header + summary_lines(plan) + notes_lines(notes))
    if max(lay.tp, lay.cp) > 1 and not {("--use-megatron-fsdp",), ("--use-custom-fsdp",)} & set(args):
        text += "# Megatron requires this with TP or CP on GPUs before Blackwell (validate_args)\n"
        text += "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    text += "MEGATRON_ARGS=(\n" + "".join(f"  {shlex.join(a)}\n" for a in args) + ")\n"
    text += comment_block([
        "add your data, tokenizer, learning-rate and checkpoint arguments, then on every node run e.g.",
        f"torchrun --nnodes {plan.cluster.n_nodes} --nproc-per-node {plan.cluster.gpus_per_node} "
        '--rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:29500" pretrain_gpt.py "${MEGATRON_ARGS[@]}" ...',
    ])
    return ExportResult("megatron", text, "megatron_args.sh", tuple(notes))


def build_args(plan: Plan, version: tuple[int, ...] = (0, 16)) -> tuple[list[Arg], list[str]]:
    """Megatron's options for the plan (each with its values) and the notes on what they cannot express."""
    notes: list[str] = lora_notes(plan, "megatron")
    args = _parallel_args(plan, notes, version) + _batch_args(plan) + _recompute_args(plan) + _offload_args(plan, notes)
    args += _precision_args(plan, notes) + _model_args(plan, notes) + _feature_args(plan, notes, version)
    args += _host_args(plan, version)
    args = list(dict.fromkeys(args))  # a flag two parts need (--use-precision-aware-optimizer) once
    return args, notes


CUDA_GRAPH_IMPL_ADDED = (0, 15)  # --cuda-graph-impl local; before it --enable-cuda-graph


def _host_args(plan: Plan, version: tuple[int, ...]) -> list[Arg]:
    """Recipe options the prediction assumed: grouped GEMMs for the routed experts, the fused router
    and CUDA graphs (host time, planner.simulate.launches); the expert all-to-alls of one
    micro-batch under another's compute (planner.simulate.step)."""
    args: list[Arg] = []
    if plan.model.moe is not None and plan.training.moe_grouped_gemm:
        args.append(("--moe-grouped-gemm",))
    if plan.model.moe is not None and plan.training.moe_router_fusion:
        args.append(("--moe-router-fusion",))
    if plan.model.moe is not None and plan.training.moe_a2a_overlap:
        args.append(("--overlap-moe-expert-parallel-comm",))
    if plan.training.cuda_graphs:
        args.append(("--cuda-graph-impl", "local") if version >= CUDA_GRAPH_IMPL_ADDED else ("--enable-cuda-graph",))
    elif plan.model.moe is not None and plan.training.moe_router_graphs and version >= CUDA_GRAPH_IMPL_ADDED:
        args += [("--cuda-graph-impl", "transformer_engine"), ("--cuda-graph-scope", "moe_router", "moe_preprocess")]
    return args


def _parallel_args(plan: Plan, notes: list[str], version: tuple[int, ...]) -> list[Arg]:
    lay = plan.layout
    args: list[Arg] = [("--tensor-model-parallel-size", str(lay.tp)),
                       ("--pipeline-model-parallel-size", str(lay.pp)),
                       ("--context-parallel-size", str(lay.cp))]
    if lay.ep > 1:
        args.append(("--expert-model-parallel-size", str(lay.ep)))
    if plan.model.moe is not None:  # Megatron-Core's default expert TP is tp; the plan's grid is explicit
        args.append(("--expert-tensor-parallel-size", str(lay.etp)))
    if lay.sequence_parallel:
        args.append(("--sequence-parallel",))
        if plan.training.async_tp:  # Transformer Engine userbuffers: SP's collectives pipelined with the GEMMs
            args.append(("--tp-comm-overlap",))
    if lay.cp > 1 and plan.training.seq_len % (2 * lay.cp):
        notes.append(f"cp {lay.cp}: Megatron needs seq_len ({plan.training.seq_len}) divisible by 2 * cp")
    return args + _pipeline_args(plan, notes, version) + _zero_args(plan, notes, version)


def _pipeline_args(plan: Plan, notes: list[str], version: tuple[int, ...]) -> list[Arg]:
    lay = plan.layout
    if lay.pp == 1:
        return []
    if lay.pp_schedule == "gpipe":
        notes.append("pp_schedule gpipe: Megatron has no GPipe schedule; it runs 1F1B (same bubble, less memory)")
    if lay.pp_schedule in ("zb-v", "dualpipev"):
        notes.append(f"pp_schedule {lay.pp_schedule}: Megatron has no such schedule; exported as interleaved 1F1B "
                     "with the same 2 chunks per rank (chunk k on rank k % pp instead of the V placement)")
    counts = stage_layers(plan)
    if len(set(counts)) == 1:
        return [("--num-layers-per-virtual-pipeline-stage", str(counts[0]))] if lay.virtual_stages > 1 else []
    if version >= LAYOUT_ADDED:
        return [("--pipeline-model-parallel-layout", pipeline_layout(counts))]
    if lay.virtual_stages == 1 and len(set(counts[1:-1])) <= 1:
        return [("--decoder-first-pipeline-num-layers", str(counts[0])),
                ("--decoder-last-pipeline-num-layers", str(counts[-1]))]
    raise ExportRefused(
        f"layers per stage {list(counts)}: Megatron-Core before 0.13 splits unevenly only through the first and "
        "last stage (--decoder-first/last-pipeline-num-layers) without virtual stages; export with "
        "--target-version 0.13 or later (--pipeline-model-parallel-layout), or plan an even split")


def pipeline_layout(counts: tuple[int, ...]) -> str:
    """Megatron's layout string for layers per stage in model order, e.g. (3, 2) -> 'E,t*3|t*2,L'."""
    return "E," + "|".join(f"t*{n}" for n in counts) + ",L"


def _zero_args(plan: Plan, notes: list[str], version: tuple[int, ...]) -> list[Arg]:
    lay = plan.layout
    if lay.zero_stage == 0:
        return []
    instances = [("--num-distributed-optimizer-instances", str(lay.dp_replicate))] if lay.dp_replicate > 1 else []
    if lay.zero_stage == 1:
        return [("--use-distributed-optimizer",), *instances]
    if lay.pp > 1:
        notes.append(f"ZeRO-{lay.zero_stage} with pp {lay.pp}: Megatron-FSDP is not documented with pipeline "
                     "parallelism; exported as the distributed optimizer (ZeRO-1), so gradients"
                     + (" and parameters" if lay.zero_stage == 3 else "") + " stay replicated over dp: "
                     + predicted_change(plan, lay.replace(zero_stage=1), "megatron"))
        return [("--use-distributed-optimizer",), *instances]
    if lay.dp_replicate > 1:
        notes.append(f"HSDP (dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}): exported as Megatron-FSDP "
                     f"sharding over all {lay.dp} data-parallel ranks, so sharded collectives cross the replicas: "
                     + predicted_change(plan, lay.replace(dp_replicate=1, dp_shard=lay.dp), "megatron"))
    strategy = "optim_grads" if lay.zero_stage == 2 else "optim_grads_params"
    if version < MEGATRON_FSDP_RENAMED:
        return [("--use-custom-fsdp",), ("--data-parallel-sharding-strategy", strategy),
                ("--use-distributed-optimizer",), ("--no-gradient-accumulation-fusion",)]
    return [("--use-megatron-fsdp",), ("--data-parallel-sharding-strategy", strategy),
            ("--use-distributed-optimizer",), ("--no-gradient-accumulation-fusion",),
            ("--ckpt-format", "fsdp_dtensor")]


def _batch_args(plan: Plan) -> list[Arg]:
    return [("--micro-batch-size", str(plan.layout.micro_batch_size)),
            ("--global-batch-size", str(plan.training.global_batch_size)),
            ("--seq-length", str(plan.training.seq_len))]


def _recompute_args(plan: Plan) -> list[Arg]:
    """selective recomputes the layout's modules (--recompute-modules, space-separated as Megatron's nargs='*'
    option takes them; none named: Megatron's default core_attn), full every layer."""
    if plan.layout.recompute == "selective":
        modules = [("--recompute-modules", *plan.layout.recompute_modules)] if plan.layout.recompute_modules else []
        return [("--recompute-granularity", "selective"), *modules]
    if plan.layout.recompute == "full" and plan.layout.recompute_layers:  # the first N layers of each chunk
        return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
                ("--recompute-num-layers", str(plan.layout.recompute_layers))]
    if plan.layout.recompute == "full":
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                ("--recompute-num-layers", "1")]
    return []


def _offload_args(plan: Plan, notes: list[str]) -> list[Arg]:
    """Optimizer offload, and the activations of N layers kept in host memory (Transformer Engine's CPU
    offload context, which Megatron-Core drives with --cpu-offloading and --cpu-offloading-num-layers)."""
    args: list[Arg] = []
    if plan.layout.activation_offload_layers:
        args += [("--cpu-offloading",), ("--cpu-offloading-num-layers", str(plan.layout.activation_offload_layers))]
    offload = plan.layout.offload
    if offload == "none":
        return args
    if offload == "optimizer+params":
        notes.append("offload of parameters: Megatron offloads optimizer state only; parameters stay on the GPU")
    return args + [("--optimizer-cpu-offload",), ("--optimizer-offload-fraction", "1.0"),
                   ("--use-precision-aware-optimizer",)]


def _precision_args(plan: Plan, notes: list[str]) -> list[Arg]:
    tr = plan.training
    args: list[Arg] = [("--bf16",)] if tr.dtype == "bf16" else [("--fp16",)] if tr.dtype == "fp16" else []
    if tr.grad_dtype == "bf16" and tr.dtype == "bf16":
        args.append(("--grad-reduce-in-bf16",))
    elif tr.grad_dtype != "fp32":
        notes.append(f"grad_dtype {tr.grad_dtype} with dtype {tr.dtype}: Megatron reduces in fp32 or bf16 only")
    args.append(("--optimizer", "adam" if tr.optimizer == "adamw" else "sgd"))  # Megatron's adam is AdamW
    if tr.precision == "fp8":  # Transformer Engine: E4M3 forward, E5M2 gradients, per-tensor delayed scaling
        args += [("--fp8-format", "hybrid"), ("--fp8-recipe", "delayed")]
    elif tr.precision == "mxfp8":
        args += [("--fp8-format", "e4m3"), ("--fp8-recipe", "mxfp8")]
    if tr.fp8_params:  # 8-bit parameters, the memory the plan assumed (planner.engines.TE_FP8)
        args.append(("--fp8-param-gather",))
    if tr.optimizer_dtype != "fp32":  # 16-bit moments: Megatron-Core's precision-aware optimizer (TE FusedAdam)
        args += [("--use-precision-aware-optimizer",), ("--exp-avg-dtype", tr.optimizer_dtype),
                 ("--exp-avg-sq-dtype", tr.optimizer_dtype)]
    if tr.fused_cross_entropy:  # Transformer Engine's loss kernel (Megatron-Core >= 0.12): only the bf16 logits kept
        args += [("--cross-entropy-loss-fusion",), ("--cross-entropy-fusion-impl", "te")]
    if tr.attention == "eager":
        notes.append("attention eager: the plan assumed unfused softmax attention (the 2021-22 Megatron-LM); "
                     "select Megatron's unfused attention backend to match it")
    return args


def _model_args(plan: Plan, notes: list[str]) -> list[Arg]:
    m, tp = plan.model, plan.layout.tp
    args: list[Arg] = [("--num-layers", str(m.n_layers)), ("--hidden-size", str(m.hidden)),
                       ("--ffn-hidden-size", str(m.ffn_hidden)), ("--num-attention-heads", str(m.n_heads)),
                       ("--kv-channels", str(m.head_dim))]
    if m.n_kv_heads != m.n_heads:
        args += [("--group-query-attention",), ("--num-query-groups", str(m.n_kv_heads))]
    args.append(("--max-position-embeddings", str(max(m.max_seq_len, plan.training.seq_len))))
    if m.position == "alibi":
        notes.append("position alibi: Megatron has no ALiBi; exported as RoPE")
    args.append(("--position-embedding-type", "learned_absolute" if m.position == "learned" else "rope"))
    args.append(("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"))
    if m.mlp == "swiglu":
        args.append(("--swiglu",))
    if not m.tie_embeddings:
        args.append(("--untie-embeddings-and-output-weights",))
    if not m.bias:
        args.append(("--disable-bias-linear",))
        if m.qkv_bias or m.attention_bias:
            args.append(("--add-qkv-bias",))
    args += [("--attention-dropout", str(m.dropout)), ("--hidden-dropout", str(m.dropout)),
             ("--vocab-size", str(m.vocab))]
    multiple = 128 * tp  # --make-vocab-size-divisible-by (default 128) times tp
    padded = -(-m.vocab // multiple) * multiple
    if padded != m.vocab:
        tables = 1 if m.tie_embeddings else 2  # input embedding, and the output layer unless tied
        notes.append(f"vocabulary: Megatron pads {m.vocab} to {padded} (a multiple of 128 x tp {tp}), adding "
                     f"{tables * (padded - m.vocab) * m.hidden} parameters the plan does not count")
    if m.moe is not None:
        args += [("--num-experts", str(m.moe.n_experts)), ("--moe-router-topk", str(m.moe.top_k)),
                 ("--moe-ffn-hidden-size", str(m.moe.expert_ffn_hidden))]
        if m.moe.n_shared_experts:
            shared = m.moe.n_shared_experts * (m.moe.shared_ffn_hidden or m.moe.expert_ffn_hidden)
            args.append(("--moe-shared-expert-intermediate-size", str(shared)))
        if m.n_moe_layers != m.n_layers:  # which layers are MoE, as a Python list expression
            pattern = "".join("1" if m.moe.is_moe_layer(i) else "0" for i in range(m.n_layers))
            args.append(("--moe-layer-freq", "[" + ",".join(pattern) + "]"))
    if m.mla is not None:
        args += [("--multi-latent-attention",), ("--kv-lora-rank", str(m.mla.kv_lora_rank)),
                 ("--qk-head-dim", str(m.mla.qk_nope_head_dim)), ("--qk-pos-emb-head-dim", str(m.mla.qk_rope_head_dim)),
                 ("--v-head-dim", str(m.mla.v_head_dim))]
        if m.mla.q_lora_rank:
            args.append(("--q-lora-rank", str(m.mla.q_lora_rank)))
    if m.mtp_layers:
        args.append(("--mtp-num-layers", str(m.mtp_layers)))
    return args


WINDOW_ADDED = (0, 15)  # --window-size and --window-attn-skip-freq
LLAMA3_SCALING = (1.0, 4.0, 8192)  # Megatron's rope scaling: low/high frequency factors and context, fixed


def _feature_args(plan: Plan, notes: list[str], version: tuple[int, ...]) -> list[Arg]:
    """What the model computes beyond its shapes (ModelSpec's family, rope, eps, norms, windows, routing),
    in Megatron's flags, and in `notes` what Megatron-LM has no flag for."""
    m = plan.model
    args: list[Arg] = [("--norm-epsilon", repr(m.norm_eps))]
    if m.family and m.family not in _BUILT_FAMILIES:
        notes.append(f"family {m.family}: its own modeling code (see `meshplan models show`), which Megatron's GPT "
                     "model does not reproduce")
    if m.attention_bias and not m.bias:
        notes.append("attention_bias: a bias on the attention output projection as well; Megatron adds biases to "
                     "q, k, v only (--add-qkv-bias) or to every linear layer")
    if m.qk_norm:
        args.append(("--qk-layernorm",))
    if m.activation == "gelu_tanh" and m.mlp == "gelu":
        args.append(("--openai-gelu",))  # the tanh approximation (GPT-2's gelu_new)
    if m.position == "rope":
        args += _rope_args(m, notes)
    if m.sliding_window:
        if version < WINDOW_ADDED:
            notes.append(f"sliding window {m.sliding_window}: Megatron-Core before 0.15 has no --window-size; "
                         "export with --target-version 0.15 or later")
        else:  # flash's (left, right): left keys before the query, the window counts the query itself
            args.append(("--window-size", f"{m.sliding_window - 1},0"))
            if m.sliding_layers != m.n_layers:
                pattern = ",".join("1" if m.window_of(i) else "0" for i in range(m.n_layers))
                args.append(("--window-attn-skip-freq", f"[{pattern}]"))
    if m.moe is not None:
        args += _router_args(m, notes)
    return args


def _rope_args(m, notes: list[str]) -> list[Arg]:
    args: list[Arg] = []
    theta = m.rope_theta
    if theta != int(theta):
        notes.append(f"rope_theta {theta}: Megatron's --rotary-base takes an integer; exported as {int(theta)}")
    args.append(("--rotary-base", str(int(theta))))
    s = m.rope_scaling
    if s is None:
        return args
    if s.kind == "llama3":
        args += [("--use-rope-scaling",), ("--rope-scaling-factor", repr(s.factor))]
        original = s.original_max_position or m.max_seq_len
        if (s.low_freq_factor, s.high_freq_factor, original) != LLAMA3_SCALING:
            notes.append(f"rope scaling llama3 with low/high frequency factors {s.low_freq_factor}/"
                         f"{s.high_freq_factor} over {original} positions: Megatron fixes them at 1/4 over 8192")
    elif s.kind == "linear" and s.factor == int(s.factor):
        args.append(("--rotary-seq-len-interpolation-factor", str(int(s.factor))))
    elif s.kind == "yarn" and m.mla is not None:
        args += [("--rope-type", "yarn"), ("--rotary-scaling-factor", repr(s.factor)),
                 ("--mscale", repr(s.mscale or 1.0)), ("--mscale-all-dim", repr(s.mscale_all_dim))]
    else:
        notes.append(f"rope scaling {s.kind} (factor {s.factor}): Megatron-LM has no flag for it"
                     + (" outside MLA" if s.kind == "yarn" else "") + "; exported without scaling")
    return args


def _router_args(m, notes: list[str]) -> list[Arg]:
    """Megatron's router: softmax over the top-k logits (= softmax, top-k, renormalized) by default."""
    moe, args = m.moe, []
    if moe.scoring == "sigmoid":
        args.append(("--moe-router-score-function", "sigmoid"))
        if not moe.norm_topk_prob and moe.top_k > 1:
            notes.append("router: sigmoid scores without renormalization; Megatron renormalizes the top-k "
                         "sigmoid scores")
        if moe.router_bias:
            args.append(("--moe-router-enable-expert-bias",))
    elif not moe.norm_topk_prob:
        args.append(("--moe-router-pre-softmax",))  # softmax over all experts, top-k weights kept as they are
    if moe.routed_scaling != 1.0:
        args.append(("--moe-router-topk-scaling-factor", repr(moe.routed_scaling)))
    if moe.n_group > 1:
        args += [("--moe-router-num-groups", str(moe.n_group)), ("--moe-router-group-topk", str(moe.topk_group))]
    if moe.shared_expert_gate:
        notes.append("shared-expert gate (Qwen2-MoE): Megatron-LM has no flag for it "
                     "(TransformerConfig.moe_shared_expert_gate)")
    return args
