"""Make sure a peer leaves nothing running behind it.

hivemind runs its DHT and averagers in forked child processes, and the DHT's child starts the
``p2pd`` daemon. A peer that is stopped by a signal must take all of them down with it
(see platform notes: after SIGTERM, a DHT's child and its p2pd were seen outliving their parent).
"""

from __future__ import annotations

import os
import signal
import time


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
    """SIGTERM, wait up to ``grace_s``, then SIGKILL whatever is left."""
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


def kill_descendants(grace_s: float = 3.0) -> None:
    """Stop every process this one started, including hivemind's p2pd."""
    terminate_tree(descendants(), grace_s)
