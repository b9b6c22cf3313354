"""Load one export with its consumer's own loader under a fake process group, and read back its values.

Each check returns the values the consumer itself computed (degrees, batch
triple, ZeRO stage, schedule, recompute), so the tests compare them with the
plan's. Any rejection by the consumer propagates as its own exception and
fails the test. The fake process group (torch.testing._internal.distributed.
fake_pg) has the plan's world size, so rank-count checks are real.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int):
    """A default process group of `world_size` fake ranks (this process is rank 0)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- DeepSpeed ----------------------------------------------------------------------

def deepspeed_values(folder: Path, world_size: int) -> dict:
    """DeepSpeedConfig(ds_config.json, mpu=the export's mpu module) under deepspeed.comm on the fake group."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (loaded, so its build_shm_op can be replaced below)
    from deepspeed.runtime.config import DeepSpeedConfig

    # TorchBackend compiles a CPU shared-memory op on first use (g++, ~45 s); the fake group needs none.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    with fake_world(world_size):
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        mpu_path = folder / "meshplan_ds_mpu.py"
        mpu = _import_file(mpu_path, "meshplan_ds_mpu").build_mpu() if mpu_path.exists() else None
        cfg = DeepSpeedConfig(str(folder / "ds_config.json"), mpu=mpu)
        tp = cfg.tensor_parallel_config.autotp_size if cfg.tensor_parallel_config else 1
        return {"dp": cfg.world_size, "global_batch": cfg.train_batch_size,
                "micro": cfg.train_micro_batch_size_per_gpu, "accum": cfg.gradient_accumulation_steps,
                "zero": cfg.zero_optimization_stage, "tp": tp or 1,
                "pp": mpu.get_pipe_parallel_world_size() if mpu else 1,
                "hpz": cfg.zero_config.zero_hpz_partition_size}


def _reset_deepspeed_groups() -> None:
    """Forget the process groups and mpu deepspeed.utils.groups kept from an earlier engine (another world)."""
    from deepspeed.utils import groups

    groups.mpu = groups.mesh_device = None
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and name.endswith(("GROUP", "GROUP_RANKS", "WORLD_SIZE", "RANK")):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)


def deepspeed_engine(folder: Path, world_size: int) -> dict:
    """deepspeed.initialize on a toy model with the export's grid: the engine's own checks.

    Some checks live in the engine, not in DeepSpeedConfig: ZeRO-2/3 with a
    PipelineEngine, the weight / gradient-accumulation dtype mix. With pipeline
    stages the model is a PipelineModule on the export's topology, else the
    export's mpu is passed. AutoTP needs a Hugging Face model, so the toy
    Linear stack runs without tensor_parallel.
    """
    import json

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (loaded, so its build_shm_op can be replaced below)
    from deepspeed.pipe import PipelineModule

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    config = {k: v for k, v in json.loads((folder / "ds_config.json").read_text()).items() if k != "tensor_parallel"}
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it
    _reset_deepspeed_groups()
    with fake_world(world_size):
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        mpu_path = folder / "meshplan_ds_mpu.py"
        mpu = _import_file(mpu_path, "meshplan_ds_mpu") if mpu_path.exists() else None
        stages = mpu.topology().get_dim("pipe") if mpu else 1
        if stages > 1:
            model, grid = PipelineModule(layers=[torch.nn.Linear(8, 8) for _ in range(2 * stages)],
                                         topology=mpu.topology(), loss_fn=torch.nn.MSELoss()), None
        else:
            model, grid = torch.nn.Sequential(torch.nn.Linear(8, 8)), (mpu.build_mpu() if mpu else None)
        # an offloading export names its optimizer (DeepSpeed's CPU Adam); otherwise the script brings one
        client = None if "optimizer" in config else torch.optim.AdamW(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                          optimizer=client, mpu=grid)
        zero = engine._config.zero_config
        offload = {"optimizer": getattr(zero.offload_optimizer, "device", None),
                   "param": getattr(zero.offload_param, "device", None)}
        return {"engine": type(engine).__name__, "zero": engine.zero_optimization_stage(),
                "dp": engine.dp_world_size, "global_batch": engine.train_batch_size(), "stages": stages,
                "optimizer": type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer")
                                  else engine.optimizer).__name__,
                "offload": {k: str(v.value if hasattr(v, "value") else v) if v is not None else None
                            for k, v in offload.items()}}


# ---- accelerate ---------------------------------------------------------------------

def accelerate_values(path: Path) -> dict:
    """What `accelerate launch` would run: its parser on the export's launch line, env, ParallelismConfig."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType
    from accelerate.utils.launch import prepare_multi_gpu_env

    from planner.export.accelerate import LAUNCH_PREFIX

    cluster = load_config_from_file(str(path))
    text = path.read_text()
    launch = [line[2 + len(LAUNCH_PREFIX):] for line in text.splitlines() if line.startswith("# " + LAUNCH_PREFIX)]
    argv = ["--config_file", str(path), "train.py"]
    if launch:  # the export's own launch line, placeholders filled
        words = shlex.split(launch[0].replace("THIS", str(path)).replace(" i ", " 0 ").replace("NODE0_ADDRESS", "h0"))
        argv = words[words.index("launch") + 1:]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    batch = dict(kv.split("=") for line in text.splitlines() if line.startswith("# batch: per_device")
                 for kv in line[len("# batch: "):].split())
    values = {"distributed_type": str(cluster.distributed_type), "num_processes": args.num_processes,
              "rdzv_backend": args.rdzv_backend, "use_cpu": bool(args.use_cpu),
              "batch": {k: int(v) for k, v in batch.items()}, "parallelism": None}
    if args.use_parallelism_config:
        env = prepare_multi_gpu_env(args)
        keys = {k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG")}
        old = {k: os.environ.get(k) for k in keys}
        os.environ.update(keys)
        try:
            pc = ParallelismConfig()
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        kind = DistributedType.FSDP if args.use_fsdp else DistributedType.MULTI_GPU
        pc._validate_accelerator(SimpleNamespace(num_processes=args.num_processes, multi_device=True,
                                                 is_fsdp2=args.use_fsdp, distributed_type=kind))
        values["parallelism"] = {"dp_replicate": pc.dp_replicate_size, "dp_shard": pc.dp_shard_size,
                                 "tp": pc.tp_size, "cp": pc.cp_size, "total": pc.total_size}
    return values


# ---- torchtitan 0.2 -----------------------------------------------------------------

def torchtitan_values(path: Path, world_size: int, n_layers: int) -> dict:
    """ConfigManager on the TOML, ParallelDims for the world, then parallelize (and pipeline) a meta model.

    The exported flavor must be one torchtitan registers; the model is then
    built at a tiny width with the plan's layer count, which checks the
    stage split and every parallel wrapper without the real weights.
    """
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    flavor = cfg.model.flavor
    registered = flavor in spec.model_args
    tiny = f"meshplan-tiny-{n_layers}"
    spec.model_args[tiny] = TransformerModelArgs(dim=256, n_layers=n_layers, n_heads=16, vocab_size=2048)
    cfg = ConfigManager().parse_args(["--job.config_file", str(path), "--model.flavor", tiny])
    p = cfg.parallelism
    parallel_dims.device_type = "cpu"  # else the mesh is on cuda, which CPU torch lacks
    with fake_world(world_size):
        dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                            pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                            etp=p.expert_tensor_parallel_degree, world_size=world_size)
        dims.build_mesh()
        args = spec.model_args[tiny]
        args.update_from_config(cfg)
        with torch.device("meta"):
            model = spec.model_cls(args)
        schedule, parts = None, [model]
        if dims.pp_enabled:
            loss = spec.build_loss_fn(cfg, parallel_dims=dims)
            schedule, parts, _, _ = spec.pipelining_fn(model, dims, cfg, torch.device("cpu"), args,
                                                       spec.parallelize_fn, loss)
        else:
            spec.parallelize_fn(model, dims, cfg)
    compiled = cfg.compile.enable  # read before the converter check turns it off for its CPU build
    return {**_torchtitan_converters(cfg, world_size, n_layers), "flavor": flavor, "registered": registered,
            "compile": compiled, "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp,
            "local_batch": cfg.training.local_batch_size, "global_batch": cfg.training.global_batch_size,
            "pp_microbatch": p.pipeline_parallel_microbatch_size, "schedule": type(schedule).__name__,
            "layers_per_part": [len(part.layers) for part in parts], "ac": cfg.activation_checkpoint.mode,
            "reshard": p.fsdp_reshard_after_forward}


