"""The churn soak: a lab swarm (geotrain.lab.bench) that trains while spot VMs come and go.

An experiment harness, not a geotrain command. Run it from the repository root, as root (the lab's namespaces):

    sudo .venv/bin/python -m benchmarks.churn_soak --setup C-4 --duration 600 --churn 2 --json soak.json
    sudo .venv/bin/python benchmarks/lab_churn.py --duration 600     # the baseline, then churn, side by side

It takes every setup option of ``geotrain bench`` (``--setup``, ``--profile``, ``--time-scale``, ``--lab``,
``--json``, ``--plot``, ...: :func:`geotrain.lab.bench.add_bench_arguments`) and its own: ``--duration``,
``--churn``, ``--churn-seed`` and ``--rejoin-delay``. The swarm trains for about ``--duration`` seconds while the
soak does to its trainers what spot clouds do:

- **Preemption notices.** ``--churn RATE`` is notices per trainer per emulated hour (lab seconds times
  ``--time-scale``; the study's hour). A seeded schedule (``--churn-seed``) spreads them over the run and
  picks the trainer; the soak sends that trainer SIGTERM (the trainer leaves the swarm cleanly, as on a
  cloud's notice) and, ``--rejoin-delay`` seconds after it has exited, starts a new trainer process in the
  same region with the same arguments (a restarted spot VM) and its own events file (``peer-3-eu.r1.jsonl``).
  That trainer loads the swarm's state from a donor before it trains.
- **One hard kill.** Once per soak a trainer's whole process group is SIGKILLed (a VM gone without notice)
  and rejoins the same way.
- **One coordinator restart.** Once per soak the coordinator is stopped and started again with the same
  state directory, host and fixed port: the trainers' initial peers stay valid, and it must resume from its
  newest checkpoint.

How the soak ends: geotrain's end-of-run agreement (geotrain/hive/state/finalize.py) runs when trainers reach
``--max-epochs``, and a running trainer cannot be given another limit. So a soak is epoch-bounded: its epochs
are estimated from ``--duration`` (or given with ``--epochs``), churn happens during the first ``--duration``
seconds after the swarm's first epoch and stops ``END_GUARD_EPOCHS`` before the last one, and the trainers
alive at the end agree on one final state. A soak without churn (``--churn 0``) is the baseline.

What it measures (:func:`measure_soak`, a pure function of the parsed events): swarm samples/s over the
run, every rejoin's seconds from the new process's start to its state load and to its first contributed
epoch next to the transfer bound from the nearest donor, epochs that go backwards, checkpoints lost over the
coordinator's restart, and whether the trainers alive at the end hold identical parameters. It exits 0 when
the soak completed and every check held, 1 otherwise, and 2 (one line on stderr) for a request that cannot
run. docs/lab.md#churn-soak describes it in full.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

from geotrain.errors import EXIT_BAD_INPUT, EXIT_SWARM_UNREACHABLE
from geotrain.events import read_events
from geotrain.lab import network
from geotrain.lab.bench import (BenchError, BenchPlan, LabSwarm, add_bench_arguments, exit_on_sigterm,
                                plan_benchmark, prepare_run_dir, publish)
from geotrain.lab.network import LabError
from geotrain.lab.topology import Topology, TopologyError
from geotrain.launcher import COORDINATOR, STOP_GRACE_S, LaunchError, PeerProcess
from geotrain.pricing.errors import InputFileError

NOTICE, KILL, RESTART = "notice", "kill", "coordinator_restart"
EMULATED_HOUR_S = 3600.0
# a preempted trainer gets no new notice before rejoin delay + this: its process starts, loads the state
# and trains again (measured at --time-scale 8 on 2 cores: 30-45 s)
REJOIN_ALLOWANCE_S = 60.0
END_GUARD_EPOCHS = 3  # no churn this close to --max-epochs: the end-of-run agreement is not a soak
COORDINATOR_PORT = 31337  # fixed, so that the trainers' initial peers stay valid over the restart
CHECKPOINT_EVERY_EPOCHS = 2
KEEP_CHECKPOINTS = 1000  # none removed during a soak: a lost one is the soak's finding, not retention
LAB_COMPUTE_EFFICIENCY = 0.7  # emulated compute reaches ~0.75 of the GPU's rate in this lab (docs/benchmarks.md)
POLL_S = 0.5
RESTORED = re.compile(r"restored checkpoint version (\d+): epoch (\d+)")


class ChurnError(BenchError):
    """A churn request that cannot run; the message says what to change."""


# --- the schedule (pure) -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChurnAction:
    at_s: float  # seconds after the swarm's first epoch
    kind: str  # NOTICE, KILL or RESTART
    slot: str | None = None  # the trainer, e.g. peer-3-eu; None for the coordinator


@dataclasses.dataclass(frozen=True)
class ChurnSchedule:
    rate_per_trainer_hour: float
    duration_s: float
    rejoin_delay_s: float
    time_scale: int
    seed: int
    window_s: float  # trainer actions happen in [0, window_s]: every trainer is back before duration_s
    actions: tuple[ChurnAction, ...]

    @property
    def notices(self) -> int:
        return sum(a.kind == NOTICE for a in self.actions)


def expected_notices(rate_per_trainer_hour: float, trainers: int, duration_s: float, time_scale: int) -> int:
    """Notices the rate asks for: rate x trainers x the run's emulated hours, rounded."""
    return round(rate_per_trainer_hour * trainers * duration_s * time_scale / EMULATED_HOUR_S)


