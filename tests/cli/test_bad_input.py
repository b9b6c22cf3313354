"""Bad input never gives a traceback: random and mutated flags and plans, fed to the CLI.

Property: every user-facing input either succeeds or fails with exit
2 (usage) or 3 (no feasible layout) and one error line naming what was wrong.
Most cases run `cli.main` in this process (a subprocess costs ~0.5 s, torch
verbs ~3 s); an exception escaping `cli.main` is exactly the traceback a user
would see, so it fails the test with that traceback. A few cases run the real
entry point as a subprocess to prove the same holds there.

Verbs whose module does not exist yet are skipped, not passed vacuously (an
unknown verb is also exit 2 with one line).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
from conftest import REPO, CliResult, run_cli
from conftest import invoke_cli as invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.model.presets import PRESETS
from topologies.errors import MeshplanError

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLUSTERS = ["cpu", "dgx-h100", "dgx-a100-80g"]




def assert_clean_failure(r: CliResult, allowed: tuple[int, ...] = (0, 2, 3)) -> None:
    """Success, or an allowed exit code with exactly one error line and no traceback.

    click's own parse errors print a usage line and a hint around their one
    `Error:` line; those two boilerplate lines are not counted.
    """
    assert r.code in allowed, f"exit {r.code}\n{r.stderr}"
    if r.code == 0:
        return
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1, f"want one error line, got:\n{r.stderr}"
    assert len(errors[0]) > len("error: ") + 10, f"an error line must say what was wrong: {errors[0]!r}"


# ---- flags -------------------------------------------------------------------

names = st.one_of(
    st.sampled_from([*PRESETS, "13B", "debg", "llama9-13b", "", " ", "../no/such.json", "/dev/null", "-1"]),
    st.text(min_size=0, max_size=10),
)
ints = st.one_of(st.integers(-3, 64), st.sampled_from([0, -1, 2**31, 10**12, 10**40]), st.sampled_from(["x", "1.5", ""]))


@FAST
@given(model=names, gpus=ints, cluster=st.one_of(st.sampled_from([*CLUSTERS, "cpux", "dgx-h10"]), st.text(max_size=8)),
       extra=st.lists(st.tuples(st.sampled_from(["--tp", "--pp", "--dp", "--cp", "--zero", "--micro-batch",
                                                  "--global-batch", "--seq-len", "--virtual-stages", "--top"]),
                                ints), max_size=3, unique_by=lambda t: t[0]))
def test_plan_flags(model, gpus, cluster, extra):
    argv = ["plan", "--model", model, "--gpus", str(gpus), "--cluster", cluster, "--json"]
    for flag, value in extra:
        argv += [flag, str(value)]
    assert_clean_failure(invoke(*argv))


def test_cluster_of_an_unknown_users_home():
    """`--cluster ~0` (the home of a user that does not exist: pathlib cannot expand it) is an unknown cluster
    name, exit 2 with the presets listed, not a traceback (found by test_plan_flags)."""
    r = invoke("plan", "--model", "llama2-7b", "--gpus", "1", "--cluster", "~0")
    assert r.code == 2 and "unknown cluster '~0'" in r.stdout + r.stderr


@FAST
@given(name=names, verb=st.sampled_from(["show", "list", "lsit", ""]))
def test_models_flags(name, verb):
    assert_clean_failure(invoke("models", verb, name) if verb == "show" else invoke("models", verb))


@FAST
@given(name=st.one_of(st.sampled_from([*CLUSTERS, "cpux", "dgx-h10", "", "../x.toml"]), st.text(max_size=8)),
       verb=st.sampled_from(["show", "list", "lsit"]))
def test_topo_names(name, verb):
    assert_clean_failure(invoke("topo", verb, name) if verb == "show" else invoke("topo", verb))


@st.composite
def mutated_lines(draw, text: str) -> str:
    """A text file after random line edits: drop, duplicate, cut short or replace a line; or no text at all."""
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        edit = draw(st.sampled_from(["drop", "dup", "cut", "replace"]))
        if edit == "drop":
            del lines[i]
        elif edit == "dup":
            lines.insert(i, lines[i])
        elif edit == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        else:
            lines[i] = draw(st.text(max_size=30))
    return draw(st.sampled_from(["\n".join(lines), "\n".join(lines), "", "\x00\xff"]))


PRESET_TOML = (REPO / "topologies" / "presets" / "dgx-h100.toml")
SMI_OUTPUT = (REPO / "tests" / "data" / "topo" / "dgx_h100_ansi.txt")


@FAST
@given(data=st.data())
def test_topo_files(data):
    """A cluster TOML (`topo show PATH`, `plan --cluster PATH`) or a saved `nvidia-smi topo -m` (`detect`)."""
    toml = write(data.draw(mutated_lines(PRESET_TOML.read_text())))
    smi = write(data.draw(mutated_lines(SMI_OUTPUT.read_text())))
    os.replace(toml, toml + ".toml")
    try:
        assert_clean_failure(invoke("topo", "show", toml + ".toml", "--json"))
        assert_clean_failure(invoke("plan", "--model", "debug", "--gpus", "8", "--cluster", toml + ".toml", "--json"))
        assert_clean_failure(invoke("topo", "detect", "--from-file", smi, "--json"))
    finally:
        os.unlink(toml + ".toml")
        os.unlink(smi)


@pytest.mark.parametrize("argv, expect", [
    (["plan", "--model", "debg", "--gpus", "4", "--cluster", "cpu"], "did you mean 'debug'"),
    (["plan", "--model", "debug", "--gpus", "4", "--cluster", "cpux"], "did you mean 'cpu'"),
    (["plan", "--model", "debug", "--gpus", "4", "--cluster", "cpu", "--tp", "3"], "tp"),
    (["plan", "--model", "debug", "--gpus", "4", "--cluster", "cpu", "--global-batch", "6", "--dp", "4"], "6"),
    (["plan", "--model", "debug", "--gpus", "4", "--cluster", "cpu", "--tp", "2", "--pp", "4"], "4"),
])
def test_named_bad_flags_say_what_was_wrong(argv, expect):
    """Unknown names suggest the nearest; degrees that cannot work name the numbers."""
    r = invoke(*argv)
    assert r.code in (2, 3), r.stdout + r.stderr
    assert_clean_failure(r)
    assert expect in r.stderr


# ---- plan files ----------------------------------------------------------------


@pytest.fixture(scope="module")
def base_plan() -> dict:
    """A real plan for 4 CPU ranks (TP 2 x ZeRO-3 2), prediction and alternatives included."""
    r = invoke("plan", "--model", "debug", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64",
               "--tp", "2", "--dp-shard", "2", "--zero", "3", "--json")
    assert r.code == 0, r.stderr
    return json.loads(r.stdout)


def _paths(obj, prefix=()):
    """Every key path in a JSON document (dict keys and list indices), parents before children."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.sampled_from([0, -1, 2**53, 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
