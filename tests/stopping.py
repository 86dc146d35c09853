"""Stopping the processes a test started: one helper for every tier (tests/ is on the import path of each)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_processes(processes: list[subprocess.Popen], timeout_s: float = 40) -> None:
    """SIGTERM to each process still running, the last started first (trainers before the coordinator they
    joined through); SIGKILL to the process group of any still running ``timeout_s`` later."""
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
