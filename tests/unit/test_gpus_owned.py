"""The cards people own: catalog entries, presets, AMD's xGMI mesh, GeForce without peer-to-peer,
near-miss suggestions by product line, and what every "unknown GPU" message offers."""

from __future__ import annotations

import pytest

from planner.cli.plan import search_plan
from planner.search.candidates import Pins
from topologies.cluster_load import GPU_KEYS, load_cluster, preset_names
from topologies.collectives import CollectiveModel, bus_bandwidth_gbytes_per_s
from topologies.errors import InfeasibleError, TopologyError
from topologies.gpu_names import GPU_OVERRIDE_KEYS, gpu_family, nearest_by_family
from topologies.hardware import GIB, GPUS, get_gpu
from topologies.links import EFFICIENCY
from topologies.smi_topo import gpu_from_smi_name

NEW_GPUS = {"a10", "a10g", "l4", "a6000", "rtx6000-ada", "rtx5090", "h100-nvl", "h20", "mi300x", "mi325x",
            "mi350x", "mi355x"}
NEW_PRESETS = {"a10-pcie", "g5-48xlarge", "g6-48xlarge", "a6000-workstation", "rtx6000ada-pcie", "rtx5090-pcie",
               "pcie-h100", "pcie-h100-nvl", "hgx-h20", "mi300x", "mi325x", "mi350x", "mi355x"}


def test_new_cards_and_presets_exist():
    assert NEW_GPUS <= set(GPUS) and NEW_PRESETS <= set(preset_names())
    assert {"l40s", "h100-pcie"} <= set(GPUS)  # already catalogued before these


def test_spec_sheet_relations_of_the_new_cards():
    # Independent facts: sparse figures halved consistently (FP8 = 2 x BF16 on Ada, Hopper, CDNA 3/4);
    # MI325X is MI300X's die with more HBM; GeForce and AWS's A10G run FP16 with FP32 accumulate at half
    # the data-center rate per SM and clock (A10: 72 SMs at 1.695 GHz -> 125; A10G: 80 at 1.71 -> 70).
    for name in ("l4", "rtx6000-ada", "h100-nvl", "h20", "mi300x", "mi355x", "rtx5090"):
        gpu = get_gpu(name)
        assert gpu.fp8_flops == pytest.approx(2 * gpu.bf16_flops, rel=5e-3), name
    assert get_gpu("mi325x").bf16_flops == get_gpu("mi300x").bf16_flops
    assert get_gpu("mi325x").memory_bytes > get_gpu("mi300x").memory_bytes == 192 * GIB
    a10, a10g = get_gpu("a10"), get_gpu("a10g")
    per_sm_clock = a10.bf16_flops / (72 * 1.695e9), a10g.bf16_flops / (80 * 1.71e9)
    assert per_sm_clock[1] == pytest.approx(per_sm_clock[0] / 2, rel=0.01)
    assert get_gpu("mi355x").mxfp8_flops == get_gpu("mi355x").fp8_flops and get_gpu("mi300x").mxfp8_flops == 0
    for name in ("rtx5090", "rtx4090"):
        assert not get_gpu(name).pcie_p2p
    for name in ("a6000", "rtx6000-ada", "l4", "a10"):
        assert get_gpu(name).pcie_p2p


@pytest.mark.parametrize("name", sorted(NEW_PRESETS))
def test_plan_answers_on_every_new_preset(name):
    """A 1B model plans on one node of each (or refuses with the shortfall); the prediction is the simulator's."""
    node = load_cluster(name).gpus_per_node
    try:
        the_plan, result = search_plan("llama3.2-1b", name, node, (), 2048, None, Pins(), "meshplan", None, 1)
    except InfeasibleError as exc:  # pragma: no cover - every preset fits 1B today; the message must say why
        assert "needs" in str(exc)
        return
    assert the_plan.cluster.gpu.name == load_cluster(name).gpu.name
    assert 0 < the_plan.prediction.mfu < 1 and the_plan.prediction.step_time_s == result.best.result.step_time_s


def busbw(cluster, op, size, ranks):
    t = CollectiveModel(cluster).time_s(op, size, ranks)
    return bus_bandwidth_gbytes_per_s(op, len(ranks), size, t)


def test_xgmi_full_mesh_pair_and_node():
    """Each MI300X pair has one link (64 GB/s rated, ~48 usable: AMD's RCCL/xGMI blog); a collective over all
    8 GPUs drives the 7 links of each at once (RCCL's rings over the full mesh): 7 x 48 = 336 GB/s."""
    c = load_cluster("mi300x")
    usable = 64 * EFFICIENCY["xgmi"]
    assert usable == pytest.approx(48)
    assert busbw(c, "all_reduce", 4 * GIB, (0, 1)) == pytest.approx(usable, rel=0.01)
    assert busbw(c, "all_reduce", 4 * GIB, tuple(range(8))) == pytest.approx(7 * usable, rel=0.01)
    assert busbw(c, "all_gather", 4 * GIB, (0, 2, 4, 6)) == pytest.approx(3 * usable, rel=0.01)
    # against NVSwitch, where a pair gets the GPU's whole NVLink: TP 2 is 7x slower per byte on MI300X
    h100 = load_cluster("dgx-h100")
    assert busbw(h100, "all_reduce", 4 * GIB, (0, 1)) > 7 * busbw(c, "all_reduce", 4 * GIB, (0, 1))
    # all-to-all sends each peer's share on its own link
    a2a = CollectiveModel(c).time_s("all_to_all", 8 * GIB, tuple(range(8)))
    assert a2a == pytest.approx(8 * GIB / 8 / (usable * 1e9), rel=0.02)


