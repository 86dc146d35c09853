"""tests/README.md lists what the suite checks, one line per test, and stays true.

Every test function of the suite has its line there under its file's heading, and every line names a test that
exists, so a test cannot disappear unnoticed: removing one means removing its line in the same change, and a
behaviour that moved to a benchmark is listed under "Checked by benchmarks" with the benchmark and its result.

    python tests/unit/test_behaviour_list.py     # prints the lines missing from tests/README.md, to paste in
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LIST = TESTS / "README.md"
HEADING = re.compile(r"^### .*\(`(tests/[^`]+\.py)`\)\s*$")
ENTRY = re.compile(r"^- `(test_\w+)`: \S")
BENCHMARK = re.compile(r"`(benchmarks/[\w/]+\.py)`")
RESULT = re.compile(r"`(benchmarks/results/[\w./-]+)`")
MOVED_HEADING = "### Checked by benchmarks"


def suite_tests() -> dict[str, dict[str, str]]:
    """{tests/DIR/test_x.py: {test name: the first line of its docstring or its name in words}}."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                doc = (ast.get_docstring(node) or "").strip().splitlines()
                names[node.name] = doc[0].rstrip(".") if doc else node.name[len("test_"):].replace("_", " ")
        if names:
            found[str(path.relative_to(TESTS.parent))] = names
    return found


def listed() -> tuple[dict[str, set[str]], list[str]]:
    """The test names under each file heading of tests/README.md, and the entries (bullet text, continuation
    lines joined) of its "Checked by benchmarks" section."""
    sections: dict[str, set[str]] = {}
    moved: list[str] = []
    current = None
    in_moved = False
    for line in LIST.read_text().splitlines():
        heading = HEADING.match(line)
        if line.startswith(("## ", "### ")):
            current = sections.setdefault(heading.group(1), set()) if heading else None
            in_moved = line.startswith(MOVED_HEADING)
        elif (entry := ENTRY.match(line)) and current is not None:
            current.add(entry.group(1))
        elif in_moved and line.startswith("- "):
            moved.append(line)
        elif in_moved and line.startswith("  ") and moved:
            moved[-1] += " " + line.strip()
    return sections, moved


def missing_lines() -> str:
    sections, _ = listed()
    out = []
    for path, names in suite_tests().items():
        absent = [name for name in names if name not in sections.get(path, set())]
        if absent:
            out.append(f"### ... (`{path}`)" if path not in sections else f"under ({path}):")
            out += [f"- `{name}`: {names[name]}" for name in absent]
    return "\n".join(out)


def test_every_test_of_the_suite_has_its_line():
    assert not missing_lines(), (f"tests without a line in {LIST.relative_to(TESTS.parent)}; add these (or run "
                                 f"python {Path(__file__).relative_to(TESTS.parent)}):\n{missing_lines()}")


def test_every_line_names_a_test_that_exists():
    existing = suite_tests()
    sections, _ = listed()
    stale = [f"{path}::{name}" for path, names in sections.items() for name in sorted(names)
             if name not in existing.get(path, {})]
    assert not stale, f"{LIST.name} lists tests that do not exist (moved or removed: say where): {stale}"


def test_behaviours_moved_to_benchmarks_name_a_benchmark_and_its_committed_result():
    _, moved = listed()
    assert moved, "the list says where the long checks went"
    root = TESTS.parent
    for entry in moved:
        benchmark, result = BENCHMARK.search(entry), RESULT.search(entry)
        assert benchmark and result, f"name the benchmark and its committed result: {entry}"
        absent = [path for path in (benchmark.group(1), result.group(1)) if not (root / path).exists()]
        assert not absent, f"{LIST.name} names benchmarks or results that are not in the repo: {absent}"


if __name__ == "__main__":
    print(missing_lines() or "tests/README.md lists every test", file=sys.stdout)
