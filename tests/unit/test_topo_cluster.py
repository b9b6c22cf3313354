"""GPU catalog, cluster presets, `--gpus` sizing, `--set` what-ifs and TOML files."""

from __future__ import annotations

import dataclasses

import pytest

from topologies.cluster import Cluster
from topologies.cluster_load import load_cluster, parse_overrides, preset_names, write_cluster_toml
from topologies.errors import TopologyError
from topologies.hardware import GIB, GPUS, GPUSpec, get_gpu

ISSUE_GPUS = {"a100-40g-sxm", "a100-80g-sxm", "a100-80g-pcie", "h100-sxm", "h100-pcie", "h200", "b200", "l40s",
              "rtx3090", "rtx4090", "t4", "v100", "cpu"}
ISSUE_PRESETS = {"dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "dgx-h200", "pcie-a100-80g", "pcie-l40s",
                 "rtx4090-pcie", "rtx3090-pcie", "t4-pcie", "cpu"}


def test_catalog_and_presets_cover_the_issue():
    assert ISSUE_GPUS <= set(GPUS)
    assert ISSUE_PRESETS <= set(preset_names())


def test_spec_sheet_relations():
    # Independent facts: NVLink3/4 links carry 25 GB/s per direction (50 GB/s bidirectional, NVIDIA
    # NVLink page); H200 computes like H100 SXM; Turing/Volta have no BF16; FP8 only from Hopper/Ada.
    for name in ("a100-80g-sxm", "h100-sxm", "h200"):
        assert get_gpu(name).nvlink_link_gbytes_per_s == pytest.approx(25)
    assert get_gpu("h200").bf16_flops == get_gpu("h100-sxm").bf16_flops
    for name in ("t4", "v100"):
        with pytest.raises(TopologyError, match="no bf16"):
            get_gpu(name).peak_flops("bf16")
    assert get_gpu("a100-80g-sxm").fp8_flops == 0 and get_gpu("h100-sxm").peak_flops("fp8") > 1.9e15
    assert get_gpu("h100-sxm").pcie_gbytes_per_s == pytest.approx(0.8 * 63.0)
    for spec in GPUS.values():
        assert spec.fp16_flops >= spec.fp32_flops > 0 and spec.memory_bytes > 0


def test_gpu_spec_json_round_trip_and_validation():
    spec = get_gpu("b200")
    assert GPUSpec.from_json(spec.to_json()) == spec
    with pytest.raises(TopologyError, match="pcie_gen"):
        dataclasses.replace(spec, pcie_gen=7)
    with pytest.raises(TopologyError, match="unknown GPU 'h100'.*did you mean"):
        get_gpu("h100")


@pytest.mark.parametrize("name", sorted(ISSUE_PRESETS | {"dgx-b200"}))
def test_every_preset_round_trips_through_json(name):
    c = load_cluster(name, 2 * load_cluster(name).gpus_per_node)
    assert c.n_nodes == 2 and Cluster.from_json(c.to_json()) == c


def test_gpus_sizing_rules():
    assert (load_cluster("cpu", 4).gpus_per_node, load_cluster("cpu", 4).n_nodes) == (4, 1)
    c = load_cluster("dgx-h100", 24)
    assert (c.n_nodes, c.gpus_per_node, c.world_size) == (3, 8, 24)
    assert load_cluster("dgx-h100").world_size == 8
    with pytest.raises(TopologyError, match=r"--gpus 12 does not fill whole nodes.*8 or 16"):
        load_cluster("dgx-h100", 12)
    with pytest.raises(TopologyError, match="positive"):
        load_cluster("dgx-h100", 0)


def test_overrides_change_what_they_name():
    c = load_cluster("dgx-a100-80g", 16, parse_overrides((
        "gpu=h100-sxm", "nic_gbit_per_s=400", "nvlink_gbytes_per_s=600", "gpu_memory_gib=94",
        "inter_node_oversubscription=2", "nics-per-node=4")))
    assert c.gpu.name == "h100-sxm" and c.gpu.nvlink_gbytes_per_s == 600 and c.gpu.memory_bytes == 94 * GIB
    assert (c.nic_gbit_per_s, c.inter_node_oversubscription, c.nics_per_node) == (400, 2, 4)
    four = load_cluster("dgx-h100", 8, {"gpus_per_node": "4"})
    assert (four.n_nodes, four.gpus_per_node) == (2, 4)


@pytest.mark.parametrize("pairs, words", [
    (("nic_gbps=3",), r"unknown --set key 'nic_gbps' \(did you mean 'nic_gbit_per_s'\?\).*accepted keys: gpu"),
    (("nic_gbit_per_s=fast",), r"nic_gbit_per_s='fast': expected a number"),
    (("gpus_per_node=2.5",), "expected an integer"),
    (("gpu=l40s",), "needs a GPU with NVLink.*intra_node=pcie"),
    (("intra_node=torus",), "intra_node must be one of"),
    (("inter_node_oversubscription=0.5",), "oversubscription >= 1"),
])
def test_bad_overrides_say_key_value_and_fix(pairs, words):
    with pytest.raises(TopologyError, match=words):
        load_cluster("dgx-h100", None, parse_overrides(pairs))


def test_parse_overrides_shape():
    assert parse_overrides(("a=1", "b = x", "a=2")) == {"a": "2", "b": "x"}
    with pytest.raises(TopologyError, match="KEY=VALUE"):
        parse_overrides(("novalue",))


def test_unknown_preset_suggests_the_nearest():
    with pytest.raises(TopologyError, match=r"unknown cluster 'dgx-h10' \(did you mean 'dgx-h100'\?\)"):
        load_cluster("dgx-h10")


def test_custom_toml_file(tmp_path):
    path = tmp_path / "mybox.toml"
    path.write_text('gpu = "l40s"\ngpus_per_node = 4\nintra_node = "pcie"\ngpus_per_pcie_switch = 2\n'
                    'nics_per_node = 1\nnic_gbit_per_s = 25\ngpu_memory_gib = 40\n')
    c = load_cluster(str(path), 8, {"nic_gbit_per_s": "50"})
    assert (c.name, c.gpu.name, c.n_nodes, c.nic_gbit_per_s, c.gpu.memory_bytes) == ("mybox", "l40s", 2, 50, 40 * GIB)
    bad = tmp_path / "bad.toml"
    bad.write_text('gpu = "l40s"\ngpus_per_node = 4\nnic_speed = 3\n')
    with pytest.raises(TopologyError, match="unknown cluster key 'nic_speed'"):
        load_cluster(str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("gpu = \n")
    with pytest.raises(TopologyError, match="not valid TOML"):
        load_cluster(str(broken))


def test_written_toml_reads_back_equal(tmp_path):
    c = load_cluster("pcie-a100-80g", None, {"gpu_memory_gib": "40", "nodes_per_leaf": "4"})
    path = tmp_path / "saved.toml"
    write_cluster_toml(c, str(path))
    assert load_cluster(str(path)) == c


def test_measured_links_must_be_square_and_known():
    gpu = get_gpu("a100-80g-pcie")
    with pytest.raises(TopologyError, match="2 x 2 matrix"):
        Cluster("m", gpu, 2, intra_node="pcie", gpu_links=(("X", "PIX"),))
    with pytest.raises(TopologyError, match="label 'QPI' is unknown"):
        Cluster("m", gpu, 2, intra_node="pcie", gpu_links=(("X", "QPI"), ("QPI", "X")))
