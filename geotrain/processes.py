"""Make sure a peer leaves nothing running behind it.

hivemind runs its DHT and averagers in forked child processes, and the DHT's child starts the
``p2pd`` daemon. A peer that is stopped by a signal must take all of them down with it
(see platform notes: after SIGTERM, a DHT's child and its p2pd were seen outliving their parent).
"""

from __future__ import annotations

import os
import signal
import time

SHARED_MEMORY_MANAGER = "torch_shm_manager"


def _children_of(pid: int) -> list[int]:
    children = []
    task_dir = f"/proc/{pid}/task"
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return children
    for task in tasks:
        try:
            with open(f"{task_dir}/{task}/children") as handle:
                children.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return children


def descendants(pid: int | None = None) -> list[int]:
    """All live descendants of ``pid`` (default: this process), parents before children."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    frontier = [pid]
    while frontier:
        next_frontier = []
        for parent in frontier:
            for child in _children_of(parent):
                if child not in found:
                    found.append(child)
                    next_frontier.append(child)
        frontier = next_frontier
    return found


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def terminate_tree(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL whatever is left; torch's shared memory manager among
    ``pids`` is left to exit by itself (see :func:`is_shared_memory_manager`)."""
    pids = [pid for pid in pids if not is_shared_memory_manager(pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def is_shared_memory_manager(pid: int) -> bool:
    """Whether ``pid`` is torch's ``torch_shm_manager``: hivemind shares tensors through files in /dev/shm
    (torch's file_system strategy), and this daemon unlinks them once every process that used them is gone
    (2 s after the last one). Stopped with the others, it left every tensor they had shared in /dev/shm (that
    is, in RAM) until the next reboot: 17 GB in 268,000 files on a test machine after a day of test runs."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip() == SHARED_MEMORY_MANAGER[:15]  # (the kernel keeps 15 characters)
    except OSError:
        return False


def kill_descendants(grace_s: float = 3.0) -> None:
    """Stop every process this one started, including hivemind's p2pd (torch's shared memory manager exits
    by itself once they are gone, removing what they shared as it does)."""
    terminate_tree(descendants(), grace_s)