def check_churn_request(rate_per_trainer_hour: float, duration_s: float, rejoin_delay_s: float,
                        time_scale: int, trainers: int) -> float:
    """The window for trainer actions; ChurnError for a request that cannot run."""
    if not math.isfinite(rate_per_trainer_hour) or rate_per_trainer_hour < 0:
        raise ChurnError(f"--churn {rate_per_trainer_hour:g}: expected notices per trainer per emulated hour, "
                         "a number >= 0 (0: a soak without churn, the baseline)")
    if not math.isfinite(duration_s) or duration_s <= 0:
        raise ChurnError(f"--duration {duration_s:g}: expected seconds > 0")
    if not math.isfinite(rejoin_delay_s) or rejoin_delay_s < 0:
        raise ChurnError(f"--rejoin-delay {rejoin_delay_s:g}: expected seconds >= 0")
    if time_scale < 1:
        raise ChurnError(f"--time-scale {time_scale}: expected a whole number >= 1")
    if trainers < 1:
        raise ChurnError("a churn soak needs at least one trainer")
    down_s = rejoin_delay_s + REJOIN_ALLOWANCE_S
    if rate_per_trainer_hour > 0 and duration_s < 2 * down_s:
        raise ChurnError(f"--duration {duration_s:g} s is too short for --rejoin-delay {rejoin_delay_s:g} s: a "
                         f"preempted trainer is down for the delay plus about {REJOIN_ALLOWANCE_S:g} s (start, state "
                         f"load, first epoch) and must be back before the soak ends; give --duration >= "
                         f"{2 * down_s:g} or a shorter --rejoin-delay")
    return duration_s - down_s


def plan_churn(slots: list[str], rate_per_trainer_hour: float, duration_s: float, rejoin_delay_s: float,
               time_scale: int, seed: int) -> ChurnSchedule:
    """Which trainer gets a notice when, the one SIGKILL and the one coordinator restart; the same for one seed.

    Notice times are uniform over the window, then each notice (and the kill) goes to a trainer drawn among
    those that are up: a trainer is down from its notice until rejoin delay + REJOIN_ALLOWANCE_S later. A
    notice that finds every trainer down waits for the first one back; when that is past the window the rate
    does not fit and ChurnError says how many notices fit.
    """
    window_s = check_churn_request(rate_per_trainer_hour, duration_s, rejoin_delay_s, time_scale, len(slots))
    if rate_per_trainer_hour == 0:
        return ChurnSchedule(0.0, duration_s, rejoin_delay_s, time_scale, seed, window_s, ())
    rng = random.Random(seed)
    count = expected_notices(rate_per_trainer_hour, len(slots), duration_s, time_scale)
    down_s = rejoin_delay_s + REJOIN_ALLOWANCE_S
    fitting = _notices_that_fit(len(slots), window_s, down_s)
    if count > fitting:
        raise ChurnError(f"--churn {rate_per_trainer_hour:g} asks for {count} notices, but with --rejoin-delay "
                         f"{rejoin_delay_s:g} s a trainer is down for about {down_s:g} s each time: at most about "
                         f"{fitting} fit into --duration {duration_s:g} s with {len(slots)} trainers; lower --churn "
                         "or --rejoin-delay, or give a longer --duration")
    trainer_events = [(rng.uniform(0, window_s), NOTICE) for _ in range(count)]
    trainer_events.append((rng.uniform(0, window_s), KILL))
    restart_s = rng.uniform(window_s / 3, 2 * window_s / 3)  # a checkpoint before it, trainers after it
    free_at_s = {slot: 0.0 for slot in slots}
    actions = [ChurnAction(round(restart_s, 3), RESTART)]
    last_s = 0.0
    for at_s, kind in sorted(trainer_events):
        at_s = max(at_s, last_s, min(free_at_s.values()))
        if at_s > window_s:
            raise ChurnError(f"--churn {rate_per_trainer_hour:g}: with --churn-seed {seed} its {count} notices fall "
                             f"too close together for {len(slots)} trainers that are down about {down_s:g} s each time "
                             f"(--rejoin-delay {rejoin_delay_s:g} s); try another --churn-seed, a lower --churn or a "
                             "longer --duration")
        slot = rng.choice(sorted(s for s, free_s in free_at_s.items() if free_s <= at_s))
        free_at_s[slot] = at_s + down_s
        actions.append(ChurnAction(round(at_s, 3), kind, slot))
        last_s = at_s
    return ChurnSchedule(rate_per_trainer_hour, duration_s, rejoin_delay_s, time_scale, seed, window_s,
                         tuple(sorted(actions, key=lambda a: a.at_s)))


