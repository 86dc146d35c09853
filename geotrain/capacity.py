"""How many trainers ``geotrain local`` may start on this machine, checked before anything starts.

The rule: at most :data:`TRAINERS_PER_CORE` trainers per CPU core this process may use, and the trainers and
the coordinator together need :data:`PROCESS_MEMORY_BYTES` each of the memory available now. The memory is
measured, for the smallest model (``--preset tiny``): a trainer's process tree (torch, two data workers,
hivemind's DHT and averager processes, p2pd) used about 790 MiB (proportional set size), the coordinator's
about 880 MiB. The cores are a rule of thumb, not a measured limit: ``make demo`` runs 3 trainers on 2 cores.
Beyond such limits the peers starve each other until averaging rounds time out, or the OOM killer ends them;
``--peers 1000`` on 2 cores had started about 167 trainers after a minute, with the machine unusable.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from geotrain.errors import UserError

TRAINERS_PER_CORE = 4
PROCESS_MEMORY_BYTES = 800 * 2**20  # a tiny-model trainer or the coordinator, with all its processes
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Machine:
    cpus: int
    available_memory_bytes: int | None  # None: unknown (not Linux)

    @classmethod
    def this_one(cls) -> "Machine":
        return cls(usable_cpus(), available_memory_bytes())

    def max_trainers(self) -> int:
        by_cpu = TRAINERS_PER_CORE * self.cpus
        if self.available_memory_bytes is None:
            return by_cpu
        by_memory = self.available_memory_bytes // PROCESS_MEMORY_BYTES - 1  # the coordinator is one more
        return max(0, min(by_cpu, by_memory))


def check_trainer_count(peers: int, machine: Machine | None = None) -> None:
    """Raise :class:`UserError` when ``peers`` trainers would not fit on ``machine`` (default: this one)."""
    machine = machine or Machine.this_one()
    limit = machine.max_trainers()
    if peers <= limit:
        return
    memory = ("" if machine.available_memory_bytes is None else
              f" and {machine.available_memory_bytes / 2**30:.1f} GiB of memory available, "
              f"{PROCESS_MEMORY_BYTES / 2**20:.0f} MiB for each trainer and the coordinator")
    advice = (f"give --peers {limit} or fewer" if limit >= 1 else "free some memory first")
    raise UserError(f"--peers {peers}: this machine can run at most {limit} trainers ({machine.cpus} CPU cores "
                    f"x {TRAINERS_PER_CORE}{memory}); {advice}, or run more trainers on other machines with "
                    "`geotrain peer`")


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = (_CGROUP / "cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by what a cgroup v2 memory limit leaves; None when unknown."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max" and available is not None:
            available = min(available, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available
