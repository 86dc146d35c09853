"""Fixtures of the deploy tests: the tools they run, each provisioned in a venv of its own on first use.

Nothing here needs Docker, a cloud or root: Dockerfiles are linted, compose and SkyPilot files parsed,
and the startup scripts run for real, in their dry-run mode, against metadata services on loopback.
A tool that cannot be installed fails the tests that need it, saying why; nothing is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import deploy_tools


def _provisioned(venv: deploy_tools.ToolVenv) -> deploy_tools.ToolVenv:
    try:
        deploy_tools.ensure(venv, log=lambda message: print(f"[deploy tests] {message}", flush=True))
    except deploy_tools.ProvisionError as error:
        pytest.fail(str(error), pytrace=False)
    return venv


@pytest.fixture(scope="session")
def repo() -> Path:
    return deploy_tools.REPO


@pytest.fixture(scope="session")
def tools() -> deploy_tools.ToolVenv:
    """.venv-tools: hadolint and shellcheck."""
    return _provisioned(deploy_tools.TOOLS)


@pytest.fixture(scope="session")
def sky() -> deploy_tools.ToolVenv:
    """.venv-sky: SkyPilot, kept apart from geotrain's dependencies."""
    return _provisioned(deploy_tools.SKY)
