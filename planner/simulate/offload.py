"""CPU offload priced: what crosses the GPU's host link per step, the host's optimizer step, the host's memory.

Two kinds (Layout.offload):

* "optimizer" (DeepSpeed ZeRO-Offload, `offload_optimizer`; Megatron-Core's
  `--optimizer-cpu-offload`): the fp32 parameters and the optimizer's moments
  of the rank's shard live in pinned host memory. Each micro-batch's backward
  copies the rank's gradient shard down (DeepSpeed's stage 1/2 offload path
  accumulates gradients on the host each micro-batch; the copies run on their
  own stream beside the backward, so only what the backward cannot hide is
  exposed), the host runs the optimizer step, and the updated 16-bit shard
  goes back up before the next forward (exposed: Ren et al. 2021, ZeRO-Offload,
  section 4.1 -- the CPU step and the parameter copy sit between the steps
  unless one-step delayed update is used, which changes the training and is
  not modelled).
* "optimizer+params" (DeepSpeed ZeRO-Infinity `offload_param` with
  `offload_optimizer`; FSDP2's CPUOffloadPolicy, torchtitan's
  enable_cpu_offload): the parameters too live on the host. Each FSDP unit's
  shard is copied up before its all-gather in the forward and again in the
  backward (ZeRO-3 re-gathers), its gradient shard copied down after its
  reduce-scatter; the optimizer step runs on the host over the host copies,
  so nothing goes back up after it. Prefetching overlaps a unit's copies with
  the previous unit's compute (planner.simulate.step prices the exposed part
  per layer, `layer_offload_s`).

The host link is PCIe x16 of the GPU's generation (topologies.hardware:
PCIE_X16_RAW_GBYTES_PER_S x PCIE_PAYLOAD_EFFICIENCY) shared by the GPUs
behind one PCIe switch (their uplink is one x16), or NVLink-C2C on Grace parts
(GPUSpec.c2c_gbytes_per_s, shared by the GPUs of one Grace). Links are
full duplex: copies down and up run at the same time.

The host's optimizer step streams CPU_ADAM_BYTES_PER_PARAM per parameter
through host memory: fp32 parameter, both moments read and written (24 B),
the fp32 gradient read (4 B) and the 16-bit copy for the GPU written (2 B);
SGD with momentum CPU_SGD_BYTES_PER_PARAM. DeepSpeed's CPU Adam (AVX-512/AVX2,
one thread per core) is bandwidth-bound on servers; the node's DRAM
bandwidth (Cluster.host_memory_gbytes_per_s, the preset's channels x rate x
8 B) is shared by the node's GPUs' optimizer processes, reached at
HOST_STREAM_EFFICIENCY (the share of peak STREAM triad reaches on two-socket
servers), and capped by the cores each process gets (Cluster.host_cores /
GPUs of the node) at CORE_STREAM_GBYTES_PER_S each (the single-core STREAM
bandwidth of current server cores).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout
from planner.memory.params import layer_params_split
from planner.model.spec import ModelSpec
from topologies.cluster import Cluster
from topologies.errors import UsageError

CPU_ADAM_BYTES_PER_PARAM = 30.0  # 8 (fp32 param r/w) + 16 (two fp32 moments r/w) + 4 (fp32 grad) + 2 (16-bit copy)
CPU_SGD_BYTES_PER_PARAM = 22.0  # 8 (param r/w) + 8 (momentum r/w) + 4 (grad) + 2 (16-bit copy)
# STREAM triad on two-socket Xeon / EPYC servers reaches 60-70% of the DRAM's theoretical peak
# (McCalpin's STREAM results; AMD and Intel tuning guides report ~65%); a CPU Adam pass has
# the same access pattern (several streams read, two written).
HOST_STREAM_EFFICIENCY = 0.6
# One server core sustains 8-15 GB/s of streaming bandwidth (single-thread STREAM on Sapphire
# Rapids, Genoa, Neoverse V2); the lower end, since the optimizer's threads share the core's caches.
CORE_STREAM_GBYTES_PER_S = 8.0
# Share of the node's RAM a plan may pin: the rest holds the OS, the page cache, data-loader
# workers and each rank's own process memory (the CUDA context, the Python heap).
HOST_USABLE_FRACTION = 0.8

OFFLOAD_NAMES = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}  # CLI -> Layout.offload


def offload_kind(name: str) -> str:
    """The Layout.offload of a --offload value ("params" offloads the parameters and, with them, the
    optimizer states: both DeepSpeed's offload_param and FSDP2's CPUOffloadPolicy run the step on the host)."""
    if name not in OFFLOAD_NAMES:
        raise UsageError(f"--offload {name!r}: use one of none, optimizer, params, auto")
    return OFFLOAD_NAMES[name]


def host_link_gbytes_per_s(cluster: Cluster) -> float:
    """One GPU's share of its host link per direction, 1e9 B/s, when every GPU of the node copies at once."""
    gpu = cluster.gpu
    if gpu.c2c_gbytes_per_s > 0:
        sharing = min(cluster.gpus_per_numa_node or cluster.gpus_per_node, cluster.gpus_per_node)
        return gpu.c2c_gbytes_per_s / max(1, sharing)
    return gpu.pcie_gbytes_per_s / max(1, min(cluster.gpus_per_pcie_switch, cluster.gpus_per_node))


