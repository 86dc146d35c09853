"""Waiting in tests for what another thread or process does."""

from __future__ import annotations

import time


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Return once ``condition()`` is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
