"""GPU catalog: the spec-sheet numbers the planner prices work with.

Peak FLOP/s are dense (no 2:4 sparsity), per GPU; where a spec sheet only
prints the sparse figure (marked * on NVIDIA sheets) we halve it. GeForce
cards run FP16/BF16 tensor math at half rate with FP32 accumulation, the
mode training uses, so their entries are the FP32-accumulate figures.
Memory bandwidth is HBM/GDDR bytes per second. NVLink bandwidth is per GPU,
per direction, summed over its links (spec sheets print the bidirectional
total: we halve it once, here). Every number names its source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from topologies.errors import TopologyError
from topologies.gpu_names import nearest_by_family, unknown_gpu_hint

GIB = 1 << 30
GB = 10**9
TFLOPS = 1e12
# Blackwell's SM issues 16 MUFU.EX2 exponentials per clock against 8,192 dense BF16 tensor-core
# FLOPs (FlashAttention-4, Zadouri et al. 2026: at head dim 128 the exponentials of a score tile
# take as long as its two MMAs on B200), so its exponential rate is its BF16 peak / 512.
# Blackwell Ultra (B300, GB300) doubles the SFU throughput for MUFU.EX2 at the same tensor-core
# rate (NVIDIA technical blogs "Inside NVIDIA Blackwell Ultra: The Chip Powering the AI Factory
# Era", 2025, "2x attention-layer acceleration"; "Making Softmax More Efficient with NVIDIA
# Blackwell Ultra", 2026, ~2x measured MUFU.EX2 throughput of GB300 over GB200).
BLACKWELL_BF16_FLOPS_PER_EXP = 512.0
BLACKWELL_ULTRA_SFU_SPEEDUP = 2.0

# PCIe x16 raw rate per direction by generation (PCI-SIG: 8, 16, 32 GT/s per
# lane with 128b/130b coding -> 15.75, 31.5, 63 GB/s for 16 lanes).
PCIE_X16_RAW_GBYTES_PER_S = {3: 15.75, 4: 31.5, 5: 63.0, 6: 126.0}
# Payload share of the raw rate once TLP headers and flow control are paid
# (PCIe DMA benchmarks reach 80-85% of the raw rate with 256 B payloads).
PCIE_PAYLOAD_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int  # device memory
    memory_gbytes_per_s: float  # HBM bandwidth, 1e9 bytes/s
    fp32_flops: float  # dense FP32 (non-tensor-core) FLOP/s
    tf32_flops: float  # dense TF32 tensor-core FLOP/s (0 where absent)
    bf16_flops: float  # dense BF16 tensor-core FLOP/s (0 where absent: T4, V100)
    fp16_flops: float  # dense FP16 tensor-core FLOP/s
    fp8_flops: float = 0.0  # dense FP8 FLOP/s, 0 where the GPU has none
    mxfp8_flops: float = 0.0  # dense MXFP8 (block-scaled FP8) FLOP/s, Blackwell and later; 0 where absent
    nvlink_gbytes_per_s: float = 0.0  # per GPU, per direction, all links together; 0: no NVLink
    pcie_gen: int = 4  # PCIe generation of the host link (x16)
    kind: str = "gpu"  # "gpu" or "cpu" (the CPU stand-in for tests)
    nvlink_links: int = 0  # NVLink links per GPU (nvidia-smi prints a pair as NV<links>)
    nvlink_gen: int = 0  # NVLink generation; 4+ with NVSwitch allows in-switch reduction (NVLS)
    pcie_p2p: bool = True  # False where the driver disables GPU peer-to-peer over PCIe (GeForce 40xx)
    # Exponentials per second of the special-function units (MUFU.EX2), the rate attention's softmax
    # runs at beside the tensor cores; 0 where not catalogued: that GPU's fitted attention efficiency
    # then covers the softmax as well (planner.simulate.compute.attention_core_times).
    exp_per_s: float = 0.0
    # FP8 GEMMs accept any operand layout (sm_100 and later: Transformer Engine's
    # is_non_tn_fp8_gemm_supported); False: TN only (Hopper, Ada), so every 8-bit operand
    # also needs a transposed copy.
    fp8_any_layout: bool = False
    # Streaming multiprocessors; communication kernels that run beside a GEMM take some of them
    # (planner.simulate.tp_overlap). 0 where not catalogued: no SM share is priced.
    sm_count: int = 0
    # AMD Infinity Fabric (xGMI): direct links to peer GPUs, one per peer on an 8-GPU Instinct platform
    # (no switch: a pair of GPUs gets one link, a collective over k GPUs k - 1 of them at once).
    xgmi_links: int = 0
    xgmi_link_gbytes_per_s: float = 0.0  # one xGMI link, per direction; 0: no xGMI
    # NVLink-C2C to the Grace CPU (GB200, GB300): the host link of the superchip, per direction, shared by
    # the GPUs of one Grace (Cluster.gpus_per_numa_node); 0: the host link is PCIe x16 of `pcie_gen`
    c2c_gbytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("memory_bytes", "memory_gbytes_per_s", "fp32_flops", "tf32_flops", "bf16_flops", "fp16_flops",
                    "fp8_flops", "nvlink_gbytes_per_s", "exp_per_s", "xgmi_link_gbytes_per_s", "c2c_gbytes_per_s"):
            value = getattr(self, key)
            # NaN passes every comparison below and would price a link or a GEMM as free
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise TopologyError(f"GPU {self.name!r}: {key} must be a finite number >= 0, got {value!r}")
        if self.memory_bytes <= 0 or self.memory_gbytes_per_s <= 0:
            raise TopologyError(f"GPU {self.name!r}: memory_bytes and memory_gbytes_per_s must be positive")
        if self.pcie_gen not in PCIE_X16_RAW_GBYTES_PER_S:
            raise TopologyError(
                f"GPU {self.name!r}: pcie_gen {self.pcie_gen} unknown; use one of {sorted(PCIE_X16_RAW_GBYTES_PER_S)}"
            )
        if isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int) or self.sm_count < 0:
            raise TopologyError(f"GPU {self.name!r}: sm_count must be an integer >= 0, got {self.sm_count!r}")
        for key in ("nvlink_links", "xgmi_links"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TopologyError(f"GPU {self.name!r}: {key} must be an integer >= 0, got {value!r}")
        if bool(self.xgmi_links) != bool(self.xgmi_link_gbytes_per_s):
            raise TopologyError(f"GPU {self.name!r}: xgmi_links ({self.xgmi_links}) and xgmi_link_gbytes_per_s "
                                f"({self.xgmi_link_gbytes_per_s}) must both be 0 or both positive")
        if self.kind not in ("gpu", "cpu"):
            raise TopologyError(f"GPU {self.name!r}: kind must be 'gpu' or 'cpu', got {self.kind!r}")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype (bf16, fp16, fp32, tf32, fp8, mxfp8)."""
        value = {"fp32": self.fp32_flops, "tf32": self.tf32_flops, "bf16": self.bf16_flops,
                 "fp16": self.fp16_flops, "fp8": self.fp8_flops, "mxfp8": self.mxfp8_flops}.get(dtype)
        if value is None:
            raise TopologyError(f"unknown dtype {dtype!r}; use bf16, fp16, fp32, tf32, fp8 or mxfp8")
        if value <= 0:
            if dtype == "bf16" and self.fp16_flops > 0:  # Turing (T4), Volta (V100): fp16 with loss scaling
                raise TopologyError(f"{self.name} has no bf16 tensor cores; train in fp16 with --precision fp16 "
                                    "(dynamic loss scaling), or pick a GPU with bf16 (Ampere or later)")
            raise TopologyError(f"{self.name} has no {dtype} tensor cores; pick another dtype or GPU")
        return value

    @property
    def pcie_gbytes_per_s(self) -> float:
        """PCIe x16 payload bandwidth per direction: raw rate * PCIE_PAYLOAD_EFFICIENCY."""
        return PCIE_PAYLOAD_EFFICIENCY * PCIE_X16_RAW_GBYTES_PER_S[self.pcie_gen]

    @property
    def xgmi_gbytes_per_s(self) -> float:
        """All xGMI links of one GPU together, per direction (0 without xGMI)."""
        return self.xgmi_links * self.xgmi_link_gbytes_per_s

    @property
    def nvlink_link_gbytes_per_s(self) -> float:
        """One NVLink link, per direction (0 without NVLink)."""
        return self.nvlink_gbytes_per_s / self.nvlink_links if self.nvlink_links else 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GPUSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise TopologyError(f"malformed GPU spec: {exc}") from None