def host_link_name(cluster: Cluster) -> str:
    return "NVLink-C2C" if cluster.gpu.c2c_gbytes_per_s > 0 else f"PCIe Gen{cluster.gpu.pcie_gen} x16"


def host_stated(cluster: Cluster) -> str | None:
    """Why `cluster` cannot price offload (its host not stated), with the keys to state it; None when it can."""
    missing = [key for key, value in (("host_memory_gib", cluster.host_memory_bytes),
                                      ("host_memory_gbytes_per_s", cluster.host_memory_gbytes_per_s),
                                      ("host_cores", cluster.host_cores)) if not value]
    if not missing:
        return None
    return (f"cluster {cluster.name!r} does not state its host ({', '.join(missing)}), which CPU offload is "
            f"priced by; add {' '.join(f'--set {k}=...' for k in missing)} (per node), or plan with --offload none")


def host_gbytes_per_s_per_gpu(cluster: Cluster) -> float:
    """Host memory bandwidth one GPU's optimizer process streams at: its share of the node's DRAM at
    HOST_STREAM_EFFICIENCY, at most its share of the cores at CORE_STREAM_GBYTES_PER_S each."""
    per_gpu = cluster.host_memory_gbytes_per_s * HOST_STREAM_EFFICIENCY / cluster.gpus_per_node
    cores = cluster.host_cores / cluster.gpus_per_node
    return min(per_gpu, cores * CORE_STREAM_GBYTES_PER_S)


def cpu_optimizer_time_s(local_params: float, optimizer: str, cluster: Cluster) -> float:
    """The host's optimizer step over the `local_params` parameters one rank updates (module docstring)."""
    per_param = CPU_ADAM_BYTES_PER_PARAM if optimizer == "adamw" else CPU_SGD_BYTES_PER_PARAM
    return local_params * per_param / (host_gbytes_per_s_per_gpu(cluster) * 1e9)


@dataclass(frozen=True)
class HostLinkBytes:
    """Bytes one rank moves over its host link in one optimizer step, per direction."""

    down: float  # GPU -> host: gradient shards, every micro-batch
    up: float  # host -> GPU: parameter shards (per unit and pass with params offloaded; after the step otherwise)

    def to_json(self) -> dict[str, float]:
        return {"down_bytes": self.down, "up_bytes": self.up}