json_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                                max_size=3), max_leaves=5)


@st.composite
def mutated_plan_text(draw, base: dict) -> str:
    """plan.json after 1-3 random edits: delete a key, replace a value, scale a number; or broken text."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(data))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["delete", "replace", "scale"]))
        old = parent[path[-1]]
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "scale" and isinstance(old, (int, float)) and not isinstance(old, bool):
            parent[path[-1]] = old * draw(st.sampled_from([0, -1, 2, 3, 10**9]))
        else:
            parent[path[-1]] = draw(json_values)
    text = json.dumps(data)
    damage = draw(st.sampled_from(["none", "none", "truncate", "garbage"]))
    if damage == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if damage == "garbage":
        return draw(st.sampled_from(["", "null", "[]", "1", '"plan"', "\x00\xff", "{'a': 1}"]))
    return text


def write(text: str) -> str:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="meshplan-bad-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def test_load_plan_raises_only_typed_one_line_errors(base_plan):
    """The library entry point every plan-reading verb shares: 300 mutated plans."""
    from planner.plan import load_plan

    @settings(max_examples=300, deadline=None)
    @given(text=mutated_plan_text(base_plan))
    def check(text):
        path = write(text)
        try:
            load_plan(path)
        except MeshplanError as exc:
            assert exc.exit_code in (2, 3) and "\n" not in str(exc), str(exc)
        finally:
            os.unlink(path)

    check()


@pytest.mark.parametrize("edit, expect", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: {**d, "schema_version": 4}, "schema_version 4"),
    (lambda d: {k: v for k, v in d.items() if k != "parallel"}, "parallel"),
    (lambda d: {**d, "parallel": {**d["parallel"], "tp": 4}}, "!= the cluster's 4 GPUs"),
    (lambda d: {**d, "parallel": {**d["parallel"], "tp": 4, "dp_shard": 1, "zero_stage": 0}},
     "must divide the model's attention heads"),
    (lambda d: {**d, "model": {**d["model"], "hidden": 0}}, "hidden must be a positive integer"),
    (lambda d: {**d, "model": {**d["model"], "n_layers": -4}}, "n_layers must be a positive integer"),
    (lambda d: {**d, "training": {**d["training"], "global_batch_size": 10}}, "!= global_batch_size (10)"),
])
def test_named_bad_plans_say_what_was_wrong(base_plan, edit, expect):
    from planner.plan import load_plan

    doc = edit(copy.deepcopy(base_plan))
    path = write(doc if isinstance(doc, str) else json.dumps(doc))
    try:
        with pytest.raises(MeshplanError) as info:
            load_plan(path)
    finally:
        os.unlink(path)
    assert info.value.exit_code == 2 and expect in str(info.value), str(info.value)


@FAST
@given(data=st.data())
def test_simulate_mutated_plans(base_plan, data):
    path = write(data.draw(mutated_plan_text(base_plan)))
    try:
        assert_clean_failure(invoke("simulate", path, "--json"))
    finally:
        os.unlink(path)


def test_plan_file_errors_are_one_line_in_a_real_process(cli, tmp_path):
    """The same through the installed entry point, for the verbs that read plan.json."""
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    for verb in ("simulate", "execute", "validate-memory"):
        for path in (bad, tmp_path / "missing.json"):
            r = cli(verb, str(path))
            assert r.code == 2, (verb, r.stderr)
            assert_clean_failure(r)
            assert str(path) in r.stderr


# ---- checkpoint export ----------------------------------------------------------


def test_checkpoint_export_bad_paths(tmp_path):
    not_ckpt = tmp_path / "empty"
    not_ckpt.mkdir()
    corrupt = tmp_path / "corrupt-run" / "checkpoints" / "step-2"
    corrupt.mkdir(parents=True)
    (corrupt / ".metadata").write_bytes(b"\x80\x04not a pickle")
    (tmp_path / "no-ckpt-run" / "checkpoints").mkdir(parents=True)
    cases = [
        (tmp_path / "nope", "does not exist"),
        (not_ckpt, "neither a checkpoint"),
        (corrupt, "corrupt"),
        (tmp_path / "corrupt-run", "corrupt"),  # the run directory resolves to its latest, step-2
        (tmp_path / "no-ckpt-run", "holds no complete checkpoint"),
    ]
    for path, expect in cases:
        r = invoke("checkpoint", "export", str(path), "--to", str(tmp_path / "m.pt"))
        assert r.code == 2 and expect in r.stderr, (path, r.stderr)
        assert_clean_failure(r)
    assert not (tmp_path / "m.pt").exists()


def test_checkpoint_export_unwritable_target(tmp_path):
    import torch.nn as nn

    from executor.components.checkpoint import CheckpointManager

    CheckpointManager(tmp_path).save(1, {"model": nn.Linear(2, 2)})
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = invoke("checkpoint", "export", str(tmp_path), "--to", str(blocker / "m.pt"))
    assert r.code == 2 and "is not a directory" in r.stderr, r.stderr  # refused before consolidating
    assert_clean_failure(r)


# ---- execute: plans, data files, run directory, disk ---------------------------

small_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 64), st.text(max_size=4))


@st.composite
def mildly_mutated_plan(draw, base: dict) -> dict:
    """One edit with small values only: big ones would make a --dry-run build a huge model (see below)."""
    data = copy.deepcopy(base)
    path = draw(st.sampled_from([p for p in _paths(data) if p[0] in ("model", "training", "parallel")]))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(small_values)
    return data


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_execute_dry_run_mutated_plans(base_plan, data):
    """`execute --dry-run` validates a plan as a real launch does (load_plan, then check_supported)."""
    path = write(json.dumps(data.draw(mildly_mutated_plan(base_plan))))
    try:
        assert_clean_failure(invoke("execute", path, "--dry-run"))
    finally:
        os.unlink(path)


@pytest.fixture
def plan_file(base_plan, tmp_path) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(base_plan))
    return str(path)


def _data_files(where) -> dict:
    import numpy as np

    files = {"missing": where / "missing.bin", "directory": where}
    for name, content in (("empty.bin", b""), ("odd.bin", b"\x01\x02\x03"), ("short.bin", b"\x01\x00" * 10),
                          ("big-ids.bin", np.full(4096, 60000, dtype=np.uint16).tobytes())):
        (where / name).write_bytes(content)
        files[name] = where / name
    np.save(where / "floats.npy", np.zeros(4096, dtype=np.float32))
    np.save(where / "objects.npy", np.array([{"a": 1}] * 3, dtype=object), allow_pickle=True)
    files.update({"floats.npy": where / "floats.npy", "objects.npy": where / "objects.npy"})
    return files


def test_execute_bad_data_files(plan_file, tmp_path):
    """Missing, empty, unreadable or ill-formed --data: exit 2 before any worker starts, naming the file."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name, path in _data_files(data_dir).items():
        r = invoke("execute", plan_file, "--data", str(path), "--steps", "1", "--out", str(tmp_path / "out"))
        assert r.code == 2, (name, r.stderr)
        assert_clean_failure(r)
        assert str(path) in r.stderr, (name, r.stderr)


