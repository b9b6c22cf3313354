"""executor.components.float8 without torchao: the refusals and torchtitan's module filter.

The conversion itself needs torchao and runs in tests/consumers/test_float8.py
(.venv-consumers installs torchao beside torch).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from executor.components.float8 import TORCHAO_PIN, check_device, convertible, require_torchao
from topologies.errors import UsageError


def test_a_missing_torchao_is_refused_with_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError, installed or not
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UsageError) as err:
        require_torchao()
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    assert f"pip install {torch_pin} {TORCHAO_PIN}" in str(err.value) and "--precision bf16" in str(err.value)


def test_cpu_ranks_refuse_fp8():
    with pytest.raises(UsageError, match="GPUs only"):
        check_device(torch.device("cpu"))


def test_torchtitans_filter_keeps_the_output_layer_and_odd_dims_high_precision():
    assert convertible(nn.Linear(64, 128, bias=False), "layers.0.attention.wq")
    assert not convertible(nn.Linear(64, 128, bias=False), "output")
    assert not convertible(nn.Linear(64, 100, bias=False), "layers.0.feed_forward.w1")
    assert not convertible(nn.LayerNorm(64), "layers.0.attention_norm")


def test_an_fp8_plan_is_refused_before_launch_when_torchao_is_missing(monkeypatch):
    from executor.parallel.parallelize import check_supported
    from planner.layout import Layout
    from planner.model.load import load_model
    from planner.plan import Plan, with_stage_layers
    from planner.training import TrainingSpec
    from topologies.cluster_load import load_cluster

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = load_model("debug")
    plan = Plan(model=model, cluster=load_cluster("dgx-h100", 8), layout=with_stage_layers(model, Layout(dp_shard=8, zero_stage=3)),
                training=TrainingSpec(seq_len=256, global_batch_size=8, precision="fp8"))
    with pytest.raises(UsageError, match=TORCHAO_PIN):
        check_supported(plan)
