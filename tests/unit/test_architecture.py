"""The shape of the code: one-way package dependencies, no import cycles, no torch on the planning path.

Imports are read with `ast` from every module, function-level imports included,
so a lazy import that closes a cycle is caught as surely as a top-level one.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import networkx as nx

from cli import VERBS

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("topologies", "planner", "executor")  # lowest first: a package imports only lower ones


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module an import names (an attribute import resolves to its module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> nx.DiGraph:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for path in files:
        me = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                target = _resolve(name, modules)
                if target and target != me and not me.startswith(target + "."):
                    graph.add_edge(me, target)
    return graph


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_packages_import_only_lower_packages():
    rank = {pkg: i for i, pkg in enumerate(PACKAGES)}
    wrong = [(a, b) for a, b in import_graph().edges if rank[b.split(".")[0]] > rank[a.split(".")[0]]]
    assert not wrong, f"imports against executor -> planner -> topologies: {wrong}"


def test_every_verb_imports_and_help_lists_it():
    for verb, target in VERBS.items():
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr).name == verb
    out = subprocess.run([sys.executable, str(REPO / "cli.py"), "--help"], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    listed = {line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(VERBS)


def test_planning_path_never_imports_torch():
    code = ("import sys; from cli import main\n"
            "try:\n    main(['plan', '--model', '13B', '--gpus', '16'])\n"
            "except SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout
    assert out.strip().endswith("NO-TORCH")
