"""Hostile input per input type, fuzzed through `cli.main` in this process: exit 0, 2 or 3, one line, no traceback.

One hypothesis test per input a user hands meshplan: a config.json given to
--model (file or snapshot directory), a cluster TOML, a plan.json, a run's
metrics.jsonl, --set values and the planning flags, --config files, output
paths. Every example runs in its own temporary directory, and the repository
must be unchanged afterwards (nothing written outside the temporary tree).
Examples are few per test (CLI_FAST), so the tier stays fast; the counts
are in HOSTILE_VALUES and the strategies below.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, CliResult
from conftest import invoke_cli as invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cli

CLI_FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])
HOSTILE_VALUES = st.one_of(
    st.sampled_from([0, -1, None, "", "x", [], {}, True, 4096.5, 2**64, 1e308, -1e308, "nan", "inf", "1e400",
                     [1, 2], {"a": 1}, "\x00", "💥" * 3]),
    st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
         "rope_theta": 500000.0, "hidden_act": "silu", "rms_norm_eps": 1e-5}




def assert_clean(r: CliResult) -> None:
    assert r.code in (0, 2, 3), f"exit {r.code}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    if r.code:
        errors = [line for line in r.stderr.splitlines() if line.lower().startswith("error:")]
        assert len(errors) == 1, f"want one error line, got:\n{r.stderr}"


def _repo_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=False).stdout


@pytest.fixture(scope="module", autouse=True)
def repo_untouched():
    """Nothing outside the examples' temporary directories changes (checked once per module: git is slow)."""
    before = _repo_state()
    yield
    assert _repo_state() == before, "a hostile input wrote into the repository"


@contextlib.contextmanager
def workdir():
    with tempfile.TemporaryDirectory(prefix="meshplan-hostile-") as tmp:
        yield Path(tmp)


# ---- config.json via --model (a file, or a snapshot directory) --------------------------

@CLI_FAST
@given(edits=st.dictionaries(st.sampled_from(sorted(LLAMA) + ["num_experts", "head_dim", "n_routed_experts"]),
                             HOSTILE_VALUES, min_size=1, max_size=3),
       as_dir=st.booleans(), verb=st.sampled_from(["plan", "models"]))
def test_model_configs(edits, as_dir, verb):
    with workdir() as tmp:
        target = tmp / "snap" if as_dir else tmp
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text(json.dumps({**LLAMA, **edits}, default=str))
        model = str(target) if as_dir else str(target / "config.json")
        argv = ["plan", "--model", model, "--gpus", "8", "--json"] if verb == "plan" else ["models", "show", model]
        assert_clean(invoke(*argv, cwd=tmp))


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", "{}".encode("utf-16"), b"[" * 200_000, b"",
                                     b'{"hidden_size": 1e400}'])
