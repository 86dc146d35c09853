"""The package layout's promises: no import cycle, the planner and pricing without torch or hivemind, and
commands that start without them (docs/architecture.md says why)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "geotrain"
HEAVY = ("torch", "hivemind")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in the file names, lazy ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: {target for target in imported_modules(path) if target in MODULES and target != name}
         for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert len(GRAPH) > 40, "the module scan found too little"
    assert cycles(GRAPH) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["geotrain.planner", "geotrain.pricing", "geotrain.lab"])
def test_pure_packages_import_neither_torch_nor_hivemind(package):
    for name, path in MODULES.items():
        if name == package or name.startswith(package + "."):
            heavy = {module for module in imported_modules(path) if module.split(".")[0] in HEAVY}
            assert not heavy, f"{name} imports {heavy}"


def test_nothing_imports_the_cli():
    importers = [name for name, targets in GRAPH.items() if "geotrain.cli" in targets and name != "geotrain.__main__"]
    assert importers == []


# peer, coordinator and status leave with os._exit (past hivemind's teardown): report from there too
RUNNER = """
import json, os, sys
def report(code):
    print(json.dumps({"code": code, "loaded": sorted(m for m in ("torch", "hivemind") if m in sys.modules)}))
    sys.stdout.flush()
leave = os._exit
os._exit = lambda code: (report(code), leave(code))
from geotrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
report(code)
"""


def loaded_by(*argv: str) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-c", RUNNER, *argv], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["code"], report["loaded"]


@pytest.mark.parametrize("argv", [
    ["plan", "--profile", "convnext_large", "--max-peers", "4", "--top", "1"],
    ["lab", "down", "--lab", "gtlabimport"],
    ["local", "--peers", "0"],  # refused before anything starts
    ["peer", "--help"],
    ["coordinator", "--help"],
    ["bench", "--help"],
])
def test_commands_that_need_neither_start_without_torch_and_hivemind(argv):
    code, loaded = loaded_by(*argv)
    assert code in (0, 2), code
    assert loaded == [], f"geotrain {' '.join(argv)} imported {loaded}"


def test_the_import_pin_sees_a_command_that_loads_torch(tmp_path):
    # a trainer that fails on its data builds its task first: torch is loaded by then
    code, loaded = loaded_by("peer", "--data-source", "folder", "--data-path", str(tmp_path / "missing"))
    assert code == 2
    assert "torch" in loaded


def test_every_module_of_the_package_imports():
    """A name moved between modules without its users (an ImportError at a peer's start) fails here, in-process,
    before any swarm test starts a peer that would die of it."""
    import importlib

    failed = {}
    for name in sorted(MODULES):
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - every kind of import failure is reported
            failed[name] = f"{type(error).__name__}: {error}"
    assert not failed, failed
