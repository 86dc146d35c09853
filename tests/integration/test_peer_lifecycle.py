"""A trainer joining late; trainers and a coordinator told to stop, and a trainer killed."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from geotrain.events import read_events
from geotrain.stopping.processes import descendants
from swarm_helpers import IDLE_SWARM, Swarm, alive, last_epoch, processes_mentioning, wait_for

STOP_BUDGET_S = 30.0
# the late trainer joins after epoch 2 and must still train some epochs with the others before the end
LATE_JOIN_TARGET_BATCH_SIZE = 2048
LATE_JOIN_EPOCHS = 7


def _finished(events_path):
    return next((e for e in read_events(events_path) if e["event"] == "finished"), None)


def test_a_trainer_that_joins_after_epoch_two_loads_state_and_ends_equal(swarm):
    swarm.start_coordinator()
    # a learning rate that changes every epoch: the late trainer must use the swarm's, not one of its own
    # the emulated task (compute slept): what is checked is the state a late trainer loads, not learning
    common = [*IDLE_SWARM, "--target-batch-size", str(LATE_JOIN_TARGET_BATCH_SIZE), "--max-epochs",
              str(LATE_JOIN_EPOCHS), "--lr-schedule", "linear", "--warmup-epochs", "1"]
    first, first_events = swarm.start_trainer("a", *common, "--wait-for-peers", "2", "--data-seed", "1")
    second, second_events = swarm.start_trainer("b", *common, "--wait-for-peers", "2", "--data-seed", "2")
    # started now, so that it has torch loaded and its model built when it is let in: it joins within a second
    late_peers_file = swarm.directory / "late-initial-peers.txt"
    late, late_events = swarm.start_trainer("late", *common, "--data-seed", "3", "--bootstrap-timeout", "240",
                                            initial_peers_file=late_peers_file)
    wait_for(lambda: last_epoch(first_events) >= 2, 180, "the swarm to reach epoch 2")
    swarm.let_join(late_peers_file)

    for process in (first, second, late):
        process.wait(timeout=300)
    results = {name: _finished(path) for name, path in
               (("a", first_events), ("b", second_events), ("late", late_events))}
    assert all(results.values()), {name: swarm.log(name)[-2000:] for name, r in results.items() if not r}
    assert {r["epoch"] for r in results.values()} == {LATE_JOIN_EPOCHS}
    late_joined = [e for e in read_events(late_events) if e["event"] == "state_loaded"]
    assert late_joined and late_joined[0]["epoch"] >= 2, "the late trainer did not load the swarm's state"
    # one transfer per load: the training state, not also hivemind's gradient buffers (parameter-sized, unread)
    late_events_all = read_events(late_events)
    downloads = [e for e in late_events_all if e["event"] == "state_download" and e["result"] == "ok"
                 and e["time"] <= late_joined[0]["time"]]
    assert len(downloads) == 1, downloads
    hashes = {r["params_sha256"] for r in results.values()}
    assert len(hashes) == 1, f"parameters differ: {results}"
    swarm_rates = {e["epoch"]: e["learning_rate"] for e in read_events(first_events) if e["event"] == "epoch"}
    late_rates = {e["epoch"]: e["learning_rate"] for e in read_events(late_events) if e["event"] == "epoch"}
    assert late_rates and len(set(swarm_rates.values())) > 3
    for epoch, rate in late_rates.items():
        assert rate == pytest.approx(swarm_rates[epoch]), (epoch, late_rates, swarm_rates)


def children_with_p2pd(pid: int) -> list[int]:
    children = descendants(pid)
    commands = []
    for child in children:
        try:
            commands.append(open(f"/proc/{child}/cmdline", "rb").read().decode(errors="replace"))
        except OSError:
            pass
    assert any("p2pd" in command for command in commands), "expected hivemind's p2pd among the children"
    return children


def ignores(pid: int, signum: int) -> bool:
    """Whether the process ignores a signal (SigIgn in /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


def stop_and_check(swarm, process, name: str, signum: int) -> None:
    """``signum`` ends the peer with exit 0 within the stop deadline, and no child (p2pd included) outlives it."""
    children = children_with_p2pd(process.pid)
    assert not ignores(process.pid, signum), f"{name} ignores {signal.Signals(signum).name}"
    sent = time.monotonic()
    process.send_signal(signum)
    process.wait(timeout=STOP_BUDGET_S + 10)
    stop_s = time.monotonic() - sent
    assert stop_s <= STOP_BUDGET_S, f"{name} took {stop_s:.1f} s to stop"
    assert process.returncode == 0, swarm.log(name)[-2000:]
    # torch's shared memory manager exits by itself once the peer's processes are gone, removing what they
    # shared in /dev/shm as it does (geotrain.stopping.processes.kill_descendants leaves it running for that)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.1)
    survivors = {pid: describe(pid) for pid in children if alive(pid)}
    assert not survivors, f"processes outlived {name}: {survivors}"
    shared = [path.name for pid in (process.pid, *children) for path in Path("/dev/shm").glob(f"torch_{pid}_*")
              if path.name not in swarm.shared_memory_at_start]
    assert not shared, f"{name} left {len(shared)} files of shared memory in /dev/shm: {shared[:5]}"


def describe(pid: int) -> str:
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:120]
        state = next(line for line in open(f"/proc/{pid}/status") if line.startswith(("State:", "PPid:")))
        return f"{state.strip()} {command}"
    except OSError:
        return "gone"