def shard_layer_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters of one layer a rank holds in its shard (TP, EP split, then ZeRO over shard_ranks)."""
    dense, experts = layer_params_split(model, layout.tp, layout.ep, layout.etp)
    shard = max(1, layout.shard_ranks) if layout.zero_stage >= 1 else 1
    return (dense + experts) / shard


def host_link_bytes(local_params: float, layer_shard_params: float, layers: int, layout: Layout,
                    dtype_bytes: int, grad_bytes: int) -> HostLinkBytes:
    """Per step and rank: gradients down every micro-batch; parameters up after the step ("optimizer") or
    before each unit's forward and backward gather ("optimizer+params", local_params = the rank's shard)."""
    if layout.offload == "none":
        return HostLinkBytes(0.0, 0.0)
    m = layout.grad_accum_steps
    down = m * local_params * grad_bytes
    if layout.offload == "optimizer":
        return HostLinkBytes(down, local_params * dtype_bytes)
    per_pass = layer_shard_params * layers * dtype_bytes
    rest = max(0.0, local_params - layer_shard_params * layers) * dtype_bytes  # embedding, head: up once per pass
    return HostLinkBytes(down, m * 2 * (per_pass + rest))


def layer_offload_s(model: ModelSpec, layout: Layout, dtype_bytes: int, grad_bytes: int, link_gbytes_per_s: float,
                    forward_s: float, backward_s: float, gather_s: float = 0.0, reduce_s: float = 0.0
                    ) -> tuple[float, float]:
    """Exposed copies of one layer per micro-batch (forward, backward), beyond the FSDP collectives' own.

    A unit's copies are in series with its collectives: its shard comes up before the all-gather
    (`gather_s`), its gradient shard goes down after the reduce-scatter (`reduce_s`); prefetching one
    unit ahead (FSDP2's and DeepSpeed stage 3's) hides the chain under the pass's compute. What the chain
    leaves exposed, less what the collectives alone leave (planner.simulate.step's fsdp_comm), is the copies'.
    """
    if layout.offload == "none":
        return 0.0, 0.0
    p = shard_layer_params(model, layout)
    down = p * grad_bytes / (link_gbytes_per_s * 1e9)
    up = p * dtype_bytes / (link_gbytes_per_s * 1e9) if layout.offload == "optimizer+params" else 0.0

    # full duplex: in the backward the shard coming up and the gradient going down share no direction
    return (exposed_beyond(up, gather_s, forward_s),
            exposed_beyond(max(up, down), gather_s + reduce_s, backward_s))


def exposed_beyond(copies_s: float, collectives_s: float, compute_s: float) -> float:
    """What copies in series with collectives add to the collectives' own exposure under `compute_s`."""
    return max(0.0, copies_s + collectives_s - compute_s) - max(0.0, collectives_s - compute_s)


def offloaded_step_s(local_params: float, optimizer: str, layout: Layout, dtype_bytes: int,
                     cluster: Cluster) -> tuple[float, float]:
    """(host optimizer step, parameter copy up after it): both exposed, between two steps."""
    cpu = cpu_optimizer_time_s(local_params, optimizer, cluster)
    up = local_params * dtype_bytes / (host_link_gbytes_per_s(cluster) * 1e9) if layout.offload == "optimizer" else 0.0
    return cpu, up


def host_bytes_per_node(host_bytes_per_rank: int, cluster: Cluster) -> int:
    """Host memory the node's ranks pin together (every rank of a node holds its own offloaded shard)."""
    return host_bytes_per_rank * cluster.gpus_per_node


def host_capacity_bytes(cluster: Cluster) -> int:
    return int(cluster.host_memory_bytes * HOST_USABLE_FRACTION)


def host_refusal(host_bytes_per_rank: int, cluster: Cluster) -> str | None:
    """Why the offloaded state does not fit the node's RAM (with the figures), or None."""
    need, cap = host_bytes_per_node(host_bytes_per_rank, cluster), host_capacity_bytes(cluster)
    if need <= cap:
        return None
    gib = 1 << 30
    return (f"offloaded state needs {need / gib:.1f} GiB of host memory per node ({cluster.gpus_per_node} ranks x "
            f"{host_bytes_per_rank / gib:.1f} GiB), has {cap / gib:.1f} ({HOST_USABLE_FRACTION:.0%} of "
            f"{cluster.host_memory_bytes / gib:.0f} GiB); add nodes, shard over more GPUs, or state a larger host "
            "with --set host_memory_gib=N")


def offload_summary(model: ModelSpec, layout: Layout, cluster: Cluster, dtype_bytes: int, grad_bytes: int,
                    optimizer: str, local_params: float, layers: int, host_bytes_per_rank: int) -> dict[str, object]:
    """What plan.json's prediction records of an offloading layout (prediction.extra.offload, planner.plan)."""
    moved = host_link_bytes(local_params, shard_layer_params(model, layout), layers, layout, dtype_bytes, grad_bytes)
    cpu, up = offloaded_step_s(local_params, optimizer, layout, dtype_bytes, cluster)
    return {"kind": layout.offload, "host_link": host_link_name(cluster),
            "host_link_gbytes_per_s": host_link_gbytes_per_s(cluster), **moved.to_json(),
            "host_optimizer_s": cpu, "parameter_upload_s": up,
            "host_memory_per_node_bytes": host_bytes_per_node(host_bytes_per_rank, cluster),
            "host_memory_capacity_bytes": host_capacity_bytes(cluster)}
