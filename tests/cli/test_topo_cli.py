"""Smoke tests of `meshplan topo list|show|detect|bench` run as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data" / "topo"


def test_list_json(cli):
    r = cli("topo", "list", "--json")
    assert r.code == 0, r.stderr
    rows = {row["name"]: row for row in r.json()}
    assert {"dgx-h100", "cpu", "rtx4090-pcie"} <= set(rows)
    assert rows["dgx-a100-80g"]["gpu"] == "a100-80g-sxm" and rows["dgx-a100-80g"]["gpus_per_node"] == 8
    assert all(row["description"] for row in rows.values())


def test_show_human_draws_matrix_and_fabric(cli):
    r = cli("topo", "show", "rtx4090-pcie", "--gpus", "16")
    assert r.code == 0, r.stderr
    assert "GPU7" in r.stdout and "PIX" in r.stdout and "SYS" in r.stdout
    assert "2 node(s) x 1 NIC(s) at 100 Gbit/s" in r.stdout.replace("\n", " ")


def test_show_json_with_what_if(cli):
    r = cli("topo", "show", "dgx-a100-80g", "--set", "nic_gbit_per_s=400", "--set", "gpu=h100-sxm", "--json")
    assert r.code == 0, r.stderr
    data = r.json()
    assert data["nic_gbit_per_s"] == 400 and data["gpu"]["name"] == "h100-sxm"
    assert data["gpu_links"][0][1] == "NV18" and data["gpu_pair_gbytes_per_s"][0][1] == 450


def test_detect_from_file_json(cli):
    r = cli("topo", "detect", "--from-file", str(DATA / "mixed_pxb_node_sys.txt"), "--gpu", "a100-80g-pcie",
            "--json")
    assert r.code == 0, r.stderr
    data = r.json()
    n = data["gpus_per_node"]
    assert n == 8 and len(data["gpu_links"]) == n and data["gpu_links"][0][:3] == ["X", "NV12", "PXB"]
    bw = data["gpu_pair_gbytes_per_s"]
    assert all(bw[i][i] == 0 for i in range(n)) and all(bw[i][j] == bw[j][i] for i in range(n) for j in range(n))
    assert bw[0][1] > bw[0][2] > bw[0][4] > 0  # NV12 > PXB > SYS


def test_detect_save_then_use_as_cluster(cli, tmp_path):
    saved = tmp_path / "node.toml"
    r = cli("topo", "detect", "--from-file", str(DATA / "dgx_h100_ansi.txt"), "--save", str(saved))
    assert r.code == 0, r.stderr
    assert "NV18" in r.stdout and "assuming GPU h100-sxm" in r.stderr
    r = cli("topo", "bench", "--cluster", str(saved), "--op", "all_reduce", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["n_ranks"] == 8


def test_detect_without_nvidia_smi_says_so_and_exits_1(cli, tmp_path):
    r = cli("topo", "detect", env={"PATH": str(tmp_path)})
    assert r.code == 1
    assert "nvidia-smi" in r.stderr and "rocm-smi" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_bench_json_keys(cli):
    r = cli("topo", "bench", "--cluster", "dgx-h100", "--op", "all_reduce", "--size", "1GiB", "--gpus", "16",
            "--json")
    assert r.code == 0, r.stderr
    data = r.json()
    assert data["size_bytes"] == 1 << 30
    assert data["algbw_gbytes_per_s"] == pytest.approx((1 << 30) / data["time_s"] / 1e9)
    assert data["busbw_gbytes_per_s"] == pytest.approx(data["algbw_gbytes_per_s"] * 2 * 15 / 16)


def test_bench_sweep_prints_an_nccl_tests_table(cli):
    r = cli("topo", "bench", "--cluster", "dgx-a100-80g", "--op", "sendrecv", "--size", "8MiB:8GiB", "--gpus", "16")
    assert r.code == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [(8 << 20) * 2**k for k in range(11)]
    busbw = [float(row[6]) for row in rows]
    assert busbw == sorted(busbw) and busbw[-1] <= 25.0  # one HDR NIC per pair of ranks across nodes
    assert "Avg bus bandwidth" in r.stdout


@pytest.mark.parametrize("args, words", [
    (("--size", "lots"), "is not a size"),
    (("--op", "all_scatter"), "unknown collective"),
    (("--gpus", "12"), "does not fill whole nodes"),
    (("--algo", "nvls", "--cluster", "dgx-a100-80g"), "--algo nvls does not apply"),
])
def test_bench_usage_errors_exit_2(cli, args, words):
    r = cli("topo", "bench", *args)
    assert r.code == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_detect_rocm_smi_capture_json(cli, tmp_path):
    """A saved `rocm-smi --showtopo --showproductname --showmeminfo vram` reads like nvidia-smi's matrix."""
    saved = tmp_path / "mi300x.toml"
    r = cli("topo", "detect", "--from-file", str(DATA / "rocm_mi300x_8gpu.txt"), "--json", "--save", str(saved))
    assert r.code == 0, r.stderr
    data = r.json()
    assert data["gpu"] == "mi300x" and data["intra_node"] == "xgmi" and data["source"] == "rocm-smi --showtopo"
    assert data["gpu_links"][0][1:] == ["XGMI"] * 7 and data["gpu_pair_gbytes_per_s"][0][1] == 64
    r = cli("plan", "--model", "llama3.2-1b", "--cluster", str(saved), "--gpus", "8", "--json")
    assert r.code == 0, r.stderr
    assert r.json()["cluster"]["intra_node"] == "xgmi"


def test_detect_rocm_capture_without_product_names_asks_for_the_gpu(cli):
    r = cli("topo", "detect", "--from-file", str(DATA / "rocm_mi300x_topo_only.txt"))
    assert r.code == 2 and "pass --gpu NAME (mi300x" in r.stderr and "Traceback" not in r.stderr


def test_detect_runs_rocm_smi_where_nvidia_smi_is_absent(cli, tmp_path):
    """A ROCm node: `topo detect` runs `rocm-smi --showtopo --showproductname --showmeminfo vram` itself."""
    fake = tmp_path / "rocm-smi"
    fake.write_text(f"#!/bin/sh\n[ \"$*\" = \"--showtopo --showproductname --showmeminfo vram\" ] || exit 9\n"
                    f"exec /bin/cat {DATA / 'rocm_mi300x_8gpu.txt'}\n")
    fake.chmod(0o755)
    r = cli("topo", "detect", "--json", env={"PATH": str(tmp_path)})  # no nvidia-smi on it, even on a GPU node
    assert r.code == 0, r.stderr
    assert r.json()["gpu"] == "mi300x" and r.json()["intra_node"] == "xgmi"