def test_model_files_that_are_not_json_objects(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    assert_clean(invoke("plan", "--model", str(tmp_path / "config.json"), "--gpus", "8", cwd=tmp_path))
    assert_clean(invoke("plan", "--model", str(tmp_path), "--gpus", "8", cwd=tmp_path))


def test_a_snapshot_directory_is_read_and_names_the_model(tmp_path):
    snap = tmp_path / "Llama-3.1-8B"
    snap.mkdir()
    (snap / "config.json").write_text(json.dumps(LLAMA))
    r = invoke("plan", "--model", str(snap), "--gpus", "8", "--json", cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert r.json()["model"]["name"] == "Llama-3.1-8B"
    (snap / "config.json").write_text(json.dumps({**LLAMA, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    assert invoke("plan", "--model", str(snap), "--gpus", "8", "--json", cwd=tmp_path).json()["model"]["name"] == \
        "meta-llama/Llama-3.1-8B"


def test_a_directory_without_config_json_says_so(tmp_path):
    r = invoke("plan", "--model", str(tmp_path), "--gpus", "8", cwd=tmp_path)
    assert r.code == 2 and "without config.json" in r.stderr


# ---- cluster TOML ---------------------------------------------------------------------

CLUSTER_KEYS = ["gpus_per_node", "n_nodes", "nics_per_node", "nic_gbit_per_s", "inter_node_oversubscription",
                "nodes_per_leaf", "gpu_memory_gib", "nvlink_gbytes_per_s", "gpu_bf16_tflops", "intra_node"]


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = repr(value)
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(text, text)
    return json.dumps(str(value))


@CLI_FAST
@given(edits=st.dictionaries(st.sampled_from(CLUSTER_KEYS), HOSTILE_VALUES, min_size=1, max_size=3),
       verb=st.sampled_from(["plan", "topo"]))
def test_cluster_toml(edits, verb):
    lines = ['gpu = "h100-sxm"', "gpus_per_node = 8"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in edits.items() if v is not None and v != [] and v != {}]
    with workdir() as tmp:
        path = tmp / "c.toml"
        path.write_text("\n".join(dict.fromkeys(lines)) + "\n")
        argv = (["plan", "--model", "8B", "--cluster", str(path), "--gpus", "8", "--json"] if verb == "plan"
                else ["topo", "bench", "--cluster", str(path), "--gpus", "16", "--json"])
        assert_clean(invoke(*argv, cwd=tmp))


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00", "gpu = 'h100-sxm'".encode("utf-16"),
                                     b"gpus_per_node = nan\ngpu = 'h100-sxm'", b"a = " + b"[" * 100_000])
def test_cluster_files_that_are_not_toml(tmp_path, content):
    (tmp_path / "c.toml").write_bytes(content)
    r = invoke("topo", "show", str(tmp_path / "c.toml"), cwd=tmp_path)
    assert r.code == 2, r.stderr
    assert_clean(r)


# ---- --set values and planning flags ---------------------------------------------------

@CLI_FAST
@given(key=st.sampled_from(["nic_gbit_per_s", "gpu_memory_gib", "nvlink_gbytes_per_s", "gpus_per_node", "n_nodes",
                            "inter_node_oversubscription", "gpu_bf16_tflops", "pcie_gen"]),
       value=st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "1e30", "true", "0x10"]),
                       st.text(min_size=1, max_size=5).filter(lambda s: "=" not in s and s.strip())),
       verb=st.sampled_from(["plan", "bench"]))
def test_set_values(key, value, verb):
    argv = (["plan", "--model", "8B", "--gpus", "16", "--json"] if verb == "plan"
            else ["topo", "bench", "--gpus", "16", "--json"])
    with workdir() as tmp:
        r = invoke(*argv, "--set", f"{key}={value}", cwd=tmp)
        assert_clean(r)
        if value.lower() in ("nan", "inf", "-inf", "1e400"):
            assert r.code == 2, f"--set {key}={value} must be refused: {r.stdout[:200]}"


@CLI_FAST
@given(gpus=st.one_of(st.sampled_from(["auto", "8-512", "512-8", "0-8", "1-1", "16777216", "8-16777216", "auto-8",
                                       "-", "8--16", " 64 "]), st.text(max_size=6)),
       extra=st.lists(st.sampled_from([("--tokens", "15T"), ("--tokens", "-1T"), ("--tokens", "nan"),
                                       ("--price-per-gpu-hour", "nan"), ("--price-per-gpu-hour", "-2"),
                                       ("--price-per-gpu-hour", "2.5"), ("--memory-headroom", "inf"),
                                       ("--memory-headroom", "95"), ("--memory-headroom", "10"),
                                       ("--global-batch", "16777216"), ("--micro-batch", "100000")]),
                      max_size=2, unique_by=lambda t: t[0]))
def test_gpu_ranges_and_answer_flags(gpus, extra):
    argv = ["plan", "--model", "8B", "--gpus", gpus, "--json"]
    for flag, value in extra:
        argv += [flag, value]
    with workdir() as tmp:
        assert_clean(invoke(*argv, cwd=tmp))


