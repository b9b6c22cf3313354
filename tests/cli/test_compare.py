"""`meshplan compare`: variants side by side, speed-up, cost, infeasible variants, chart."""

from __future__ import annotations

import pytest

from planner.search.compare import parse_what_if, variants
from topologies.errors import UsageError


def test_two_clusters_side_by_side(cli):
    r = cli("compare", "--model", "13B", "--gpus", "16", "--cluster", "dgx-a100-80g,dgx-h100",
            "--price-per-gpu-hour", "2.5", "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    a100, h100 = doc["variants"]
    assert (a100["gpu"], h100["gpu"]) == ("a100-80g-sxm", "h100-sxm")
    assert a100["speedup"] == 1.0
    # H100 SXM has 3.2x the dense bf16 peak and 1.6x the HBM bandwidth of A100 (datasheets): clearly faster
    assert h100["speedup"] > 1.5
    assert h100["speedup"] == pytest.approx(h100["prediction"]["tokens_per_s"] / a100["prediction"]["tokens_per_s"])
    for v in (a100, h100):
        cost = 2.5 * 16 / 3600 / v["prediction"]["tokens_per_s"] * 1e6
        assert v["cost_per_million_tokens"] == pytest.approx(cost)


def test_one_price_per_variant(cli):
    r = cli("compare", "--model", "7B", "--gpus", "8", "--cluster", "dgx-a100-80g,dgx-h100",
            "--price-per-gpu-hour", "1.5,3", "--json")
    assert r.code == 0, r.stderr
    a100, h100 = r.json()["variants"]
    assert (a100["price_per_gpu_hour"], h100["price_per_gpu_hour"]) == (1.5, 3.0)
    assert a100["cost_per_million_tokens"] == pytest.approx(1.5 * 8 / 3600 / a100["prediction"]["tokens_per_s"] * 1e6)
    r = cli("compare", "--model", "7B", "--gpus", "8", "--cluster", "dgx-h100", "--price-per-gpu-hour", "1,2")
    assert r.code == 2 and "one per variant" in r.stderr


def test_what_if_network_and_infeasible_variant(cli):
    r = cli("compare", "--model", "13B", "--gpus", "16", "--what-if", "nic_gbit_per_s=100,400", "--json")
    assert r.code == 0, r.stderr
    slow, fast = r.json()["variants"]
    assert fast["prediction"]["step_time_s"] <= slow["prediction"]["step_time_s"]  # more bandwidth never hurts
    r = cli("compare", "--model", "70B", "--gpus", "64", "--what-if", "gpus=8,64", "--json")
    assert r.code == 0, r.stderr
    small, big = r.json()["variants"]
    assert not small["feasible"] and "needs" in small["error"]
    assert big["feasible"] and big["speedup"] == 1.0  # the first feasible variant is the baseline


def test_human_table_and_png(cli, tmp_path):
    png = tmp_path / "cmp.png"
    r = cli("compare", "--model", "7B", "--gpus", "8", "--cluster", "dgx-a100-80g,dgx-h100", "--png", str(png))
    assert r.code == 0, r.stderr
    assert "speed-up" in r.stdout and "dgx-a100-80g" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_variant_infeasible_exits_3(cli):
    r = cli("compare", "--model", "405B", "--gpus", "8", "--cluster", "dgx-h100")
    assert r.code == 3 and "no variant" in r.stderr


@pytest.mark.parametrize("item", ["nic_gbit_per_s", "=1,2", "gpus=x", "seq_len=0"])
def test_bad_what_if_is_a_usage_error(item):
    with pytest.raises(UsageError):
        parse_what_if((item,))


def test_variants_cross_clusters_and_values():
    out = variants("a,b", {"k": "v"}, [("nic_gbit_per_s", ["100", "200"]), ("seq_len", ["1024"])])
    assert [v.label for v in out] == ["a nic_gbit_per_s=100 seq_len=1024", "a nic_gbit_per_s=200 seq_len=1024",
                                      "b nic_gbit_per_s=100 seq_len=1024", "b nic_gbit_per_s=200 seq_len=1024"]
    assert out[0].overrides == {"k": "v", "nic_gbit_per_s": "100"} and out[0].run == {"seq_len": 1024}


def test_unknown_what_if_key_exits_2(cli):
    r = cli("compare", "--model", "7B", "--gpus", "8", "--what-if", "bogus_key=1,2")
    assert r.code == 2 and "Traceback" not in r.stderr
