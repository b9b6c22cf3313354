"""A pinned schedule or ZeRO stage an engine does not run with pipelining is a usage error (exit 2) that names
the engine and what it runs, not meshplan's executor."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("args, message", [
    (("--engine", "megatron", "--pp-schedule", "zb-v"),
     "runs on engine megatron: engine megatron@core-0.16 pipelines with 1f1b, interleaved-1f1b only"),
    (("--engine", "deepspeed", "--pp", "2", "--zero", "2"),
     "runs on engine deepspeed: engine deepspeed@0.6 runs ZeRO 0-1 with pipeline parallelism, got ZeRO-2 with pp 2"),
])
def test_what_an_engine_does_not_pipeline_is_a_usage_error(cli, args, message):
    r = cli("plan", "--model", "13B", "--gpus", "16", *args)
    assert r.code == 2 and message in r.stderr, r.stderr
    assert "meshplan's executor" not in r.stderr