def test_huge_counts_answer_quickly(tmp_path):
    import time

    start = time.perf_counter()
    r = invoke("plan", "--model", "405B", "--gpus", "16777216", "--global-batch", "16777216", cwd=tmp_path)
    assert r.code == 2 and "exceeds" in r.stderr
    r = invoke("topo", "bench", "--gpus", "1000000000", cwd=tmp_path)
    assert r.code == 2 and "exceeds" in r.stderr
    assert time.perf_counter() - start < 10


@CLI_FAST
@given(body=st.one_of(
    st.dictionaries(st.sampled_from(["model", "gpus", "cluster", "global-batch", "global_batch", "tp", "set", "png",
                                     "memory-headroom", "bogus", "json"]), HOSTILE_VALUES, max_size=4),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1"))),
    suffix=st.sampled_from([".toml", ".yaml"]))
def test_config_files(body, suffix):
    with workdir() as tmp:
        path = tmp / f"job{suffix}"
        if isinstance(body, dict):
            import yaml

            text = (yaml.safe_dump(body) if suffix == ".yaml"
                    else "\n".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in body.items()))
        else:
            text = body
        path.write_text(text, encoding="latin-1")
        assert_clean(invoke("plan", "--config", str(path), "--model", "8B", "--gpus", "8", "--json", cwd=tmp))



def test_a_null_config_key_leaves_the_flag_at_its_default():
    """`cluster: null` in YAML is no value: the plan is the one without the key (dgx-h100), not a traceback."""
    with workdir() as tmp:
        (tmp / "job.yaml").write_text("cluster: null\ntp: null\n")
        with_null = invoke("plan", "--config", str(tmp / "job.yaml"), "--model", "8B", "--gpus", "8", "--json", cwd=tmp)
        plain = invoke("plan", "--model", "8B", "--gpus", "8", "--json", cwd=tmp)
    assert with_null.code == 0, with_null.stderr
    assert json.loads(with_null.stdout)["cluster"]["name"] == json.loads(plain.stdout)["cluster"]["name"]

# ---- plan.json -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "p.json"
    assert invoke("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "2", "--global-batch", "8",
                  "--seq-len", "64", "-o", str(path), cwd=path.parent).code == 0
    return path.read_text()


@CLI_FAST
@given(edit=st.tuples(st.sampled_from(["model", "cluster", "training", "parallel", "prediction"]),
                      st.text(max_size=12), HOSTILE_VALUES),
       verb=st.sampled_from(["simulate", "export"]))
def test_plan_files(plan_text, edit, verb):
    import math

    data = json.loads(plan_text)
    section, key, value = edit
    edited = isinstance(data.get(section), dict) and bool(data[section])
    if edited:
        key = sorted(data[section])[hash(key) % len(data[section])]
        data[section][key] = value
    with workdir() as tmp:
        (tmp / "p.json").write_text(json.dumps(data, default=str))
        argv = ["simulate", "p.json", "--json"] if verb == "simulate" else ["export", "p.json", "--to", "torchtitan"]
        r = invoke(*argv, cwd=tmp)
        assert_clean(r)
        if edited and isinstance(value, float) and not math.isfinite(value):
            assert r.code == 2 and "not a finite number" in r.stderr, r.stderr


@pytest.mark.parametrize("content", ["[" * 200_000, '{"model": NaN}', "\x00\x01", ""])
def test_plan_files_that_are_not_plans(tmp_path, content):
    (tmp_path / "p.json").write_text(content, encoding="latin-1")
    r = invoke("simulate", "p.json", cwd=tmp_path)
    assert r.code == 2
    assert_clean(r)


# ---- metrics.jsonl (report) -------------------------------------------------------------

@CLI_FAST
@given(rows=st.lists(st.fixed_dictionaries({"step": st.one_of(st.integers(-2, 8), HOSTILE_VALUES),
                                            "step_time_s": st.one_of(st.floats(-1, 2), HOSTILE_VALUES),
                                            "loss": HOSTILE_VALUES, "peak_memory_bytes": HOSTILE_VALUES}),
                     max_size=6),
       tail=st.sampled_from(["", '{"step": 9, "step_', "[" * 50_000 + "\n"]))
