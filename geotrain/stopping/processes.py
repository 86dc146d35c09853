"""Make sure a peer leaves nothing running behind it, nor what its processes shared in /dev/shm.

hivemind runs its DHT and averagers in forked child processes, and the DHT's child starts the
``p2pd`` daemon. A peer that is stopped by a signal must take all of them down with it
(see platform notes: after SIGTERM, a DHT's child and its p2pd were seen outliving their parent).
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from collections import Counter
from pathlib import Path

SHARED_MEMORY_MANAGER = "torch_shm_manager"
SHARED_MEMORY_DIR = Path("/dev/shm")
SHARED_MEMORY_PREFIX = "torch_"  # torch names its files torch_<creator pid>_<random>_<counter>

_own_descendants_seen: set[int] = set()  # every descendant of this process that descendants() has seen


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
    if pid == os.getpid():
        _own_descendants_seen.update(found)
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


def kill_descendants(grace_s: float = 3.0, *, final: bool = False) -> None:
    """Stop every process this one started, including hivemind's p2pd (torch's shared memory manager exits
    by itself once they are gone, removing what they shared as it does). ``final``: this process exits next;
    also remove what its processes shared and nobody can use any more (:func:`remove_shared_memory_left`)."""
    terminate_tree(descendants(), grace_s)
    if final:
        remove_shared_memory_left(_own_descendants_seen)  # (descendants() has added the ones just stopped)


def remove_shared_memory_left(descendant_pids: set[int]) -> list[str]:
    """Remove the files in /dev/shm that this process and its dead ``descendant_pids`` created and that no
    process can use any more; returns their names. Called on the way out, after the descendants are gone.

    torch's shared memory manager normally removes them, but it aborts when a process dies between sending it
    a new file's name and reading its answer (its reply fails with EPIPE and it terminates, removing nothing):
    a peer's processes stopped in the middle of sharing a tensor left their files in RAM. A file is removed
    when its creator is this process or a dead descendant and no other live process maps it. One this process
    maps itself first gets one more reference in torch's count at its start: a storage that closes later
    (torch removes the file when the last reference goes) then finds nothing to remove, instead of failing.
    The memory itself is freed when the last mapping goes, at this process's exit at the latest.
    """
    own = os.getpid()
    creators = {own} | {pid for pid in descendant_pids if not is_alive(pid)}
    removed = []
    try:
        paths = [path for path in SHARED_MEMORY_DIR.glob(f"{SHARED_MEMORY_PREFIX}*") if _creator(path) in creators]
    except OSError:
        return removed
    mappings = _shared_memory_mappings() if paths else {}
    for path in paths:
        holders = mappings.get(path.name, Counter())
        if set(holders) - {own}:
            continue  # a live process (another peer's, should a pid have come round again) still maps it
        try:
            if holders[own]:
                _add_reference(path)
            path.unlink()
            removed.append(path.name)
        except (OSError, ValueError):
            pass
    return removed


def start_shared_memory_manager() -> None:
    """Start this process's ``torch_shm_manager`` now, with SIGINT and SIGTERM held back until it answers.

    torch starts it at the first tensor this process shares through a file (hivemind's first future, made when
    the DHT starts), then reads the manager's first words from a pipe. A signal caught during that read (Ctrl-C
    while a peer begins to join) makes torch 2.x retry the failed read's result forever instead of reading
    again: the peer spun at 100% CPU, holding the GIL, deaf to more signals and to the stop watchdog. Blocked
    here, the signal waits until the manager is up and is handled right after. (The manager inherits the mask,
    so these two signals stay pending in it; it exits by itself once its clients are gone, see
    :func:`is_shared_memory_manager`.)
    """
    import torch  # (only commands that join a swarm get here; they have torch)

    blocked = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        torch.empty(1, dtype=torch.uint8).share_memory_()  # with hivemind's strategy, file_system: the manager
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def remember_descendants() -> None:
    """Note this process's descendants now (hivemind's processes, once started), so that what they shared is
    removed on the way out even when they end before it (:func:`remove_shared_memory_left`)."""
    descendants()


def _creator(path: Path) -> int | None:
    parts = path.name.split("_")
    return int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None


def _shared_memory_mappings() -> dict[str, Counter]:
    """For each torch file in /dev/shm that live processes map: how many mappings each process holds."""
    mappings: dict[str, Counter] = {}
    marker = f"{SHARED_MEMORY_DIR}/{SHARED_MEMORY_PREFIX}"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as handle:
                for line in handle:
                    if marker in line:
                        name = line[line.index(marker) + len(str(SHARED_MEMORY_DIR)) + 1:].split()[0]
                        mappings.setdefault(name, Counter())[int(entry)] += 1
        except OSError:
            continue
    return mappings


def _add_reference(path: Path) -> None:
    """One more in the reference count torch keeps at the start of a shared memory file (an int32, one per
    storage that maps the file; torch removes the file when it falls to zero)."""
    with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), 4) as header:
        count = int.from_bytes(header[:4], "little", signed=True)
        header[:4] = (count + 1).to_bytes(4, "little", signed=True)
