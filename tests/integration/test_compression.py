"""Gradient compression beyond fp16, in real swarms of two trainers on loopback (nothing mocked).

One short run per compression (fp16, the default, as the baseline; uniform8bit; powersgd), one after the
other, each under its own run id next to one bootstrap coordinator. What a user notices: the loss falls,
every trainer ends with the very same parameters, and fewer bytes go over the wire per sample than with
fp16: the kernel's byte counters of each trainer's sockets, in its ``finished`` event (the whole run:
joining, DHT look-ups, every round and the end-of-run state transfer, which is the same for all). Each
byte between the trainers is counted by both, as sent and as received, from counters each samples every
few seconds: a connection that closes between two samples loses its last bytes at one end (seen: the
end-of-run transfer missing at its sender), so the larger of the two totals is the count.

A trainer that falls an epoch behind (one that starts late on a busy machine) downloads the whole state
(hivemind's catch-up), maybe each epoch: several times the bytes of all the rounds of such a short run.
Every state download is an event with its bytes (``state_download``); they are left out of both totals, so
that the comparison is of the rounds, whatever catch-ups a run had.
"""

from __future__ import annotations

import math
import re

import pytest

from geotrain.events import read_events
from swarm_helpers import FAST_SWARM, Swarm, processes_mentioning

TRAINERS = 2
# Short epochs (each one a step of the swarm's optimizer; the first epoch's loss is before any). An epoch's
# bytes are the same whatever its size, so more epochs widen the difference in bytes next to what varies
# between runs (retried or failed rounds); shorter ones than these let a trainer finish the first epoch
# before the other's first step, which then falls behind and downloads the state (seen at 128 samples)
EPOCHS = 4
TARGET_BATCH_SIZE = 256  # a quarter of FAST_SWARM's
LEARNING_RATE = 0.01
CHANCE_LOSS = math.log(10)  # the tiny CV task has 10 classes
COMPRESSIONS = ("fp16", "uniform8bit", "powersgd")
RUN_TIMEOUT_S = 240
FAILED_ROUND = re.compile(r"gradient averaging round (failed|timed out)")


def state_download_bytes(events: list[list[dict]]) -> int:
    """Bytes of the whole states the trainers downloaded (each peer's ``state_download`` events): the donor
    sent them and the trainer received them, besides the gradients."""
    return sum(e["bytes"] for peer in events for e in peer if e["event"] == "state_download")


def train(swarm: Swarm, compression: str) -> dict:
    """Two trainers from start to the end-of-run agreement; what their events and logs say."""
    names = [f"{compression}-{index}" for index in range(TRAINERS)]
    started = [swarm.start_trainer(name, "--run-id", f"compression-{compression}", *FAST_SWARM,
                                   "--target-batch-size", str(TARGET_BATCH_SIZE), "--lr", str(LEARNING_RATE),
                                   "--max-epochs", str(EPOCHS), "--wait-for-peers", str(TRAINERS),
                                   "--data-seed", str(index + 1), "--grad-compression", compression,
                                   env={"HIVEMIND_LOGLEVEL": "INFO"})
               for index, name in enumerate(names)]
    for process, _ in started:
        process.wait(timeout=RUN_TIMEOUT_S)
    events = [read_events(path) for _, path in started]
    finished = [next((e for e in peer if e["event"] == "finished"), None) for peer in events]
    losses = []
    for epoch in range(1, EPOCHS + 1):
        of_epoch = [e for peer in events for e in peer if e["event"] == "epoch" and e["epoch"] == epoch]
        losses.append(sum(e["loss"] * e["samples"] for e in of_epoch) / max(1, sum(e["samples"] for e in of_epoch)))
    samples = sum(f["samples"] for f in finished if f is not None)
    # a trainer that fell behind (and the end-of-run agreement) downloads the whole state: that is not
    # the compression's traffic, and is left out
    downloads = state_download_bytes(events)
    sent = sum(sum(f["sent_bytes_by_region"].values()) for f in finished if f is not None) - downloads
    received = sum(f["received_bytes"] for f in finished if f is not None) - downloads
    logs = {name: swarm.log(name) for name in names}
    return {"exit_codes": [process.returncode for process, _ in started], "finished": finished, "losses": losses,
            "bytes_per_sample": max(sent, received) / samples if samples else math.nan,
            "logs": logs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compression")
    swarm = Swarm(directory)
    try:
        swarm.start_coordinator()
        yield {compression: train(swarm, compression) for compression in COMPRESSIONS}
    finally:
        swarm.stop()
    assert not processes_mentioning(str(directory)), "a peer process outlived the test"


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compression_trains_to_identical_parameters(runs, compression):
    run = runs[compression]
    logs = "\n".join(f"--- {name}\n{log[-3000:]}" for name, log in run["logs"].items())
    assert run["exit_codes"] == [0] * TRAINERS, logs
    assert all(f is not None and f["epoch"] == EPOCHS for f in run["finished"]), logs
    hashes = {f["params_sha256"] for f in run["finished"]}
    assert len(hashes) == 1, f"the trainers ended with different parameters: {hashes}"

    losses = run["losses"]
    assert not any(math.isnan(loss) for loss in losses), losses
    assert losses[-1] < 0.85 * losses[0], f"the loss did not fall: {losses}"
    assert losses[-1] < 0.85 * CHANCE_LOSS, f"the loss did not fall below chance level: {losses}"

    for name, log in run["logs"].items():
        # the rounds are where the compression acts: each trainer must have averaged in some of them
        assert len(FAILED_ROUND.findall(log)) < EPOCHS, f"{name}: every gradient averaging round failed\n{log}"
        if compression == "powersgd":
            assert "first PowerSGD round done in a group of 2 peers" in log, f"{name}: no PowerSGD round ended\n{log}"


@pytest.mark.parametrize("compression", ["uniform8bit", "powersgd"])
def test_compression_sends_fewer_bytes_per_sample_than_fp16(runs, compression):
    fp16 = runs["fp16"]["bytes_per_sample"]
    compressed = runs[compression]["bytes_per_sample"]
    assert fp16 > 0, "the fp16 run counted no bytes (is `ss` from iproute2 installed?)"
    assert compressed < fp16, f"{compression}: {compressed:.0f} bytes on the wire per sample, fp16: {fp16:.0f}"