def _gpu(name: str, memory_bytes: float, hbm: float, fp32: float, tf32: float, bf16: float, fp16: float,
         **rest: Any) -> GPUSpec:
    """Catalog entry with FLOP/s given in TFLOP/s, as spec sheets print them."""
    fp8, mxfp8 = rest.pop("fp8", 0.0), rest.pop("mxfp8", 0.0)
    return GPUSpec(name, int(memory_bytes), hbm, fp32 * TFLOPS, tf32 * TFLOPS, bf16 * TFLOPS, fp16 * TFLOPS,
                   fp8_flops=fp8 * TFLOPS, mxfp8_flops=mxfp8 * TFLOPS, **rest)


# SM counts: A100 108 (NVIDIA A100 Tensor Core GPU architecture whitepaper), H100 SXM5 132 and
# PCIe 114 (NVIDIA H100 Tensor Core GPU architecture whitepaper; H200 and H800 are the SXM5 die),
# B200 148 (two dies of 74 enabled SMs, as CUDA reports it; GB200's GPUs are B200s), B300/GB300
# 160 (NVIDIA technical blog "Inside NVIDIA Blackwell Ultra"), L40S 142 and RTX 4090 128 (NVIDIA
# Ada GPU architecture whitepaper and L40S datasheet), RTX 3090 82 (GA102 whitepaper), T4 40
# (Turing whitepaper), V100 80 (Volta whitepaper). A peak is SMs x FLOPs per SM and clock x the
# part's rated clock, which follows its form factor (B200 and GB200 share a 148-SM die rated 4.5
# and 5 PF dense FP8): a profile fitted on one part reaches another of its family per SM
# (planner.simulate.calibration.per_sm_transfer), since measured runs follow the SMs, not the rating.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column: 19.5 FP32, 156 TF32, 312 BF16/FP16
        # TFLOP/s dense; 40GB HBM2 at 1555 GB/s; NVLink3 600 GB/s bidirectional over 12 links; PCIe Gen4.
        _gpu("a100-40g-sxm", 40 * GIB, 1555, 19.5, 156, 312, 312,
             nvlink_gbytes_per_s=300, nvlink_links=12, nvlink_gen=3, pcie_gen=4, sm_count=108),
        # Same datasheet, 80GB SXM: HBM2e at 2039 GB/s; compute and NVLink as the 40GB part.
        _gpu("a100-80g-sxm", 80 * GIB, 2039, 19.5, 156, 312, 312,
             nvlink_gbytes_per_s=300, nvlink_links=12, nvlink_gen=3, pcie_gen=4, sm_count=108),
        # Same datasheet, 80GB PCIe: HBM2e at 1935 GB/s; NVLink bridge for 2 GPUs, 600 GB/s bidirectional.
        _gpu("a100-80g-pcie", 80 * GIB, 1935, 19.5, 156, 312, 312,
             nvlink_gbytes_per_s=300, nvlink_links=12, nvlink_gen=3, pcie_gen=4, sm_count=108),
        # NVIDIA H100 Tensor Core GPU datasheet, SXM: 67 FP32, 989 TF32*, 1979 BF16/FP16*, 3958 FP8*
        # (* sparse: halved); 80GB HBM3 at 3.35 TB/s; NVLink4 900 GB/s bidirectional, 18 links; Gen5.
        _gpu("h100-sxm", 80 * GIB, 3350, 67, 494.7, 989.4, 989.4, fp8=1978.9,
             nvlink_gbytes_per_s=450, nvlink_links=18, nvlink_gen=4, pcie_gen=5, sm_count=132),
        # Same datasheet, PCIe: 51 FP32, 756 TF32*, 1513 BF16/FP16*, 3026 FP8*; 80GB HBM2e at 2.0 TB/s;
        # NVLink bridge 600 GB/s bidirectional (pairs); PCIe Gen5.
        _gpu("h100-pcie", 80 * GIB, 2000, 51, 378, 756.5, 756.5, fp8=1513,
             nvlink_gbytes_per_s=300, nvlink_links=12, nvlink_gen=4, pcie_gen=5, sm_count=114),
        # NVIDIA H100 NVL datasheet (2023, per GPU): 60 FP32, 835 TF32*, 1671 BF16/FP16*, 3341 FP8* (sparse:
        # halved); 94 GB HBM3 at 3.9 TB/s; NVLink bridge 600 GB/s bidirectional (pairs); PCIe Gen5; the
        # full 132-SM GH100 of the SXM part at a lower power limit (400 W).
        _gpu("h100-nvl", 94 * GIB, 3900, 60, 417.5, 835.5, 835.5, fp8=1670.5,
             nvlink_gbytes_per_s=300, nvlink_links=12, nvlink_gen=4, pcie_gen=5, sm_count=132),
        # NVIDIA HGX H20 product brief (export part): 44 FP32, 74 TF32, 148 BF16/FP16, 296 FP8 TFLOP/s
        # dense (tensor rate capped under the export rules' total processing performance); 96 GB HBM3
        # at 4.0 TB/s; NVLink4 900 GB/s bidirectional over 18 links; PCIe Gen5. 78 SMs (its Geekbench 6
        # listing, as Wccftech reported it; 78 x 128 FP32 lanes x 2 x ~2.2 GHz gives the sheet's 44 TFLOP/s).
        _gpu("h20", 96 * GIB, 4000, 44, 74, 148, 148, fp8=296,
             nvlink_gbytes_per_s=450, nvlink_links=18, nvlink_gen=4, pcie_gen=5, sm_count=78),
        # NVIDIA H200 Tensor Core GPU datasheet, SXM: compute as H100 SXM (67 FP32, 989 TF32*, 1979
        # BF16/FP16*, 3958 FP8*); 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional; PCIe Gen5.
        _gpu("h200", 141 * GB, 4800, 67, 494.7, 989.4, 989.4, fp8=1978.9,
             nvlink_gbytes_per_s=450, nvlink_links=18, nvlink_gen=4, pcie_gen=5, sm_count=132),
        # NVIDIA DGX B200 datasheet, divided by its 8 GPUs: 72 PF FP8*, 36 PF BF16/FP16*, 18 PF TF32*
        # (sparse, halved); 1,440 GB HBM3e at 64 TB/s in total; NVLink5 1.8 TB/s bidirectional per GPU
        # (18 links). FP32 75 TFLOP/s from the HGX B200 spec table (600 TF for 8 GPUs).
        # Blackwell's fifth-generation tensor cores run MXFP8 (OCP microscaling, 32-element blocks)
        # at the FP8 rate (NVIDIA Blackwell architecture technical brief).
        _gpu("b200", 180 * GB, 8000, 75, 1125, 2250, 2250, fp8=4500, mxfp8=4500,
             nvlink_gbytes_per_s=900, nvlink_links=18, nvlink_gen=5, pcie_gen=5,
             exp_per_s=2250 * TFLOPS / BLACKWELL_BF16_FLOPS_PER_EXP, fp8_any_layout=True, sm_count=148),
        # NVIDIA H800 SXM (the H100 die for export markets): compute and HBM3 as H100 SXM (989
        # BF16, 1979 FP8 TFLOP/s dense; 80 GB at 3.35 TB/s); NVLink cut to 400 GB/s bidirectional
        # (8 links of NVLink4; DeepSeek-V3 report, section 3.2.2: 160 GB/s achieved of 200 per
        # direction); PCIe Gen5.
        _gpu("h800", 80 * GIB, 3350, 67, 494.7, 989.4, 989.4, fp8=1978.9,
             nvlink_gbytes_per_s=200, nvlink_links=8, nvlink_gen=4, pcie_gen=5, sm_count=132),
        # NVIDIA GB200 NVL72 datasheet, divided by its 72 GPUs: 360 PF FP8/FP6*, 180 PF BF16/FP16*,
        # 90 PF TF32* (sparse, halved: 2.5 PF bf16, 5 PF fp8 per GPU); 13.4 TB HBM3e at 576 TB/s
        # (186 GB at 8 TB/s per GPU); 5,760 FP32 TFLOP/s (80 per GPU); NVLink5 130 TB/s for the rack
        # (1.8 TB/s bidirectional per GPU, 18 links). Its Grace host link is NVLink-C2C (900 GB/s
        # bidirectional per Grace and its two GPUs: 450 per direction); PCIe Gen6 to the ConnectX-7/8 NICs.
        _gpu("gb200", 186 * GB, 8000, 80, 1250, 2500, 2500, fp8=5000, mxfp8=5000,
             nvlink_gbytes_per_s=900, nvlink_links=18, nvlink_gen=5, pcie_gen=6, c2c_gbytes_per_s=450,
             exp_per_s=2500 * TFLOPS / BLACKWELL_BF16_FLOPS_PER_EXP, fp8_any_layout=True, sm_count=148),
        # NVIDIA GB300 NVL72 datasheet, divided by 72: 360 PF FP8*, 180 PF BF16/FP16* (sparse,
        # halved: 2.5 PF bf16, 5 PF fp8 per GPU; Blackwell Ultra raises FP4, not FP8); 20 TB
        # HBM3e at 576 TB/s (288 GB at 8 TB/s per GPU); FP32 6 PF (83 per GPU); NVLink5 1.8 TB/s
        # bidirectional per GPU; ConnectX-8 800 Gbit/s per GPU (PCIe Gen6); Grace host link NVLink-C2C,
        # 900 GB/s bidirectional per Grace (GB300 NVL72 datasheet), 450 per direction.
        _gpu("gb300", 288 * GB, 8000, 83, 1250, 2500, 2500, fp8=5000, mxfp8=5000,
             nvlink_gbytes_per_s=900, nvlink_links=18, nvlink_gen=5, pcie_gen=6, c2c_gbytes_per_s=450,
             exp_per_s=2500 * TFLOPS / BLACKWELL_BF16_FLOPS_PER_EXP * BLACKWELL_ULTRA_SFU_SPEEDUP, fp8_any_layout=True, sm_count=160),
        # NVIDIA DGX B300 datasheet, divided by its 8 GPUs: 72 PF FP8 training* (sparse, halved:
        # 4.5 PF fp8, 2.25 PF bf16 per GPU, as B200), 2.3 TB HBM3e (288 GB per GPU) at 8 TB/s
        # per GPU; NVLink5 14.4 TB/s in total (1.8 TB/s bidirectional per GPU); 8 ConnectX-8
        # 800 Gbit/s ports; PCIe Gen6.
        _gpu("b300", 288 * GB, 8000, 75, 1125, 2250, 2250, fp8=4500, mxfp8=4500,
             nvlink_gbytes_per_s=900, nvlink_links=18, nvlink_gen=5, pcie_gen=6,
             exp_per_s=2250 * TFLOPS / BLACKWELL_BF16_FLOPS_PER_EXP * BLACKWELL_ULTRA_SFU_SPEEDUP, fp8_any_layout=True, sm_count=160),
        # NVIDIA L40S datasheet: 91.6 FP32, 366 TF32*, 733 BF16/FP16*, 1466 FP8* TFLOP/s (sparse,
        # halved); 48 GB GDDR6 at 864 GB/s; no NVLink; PCIe Gen4 x16.
        _gpu("l40s", 48 * GB, 864, 91.6, 183, 362.05, 362.05, fp8=733, pcie_gen=4, sm_count=142),
        # NVIDIA L4 datasheet: 30.3 FP32, 120 TF32*, 242 BF16/FP16*, 485 FP8* TFLOP/s (sparse, halved);
        # 24 GB GDDR6 at 300 GB/s; no NVLink; PCIe Gen4 x16; 58 SMs (AD104, Ada whitepaper).
        _gpu("l4", 24 * GB, 300, 30.3, 60, 121, 121, fp8=242.5, pcie_gen=4, sm_count=58),
        # NVIDIA A10 datasheet: 31.2 FP32, 62.5 TF32, 125 BF16/FP16 TFLOP/s dense (250 sparse); 24 GB
        # GDDR6 at 600 GB/s; no NVLink; PCIe Gen4; 72 SMs (GA102). Data-center part: FP16/BF16 with
        # FP32 accumulate at the full tensor rate.
        _gpu("a10", 24 * GB, 600, 31.2, 62.5, 125, 125, pcie_gen=4, sm_count=72),
        # AWS's A10G (EC2 G5; NVIDIA publishes no datasheet; AWS G5 documentation and Baseten, "NVIDIA A10
        # vs A10G for ML model inference", 2023): 80 SMs of GA102 at 1.71 GHz, 35 FP32, 35 TF32, 70
        # BF16/FP16 TFLOP/s dense (tensor math at GeForce's half rate with FP32 accumulate: 80 x 4 x 64
        # FMA x 2 x 1.71 GHz); 24 GB GDDR6 at 600 GB/s; PCIe Gen4.
        _gpu("a10g", 24 * GB, 600, 35, 35, 70, 70, pcie_gen=4, sm_count=80),
        # NVIDIA RTX A6000 datasheet: 38.7 FP32, 309.7 tensor TFLOP/s (sparse: 154.8 BF16/FP16 dense with
        # FP32 accumulate, 77.4 TF32); 48 GB GDDR6 at 768 GB/s; NVLink bridge 112.5 GB/s bidirectional
        # (4 links of NVLink3, pairs); PCIe Gen4; 84 SMs (GA102). Workstation cards allow PCIe peer-to-peer.
        _gpu("a6000", 48 * GB, 768, 38.7, 77.4, 154.8, 154.8,
             nvlink_gbytes_per_s=56.25, nvlink_links=4, nvlink_gen=3, pcie_gen=4, sm_count=84),
        # NVIDIA RTX 6000 Ada Generation datasheet: 91.1 FP32, 1457 FP8 tensor TFLOP/s (sparse: 728.5 FP8,
        # 364.25 BF16/FP16, 182.1 TF32 dense, FP32 accumulate at the full rate on this workstation part);
        # 48 GB GDDR6 at 960 GB/s; no NVLink; PCIe Gen4; 142 SMs (AD102).
        _gpu("rtx6000-ada", 48 * GB, 960, 91.1, 182.1, 364.25, 364.25, fp8=728.5, pcie_gen=4, sm_count=142),
        # NVIDIA RTX Blackwell GPU architecture whitepaper, GeForce RTX 5090 column: 104.8 FP32; with FP32
        # accumulate 104.8 TF32, 209.5 BF16/FP16, 419 FP8 TFLOP/s dense (half of the FP16-accumulate rate,
        # 838 FP16 sparse); 32 GB GDDR7 at 1792 GB/s; no NVLink; PCIe Gen5; 170 SMs (GB202). GeForce:
        # the driver disables PCIe peer-to-peer.
        _gpu("rtx5090", 32 * GB, 1792, 104.8, 104.8, 209.5, 209.5, fp8=419, pcie_gen=5, pcie_p2p=False,
             sm_count=170),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column: 82.6 FP32; with FP32
        # accumulate 82.6 TF32, 165.2 BF16/FP16, 330.3 FP8 TFLOP/s dense; 24 GB GDDR6X at 1008 GB/s;
        # no NVLink; PCIe Gen4. The GeForce driver disables PCIe peer-to-peer.
        _gpu("rtx4090", 24 * GB, 1008, 82.6, 82.6, 165.2, 165.2, fp8=330.3, pcie_gen=4, pcie_p2p=False, sm_count=128),
        # NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090 column: 35.6 FP32; with FP32
        # accumulate 35.6 TF32, 71 BF16/FP16 TFLOP/s dense; 24 GB GDDR6X at 936 GB/s; NVLink bridge
        # (4 links of NVLink3) 112.5 GB/s bidirectional; PCIe Gen4.
        _gpu("rtx3090", 24 * GB, 936, 35.6, 35.6, 71, 71,
             nvlink_gbytes_per_s=56.25, nvlink_links=4, nvlink_gen=3, pcie_gen=4, sm_count=82),
        # NVIDIA T4 datasheet: 8.1 FP32, 65 FP16 mixed-precision TFLOP/s; no BF16 or TF32 (Turing);
        # 16 GB GDDR6 at 320 GB/s; PCIe Gen3 x16.
        _gpu("t4", 16 * GB, 320, 8.1, 0, 0, 65, pcie_gen=3, sm_count=40),
        # NVIDIA V100 Tensor Core GPU datasheet, SXM2 32GB: 15.7 FP32, 125 tensor (FP16) TFLOP/s; no
        # BF16 or TF32 (Volta); HBM2 at 900 GB/s; NVLink2 300 GB/s bidirectional over 6 links; Gen3.
        _gpu("v100", 32 * GIB, 900, 15.7, 0, 0, 125,
             nvlink_gbytes_per_s=150, nvlink_links=6, nvlink_gen=2, pcie_gen=3, sm_count=80),
        # AMD Instinct MI300X datasheet (OAM): 163.4 FP32 (matrix), 653.7 TF32, 1307.4 BF16/FP16, 2614.9 FP8
        # TFLOP/s dense (sparsity doubles them); 192 GB HBM3 at 5.3 TB/s (rocm-smi reports 192 GiB); 304
        # CUs; Infinity Fabric: 7 links of 128 GB/s bidirectional to the 7 peer GPUs of the 8-GPU platform
        # (AMD ROCm blog "Understanding RCCL Bandwidth and xGMI Performance on AMD Instinct MI300X", 2025:
        # 64 GB/s per link and direction, fully connected mesh); PCIe Gen5 x16 host link. sm_count holds
        # the compute units (the SM's counterpart). PyTorch runs it through ROCm's RCCL under the `nccl`
        # backend name.
        _gpu("mi300x", 192 * GIB, 5300, 163.4, 653.7, 1307.4, 1307.4, fp8=2614.9, pcie_gen=5,
             xgmi_links=7, xgmi_link_gbytes_per_s=64, sm_count=304),
        # AMD Instinct MI325X datasheet: compute as MI300X (same CDNA 3 die: 1307.4 BF16, 2614.9 FP8 dense);
        # 256 GB HBM3E at 6.0 TB/s; Infinity Fabric 7 x 128 GB/s bidirectional; PCIe Gen5.
        _gpu("mi325x", 256 * GIB, 6000, 163.4, 653.7, 1307.4, 1307.4, fp8=2614.9, pcie_gen=5,
             xgmi_links=7, xgmi_link_gbytes_per_s=64, sm_count=304),
        # AMD Instinct MI350X / MI355X datasheets (CDNA 4, 256 CUs of 8,192 dense FP8 FLOPs per clock,
        # ISSCC 2026): MI355X (1,400 W, 2.4 GHz) 157.3 FP32, 2516.6 BF16/FP16, 5033.2 FP8 and MXFP8
        # TFLOP/s dense; MI350X (1,000 W, 2.2 GHz) 144.2 FP32, 2306.9 BF16/FP16, 4613.7 FP8/MXFP8;
        # 288 GB HBM3E at 8 TB/s; Infinity Fabric 7 links of 153.6 GB/s bidirectional; PCIe Gen5. The
        # datasheets list no TF32 matrix rate (0: not catalogued; fp32 plans use the FP32 rate).
        _gpu("mi355x", 288 * GIB, 8000, 157.3, 0, 2516.6, 2516.6, fp8=5033.2, mxfp8=5033.2, pcie_gen=5,
             xgmi_links=7, xgmi_link_gbytes_per_s=76.8, sm_count=256),
        _gpu("mi350x", 288 * GIB, 8000, 144.2, 0, 2306.9, 2306.9, fp8=4613.7, mxfp8=4613.7, pcie_gen=5,
             xgmi_links=7, xgmi_link_gbytes_per_s=76.8, sm_count=256),
        # CPU stand-in for the `cpu` cluster: numbers of a small server core complex;
        # only used to run the executor and its tests, never to rank GPU layouts.
        GPUSpec("cpu", 16 * GIB, 20, 0.2 * TFLOPS, 0.0, 0.2 * TFLOPS, 0.2 * TFLOPS, pcie_gen=4, kind="cpu"),
    ]
}


def get_gpu(name: str) -> GPUSpec:
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    raise TopologyError(f"unknown GPU {name!r}{nearest_by_family(key, {g: g for g in GPUS})}; known: "
                        f"{', '.join(GPUS)}{unknown_gpu_hint()}")
