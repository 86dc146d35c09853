"""The coordinator's durable state, with real processes: checkpoints, a crash while writing one, a
coordinator that is down while trainers go on, and a swarm that lost every trainer."""

from __future__ import annotations

import os
import signal

import pytest

from geotrain.checkpoint import CheckpointStore
from geotrain.config import TaskConfig, validate_config
from geotrain.events import read_events
from geotrain.tasks import build_task
from geotrain.hive.state.snapshot import parameters_sha256
from geotrain.schedule import learning_rate_at
from swarm_helpers import IDLE_SWARM, last_epoch, spawn, wait_for

CRASH_EXIT_CODE = 86  # geotrain.checkpoint's injected crash between write and rename
# a learning rate that changes every epoch: a swarm restored from a checkpoint must use the schedule's
SCHEDULE = ["--lr-schedule", "linear", "--schedule-epochs", "60", "--lr", "0.002"]
# the emulated task (compute slept): what is checked is the state kept and restored, not learning
SCHEDULED_SWARM = [*IDLE_SWARM, *SCHEDULE]


def start_coordinator(swarm, name: str, port: int | None = None, crash: bool = False,
                      checkpoint_every_epochs: int = 2):
    peers_file = swarm.directory / f"{name}-peers.txt"
    process = spawn("coordinator", "--state-dir", str(swarm.directory / "coord"), "--initial-peers-file",
                    str(peers_file), "--port", str(port or 0), *SCHEDULED_SWARM, "--network-profile", "loopback",
                    "--checkpoint-every-epochs", str(checkpoint_every_epochs), log_path=swarm.directory / f"{name}.log",
                    env={"GEOTRAIN_CRASH_BEFORE_RENAME": "1" if crash else ""})
    swarm.processes.append(process)
    wait_for(peers_file.exists, 90, f"{name} to come up")
    swarm.initial_peers = peers_file.read_text().split()
    return process


def checkpoints_parameters_sha256(store_dir, known: dict[int, str]) -> dict[int, str]:
    """epoch -> parameters' sha256 of each checkpoint in ``store_dir``, added to ``known`` (older ones are
    removed as newer ones are written: read them while they are there)."""
    import torch

    for info in CheckpointStore(store_dir).list():
        if info.epoch not in known:
            model = build_task(TaskConfig(name="emulated", preset="tiny")).build_model()
            model.load_state_dict(torch.load(info.path, map_location="cpu", weights_only=True)["model"])
            known[info.epoch] = parameters_sha256(model)
    return known