@pytest.fixture(scope="module")
def three_trainers(tmp_path_factory):
    """A coordinator that holds state (a checkpoint every epoch) and three trainers, for the tests below, which
    run in this order: SIGKILL takes the "victim", SIGTERM stops "a", Ctrl-C stops "b" and the coordinator."""
    directory = tmp_path_factory.mktemp("three-trainers")
    swarm = Swarm(directory)
    try:
        short_epochs = [*IDLE_SWARM, "--target-batch-size", "512"]
        swarm.start_coordinator("--checkpoint-every-epochs", "1", *short_epochs)  # holds state: has an optimizer
        trainers = {name: swarm.start_trainer(name, *short_epochs, "--wait-for-peers", "3", "--data-seed", str(seed))
                    for seed, name in enumerate(("a", "b", "victim"), start=1)}
        wait_for(lambda: last_epoch(trainers["victim"][1]) >= 2, 180, "three trainers training together")
        yield swarm, trainers
    finally:
        swarm.stop()
    assert not processes_mentioning(str(directory)), "a peer process outlived the tests"


def test_sigkill_of_one_of_three_trainers_mid_round_the_others_go_on(three_trainers):
    swarm, trainers = three_trainers
    victim, victim_events = trainers["victim"]
    others = [trainers["a"], trainers["b"]]

    # Aim the kill at the next averaging round: it starts when the swarm reaches the target batch,
    # near the end of an epoch.
    epochs = [e for e in read_events(victim_events) if e["event"] == "epoch"]
    period_s = epochs[-1]["time"] - epochs[-2]["time"]
    time.sleep(max(0.0, epochs[-1]["time"] + 0.85 * period_s - time.time()))
    children = descendants(victim.pid)
    epoch_at_kill = max(last_epoch(events) for _, events in others)
    victim.send_signal(signal.SIGKILL)  # the peer alone, as the OOM killer would: its children must follow
    victim.wait()

    wait_for(lambda: all(last_epoch(events) >= epoch_at_kill + 2 for _, events in others), 180,
             "the two remaining trainers to complete their next epochs")
    wait_for(lambda: not [pid for pid in children if alive(pid)], 15,
             "the killed trainer's DHT node and p2pd to exit")


def test_sigterm_stops_a_trainer_within_30_s_and_leaves_no_process(three_trainers):
    swarm, trainers = three_trainers
    trainer, events = trainers["a"]
    stop_and_check(swarm, trainer, "a", signal.SIGTERM)
    finished = _finished(events)
    assert finished is not None and finished["stopped_by_request"] is True


def test_ctrl_c_stops_a_training_trainer_and_a_coordinator_that_holds_state(three_trainers):
    """hivemind's averagers set SIGINT to SIG_IGN in the process that starts them; Ctrl-C must still work."""
    swarm, trainers = three_trainers
    trainer, events = trainers["b"]
    wait_for(lambda: "checkpoint version 1 written" in swarm.log("coordinator"), 120, "the coordinator's checkpoint")
    stop_and_check(swarm, trainer, "b", signal.SIGINT)
    finished = _finished(events)
    assert finished is not None and finished["stopped_by_request"] is True
    assert finished["stop_reason"] == "SIGINT received"
    coordinator = swarm.processes[0]
    stop_and_check(swarm, coordinator, "coordinator", signal.SIGINT)
