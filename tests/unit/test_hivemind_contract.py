"""The hivemind internals geotrain relies on (geotrain.hive.hivemind_contract) against the installed hivemind.

Read from hivemind's source files (nothing is imported or started, and geotrain's patches of hivemind's
classes in this process do not hide hivemind's own definitions): an upgrade that renames, removes or reshapes
one of them fails here instead of silently bypassing an override in a swarm.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path

import pytest

import geotrain
from geotrain.errors import UserError
from geotrain.hive.hivemind_contract import HIVEMIND_VERSION, INTERNALS, check_hivemind_version

GEOTRAIN = Path(geotrain.__file__).parent
HIVEMIND = Path(importlib.util.find_spec("hivemind").origin).parent
# private names of geotrain's own that hivemind happens to use too (nothing of hivemind's behind them)
GEOTRAIN_OWN = {
    "_lock": "the threading locks of geotrain.fork_server.ForkServer and geotrain.stopping.stopper.Stopper",
    "_run": "methods of geotrain's lab command, local swarm and preemption watcher",
    "_store": "geotrain.hive.state.finalize's helper that stores a finalization record",
}


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module_path(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _owner_node(owner: str) -> ast.AST:
    """The ast of the hivemind module or class named ``owner``, from its source file."""
    path = _module_path(owner) if not owner.rsplit(".", 1)[-1][:1].isupper() else None
    if path is not None:
        return _tree(path)
    module, class_name = owner.rsplit(".", 1)
    path = _module_path(module)
    assert path is not None, f"hivemind has no module {module}"
    found = [node for node in _tree(path).body if isinstance(node, ast.ClassDef) and node.name == class_name]
    assert found, f"hivemind's {module} defines no class {class_name}"
    return found[0]


def _functions_named(owner: ast.AST, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """``name``'s definitions in the class or module ``owner``; in a module, also the one it imports it from
    (a patch replaces the module's own binding of an imported function)."""
    found = [node for node in owner.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and node.name == name]
    if isinstance(owner, ast.Module):
        for node in owner.body:
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
                path = _module_path(node.module)
                found += _functions_named(_tree(path), name) if path is not None else []
    return found


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    names += [arguments.vararg.arg] if arguments.vararg else []
    names += [a.arg for a in arguments.kwonlyargs]
    names += [arguments.kwarg.arg] if arguments.kwarg else []
    return tuple(names)


def _assigns_attribute(owner: ast.AST, name: str) -> bool:
    for node in ast.walk(owner):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets):
            return True
    return False


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda internal: f"{internal.owner}.{internal.name}")
def test_each_hivemind_internal_geotrain_relies_on_is_there_with_the_parameters_it_expects(internal):
    owner = _owner_node(internal.owner)
    if internal.parameters is None:
        assert _assigns_attribute(owner, internal.name), (
            f"hivemind's {internal.owner} no longer assigns self.{internal.name}, which geotrain reads to "
            f"{internal.why}")
        return
    functions = _functions_named(owner, internal.name)
    assert functions, (f"hivemind's {internal.owner} no longer defines {internal.name}, which geotrain uses to "
                       f"{internal.why}")
    assert _parameters(functions[-1]) == internal.parameters, (
        f"hivemind's {internal.owner}.{internal.name} now takes {_parameters(functions[-1])}, geotrain expects "
        f"{internal.parameters} (to {internal.why})")


def _private_names(root: Path) -> dict[str, set[str]]:
    """Private (single-underscore) names that the modules under ``root`` define, read or assign, by file."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    found.setdefault(name, set()).add(str(path.relative_to(root.parent)))
    return found


@lru_cache(maxsize=None)
def _hivemind_private_names() -> frozenset[str]:
    """The private methods hivemind defines and the private attributes it assigns on ``self``."""
    names = set()
    for path in HIVEMIND.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return frozenset(name for name in names if name.startswith("_") and not name.startswith("__"))


def test_every_private_hivemind_name_geotrain_touches_is_in_the_contract():
    listed = {internal.name for internal in INTERNALS}
    used = _private_names(GEOTRAIN)
    unlisted = {name: sorted(files) for name, files in used.items()
                if name in _hivemind_private_names() and name not in listed and name not in GEOTRAIN_OWN}
    assert not unlisted, (f"geotrain uses hivemind's private names that geotrain/hive/hivemind_contract.py does not "
                          f"list (add each with what geotrain does with it): {unlisted}")


def test_each_name_in_the_contract_is_still_used_by_geotrain():
    used = set()
    for path in GEOTRAIN.rglob("*.py"):
        if path.name == "hivemind_contract.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                used.add(node.name)
            elif isinstance(node, ast.Assign):
                used.update(t.id for t in node.targets if isinstance(t, ast.Name))
    stale = [f"{internal.owner}.{internal.name}" for internal in INTERNALS if internal.name not in used]
    assert not stale, f"the contract lists names no module of geotrain uses any more: {stale}"


def test_the_installed_hivemind_is_the_one_the_contract_is_written_for():
    check_hivemind_version()  # raises otherwise


@pytest.mark.parametrize("installed", ["1.1.11", "1.2.0", "none"])
def test_another_hivemind_is_refused_with_what_to_install(installed):
    with pytest.raises(UserError) as refused:
        check_hivemind_version(installed)
    message = str(refused.value)
    assert f"hivemind {installed} is installed" in message
    assert f"pip install hivemind=={HIVEMIND_VERSION}" in message