def test_report_metrics(plan_text, rows, tail):
    with workdir() as tmp:
        (tmp / "run").mkdir()
        (tmp / "run" / "plan.json").write_text(plan_text)
        lines = "".join(json.dumps(r, default=str) + "\n" for r in rows) + tail
        (tmp / "run" / "metrics.jsonl").write_text(lines)
        assert_clean(invoke("report", "run", "--json", cwd=tmp))


# ---- output paths ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "fifo", "devnull", "dir", "missing_dir", "bad_suffix"])
def test_outputs_never_replace_what_they_were_not_asked_to(tmp_path, kind):
    real = tmp_path / "real.json"
    if kind == "symlink":
        real.write_text("old")
        (tmp_path / "out.json").symlink_to(real)
        out = tmp_path / "out.json"
    elif kind == "fifo":
        out = tmp_path / "fifo"
        os.mkfifo(out)
        reader = os.open(out, os.O_RDONLY | os.O_NONBLOCK)
    elif kind == "devnull":
        out = Path("/dev/null")
    elif kind == "dir":
        out = tmp_path
    elif kind == "missing_dir":
        out = tmp_path / "no" / "such" / "p.json"
    else:
        out = tmp_path / "p.json"
    png = str(tmp_path / "chart.txt") if kind == "bad_suffix" else None
    argv = ["plan", "--model", "8B", "--gpus", "8", "-o", str(out), *(["--png", png] if png else [])]
    r = invoke(*argv, cwd=tmp_path)
    assert_clean(r)
    if kind == "symlink":
        assert out.is_symlink() and json.loads(real.read_text())["model"]["name"]
    elif kind == "fifo":
        assert os.read(reader, 20).startswith(b"{")
        os.close(reader)
        assert out.is_fifo()
    elif kind == "devnull":
        assert r.code == 0 and out.is_char_device()
    else:
        assert r.code == 2 and "search:" not in r.stdout  # refused before searching
        assert not (tmp_path / "p.json").exists()


# ---- every numeric flag of the light verbs, found by introspection ------------------------

def _numeric_options(argv_prefix: list[str]) -> list[str]:
    """The long flags taking a number on the command `argv_prefix` names (click introspection)."""
    import click

    command = cli.meshplan
    ctx = click.Context(command)
    for name in argv_prefix:
        command = command.get_command(ctx, name)
    numeric = (click.types.IntParamType, click.types.FloatParamType)
    return [next(o for o in p.opts if o.startswith("--")) for p in command.params
            if isinstance(p, click.Option) and not p.is_flag and
            (isinstance(p.type, numeric) or p.type.name in ("number", "integer range", "float range"))]


LIGHT_VERBS = {("plan",): ["--model", "8B", "--gpus", "8", "--json"],
               ("compare",): ["--model", "8B", "--gpus", "8", "--json"],
               ("topo", "bench"): ["--json"], ("topo", "show"): ["dgx-h100", "--json"],
               ("execute",): ["{plan}", "--print-launch", "torchrun"],
               ("report",): ["{run}", "--json"]}


@pytest.mark.parametrize("verb", sorted(LIGHT_VERBS), ids=" ".join)
def test_every_numeric_flag_refuses_non_finite_and_negative_values(plan_text, tmp_path, verb):
    (tmp_path / "p.json").write_text(plan_text)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text(plan_text)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 1.0}\n')
    base = [a.format(plan="p.json", run="run") for a in LIGHT_VERBS[verb]]
    flags = _numeric_options(list(verb))
    assert flags, f"no numeric flags found on {verb}"
    for flag in flags:
        for value in ("nan", "inf", "-inf", "1e400", "-1", "99999999999999999999"):
            r = invoke(*verb, *base, flag, value, cwd=tmp_path)
            assert_clean(r)
            if value in ("nan", "inf", "-inf", "1e400"):
                assert r.code == 2, f"{' '.join(verb)} {flag} {value} was accepted"
