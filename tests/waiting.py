"""Waiting in tests for what another thread or process does: one helper for every tier (tests/ is on the import
path of each: pytest puts the root conftest's folder there)."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.3):
    """``predicate()``'s first true value, looked for every ``interval_s``; fails naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