def test_xgmi_mesh_needs_a_link_per_peer():
    import dataclasses

    from topologies.cluster import Cluster

    four_links = dataclasses.replace(get_gpu("mi300x"), xgmi_links=3)
    with pytest.raises(TopologyError, match="need 7 xGMI links per GPU and mi300x has 3"):
        Cluster("m", four_links, 8, intra_node="xgmi")
    assert Cluster("m", four_links, 4, intra_node="xgmi").gpus_per_node == 4
    with pytest.raises(TopologyError, match="intra_node 'xgmi'"):
        load_cluster("dgx-h100", None, {"intra_node": "xgmi"})


def test_geforce_without_p2p_goes_through_host_memory():
    """The GeForce driver disables PCIe peer-to-peer: NCCL stages through host memory, two copies per
    transfer, so two GPUs under one switch move half the bytes of the same box with P2P on (what-if
    `--set pcie_p2p=true`); across sockets NCCL stages through the host either way (P2P over SYS is off
    by default), so the whole node's ring, whose slowest hop crosses sockets, is no faster with it."""
    for name in ("rtx5090-pcie", "rtx4090-pcie"):
        off = load_cluster(name)
        on = load_cluster(name, None, {"pcie_p2p": "true"})
        pair, node = (0, 1), tuple(range(8))
        assert busbw(on, "all_reduce", GIB, pair) == pytest.approx(2 * busbw(off, "all_reduce", GIB, pair), rel=0.01)
        assert busbw(on, "all_reduce", GIB, node) == pytest.approx(busbw(off, "all_reduce", GIB, node), rel=0.01)


@pytest.mark.parametrize("typed, must, must_not", [
    ("mi300", "mi300x", "b300"), ("mi-300x", "mi300x", "b300"), ("a10x", "a10-pcie", "v100"),
    ("a10", "a10-pcie", "dgx-a100-80g"), ("h100", "dgx-h100", "dgx-h200"), ("rtx 5090", "rtx5090-pcie", "rtx4090"),
    ("4090", "rtx4090-pcie", None), ("l4", "g6-48xlarge", "pcie-l40s"), ("l40", "pcie-l40s", "g6-48xlarge"),
    ("dgx-h1000", "dgx-h100", None), ("mi325", "mi325x", None), ("h20x", "hgx-h20", "dgx-h200"),
])
def test_cluster_near_miss_matches_the_product_line_first(typed, must, must_not):
    with pytest.raises(TopologyError) as err:
        load_cluster(typed)
    hint = str(err.value).split(";")[0]
    assert f"did you mean {must!r}" in hint, hint
    if must_not:
        assert must_not not in hint


def test_no_suggestion_from_another_product_line():
    gpus = {"dgx-b300": "b300", "dgx-h100": "h100-sxm", "mi355x": "mi355x", "t4-pcie": "t4"}
    assert nearest_by_family("mi250x", gpus) == ""  # an MI250X is no MI355X, nor a B300
    assert nearest_by_family("t4", gpus) == " (did you mean 't4-pcie'?)"
    assert gpu_family("AMD Instinct MI300X") == ("mi", "300") and gpu_family("RTX 4090") == ("", "4090")
    assert gpu_family("dgx-a100-80g") == ("a", "100") and gpu_family("a10g") == ("a", "10")


def test_every_unknown_gpu_message_names_the_overrides():
    """The four ways to name a GPU the catalog lacks all say how to describe it: --set gpu_* what-ifs."""
    messages = []
    for call in (lambda: get_gpu("mi250x"), lambda: load_cluster("dgx-h100", None, {"gpu": "rtx2080"}),
                 lambda: gpu_from_smi_name("AMD Instinct MI210")):
        with pytest.raises(TopologyError) as err:
            call()
        messages.append(str(err.value))
    for text in messages:
        assert "--set gpu=" in text and "gpu_memory_gib" in text and "gpu_bf16_tflops" in text, text
    assert set(GPU_OVERRIDE_KEYS) == set(GPU_KEYS)  # the message names exactly the keys --set accepts


def test_smi_names_of_the_new_cards():
    for smi, key in (("NVIDIA A10G", "a10g"), ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
                     ("NVIDIA RTX A6000", "a6000"), ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada"),
                     ("NVIDIA GeForce RTX 5090", "rtx5090"), ("NVIDIA H20", "h20"), ("NVIDIA H200", "h200"),
                     ("NVIDIA H100 NVL", "h100-nvl"), ("AMD Instinct MI300X", "mi300x"),
                     ("AMD Instinct MI300X VF", "mi300x"), ("AMD Instinct MI325X", "mi325x"),
                     ("AMD Instinct MI355X", "mi355x")):
        assert gpu_from_smi_name(smi).name == key, smi


def test_pcie_p2p_what_if_saved_and_read_back(tmp_path):
    from topologies.cluster_load import write_cluster_toml

    c = load_cluster("rtx5090-pcie", None, {"pcie_p2p": "true", "gpu_bf16_tflops": "300", "gpu_memory_gib": "30"})
    path = tmp_path / "box.toml"
    write_cluster_toml(c, str(path))
    assert load_cluster(str(path)) == c and c.gpu.pcie_p2p