def test_execute_unwritable_out(plan_file, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = invoke("execute", plan_file, "--steps", "1", "--out", str(blocker / "run"))
    assert r.code == 2 and str(blocker) in r.stderr, r.stderr
    assert_clean_failure(r)


ABSURD = {  # (section, key, value, companion edits keeping the plan self-consistent)
    "n_layers": ("model", "n_layers", 10**6, {("parallel", "layers_per_stage"): [10**6]}),
    "hidden": ("model", "hidden", 10**9, {("model", "head_dim"): 10**9 // 4}),
    "vocab": ("model", "vocab", 10**12, {}),
    "global_batch": ("training", "global_batch_size", 10**12,
                     {("parallel", "micro_batch_size"): 10**12 // 2, ("parallel", "grad_accum_steps"): 1}),
}


@pytest.mark.parametrize("name", sorted(ABSURD))
def test_execute_refuses_absurd_sizes(base_plan, tmp_path, name):
    """A plan that validates but cannot fit this machine is refused up front (exit 2), not crashed or hung."""
    section, key, value, companions = ABSURD[name]
    doc = copy.deepcopy(base_plan)
    doc[section][key] = value
    for (sec, k), v in companions.items():
        doc[sec][k] = v
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    r = run_cli("execute", str(plan), "--steps", "1", "--out", str(tmp_path / "out"), timeout=30)
    assert r.code in (2, 3), r.stderr[-2000:]
    assert_clean_failure(r)
