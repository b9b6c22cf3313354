"""Plan: the one contract between planner and executor (plan.json, schema_version 3).

Version 3 added what execution needs to compute the model its config
describes (model.family, rope_theta, rope_scaling, norm_eps, activation,
sliding_layer_ids; moe.scoring, norm_topk_prob, routed_scaling, n_group,
topk_group; mla.rope_interleave) and `weights_dir`: the Hugging Face
directory `plan --model DIR` read, when it holds safetensors weights (null
otherwise), which `execute` starts from and the launch exports carry as
`--init-from`. A version-2 plan loads with the defaults every run used before
(rope theta 10,000, no scaling, eps 1e-5, softmax top-k renormalized, no
weights).

The engine is recorded by name ("engine", as before) and release
("engine_release", the release its prediction modelled: planner.engines, e.g.
"2025-06" for torchtitan@2025-06); a plan without "engine_release" was made
before releases were modelled and loads as the engine's newest release.

Version 2 added the training keys precision, attention and compile (and the
"op" recompute kind); a version-1 plan still loads, with precision = its
dtype, the engine's attention kernel and no compile. zero_stage shards over
dp_shard x cp (planner.layout.zero_axes), so a plan with dp_shard 1 and
cp > 1 may carry zero_stage 1-3 (FSDP over the cp ranks alone); every plan
an earlier version 2 wrote still loads unchanged.

LoRA (still version 3: optional keys, written only for a LoRA plan): training
may carry "finetune" ("full" | "lora" | "qlora"), "lora_rank", "lora_alpha"
and "lora_targets" (a list of q, k, v, o, gate, up, down); a plan without
them is full fine-tuning, as every plan before (planner.training).

A plan written by `meshplan plan -o` also records how it was searched, in the
optional key "search": {"pins": the options pinned on the command line,
"usable_memory_fraction", "calibration": the profile path or null}, so
`execute --replan` can search again for other GPU counts with the same pins
(where still valid). Plans without it load unchanged and re-plan unpinned.

`parallel.offload` ("none", "optimizer", "optimizer+params": `plan --offload
none|optimizer|params`, "auto" searched and resolved to one of them) keeps its
values from before; a plan that offloads also records, in the optional
`prediction.offload` (planner.simulate.offload.offload_summary): kind,
host_link, host_link_gbytes_per_s (one GPU's share per direction),
down_bytes / up_bytes (what one rank moves over its host link per step),
host_optimizer_s, parameter_upload_s, host_memory_per_node_bytes and
host_memory_capacity_bytes. The cluster's host fields (host_memory_bytes,
host_memory_gbytes_per_s, host_cores; 0 = not stated) are optional: older
plans load with 0.

Every number is resolved: no "auto". Loading a plan never executes code: it is
plain JSON, checked key by key, and every inconsistency is a PlanError that
names the values and says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.engines import get_engine
from planner.layout import Layout, balanced_layers, divisors
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec
from topologies.cluster import Cluster
from topologies.errors import MeshplanError, PlanError

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "other")


@dataclass(frozen=True)
class Prediction:
    """What the simulator expects of one optimizer step on the worst rank."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float  # 6N + attention FLOPs per token, no recomputation
    mfu: float  # model_tflops_per_gpu / the GPU's dense peak for the compute dtype
    peak_memory_bytes: int  # worst rank
    memory_breakdown_bytes: dict[str, int]  # MEMORY_CATEGORIES on the worst rank
    time_breakdown_s: dict[str, float]  # compute, exposed_comm, bubble, optimizer, ...
    extra: dict[str, Any] = field(default_factory=dict)  # worst_rank, host bytes, ...

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(data.pop("extra"))
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Prediction:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [n for n in names if n not in data]
        if missing:
            raise PlanError(f"plan.json 'prediction' is missing keys: {', '.join(missing)}")
        for n in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_memory_bytes"):
            value = data[n]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise PlanError(f"plan.json 'prediction'.{n} must be a number >= 0, got {value!r}: re-simulate with "
                                "`meshplan simulate` or re-create the plan")
        for n in ("memory_breakdown_bytes", "time_breakdown_s"):
            if not isinstance(data[n], dict) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in data[n].values()):
                raise PlanError(f"plan.json 'prediction'.{n} must map names to numbers, got {data[n]!r}")
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**{n: data[n] for n in names}, extra=extra)


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: Cluster
    training: TrainingSpec
    layout: Layout  # plan.json's "parallel"
    engine: str = "meshplan"  # whose step the prediction models: NAME or NAME@RELEASE (planner.engines)
    prediction: Prediction | None = None
    alternatives: tuple[dict[str, Any], ...] = ()
    explanation: tuple[str, ...] = ()
    weights_dir: str | None = None  # the Hugging Face directory whose weights a run starts from (schema 3)
    search: dict[str, Any] | None = None  # how `plan` searched: pins, memory fraction, calibration (see above)

    def __post_init__(self) -> None:
        validate(self.model, self.cluster, self.training, self.layout)
        get_engine(self.engine)  # a PlanError naming the engines and releases when unknown
        if self.weights_dir is not None and (not isinstance(self.weights_dir, str) or not self.weights_dir):
            raise PlanError(f"plan.json weights_dir must be a directory path or null, got {self.weights_dir!r}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_json(),
            "cluster": self.cluster.to_json(),
            "training": self.training.to_json(),
            "parallel": self.layout.to_json(),
            "mesh": self.layout.mesh_json(),
            "engine": get_engine(self.engine).name,
            "engine_release": get_engine(self.engine).release,
            "prediction": self.prediction.to_json() if self.prediction else None,
            "alternatives": list(self.alternatives),
            "explanation": list(self.explanation),
            "weights_dir": self.weights_dir,
            **({"search": self.search} if self.search is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"plan.json must hold a JSON object, got {type(data).__name__}")
        bad = _first_non_finite(data)
        if bad is not None:
            raise PlanError(f"plan.json key {bad[0]} = {bad[1]!r} is not a finite number (Python's json reads NaN "
                            "and Infinity): fix the value or re-create the plan with `meshplan plan ... -o`")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise PlanError(
                f"plan.json has schema_version {version!r}; this meshplan reads {list(READABLE_VERSIONS)}: "
                "re-create it with `meshplan plan ... -o plan.json`"
            )
        missing = [k for k in ("model", "cluster", "training", "parallel") if not isinstance(data.get(k), dict)]
        if missing:
            raise PlanError(f"plan.json is missing the objects: {', '.join(missing)}")
        try:
            prediction = data.get("prediction")
            plan = cls(
                model=ModelSpec.from_json(data["model"]),
                cluster=Cluster.from_json(data["cluster"]),
                training=_training(data["training"], version, _engine_spec(data)),
                layout=Layout.from_json(data["parallel"]),
                engine=_engine_spec(data),
                prediction=Prediction.from_json(prediction) if isinstance(prediction, dict) else None,
                alternatives=tuple(data.get("alternatives") or ()),
                explanation=tuple(data.get("explanation") or ()),
                weights_dir=data.get("weights_dir"),
                search=data["search"] if isinstance(data.get("search"), dict) else None,
            )
            # Specs are hashed by caches downstream: a list or object where a number or
            # string belongs must fail here, as a PlanError, not later as a traceback.
            hash((plan.model, plan.cluster, plan.training, plan.layout))
            if plan.model.moe is not None and type(plan.model.moe).__name__ != "MoESpec":
                raise PlanError(f"model.moe must be an object of expert settings or null, got {plan.model.moe!r}")
            return plan
        except MeshplanError as exc:
            raise PlanError(f"invalid plan: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError, ZeroDivisionError) as exc:
            # a list, number or object where another kind belongs, deeper than the specs check
            raise PlanError(f"invalid plan: a value has the wrong type ({type(exc).__name__}: {exc})") from None

    def save(self, path: str | Path) -> None:
        """Write plan.json through topologies.files: atomic for a regular file, in place for a device or pipe."""
        from topologies.files import write_text
        from topologies.terminal import dumps_json

        write_text(path, dumps_json(self.to_json()) + "\n", what="plan")


def _first_non_finite(obj: Any, where: str = "") -> tuple[str, float] | None:
    """The dotted key of the first NaN or infinity anywhere in a JSON document, else None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "(top level)", obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def _engine_spec(data: dict[str, Any]) -> str:
    """NAME@RELEASE from plan.json's engine and engine_release; NAME alone for the newest release, as `plan`
    spells a bare --engine, so a saved plan loads equal to the one that was saved."""
    name, release = data.get("engine", "meshplan"), data.get("engine_release")
    if not isinstance(name, str) or (release is not None and not isinstance(release, str)):
        raise PlanError(f"plan.json engine and engine_release must be strings, got {name!r}, {release!r}")
    if not release or get_engine(name).release == release:
        return name
    return f"{name}@{release}"


def _training(data: dict[str, Any], version: int, engine: str) -> TrainingSpec:
    """plan.json's training; version 1 had no precision/attention/compile: its dtype and the engine's kernel."""
    training = TrainingSpec.from_json(data)
    if version == 1 and training.attention == "":
        fused = get_engine(engine).fused_attention(training)
        training = training.replace(attention="fused" if fused else "eager")
    return training


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist: create one with `meshplan plan ... -o {path}`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan file {str(path)!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise PlanError(f"plan file {str(path)!r} is nested too deeply to be a plan: regenerate it with "
                        f"`meshplan plan ... -o {path}`") from None
    return Plan.from_json(data)


def with_stage_layers(model: ModelSpec, layout: Layout) -> Layout:
    """Fill layers_per_stage with a balanced split when the layout leaves it empty."""
    if layout.layers_per_stage:
        return layout
    # balanced_layers splits n_layers over exactly pp * virtual_stages chunks: valid by construction
    return layout.trusted_replace(layers_per_stage=balanced_layers(model.n_layers, layout.pp * layout.virtual_stages))


def validate(model: ModelSpec, cluster: Cluster, training: TrainingSpec, layout: Layout) -> None:
    """Check that a layout can run this model and batch on this cluster. Raises PlanError."""
    if layout.world_size != cluster.world_size:
        raise PlanError(
            f"pp({layout.pp}) * dp_replicate({layout.dp_replicate}) * dp_shard({layout.dp_shard}) * "
            f"cp({layout.cp}) * tp({layout.tp}) = {layout.world_size} != the cluster's "
            f"{cluster.world_size} GPUs ({cluster.n_nodes} x {cluster.gpus_per_node})"
        )
    if model.n_heads % layout.tp or model.n_kv_heads % layout.tp:
        raise PlanError(
            f"tp ({layout.tp}) must divide the model's attention heads ({model.n_heads}) and "
            f"KV heads ({model.n_kv_heads}); try tp in {list(divisors(math.gcd(model.n_heads, model.n_kv_heads)))}"
        )
    stages = layout.pp * layout.virtual_stages
    if stages > model.n_layers:
        raise PlanError(
            f"pp ({layout.pp}) * virtual_stages ({layout.virtual_stages}) = {stages} exceeds the model's "
            f"{model.n_layers} layers"
        )
    if layout.layers_per_stage and sum(layout.layers_per_stage) != model.n_layers:
        raise PlanError(
            f"layers_per_stage {list(layout.layers_per_stage)} sums to {sum(layout.layers_per_stage)}, "
            f"but the model has {model.n_layers} layers"
        )
    per_step = layout.micro_batch_size * layout.grad_accum_steps * layout.dp
    if per_step != training.global_batch_size:
        raise PlanError(
            f"micro_batch_size ({layout.micro_batch_size}) * grad_accum_steps ({layout.grad_accum_steps}) * "
            f"dp ({layout.dp}) = {per_step} != global_batch_size ({training.global_batch_size})"
        )
    if training.seq_len % (layout.cp * (layout.tp if layout.sequence_parallel else 1)):
        raise PlanError(
            f"seq_len ({training.seq_len}) must be divisible by cp ({layout.cp})"
            + (f" * tp ({layout.tp}) with sequence parallel" if layout.sequence_parallel else "")
        )
    if layout.ep > 1 or layout.etp > 1:
        if model.moe is None:
            raise PlanError(f"ep ({layout.ep}) or etp ({layout.etp}) > 1 needs a mixture-of-experts model; "
                            f"{model.name} is dense")
        if model.moe.n_experts % layout.ep:
            raise PlanError(f"ep ({layout.ep}) must divide the number of experts ({model.moe.n_experts})")
        if model.moe.expert_ffn_hidden % layout.etp:
            raise PlanError(f"etp ({layout.etp}) must divide the experts' inner size ({model.moe.expert_ffn_hidden})")
    if layout.pp_schedule == "interleaved-1f1b" and layout.grad_accum_steps % layout.pp:
        raise PlanError(
            f"pipeline schedule interleaved-1f1b runs micro-batches in groups of pp ({layout.pp}), got "
            f"grad_accum_steps {layout.grad_accum_steps}: raise the global batch or change the micro-batch"
        )