def _notices_that_fit(trainers: int, window_s: float, down_s: float) -> int:
    """Trainer actions that fit: each trainer once per down period over the window; one is the kill."""
    return max(0, trainers * (int(window_s // down_s) + 1) - 1)


def soak_epochs(plan: BenchPlan, duration_s: float) -> int:
    """Epochs for about ``duration_s`` of training without churn: the round's emulated compute at the lab's
    compute efficiency, plus the warm-up epochs and the end guard (no churn there)."""
    round_s = plan.target_batch_size / (plan.peers * plan.samples_per_second_per_gpu) / LAB_COMPUTE_EFFICIENCY
    return plan.warmup_epochs + math.ceil(duration_s / round_s) + END_GUARD_EPOCHS


# --- the swarm, with trainers that come and go ----------------------------------------------------------

@dataclasses.dataclass
class Incarnation:
    """One trainer process of a slot: the first (index 0) or a rejoin after a notice or a kill."""

    slot: str
    region: str
    index: int
    events_path: Path
    started_unix_s: float
    ended_by: str | None = None  # NOTICE or KILL when the bench ended it
    ended_unix_s: float | None = None  # when the bench sent the signal
    exited_unix_s: float | None = None  # when the bench saw the process gone
    exit_code: int | None = None
    process: PeerProcess | None = dataclasses.field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.slot if self.index == 0 else f"{self.slot}.r{self.index}"

    def to_dict(self) -> dict:
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "process"}
        return {**data, "events_path": str(self.events_path), "name": self.name}


class SoakSwarm(LabSwarm):
    """The bench's swarm with a coordinator that holds state on a fixed port, and trainers by slot."""

    def __init__(self, plan: BenchPlan, lab: str, run_dir: Path):
        super().__init__(plan, lab, run_dir)
        self.incarnations: list[Incarnation] = []
        self.initial_peers: list[str] = []
        self.coordinator_command: list[str] = []
        self.peers_file = run_dir / "initial_peers.txt"
        self.state_dir = run_dir / "coordinator"
        self._trainer_arguments: dict[str, list[str]] = {}
        self._regions: dict[str, str] = {}

    def start(self, state: dict) -> list[Path]:
        regions = state["regions"]
        first = self.plan.topology.regions[0].name
        host = regions[first]["address"]
        self.coordinator_command = self._in_region(first, [
            "coordinator", "--host", host, "--port", str(COORDINATOR_PORT), "--state-dir", str(self.state_dir),
            "--region", first,  # donors are ranked by region: the coordinator's is the first region's
            "--initial-peers-file", str(self.peers_file),
            "--set", f"coordinator.checkpoint_every_epochs={CHECKPOINT_EVERY_EPOCHS}",
            "--set", f"coordinator.keep_checkpoints={KEEP_CHECKPOINTS}", *self.training_arguments()])
        self.initial_peers = [a for a in self._start_coordinator() if host in a]
        index = 0
        for region in self.plan.topology.regions:
            for _ in range(region.peers):
                index += 1
                slot = f"peer-{index}-{region.name}"
                self._regions[slot] = region.name
                self._trainer_arguments[slot] = [
                    "peer", "--host", regions[region.name]["address"], "--port", "0", "--preemption", "none",
                    "--data-seed", str(index), "--threads", "1", "--max-epochs", str(self.plan.epochs),
                    "--region", region.name, *self.training_arguments(),
                    *[item for address in self.initial_peers for item in ("--initial-peers", address)]]
                self._spawn(slot, 0, wait_for_peers=self.plan.peers)
        return [i.events_path for i in self.incarnations]

    def _start_coordinator(self) -> list[str]:
        try:
            return self.launcher.start_coordinator(self.coordinator_command, self.peers_file)
        except LaunchError as error:
            raise BenchError(str(error)) from None

    def _spawn(self, slot: str, index: int, wait_for_peers: int) -> Incarnation:
        name = slot if index == 0 else f"{slot}.r{index}"
        incarnation = Incarnation(slot, self._regions[slot], index, self.run_dir / f"{name}.jsonl", time.time())
        # a rejoin waits for no one: the swarm is there (it would wait for a trainer that is down)
        arguments = [*self._trainer_arguments[slot], "--events", str(incarnation.events_path),
                     "--wait-for-peers", str(wait_for_peers)]
        incarnation.process = self.launcher.spawn(incarnation.name, self._in_region(incarnation.region, arguments),
                                                  incarnation.events_path, threads=1)
        self.incarnations.append(incarnation)
        return incarnation

    def current(self, slot: str) -> Incarnation:
        return [i for i in self.incarnations if i.slot == slot][-1]

    @property
    def slots(self) -> list[str]:
        return list(self._trainer_arguments)

    def end(self, slot: str, how: str) -> Incarnation:
        """A preemption notice (SIGTERM: the trainer leaves cleanly) or a VM gone (SIGKILL to its process group)."""
        incarnation = self.current(slot)
        incarnation.ended_by, incarnation.ended_unix_s = how, time.time()
        process = incarnation.process.process
        if process.poll() is None:
            if how == KILL:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.send_signal(signal.SIGTERM)
        return incarnation

    def rejoin(self, slot: str) -> Incarnation:
        return self._spawn(slot, self.current(slot).index + 1, wait_for_peers=1)

    def stop_coordinator(self) -> PeerProcess:
        """The restart's first half: SIGTERM to the coordinator (it leaves the swarm and exits)."""
        coordinator = [p for p in self.launcher.processes if p.name == COORDINATOR][-1]
        coordinator.process.send_signal(signal.SIGTERM)
        return coordinator

    def start_coordinator_again(self, stopped: PeerProcess) -> None:
        """The second half, once the old process is gone: the same command, state directory and port."""
        stopped.log_path.rename(stopped.log_path.with_name("coordinator.r0.log"))
        self.peers_file.unlink(missing_ok=True)
        self.launcher.spawn(COORDINATOR, self.coordinator_command)

    def coordinator_address(self) -> list[str] | None:
        """The restarted coordinator's join addresses once it is up, else None."""
        return self.peers_file.read_text().split() if self.peers_file.exists() else None

    def poll_exits(self) -> None:
        for incarnation in self.incarnations:
            code = incarnation.process.process.poll()
            if code is not None and incarnation.exit_code is None:
                incarnation.exit_code, incarnation.exited_unix_s = code, time.time()

    def trainers_running(self) -> int:
        return sum(i.process.process.poll() is None for i in self.incarnations)


def checkpoint_listing(state_dir: Path) -> list[dict]:
    """The coordinator's checkpoints as (version, epoch), oldest first."""
    from geotrain.checkpoint import CheckpointStore  # torch: only where checkpoints are read

    directory = state_dir / "checkpoints"
    if not directory.exists():
        return []
    return [{"version": info.version, "epoch": info.epoch}
            for info in sorted(CheckpointStore(directory).list(), key=lambda info: info.version)]


def restored_checkpoint(log_text: str) -> dict | None:
    """The checkpoint a coordinator's log says it restored, or None."""
    match = RESTORED.search(log_text)
    return None if match is None else {"version": int(match[1]), "epoch": int(match[2])}


# --- the driver ----------------------------------------------------------------------------------------

def swarm_epoch(paths: list[Path]) -> tuple[int, float | None]:
    """(highest epoch in any trainer's epoch events, time of the first epoch event) from the events files."""
    epochs = [e for path in paths for e in read_events(path) if e["event"] == "epoch"]
    if not epochs:
        return 0, None
    return max(e["epoch"] for e in epochs), min(e["time"] for e in epochs)


def has_contributed(incarnation: Incarnation) -> bool:
    return any(e["event"] == "epoch" and e.get("samples", 0) > 0 for e in read_events(incarnation.events_path))


class CoordinatorRestart:
    """The coordinator's restart, one poll at a time: stopping, then starting, then up."""

    def __init__(self, swarm: SoakSwarm):
        self.swarm = swarm
        self.record: dict = {"stopped_unix_s": time.time()}
        self.old = swarm.stop_coordinator()
        self.phase = "stopping"

    def poll(self) -> bool:
        """Advance; True once the coordinator is up again."""
        if self.phase == "stopping":
            code = self.old.process.poll()
            if code is None and time.time() - self.record["stopped_unix_s"] > STOP_GRACE_S:
                os.killpg(self.old.process.pid, signal.SIGKILL)
                return False
            if code is None:
                return False
            self.record.update(exit_code=code, exited_unix_s=time.time(),
                               checkpoints_before=checkpoint_listing(self.swarm.state_dir))
            self.swarm.start_coordinator_again(self.old)
            self.record["started_unix_s"] = time.time()
            self.phase = "starting"
        addresses = self.swarm.coordinator_address()
        if addresses is None:
            return False
        self.record.update(up_unix_s=time.time(),
                           same_address=all(a in addresses for a in self.swarm.initial_peers))
        self.phase = "up"
        return True


class ChurnDriver:
    """Carries out a schedule on a SoakSwarm: notices, the kill, rejoins after the delay, the restart.

    Rejoins wait while the coordinator restarts (their only initial peer), and the restart waits while a
    rejoined trainer is still joining; a rejoin that found no initial peer (exit 3) is started again."""

    def __init__(self, swarm: SoakSwarm, schedule: ChurnSchedule, log=print):
        self.swarm = swarm
        self.schedule = schedule
        self.pending = list(schedule.actions)
        self.rejoins_due: dict[str, float] = {}  # slot -> unix time its new process starts (inf until it exited)
        self.done: list[dict] = []
        self.restart: dict | None = None
        self._restarting: CoordinatorRestart | None = None
        self.first_epoch_unix_s: float | None = None
        self.log = log

    def run(self, timeout_s: float) -> bool:
        """Until every trainer has exited and no rejoin is pending (True), or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.swarm.poll_exits()
            epoch, first_unix_s = swarm_epoch([i.events_path for i in self.swarm.incarnations])
            if self.first_epoch_unix_s is None and first_unix_s is not None:
                self.first_epoch_unix_s = first_unix_s
                self.log(f"churn: the swarm finished its first epoch; schedule starts ({len(self.pending)} actions)")
            if self._restarting is not None and self._restarting.poll():
                self.restart, self._restarting = self._restarting.record, None
                self.log("churn: the coordinator is up again")
            if self.first_epoch_unix_s is not None:
                self._act(time.time() - self.first_epoch_unix_s, epoch)
                self._retry_unreachable()
                self._rejoin(epoch)
            if self.swarm.trainers_running() == 0 and not self.rejoins_due and self._restarting is None:
                self.swarm.poll_exits()
                return True
            time.sleep(POLL_S)
        return False

    @property
    def restart_record(self) -> dict | None:
        """The coordinator's restart: done, or still under way when the soak ended."""
        return self.restart or (self._restarting.record if self._restarting else None)

    def _churn_open(self, run_s: float, epoch: int) -> bool:
        return run_s < self.schedule.duration_s and epoch < self.swarm.plan.epochs - END_GUARD_EPOCHS

    def _joining(self) -> bool:
        """A trainer process that runs but has not started training yet (it needs its initial peer)."""
        return any(i.exit_code is None and not any(e["event"] == "training" for e in read_events(i.events_path))
                   for i in self.swarm.incarnations if i.index > 0)

    def _act(self, run_s: float, epoch: int) -> None:
        while self.pending and self.pending[0].at_s <= run_s:
            action = self.pending[0]
            if not self._churn_open(run_s, epoch):
                self._record(action, run_s, "skipped: the soak is ending")
                self.pending.pop(0)
                continue
            if action.kind == RESTART:
                if self._joining():
                    return  # a trainer on its way in needs the coordinator's address: after it
                self.pending.pop(0)
                self.log(f"churn {run_s:6.1f} s: restarting the coordinator")
                self._restarting = CoordinatorRestart(self.swarm)
                self._record(action, run_s, "done")
                continue
            incarnation = self.swarm.current(action.slot)
            if action.slot in self.rejoins_due or not has_contributed(incarnation):
                return  # that trainer is not back yet: the action waits for it (recorded with its delay)
            self.pending.pop(0)
            self.log(f"churn {run_s:6.1f} s: {'SIGTERM (notice)' if action.kind == NOTICE else 'SIGKILL'} to "
                     f"{incarnation.name}")
            self.swarm.end(action.slot, action.kind)
            self.rejoins_due[action.slot] = math.inf  # set once the process is gone
            self._record(action, run_s, "done")

    def _retry_unreachable(self) -> None:
        for slot in self.swarm.slots:
            incarnation = self.swarm.current(slot)
            if (incarnation.index > 0 and incarnation.ended_by is None and slot not in self.rejoins_due
                    and incarnation.exit_code == EXIT_SWARM_UNREACHABLE):
                incarnation.ended_by = "unreachable"  # its VM would start it again: so does the bench
                self.rejoins_due[slot] = time.time() + self.schedule.rejoin_delay_s
                self.done.append({"kind": "rejoin", "slot": slot, "result": f"{incarnation.name} found no initial "
                                                                           "peer (exit 3); started again"})

    def _rejoin(self, epoch: int) -> None:
        for slot, due_unix_s in list(self.rejoins_due.items()):
            incarnation = self.swarm.current(slot)
            if math.isinf(due_unix_s):
                if incarnation.exit_code is not None:
                    self.rejoins_due[slot] = incarnation.exited_unix_s + self.schedule.rejoin_delay_s
                continue
            if time.time() < due_unix_s or self._restarting is not None:
                continue
            del self.rejoins_due[slot]
            if epoch >= self.swarm.plan.epochs - 1:
                self.done.append({"kind": "rejoin", "slot": slot, "result": "skipped: the soak is ending"})
                continue
            new = self.swarm.rejoin(slot)
            self.log(f"churn: {new.name} started in {new.region}")

    def _record(self, action: ChurnAction, run_s: float, result: str) -> None:
        self.done.append({**dataclasses.asdict(action), "done_at_s": round(run_s, 3), "result": result})


# --- the measurement (pure) ----------------------------------------------------------------------------

def transfer_bound_s(state_bytes: float, link) -> float:
    """A state's bytes over the link's bandwidth, plus its one-way latency."""
    return state_bytes * 8 / (link.bandwidth_mbit_s * 1e6) + link.latency_ms / 1000


def nearest_donor_bound(state_bytes: float, region: str, topology: Topology,
                        holders: dict[str, int] | None = None) -> tuple[float, str] | None:
    """(seconds, donor region) of the fastest transfer to ``region`` from a region that holds another peer
    (a trainer, or the coordinator in the first region); None when no link is known. ``holders``: the peers
    that held the swarm's current state, by region (:func:`current_holders`); without it, every trainer of the
    topology but the rejoining one, and the coordinator."""
    if holders is None:
        peers = {r.name: r.peers for r in topology.regions}
        peers[region] -= 1  # the rejoining trainer itself
        peers[topology.regions[0].name] += 1  # the coordinator
    else:
        peers = dict(holders)
    bounds = [(transfer_bound_s(state_bytes, link), name) for name, count in peers.items() if count > 0
              for link in [topology.link(region, name)] if link is not None]
    return min(bounds) if bounds else None


def current_holders(unix_s: float, incarnations: list[dict], topology: Topology, but: str) -> dict[str, int]:
    """Peers by region that held the swarm's current state at ``unix_s``, other than incarnation ``but``: trainers
    running then (a rejoined one once it had loaded the state) that had not been told to stop, and the
    coordinator while a trainer shared its region (only then does it keep its state current every epoch:
    ``coordinator.refresh_in_region``; otherwise it offers its last checkpoint's)."""
    holders: dict[str, int] = {}
    for incarnation in incarnations:
        if incarnation["name"] == but:
            continue
        if incarnation["index"] == 0:
            ready_s = incarnation["started_unix_s"]
        else:
            ready_s = next((e["time"] for e in incarnation["events"] if e["event"] == "state_loaded"), None)
        ended_s = incarnation.get("ended_unix_s")
        if ready_s is not None and ready_s <= unix_s and (ended_s is None or ended_s > unix_s):
            holders[incarnation["region"]] = holders.get(incarnation["region"], 0) + 1
    coordinator_region = topology.regions[0].name
    if holders.get(coordinator_region):
        holders[coordinator_region] += 1
    return holders


def epoch_problems(name: str, events: list[dict]) -> list[str]:
    """Where a trainer's epoch went backwards in one events file (epoch events must increase strictly)."""
    problems = []
    last, last_kind = None, None
    for event in events:
        epoch = event.get("epoch")
        if not isinstance(epoch, int):
            continue
        strict = event["event"] == "epoch"
        if last is not None and (epoch < last or (strict and epoch == last and last_kind == "epoch")):
            problems.append(f"{name}: {event['event']} at epoch {epoch} after {last_kind} at epoch {last}")
        last, last_kind = epoch, event["event"]
    return problems


def slot_epoch_problems(incarnations: list[dict]) -> list[str]:
    """A rejoined trainer that starts training below the epoch its slot had reached before."""
    problems = []
    reached: dict[str, tuple[int, str]] = {}
    for incarnation in sorted(incarnations, key=lambda i: (i["slot"], i["index"])):
        epochs = [e["epoch"] for e in incarnation["events"] if e["event"] == "epoch"]
        training = next((e["epoch"] for e in incarnation["events"] if e["event"] == "training"), None)
        before = reached.get(incarnation["slot"])
        if before is not None and training is not None and training < before[0]:
            problems.append(f"{incarnation['name']}: started training at epoch {training}, below epoch {before[0]} "
                            f"that {before[1]} had reached")
        if epochs:
            reached[incarnation["slot"]] = (max(epochs), incarnation["name"])
    return problems


def checkpoint_problems(before: list[dict], after: list[dict], restored: dict | None) -> list[str]:
    """Checkpoints lost over the coordinator's restart, epochs that go backwards, a restore from an old one."""
    problems = []
    kept = {c["version"]: c["epoch"] for c in after}
    for checkpoint in before:
        if kept.get(checkpoint["version"]) != checkpoint["epoch"]:
            problems.append(f"checkpoint version {checkpoint['version']} (epoch {checkpoint['epoch']}) was lost")
    ordered = sorted(after, key=lambda c: c["version"])
    for older, newer in zip(ordered, ordered[1:]):
        if newer["epoch"] < older["epoch"]:
            problems.append(f"checkpoint version {newer['version']} holds epoch {newer['epoch']}, below version "
                            f"{older['version']}'s epoch {older['epoch']}")
    if before:
        latest = max(before, key=lambda c: c["version"])
        if restored is None:
            problems.append(f"the restarted coordinator restored no checkpoint (newest: version {latest['version']})")
        elif restored != latest:
            problems.append(f"the restarted coordinator restored version {restored['version']} (epoch "
                            f"{restored['epoch']}), not the newest, version {latest['version']} (epoch "
                            f"{latest['epoch']})")
    return problems


def final_parameters(incarnations: list[dict]) -> dict:
    """params_sha256 of the trainers that reached the end; identical only when every one of them says so."""
    alive = [i for i in incarnations if i.get("ended_by") is None]
    hashes = {}
    problems = []
    for incarnation in alive:
        finished = next((e for e in incarnation["events"] if e["event"] == "finished"), None)
        if finished is None or finished.get("stopped_by_request"):
            problems.append(f"{incarnation['name']}: no finished event at the end of the run")
            continue
        hashes[incarnation["name"]] = finished.get("params_sha256")
    if len(set(hashes.values())) > 1:
        problems.append("parameters differ: " + ", ".join(f"{n} {h[:16] if h else None}" for n, h in hashes.items()))
    return {"trainers": sorted(hashes), "identical": bool(hashes) and not problems, "problems": problems,
            "params_sha256": sorted(set(hashes.values()))}


def rejoin_record(incarnation: dict, topology: Topology, incarnations: list[dict] | None = None) -> dict:
    """Seconds from a rejoined process's start to its state load, to its first samples counted toward the
    swarm's batch (``contributing`` event) and to the end of the first epoch it contributed to, and the bound:
    the transfer from the nearest region that held the swarm's current state when the download began
    (:func:`current_holders`, given ``incarnations``).

    The path in parts: the process's start to joining the DHT (``to_joined_s``), the state's download
    itself (``download_s``, against the bound: ``download_ratio``), the first micro-batch, and the rest (the
    swarm's round, which the trainer now works on, to its end); ``joined_to_contributing_s``: from joining the
    DHT to the first samples. ``state_downloads``: whole states this process downloaded while it trained
    (more than one: it fell behind after its load and loaded again; the end-of-run agreement's is not counted).
    """
    events = incarnation["events"]
    start_s = incarnation["started_unix_s"]
    joined = next((e for e in events if e["event"] == "joined"), None)
    loaded = next((e for e in events if e["event"] == "state_loaded"), None)
    first = next((e for e in events if e["event"] == "epoch" and e.get("samples", 0) > 0), None)
    contributing = next((e for e in events if e["event"] == "contributing"), None)
    downloads = [e for e in events if e["event"] == "state_download" and e.get("result") == "ok"]
    download = downloads[0] if downloads else None
    finished = next((e for e in events if e["event"] == "finished" and not e.get("stopped_by_request")), None)
    last_epoch_s = max((e["time"] for e in events if e["event"] == "epoch"), default=None)
    if finished is not None and last_epoch_s is not None:  # the agreement's download comes after the last epoch
        downloads = [e for e in downloads if e["time"] <= last_epoch_s]
    # the state's size: a striped download's received bytes also count the stripes two donors sent at once
    state_bytes = (download.get("state_bytes") or download.get("bytes")) if download else None
    holders = None
    if incarnations is not None and download is not None:
        holders = current_holders(download["time"] - download.get("seconds", 0.0), incarnations, topology,
                                  but=incarnation["name"])
    bound = nearest_donor_bound(state_bytes, incarnation["region"], topology, holders) if state_bytes else None
    record = {
        "name": incarnation["name"], "region": incarnation["region"],
        "to_joined_s": joined["time"] - start_s if joined else None,
        "to_state_loaded_s": loaded["time"] - start_s if loaded else None,
        "to_contributing_s": contributing["time"] - start_s if contributing else None,
        "to_first_epoch_s": first["time"] - start_s if first else None,
        # from the DHT join: what the swarm waits for once the peer is there (the process's start, Python's
        # imports and the DHT's bootstrap, does not shrink with the lab's time scale)
        "joined_to_contributing_s": contributing["time"] - joined["time"] if contributing and joined else None,
        "download_s": download.get("seconds") if download else None,
        "state_downloads": len(downloads),
        "state_bytes": state_bytes, "donor_region": (loaded or {}).get("donor_region"),
        "bound_s": bound[0] if bound else None, "bound_donor_region": bound[1] if bound else None,
    }
    for key, ratio_key in (("to_state_loaded_s", "state_loaded_ratio"), ("to_contributing_s", "contributing_ratio"),
                           ("joined_to_contributing_s", "joined_contributing_ratio"),
                           ("to_first_epoch_s", "first_epoch_ratio"),
                           ("download_s", "download_ratio")):
        record[ratio_key] = record[key] / record["bound_s"] if record[key] is not None and record["bound_s"] else None
    return record


def throughput(incarnations: list[dict], warmup_epochs: int) -> dict:
    """Swarm samples/s from the end of the warm-up epochs to the last epoch, every incarnation's samples."""
    epochs = [e for i in incarnations for e in i["events"] if e["event"] == "epoch"]
    if not epochs:
        return {"epochs_reached": 0}
    last = max(e["epoch"] for e in epochs)
    result = {"epochs_reached": last}
    if last <= warmup_epochs:
        return result

    def boundary(epoch: int) -> float:
        if epoch == 0:
            return min(e["time"] for i in incarnations for e in i["events"] if e["event"] == "training")
        return min(e["time"] for e in epochs if e["epoch"] == epoch)

    wall_s = boundary(last) - boundary(warmup_epochs)
    samples = sum(e["samples"] for e in epochs if warmup_epochs < e["epoch"] <= last)
    result.update({"measured_epochs": [warmup_epochs + 1, last], "wall_s": wall_s, "samples": samples,
                   "swarm_samples_per_second": samples / wall_s if wall_s > 0 else None,
                   "round_s": wall_s / (last - warmup_epochs)})
    return result


def trainer_seconds_lost(incarnations: list[dict]) -> float:
    """Seconds that slots spent without a contributing trainer: from the bench's signal to the old process to the
    replacement's first samples counted toward the swarm's batch (its ``contributing`` event; the end of the
    first epoch it contributed to for runs before that event; the run's last epoch when it never did)."""
    epochs = [e["time"] for i in incarnations for e in i["events"] if e["event"] == "epoch"]
    end_s = max(epochs, default=0.0)
    by_name = {(i["slot"], i["index"]): i for i in incarnations}
    lost_s = 0.0
    for incarnation in incarnations:
        previous = by_name.get((incarnation["slot"], incarnation["index"] - 1))
        if incarnation["index"] == 0 or previous is None or previous.get("ended_unix_s") is None:
            continue
        first = next((e["time"] for e in incarnation["events"] if e["event"] == "contributing"), None)
        if first is None:
            first = next((e["time"] for e in incarnation["events"]
                          if e["event"] == "epoch" and e.get("samples", 0) > 0), end_s)
        lost_s += max(0.0, first - previous["ended_unix_s"])
    return lost_s


def measure_soak(incarnations: list[dict], topology: Topology, warmup_epochs: int,
                 checkpoints_before: list[dict] | None, checkpoints_after: list[dict],
                 restored: dict | None, restart_completed: bool = True) -> dict:
    """Everything a soak reports, from its incarnations (each with its parsed ``events``) and checkpoints.

    ``checkpoints_before`` is None when the coordinator was not restarted."""
    problems = [p for i in incarnations for p in epoch_problems(i["name"], i["events"])]
    problems += slot_epoch_problems(incarnations)
    lost = [] if checkpoints_before is None else checkpoint_problems(checkpoints_before, checkpoints_after, restored)
    if checkpoints_before is not None and not restart_completed:
        lost.append("the coordinator's restart did not complete before the soak ended")
    rate = throughput(incarnations, warmup_epochs)
    slots = len({i["slot"] for i in incarnations})
    lost_s = trainer_seconds_lost(incarnations)
    return {
        **rate,
        # the share of trainer time the churn took away: [EMJ24]'s "interruption rate", as this run measured it
        "trainer_seconds_lost": lost_s,
        "interruption_fraction": lost_s / (slots * rate["wall_s"]) if rate.get("wall_s") and slots else None,
        "rejoins": [rejoin_record(i, topology, incarnations) for i in incarnations if i["index"] > 0],
        "epochs_monotonic": not problems, "epoch_problems": problems,
        "checkpoints_kept": None if checkpoints_before is None else not lost, "checkpoint_problems": lost,
        "checkpoints": checkpoints_after, "restored_checkpoint": restored,
        "parameters": final_parameters(incarnations),
        "exit_codes": {i["name"]: i.get("exit_code") for i in incarnations},
    }


# --- running and reporting -----------------------------------------------------------------------------

def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's own options, next to the setup options of ``geotrain bench`` (:func:`add_bench_arguments`)."""
    soak = parser.add_argument_group("churn soak (docs/lab.md#churn-soak)")
    soak.add_argument("--duration", type=float, required=True, metavar="SECONDS",
                      help="train about this long (epochs estimated from it unless --epochs is given), with --churn "
                           "during it")
    soak.add_argument("--churn", type=float, default=0.0, metavar="RATE",
                      help="preemption notices per trainer per emulated hour (lab seconds x --time-scale); with one "
                           "SIGKILL and one coordinator restart when > 0 (default: %(default)s, the baseline)")
    soak.add_argument("--churn-seed", type=int, default=1, help="seed of the churn schedule (default: %(default)s)")
    soak.add_argument("--rejoin-delay", type=float, default=10.0, metavar="SECONDS",
                      help="a preempted trainer's replacement starts this long after it left (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.churn_soak")
    add_bench_arguments(parser, run_name="soak")
    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = "Run it from the repository root, as root (the lab's namespaces). See docs/lab.md#churn-soak."
    add_soak_arguments(parser)
    return parser


def soak_plan(args: argparse.Namespace) -> BenchPlan:
    """The bench's plan for the soak's setup, with the epochs ``--duration`` holds unless ``--epochs`` is given;
    ChurnError (or BenchError) for a request that cannot run."""
    plan = plan_benchmark(args)
    check_churn_request(args.churn, args.duration, args.rejoin_delay, plan.time_scale, plan.peers)
    if args.epochs is None:
        plan = dataclasses.replace(plan, epochs=soak_epochs(plan, args.duration))
    return plan


def main(argv: list[str] | None = None) -> int:
    """One soak: its report printed, --json and --plot written. Exit code 0 when it passed, 1 when not, 2 for a
    request that cannot run (one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return run_soak(args, soak_plan(args))
    except (LabError, TopologyError, BenchError, InputFileError) as error:
        print(f"churn soak: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run_soak(args: argparse.Namespace, plan: BenchPlan) -> int:
    """The soak, its report, its JSON and plot."""
    slots = [f"peer-{n}-{name}" for n, name in enumerate(
        (r.name for r in plan.topology.regions for _ in range(r.peers)), start=1)]
    schedule = plan_churn(slots, args.churn, args.duration, args.rejoin_delay, plan.time_scale, args.churn_seed)
    network.require_lab_support("up")
    run_dir = prepare_run_dir(args.run_dir or Path("runs") / time.strftime(f"soak-{plan.setup}-%Y%m%d-%H%M%S"))
    print(f"churn soak {plan.setup}: {plan.peers} trainers, {plan.epochs} epochs (about {args.duration:g} s); "
          f"churn {args.churn:g} notices per trainer per emulated hour (time scale {plan.time_scale}): "
          f"{schedule.notices} notices, "
          f"{'1 kill, 1 coordinator restart' if schedule.actions else 'no kill, no restart'}; "
          f"rejoin delay {args.rejoin_delay:g} s; logs in {run_dir}", flush=True)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    network.up(plan.topology, args.lab)
    swarm = SoakSwarm(plan, args.lab, run_dir)
    driver = ChurnDriver(swarm, schedule, log=lambda line: print(line, flush=True))
    started = time.time()
    try:
        swarm.start(network.require_state(args.lab))
        completed = driver.run(soak_timeout_s(args.timeout, args.duration))
    finally:
        swarm.stop()
        swarm.poll_exits()
        network.down(args.lab)
    incarnations = [{**i.to_dict(), "events": read_events(i.events_path)} for i in swarm.incarnations]
    restart = driver.restart_record
    log_path = run_dir / "coordinator.log"
    restored = restored_checkpoint(log_path.read_text(errors="replace")) if restart else None
    measured = measure_soak(incarnations, plan.topology, plan.warmup_epochs,
                            restart.get("checkpoints_before", []) if restart else None,
                            checkpoint_listing(swarm.state_dir), restored,
                            restart_completed=restart is None or "up_unix_s" in restart)
    result = soak_report(plan, schedule, driver, measured, incarnations, completed, run_dir, time.time() - started)
    publish(args, result, format_soak(result), plot_soaks)
    return 0 if completed and soak_passed(result) else 1


def soak_timeout_s(timeout_s: float, duration_s: float) -> float:
    """--timeout, at least twice the duration plus start and end: churn slows the swarm down."""
    return max(timeout_s, 2 * duration_s + 300)


def soak_passed(result: dict) -> bool:
    m = result["measured"]
    return bool(m.get("swarm_samples_per_second")) and m["epochs_monotonic"] and m["checkpoints_kept"] is not False \
        and m["parameters"]["identical"]


def soak_report(plan: BenchPlan, schedule: ChurnSchedule, driver: ChurnDriver, measured: dict,
                incarnations: list[dict], completed: bool, run_dir: Path, elapsed_s: float) -> dict:
    timeline = [{"name": i["name"], "slot": i["slot"], "started_unix_s": i["started_unix_s"],
                 "ended_by": i["ended_by"], "ended_unix_s": i["ended_unix_s"],
                 "epochs": [[e["time"], e["epoch"]] for e in i["events"] if e["event"] == "epoch"]}
                for i in incarnations]
    return {
        "setup": plan.setup, "peers": plan.peers, "preset": plan.preset, "time_scale": plan.time_scale,
        "bandwidth_scale": plan.bandwidth_scale, "epochs": plan.epochs, "warmup_epochs": plan.warmup_epochs,
        "target_batch_size": plan.target_batch_size,
        "churn": {"rate_per_trainer_emulated_hour": schedule.rate_per_trainer_hour,
                  "duration_s": schedule.duration_s, "rejoin_delay_s": schedule.rejoin_delay_s,
                  "seed": schedule.seed, "window_s": schedule.window_s,
                  "schedule": [dataclasses.asdict(a) for a in schedule.actions], "done": driver.done},
        "first_epoch_unix_s": driver.first_epoch_unix_s,
        "coordinator_restart": driver.restart_record,
        "completed": completed, "measured": measured, "timeline": timeline,
        "run_dir": str(run_dir), "elapsed_s": elapsed_s, "machine": {"cpus": os.cpu_count()},
    }


def _number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_soak(result: dict) -> str:
    m, churn = result["measured"], result["churn"]
    done = [d for d in churn["done"] if d.get("result") == "done"]
    lines = [f"{result['setup']} soak: churn {churn['rate_per_trainer_emulated_hour']:g} notices per trainer per "
             f"emulated hour, seed {churn['seed']}: {sum(d['kind'] == NOTICE for d in done)} notices, "
             f"{sum(d['kind'] == KILL for d in done)} kill, {sum(d['kind'] == RESTART for d in done)} coordinator "
             f"restart done ({sum(d.get('result', '').startswith('skipped') for d in churn['done'])} skipped)"]
    if "swarm_samples_per_second" not in m:
        lines.append(f"no measurement: the swarm reached epoch {m['epochs_reached']} of {result['epochs']}")
    else:
        lines.append(f"swarm samples/s {_number(m['swarm_samples_per_second'])} over epochs "
                     f"{m['measured_epochs'][0]}-{m['measured_epochs'][1]} ({_number(m['wall_s'])} s, "
                     f"{_number(m['round_s'])} s per round)")
        if m.get("interruption_fraction") is not None:
            lines.append(f"trainer time lost to churn: {_number(m['trainer_seconds_lost'])} s, "
                         f"{100 * m['interruption_fraction']:.1f}% of the trainers' time (the interruption rate)")
    if m["rejoins"]:
        lines.append(f"{'rejoin':<16} {'region':<7} {'joined s':>8} {'to state s':>10} {'to samples s':>12} "
                     f"{'to epoch s':>10} {'state MB':>9} {'donor':<7} {'download s':>10} {'bound s':>8} {'from':<6} "
                     f"{'download/bound':>14} {'samples/bound':>13} {'from joined':>11} {'epoch/bound':>11} "
                     f"{'downloads':>9}")
        for r in m["rejoins"]:
            lines.append(f"{r['name']:<16} {r['region']:<7} {_number(r.get('to_joined_s')):>8} "
                         f"{_number(r['to_state_loaded_s']):>10} {_number(r.get('to_contributing_s')):>12} "
                         f"{_number(r['to_first_epoch_s']):>10} "
                         f"{_number(r['state_bytes'] / 1e6 if r['state_bytes'] else None):>9} "
                         f"{r['donor_region'] or '-':<7} {_number(r.get('download_s')):>10} "
                         f"{_number(r['bound_s'], 2):>8} {r['bound_donor_region'] or '-':<6} "
                         f"{_number(r.get('download_ratio'), 2):>14} {_number(r.get('contributing_ratio'), 2):>13} "
                         f"{_number(r.get('joined_contributing_ratio'), 2):>11} "
                         f"{_number(r['first_epoch_ratio'], 2):>11} "
                         f"{r.get('state_downloads', '-'):>9}")
    restored = m["restored_checkpoint"]
    kept = {None: "no restart", True: "yes", False: "NO"}[m["checkpoints_kept"]]
    lines += [
        "epochs never go backwards: " + ("yes" if m["epochs_monotonic"] else "NO: " + "; ".join(m["epoch_problems"])),
        f"checkpoints kept over the coordinator restart: {kept}"
        + (f" (resumed from version {restored['version']}, epoch {restored['epoch']})" if restored else "")
        + ("" if not m["checkpoint_problems"] else ": " + "; ".join(m["checkpoint_problems"])),
        f"parameters identical on the {len(m['parameters']['trainers'])} trainers at the end: "
        + ("yes" if m["parameters"]["identical"] else "NO: " + "; ".join(m["parameters"]["problems"])),
    ]
    return "\n".join(lines)


def plot_soaks(results: list[dict], path: Path) -> None:
    """Epoch over time per trainer incarnation, one panel per soak, notices and kills marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results):
        origin = result["first_epoch_unix_s"] or 0.0
        slots = sorted({t["slot"] for t in result["timeline"]})
        colours = {slot: f"C{n}" for n, slot in enumerate(slots)}
        for trainer in result["timeline"]:
            points = trainer["epochs"]
            if points:
                axis.plot([t - origin for t, _ in points], [e for _, e in points], marker=".", lw=1,
                          color=colours[trainer["slot"]], label=trainer["slot"] if trainer["name"] == trainer["slot"]
                          else None)
            if trainer["ended_by"]:
                axis.axvline(trainer["ended_unix_s"] - origin, color=colours[trainer["slot"]],
                             ls=":" if trainer["ended_by"] == NOTICE else "--", lw=1)
        restart = result.get("coordinator_restart")
        if restart:
            axis.axvline(restart["stopped_unix_s"] - origin, color="black", lw=1.5, label="coordinator restart")
        m = result["measured"]
        axis.set_title(f"{result['setup']}, churn {result['churn']['rate_per_trainer_emulated_hour']:g}/trainer/"
                       f"emulated h: {_number(m.get('swarm_samples_per_second'))} samples/s", fontsize=9)
        axis.set_xlabel("seconds after the first epoch (dotted: notice, dashed: kill)")
        axis.set_ylabel("epoch")
        axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