def _torchtitan_converters(cfg, world_size: int, n_layers: int) -> dict:
    """The model converters the TOML names, built by torchtitan and applied to a tiny meta model.

    torchtitan's float8 converter refuses a GPU below SM89 unless it emulates
    in eager mode, so the CPU check turns emulation on (and compile off) for
    the build only: what the file sets is read back before that.
    """
    import torchtitan.components.quantization  # noqa: F401  (registers the converters)
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    names = list(cfg.model.converters)
    float8 = cfg.quantize.linear.float8
    out = {"converters": names, "float8_all_gather": float8.enable_fsdp_float8_all_gather,
           "float8_filter": list(float8.filter_fqns), "float8_linears": 0}
    if "quantize.linear.float8" not in names:
        return out
    float8.emulate, cfg.compile.enable = True, False
    with fake_world(world_size):
        dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1,
                            world_size=world_size)
        args = TransformerModelArgs(dim=256, n_layers=n_layers, n_heads=16, vocab_size=2048)
        with torch.device("meta"):
            model = get_train_spec("llama3").model_cls(args)
        build_model_converters(cfg, dims).convert(model)
    out["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    out["output_float8"] = type(model.output).__name__ == "Float8Linear"
    return out


# ---- Megatron-Core ------------------------------------------------------------------

def megatron_args(path: Path) -> dict[str, list[str]]:
    """The MEGATRON_ARGS bash array as option -> values (flags map to [])."""
    text = path.read_text()
    body = text[text.index("MEGATRON_ARGS=(") + len("MEGATRON_ARGS=("):text.index("\n)")]
    options: dict[str, list[str]] = {}
    for line in body.strip().splitlines():
        words = shlex.split(line)
        options[words[0]] = words[1:]
    return options


def megatron_values(path: Path, world_size: int) -> dict:
    """initialize_model_parallel, the microbatch calculator and TransformerConfig from Megatron-Core."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron.core.transformer import TransformerConfig

    a = megatron_args(path)

    def num(key: str, default: int = 1) -> int:
        return int(a[key][0]) if key in a else default

    tp, pp, cp = num("--tensor-model-parallel-size"), num("--pipeline-model-parallel-size"), num("--context-parallel-size")
    layers = num("--num-layers")
    vpp = None
    if "--num-layers-per-virtual-pipeline-stage" in a:
        vpp = layers // (pp * num("--num-layers-per-virtual-pipeline-stage"))
    layout = a.get("--pipeline-model-parallel-layout", [None])[0]
    if layout is not None:
        vpp = None  # Megatron derives it from the layout (and refuses a different one)
    dtype = torch.bfloat16 if "--bf16" in a else torch.float16 if "--fp16" in a else torch.float32
    with fake_world(world_size):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
            expert_model_parallel_size=num("--expert-model-parallel-size"),
            expert_tensor_parallel_size=num("--expert-tensor-parallel-size", tp),
            num_distributed_optimizer_instances=num("--num-distributed-optimizer-instances"),
            create_gloo_process_groups=False)
        try:
            dp = parallel_state.get_data_parallel_world_size()
            destroy_num_microbatches_calculator()
            init_num_microbatches_calculator(0, None, num("--global-batch-size"), num("--micro-batch-size"), dp, False)
            accum = get_num_microbatches()
            recompute = a.get("--recompute-granularity", [None])[0]
            config = TransformerConfig(
                num_layers=layers, hidden_size=num("--hidden-size"), num_attention_heads=num("--num-attention-heads"),
                ffn_hidden_size=num("--ffn-hidden-size"), kv_channels=num("--kv-channels"),
                num_query_groups=num("--num-query-groups", num("--num-attention-heads")),
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                sequence_parallel="--sequence-parallel" in a, bf16="--bf16" in a, fp16="--fp16" in a,
                params_dtype=dtype, pipeline_dtype=dtype if pp > 1 else None,
                recompute_granularity=recompute,
                recompute_method=a.get("--recompute-method", [None])[0],
                recompute_num_layers=num("--recompute-num-layers") if "--recompute-num-layers" in a else None,
                gated_linear_unit="--swiglu" in a, add_bias_linear="--disable-bias-linear" not in a,
                normalization=a.get("--normalization", ["LayerNorm"])[0], pipeline_model_parallel_layout=layout,
                num_moe_experts=num("--num-experts") if "--num-experts" in a else None,
                moe_router_topk=num("--moe-router-topk", 2),
                moe_ffn_hidden_size=num("--moe-ffn-hidden-size") if "--moe-ffn-hidden-size" in a else None,
                expert_model_parallel_size=num("--expert-model-parallel-size"),
                expert_tensor_parallel_size=num("--expert-tensor-parallel-size", tp))
            expert_dp = parallel_state.get_expert_data_parallel_world_size()
        finally:
            destroy_num_microbatches_calculator()
            parallel_state.destroy_model_parallel()
    chunks = pp * (config.virtual_pipeline_model_parallel_size or 1)
    if layout is not None:  # Megatron's own parse of the layout: decoder layers of chunk k (rank k % pp)
        from megatron.core.transformer.enums import LayerType

        parsed = config.pipeline_model_parallel_layout
        parsed.validate_layer_layout(num_layers=layers, mtp_num_layers=0)
        per_chunk = [parsed.layout[k % pp][k // pp].count(LayerType.decoder) for k in range(chunks)]
    else:
        per_chunk = [layers // chunks] * chunks
    return {"layers_per_stage": per_chunk, "ep": config.expert_model_parallel_size,
            "etp": config.expert_tensor_parallel_size, "experts": config.num_moe_experts, "expert_dp": expert_dp,
            "tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
            "cp": config.context_parallel_size, "vpp": config.virtual_pipeline_model_parallel_size or 1,
            "dp": dp, "accum": accum, "micro": num("--micro-batch-size"),
            "global_batch": num("--global-batch-size"), "recompute": config.recompute_granularity or "none",
            "distributed_optimizer": "--use-distributed-optimizer" in a, "fsdp": "--use-megatron-fsdp" in a}
