"""`plan --layers-per-stage` and `--activation-offload-layers`: what a published run states about its pipeline
split and its host offload, as flags (Megatron's uneven split, Megatron-Core's cpu_offloading_num_layers)."""

from __future__ import annotations

import json

import pytest
from conftest import invoke_cli

PLAN = ("plan", "--model", "8B", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64")


def _plan(*flags: str) -> dict:
    res = invoke_cli(*PLAN, *flags, "--json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


def test_pinned_split_is_the_plans_split():
    par = _plan("--pp", "4", "--layers-per-stage", "7,9,9,7")["parallel"]
    assert par["pp"] == 4 and par["layers_per_stage"] == [7, 9, 9, 7] and par["virtual_stages"] == 1


def test_pinned_split_with_interleaving_fixes_the_chunks_per_rank():
    par = _plan("--pp", "2", "--layers-per-stage", "3,5,4,4,4,4,5,3")["parallel"]
    assert par["pp_schedule"] == "interleaved-1f1b" and par["virtual_stages"] == 4
    assert par["layers_per_stage"] == [3, 5, 4, 4, 4, 4, 5, 3]


def test_uneven_split_changes_the_prediction():
    even = _plan("--pp", "4", "--layers-per-stage", "8,8,8,8", "--micro-batch", "1", "--tp", "1", "--cp", "1")
    uneven = _plan("--pp", "4", "--layers-per-stage", "5,11,11,5", "--micro-batch", "1", "--tp", "1", "--cp", "1")
    assert even["parallel"]["layers_per_stage"] == [8, 8, 8, 8]
    # the busiest stage holds 11 layers instead of 8 (the ends' embedding and output layer do not make up for it)
    assert uneven["prediction"]["step_time_s"] > even["prediction"]["step_time_s"]


@pytest.mark.parametrize(("flags", "message"), [
    (("--pp", "4", "--layers-per-stage", "7,9,9,8"), "--layers-per-stage 7,9,9,8 sums to 33 layers; llama3-8b has 32"),
    (("--pp", "4", "--layers-per-stage", "16,16"), "one count >= 1 per chunk, --pp x virtual stages of them (--pp 4"),
    (("--layers-per-stage", "16,16"), "(--pp not pinned"),
    (("--pp", "2", "--layers-per-stage", "0,32"), "one count >= 1 per chunk"),
    (("--pp", "2", "--layers-per-stage", "16,x"), "--layers-per-stage"),
    (("--activation-offload-layers", "-1"), "--activation-offload-layers"),
])
def test_bad_values_are_usage_errors(flags, message):
    res = invoke_cli(*PLAN, *flags)
    assert res.code == 2, res.stdout
    assert message in res.stderr and "Traceback" not in res.stderr


def test_activation_offload_is_megatrons():
    res = invoke_cli(*PLAN, "--activation-offload-layers", "2")
    assert res.code == 2
    assert "does not offload activations to the host" in res.stderr and "--engine megatron" in res.stderr
    kept = _plan("--engine", "megatron", "--pp", "1", "--tp", "2", "--micro-batch", "2", "--recompute", "none")
    offloaded = _plan("--engine", "megatron", "--pp", "1", "--tp", "2", "--micro-batch", "2", "--recompute", "none",
                      "--activation-offload-layers", "8")
    assert offloaded["parallel"]["activation_offload_layers"] == 8
    assert offloaded["prediction"]["peak_memory_bytes"] < kept["prediction"]["peak_memory_bytes"]


def test_fewer_micro_batches_than_stages_is_the_engines_rule():
    """torch.distributed.pipelining refuses 1F1B with fewer micro-batches than stages; Megatron runs it (a warm-up
    of min(pp - rank - 1, micro-batches))."""
    flags = ("--global-batch", "4", "--pp", "4", "--dp", "4", "--micro-batch", "1", "--pp-schedule", "1f1b",
             "--recompute", "full")
    res = invoke_cli("plan", "--model", "8B", "--cluster", "dgx-h100", "--gpus", "16", *flags)
    assert res.code == 2 and "no micro-batch count suits the pipeline schedules left" in res.stderr
    res = invoke_cli("plan", "--model", "8B", "--cluster", "dgx-h100", "--gpus", "16", "--engine", "megatron", *flags,
                     "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["parallel"]["grad_accum_steps"] == 1
