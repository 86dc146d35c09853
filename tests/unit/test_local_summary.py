"""The run summary that `geotrain local` prints and writes, computed from the peers' event files."""

from __future__ import annotations

import math
from types import SimpleNamespace

from geotrain.config import load_config
from geotrain.events import EventLog, read_events
from geotrain.local import format_summary, live_progress, summarize


def peer_events(path, peer_id, start, epochs, sha256, loss0):
    log = EventLog(path)
    log.write("joined", peer_id=peer_id, parameters=1000)
    log._handle.write('{"event": "training", "time": %f, "peer_id": "%s", "epoch": 0}\n' % (start, peer_id))
    samples_total = 0
    for epoch, (samples, seconds) in enumerate(epochs, start=1):
        samples_total += samples
        log._handle.write(
            '{"event": "epoch", "time": %f, "epoch": %d, "samples": %d, "samples_per_second": %f, "loss": %f, '
            '"compute_s": 1.0, "comm_s": 0.5}\n' % (start + seconds, epoch, samples, samples / 2, loss0 / epoch))
    log.write("finished", peer_id=peer_id, epoch=len(epochs), samples=samples_total, compute_s=len(epochs) * 1.0,
              comm_s=len(epochs) * 0.5, params_sha256=sha256)
    log.close()


def trainer(name, path, code=0):
    return SimpleNamespace(name=name, events_path=path, process=SimpleNamespace(returncode=code))


def test_summary_adds_up(tmp_path):
    peer_events(tmp_path / "a.jsonl", "A", 100.0, [(100, 2.0), (300, 4.0)], "same", 2.0)
    peer_events(tmp_path / "b.jsonl", "B", 101.0, [(200, 2.0), (100, 5.0)], "same", 4.0)
    config = load_config(overrides={"training.max_epochs": 2, "optimizer.target_batch_size": 256})
    summary = summarize(config, [trainer("peer-0", tmp_path / "a.jsonl"), trainer("peer-1", tmp_path / "b.jsonl")],
                        tmp_path)
    assert summary["epochs_completed"] == 2
    assert summary["samples_total"] == 700
    assert summary["wall_s"] == 6.0  # first training start (100) to last epoch (106)
    assert math.isclose(summary["swarm_samples_per_second"], 700 / 6.0)
    assert math.isclose(summary["loss_first"], (2.0 * 100 + 4.0 * 200) / 300)  # sample-weighted
    assert math.isclose(summary["loss_last"], (1.0 * 300 + 2.0 * 100) / 400)
    assert summary["granularity"] == 2.0
    assert summary["params_identical"] is True
    assert [p["peer_id"] for p in summary["peers"]] == ["A", "B"]
    assert "parameters identical on every peer: yes" in format_summary(summary)


def test_different_parameters_are_reported(tmp_path):
    peer_events(tmp_path / "a.jsonl", "A", 0.0, [(100, 1.0)], "one", 2.0)
    peer_events(tmp_path / "b.jsonl", "B", 0.0, [(100, 1.0)], "other", 2.0)
    summary = summarize(load_config(), [trainer("a", tmp_path / "a.jsonl"), trainer("b", tmp_path / "b.jsonl")],
                        tmp_path)
    assert summary["params_identical"] is False
    assert "parameters identical on every peer: NO" in format_summary(summary)


def test_live_progress_and_half_written_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    peer_events(path, "A", 0.0, [(100, 1.0), (100, 2.0)], "x", 2.0)
    with open(path, "a") as handle:
        handle.write('{"event": "epo')  # a line still being written
    events = read_events(path)
    assert events[-1]["event"] == "finished"
    progress = live_progress([events, []])
    assert progress["epoch"] == 2 and progress["samples_per_second"] == 50.0