def test_checkpoints_survive_a_crash_and_a_swarm_that_lost_every_trainer(swarm):
    store_dir = swarm.directory / "coord" / "checkpoints"
    coordinator = start_coordinator(swarm, "coordinator-1")
    port = int(swarm.initial_peers[0].split("/tcp/")[1].split("/")[0])
    first, first_events = swarm.start_trainer("a", *SCHEDULED_SWARM, "--wait-for-peers", "2", "--data-seed", "1")
    known_peers = swarm.directory / "b-known-peers.txt"
    second, _ = swarm.start_trainer("b", *SCHEDULED_SWARM, "--wait-for-peers", "2", "--data-seed", "2",
                                    "--known-peers-file", str(known_peers))
    wait_for(lambda: CheckpointStore(store_dir).list(), 180, "the first checkpoint")
    first_checkpoint = CheckpointStore(store_dir).list()[0]
    first_peer_id = next(e["peer_id"] for e in read_events(first_events) if e["event"] == "joined")
    wait_for(lambda: first_peer_id in known_peers.read_text(), 30, "b to keep a's address in its known peers")

    # The coordinator goes down; trainers go on. It comes back with a crash injected into its next save.
    coordinator.send_signal(signal.SIGTERM)
    coordinator.wait(timeout=40)
    epoch_while_down = last_epoch(first_events)

    # Meanwhile b's VM restarts: its only initial peer is the coordinator, which is down, and it rejoins through
    # the peers it knew (--known-peers-file), loads a's state and trains with it.
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    second, second_events = swarm.start_trainer("b-restarted", *SCHEDULED_SWARM, "--data-seed", "2",
                                                "--known-peers-file", str(known_peers))
    wait_for(lambda: [e for e in read_events(second_events) if e["event"] == "epoch" and e["peers"] == 2], 120,
             f"b to rejoin through a while the coordinator is down:\n{swarm.log('b-restarted')[-2000:]}")
    assert coordinator.poll() is not None
    crashing = start_coordinator(swarm, "coordinator-2", port=port, crash=True)
    crashing.wait(timeout=180)
    assert crashing.returncode == CRASH_EXIT_CODE, swarm.log("coordinator-2")[-3000:]
    assert last_epoch(first_events) > epoch_while_down, "trainers stopped while the coordinator was down"
    assert CheckpointStore(store_dir).list()[0].version == first_checkpoint.version, "a half-written checkpoint"

    # Restarted again: it restores the last good checkpoint and catches up with the swarm. It checkpoints every
    # state it downloads, so the state it offers is always one it has written.
    start_coordinator(swarm, "coordinator-3", port=port, checkpoint_every_epochs=1)
    wait_for(lambda: f"restored checkpoint version {first_checkpoint.version}" in swarm.log("coordinator-3"), 60,
             "the restore of the last good checkpoint")
    wait_for(lambda: CheckpointStore(store_dir).list()[0].version > first_checkpoint.version, 180,
             "a checkpoint after the restart")

    # Every trainer is lost at once (their VMs vanish: SIGKILL to all their processes).
    for process in (first, second):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    checkpoints = checkpoints_parameters_sha256(store_dir, {})
    epoch_at_loss = max(checkpoints)

    # Two new trainers continue from the coordinator's state: that of its newest checkpoint at the loss, or of
    # one it wrote just after (a state it had downloaded as the trainers went)
    newcomers = [swarm.start_trainer(name, *SCHEDULED_SWARM, "--wait-for-peers", "2", "--data-seed", seed)
                 for name, seed in (("c", "3"), ("d", "4"))]
    for name, events in zip("cd", (events for _, events in newcomers)):
        loaded = wait_for(lambda: [e for e in read_events(events) if e["event"] == "state_loaded"], 120,
                          "a newcomer to load the coordinator's state")[0]
        epoch = loaded["state_epoch"]
        assert epoch >= epoch_at_loss, loaded
        wait_for(lambda: epoch in checkpoints_parameters_sha256(store_dir, checkpoints), 30,
                 f"the coordinator's checkpoint of epoch {epoch}")
        assert loaded["params_sha256"] == checkpoints[epoch], (
            f"the newcomer did not start from the coordinator's checkpoint of epoch {epoch}: {loaded}\n"
            f"checkpoints (epoch: parameters sha256): {checkpoints}\n" + swarm.log("coordinator-3")[-3000:])
        # the lost trainers' progress records may still say a later epoch: the log names the state's own (its
        # line comes just after the event: seen missing when read at once, on a loaded machine)
        wait_for(lambda: f"loaded the state of epoch {epoch} " in swarm.log(name), 10,
                 f"{name}'s log line of the load:\n{swarm.log(name)[-2000:]}")
        assert loaded["epoch"] >= epoch
    wait_for(lambda: all(last_epoch(events) > epoch for _, events in newcomers), 120,
             "the new trainers to train past the checkpoint")
    schedule = validate_config({"optimizer": {"lr_schedule": "linear", "schedule_epochs": 60, "learning_rate": 0.002}})
    for _, events in newcomers:
        for event in epoch_events(events):
            assert event["learning_rate"] == pytest.approx(learning_rate_at(schedule, event["epoch"])), event
    # The lost trainers' progress records expire (optimizer.progress_expiration_s): the newcomers stop
    # counting them as peers, and so stop waiting for them in matchmaking.
    wait_for(lambda: all(epoch_events(events) and epoch_events(events)[-1]["peers"] == 2 for _, events in newcomers),
             90, "the newcomers to count only each other")


def epoch_events(path) -> list[dict]:
    return [e for e in read_events(path) if e["event"] == "epoch"]


def write_checkpoint(state_dir, config_yaml: str, preset: str = "tiny") -> CheckpointStore:
    """A checkpoint as a coordinator of a CV run writes it (model and optimizer state of the task's model)."""
    import torch

    model = build_task(TaskConfig(name="cv", preset=preset)).build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    store = CheckpointStore(state_dir / "checkpoints", config_yaml=config_yaml)
    store.save({"epoch": 3, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, epoch=3,
               samples_seen=3 * 1024)
    return store


def checkpoint_files(state_dir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((state_dir / "checkpoints").iterdir())}


def test_a_checkpoint_of_another_config_is_refused_and_kept(tmp_path):
    from swarm_helpers import geotrain

    cv_run = validate_config({"swarm": {"run_id": "imagenet"}, "task": {"name": "cv", "preset": "tiny"}})
    write_checkpoint(tmp_path, cv_run.to_yaml())
    before = checkpoint_files(tmp_path)
    result = geotrain("coordinator", "--state-dir", str(tmp_path), "--run-id", "imagenet", "--task", "nlp",
                      "--port", "0", timeout_s=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "was written for another config (task.name: 'cv' in the checkpoint, 'nlp' now" in result.stderr
    assert "task.preset" not in result.stderr or "'tiny' in the checkpoint" in result.stderr
    assert "Traceback" not in result.stderr and "is up" not in result.stdout
    assert checkpoint_files(tmp_path) == before, "the refused checkpoints must stay as they were"


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_and_kept(tmp_path):
    from swarm_helpers import geotrain

    write_checkpoint(tmp_path, config_yaml="", preset="tiny")  # written by hand: no config to compare
    before = checkpoint_files(tmp_path)
    result = geotrain("coordinator", "--state-dir", str(tmp_path), "--task", "cv", "--preset", "resnet18",
                      "--port", "0", timeout_s=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "does not fit the model of task cv/resnet18" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert checkpoint_files(tmp_path) == before
