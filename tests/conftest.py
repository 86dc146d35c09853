"""The suite's tiers, one folder each, and what each cost: printed at the end of every run.

- ``unit``: in-process (the planner, the config, hivemind's objects on loopback inside the test's process);
- ``integration``: coordinators and trainers as OS processes on loopback;
- ``lab``: emulated regions in network namespaces (root; skipped elsewhere with the reason);
- ``deploy``: the recipes in docker/, peers/ and monitoring/ against their tools.

Each test gets its tier's marker, so ``pytest -m "not integration"`` (or ``-m unit``) picks tiers across
folders. tests/README.md lists what each test checks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "lab", "deploy")
HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of tests/{tier}/ (see tests/conftest.py)")


def tier_of(path: Path) -> str | None:
    try:
        return path.resolve().relative_to(HERE).parts[0]
    except ValueError:
        return None


def pytest_collection_modifyitems(items):
    for item in items:
        tier = tier_of(Path(str(item.fspath)))
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


# Each tier's wall-clock span: its first test's start to its last test's end, setup and teardown included (so
# module fixtures' swarms count), and its number of tests.
_first_start: dict[str, float] = {}
_last_stop: dict[str, float] = {}
_counts: dict[str, int] = defaultdict(int)
_run_started = time.time()


def pytest_runtest_logreport(report):
    tier = tier_of(Path(report.fspath)) if report.fspath else None
    if tier not in TIERS:
        return
    _first_start[tier] = min(_first_start.get(tier, report.start), report.start)
    _last_stop[tier] = max(_last_stop.get(tier, report.stop), report.stop)
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _counts[tier] += 1


def pytest_terminal_summary(terminalreporter):
    if not _first_start:
        return
    parts = [f"{tier} {_last_stop[tier] - _first_start[tier]:.0f} s ({_counts[tier]} tests)" for tier in TIERS
             if tier in _first_start]
    terminalreporter.write_line(f"time per tier: {', '.join(parts)}; total {time.time() - _run_started:.0f} s")


@pytest.fixture
def run_cli(capsys):
    """geotrain's command line run in this process, as ``geotrain ARGS`` would run: a function of the arguments
    returning its ``returncode``, ``stdout`` and ``stderr`` (argparse's own refusals included). For refusals and
    other checks that end before a peer joins: a process per case would cost a Python start with torch each."""
    from types import SimpleNamespace

    from geotrain import cli

    def run(*arguments: str) -> SimpleNamespace:
        capsys.readouterr()
        try:
            code = cli.main(list(arguments), embedded=True)
        except SystemExit as exited:
            code = exited.code
        printed = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=printed.out, stderr=printed.err)

    return run
