"""Checkpoints: a restore gives back the exact state; damaged, half-written or crashed saves are never
mistaken for a checkpoint, and the previous one is used instead."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import geotrain
from geotrain.checkpoint import CRASH_BEFORE_RENAME_ENV, CRASH_EXIT_CODE, CheckpointStore

REPO_ROOT = Path(geotrain.__file__).resolve().parent.parent


def trained_state(seed: int) -> dict:
    """A real model and Adam state after one step, so the optimizer holds per-parameter tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": seed}


def assert_same_state(actual, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same_state(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for actual_item, expected_item in zip(actual, expected):
            assert_same_state(actual_item, expected_item)
    else:
        assert actual == expected


def save_versions(store: CheckpointStore, count: int) -> list[dict]:
    states = [trained_state(seed) for seed in range(1, count + 1)]
    for state in states:
        store.save(state, epoch=state["epoch"], samples_seen=state["epoch"] * 1024)
    return states


def test_round_trip_restores_model_optimizer_and_progress(tmp_path):
    config_yaml = "task: {name: cv}\n"
    store = CheckpointStore(tmp_path / "checkpoints", config_yaml=config_yaml)
    state = trained_state(seed=7)
    info = store.save(state, epoch=7, samples_seen=7168)

    restored, restored_info = CheckpointStore(tmp_path / "checkpoints").load_latest()
    assert_same_state(restored, state)
    assert restored_info == info
    assert (info.version, info.epoch, info.samples_seen) == (1, 7, 7168)
    data = Path(info.path).read_bytes()
    assert info.size_bytes == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.config_sha256 == hashlib.sha256(config_yaml.encode()).hexdigest()
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint-000001.json").read_text())
    assert manifest["config_yaml"] == config_yaml  # a checkpoint says which settings produced it

    # a model built afresh takes the restored parameters and computes the same outputs
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    model.load_state_dict(restored["model"])
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(restored["optimizer"])
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)


def test_versions_increase_and_continue_after_a_restart(tmp_path):
    store = CheckpointStore(tmp_path, keep=10)
    versions = [store.save({"step": torch.tensor(step)}, epoch=step, samples_seen=0).version for step in range(3)]
    assert versions == [1, 2, 3]
    assert CheckpointStore(tmp_path, keep=10).save({"step": torch.tensor(3)}, epoch=3, samples_seen=0).version == 4
    assert [info.version for info in store.list()] == [4, 3, 2, 1]


def test_retention_keeps_the_newest_k(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    states = save_versions(store, 5)
    assert [info.version for info in store.list()] == [5, 4]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint-000004.json", "checkpoint-000004.pt", "checkpoint-000005.json", "checkpoint-000005.pt"]
    restored, info = store.load_latest()
    assert info.version == 5
    assert_same_state(restored, states[-1])


def test_a_flipped_byte_is_caught_and_the_previous_version_restored(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    states = save_versions(store, 2)
    newest = tmp_path / "checkpoint-000002.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="geotrain.checkpoint"):
        restored, info = store.load_latest()
    assert info.version == 1
    assert_same_state(restored, states[0])
    assert f"{newest}: checksum mismatch: expected " in caplog.text
    assert "skipping checkpoint 2" in caplog.text


def test_a_truncated_file_is_caught_and_the_previous_version_restored(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    states = save_versions(store, 2)
    newest = tmp_path / "checkpoint-000002.pt"
    size_bytes = newest.stat().st_size
    with open(newest, "r+b") as file:
        file.truncate(1234)

    with caplog.at_level(logging.WARNING, logger="geotrain.checkpoint"):
        restored, info = store.load_latest()
    assert info.version == 1
    assert_same_state(restored, states[0])
    assert f"{newest}: truncated: 1234 of {size_bytes} bytes" in caplog.text


def test_a_garbage_manifest_or_a_missing_data_file_is_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    states = save_versions(store, 3)
    (tmp_path / "checkpoint-000003.json").write_text('{"version": 3, "epoch": ')
    (tmp_path / "checkpoint-000002.pt").unlink()

    with caplog.at_level(logging.WARNING, logger="geotrain.checkpoint"):
        restored, info = store.load_latest()
    assert info.version == 1
    assert_same_state(restored, states[0])
    assert f"{tmp_path / 'checkpoint-000003.json'}: manifest is not valid JSON" in caplog.text
    assert f"{tmp_path / 'checkpoint-000002.pt'}: data file is missing" in caplog.text
    # the damaged number is not reused, so the next save cannot be confused with it
    assert store.save({"x": torch.ones(1)}, epoch=4, samples_seen=0).version == 4


def test_nothing_verifies_means_none_with_a_warning(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    save_versions(store, 1)
    (tmp_path / "checkpoint-000001.pt").write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="geotrain.checkpoint"):
        assert store.load_latest() is None
    assert f"none of the 1 checkpoints in {tmp_path} verifies" in caplog.text


def test_an_empty_directory_has_no_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "new")
    assert store.load_latest() is None
    assert store.list() == []


def test_a_crash_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    (first_state,) = save_versions(store, 1)
    script = textwrap.dedent(f"""
        import torch
        from geotrain.checkpoint import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r})
        store.save({{"weights": torch.randn(256, 256)}}, epoch=2, samples_seen=2048)
        raise SystemExit("save returned although the crash hook was set")
    """)
    environment = {**os.environ, CRASH_BEFORE_RENAME_ENV: "1",
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    crashed = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                             timeout=60)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr

    leftover = tmp_path / ".checkpoint-000002.pt.tmp"
    assert leftover.stat().st_size > 256 * 256 * 4  # the crash came after the data was written
    assert not (tmp_path / "checkpoint-000002.pt").exists()
    assert not (tmp_path / "checkpoint-000002.json").exists()

    restarted = CheckpointStore(tmp_path)
    assert [info.version for info in restarted.list()] == [1]
    restored, info = restarted.load_latest()
    assert info.version == 1
    assert_same_state(restored, first_state)
    assert restarted.save({"weights": torch.ones(2)}, epoch=2, samples_seen=2048).version == 2
    assert not leftover.exists()  # the restarted writer cleaned up


def test_a_data_file_without_manifest_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    save_versions(store, 1)
    # as if the VM died after the data file's rename but before the manifest was written
    torch.save({"half": torch.ones(3)}, tmp_path / "checkpoint-000009.pt")
    restarted = CheckpointStore(tmp_path)
    assert [info.version for info in restarted.list()] == [1]
    assert restarted.load_latest()[1].version == 1
    assert restarted.save({"whole": torch.ones(3)}, epoch=2, samples_seen=0).version == 2
    assert not (tmp_path / "checkpoint-000009.pt").exists()


def test_a_reader_leaves_a_save_in_progress_alone(tmp_path):
    """Other processes (an operator's script, a test) may open the coordinator's directory while it writes."""
    writer = CheckpointStore(tmp_path)
    save_versions(writer, 1)
    in_progress = [tmp_path / ".checkpoint-000002.pt.tmp", tmp_path / "checkpoint-000002.pt"]
    for path in in_progress:  # the data file written, its manifest not yet
        path.write_bytes(b"being written")
    reader = CheckpointStore(tmp_path)
    assert [info.version for info in reader.list()] == [1]
    assert reader.load_latest()[1].version == 1
    assert all(path.exists() for path in in_progress)


def test_a_state_that_could_not_be_restored_is_refused_before_writing(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(TypeError, match=r"state\['scheduler'\]\['last_lr'\] is a numpy.float64"):
        store.save({"scheduler": {"last_lr": np.float64(0.1)}}, epoch=1, samples_seen=0)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_mirror_keeps_the_local_checkpoint(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the mirror's folder would be")
    store = CheckpointStore(tmp_path / "local", mirror_url=f"file://{blocker}/run")
    with caplog.at_level(logging.ERROR, logger="geotrain.checkpoint"):
        info = store.save({"x": torch.arange(4)}, epoch=1, samples_seen=64)
    assert "could not mirror checkpoint 1 to file://" in caplog.text
    assert "the local copy" in caplog.text and "is intact" in caplog.text
    restored, restored_info = store.load_latest()
    assert restored_info == info and torch.equal(restored["x"], torch.arange(4))


def test_a_fresh_disk_restores_from_the_mirror_and_continues_its_numbering(tmp_path):
    mirror_url = f"file://{tmp_path}/mirror/run"
    states = save_versions(CheckpointStore(tmp_path / "vm1", keep=2, mirror_url=mirror_url), 3)
    assert sorted(os.listdir(tmp_path / "mirror" / "run")) == [
        "checkpoint-000002.json", "checkpoint-000002.pt", "checkpoint-000003.json", "checkpoint-000003.pt"]

    fresh = CheckpointStore(tmp_path / "vm2", keep=2, mirror_url=mirror_url)
    restored, info = fresh.load_latest()
    assert info.version == 3 and info.path == str(tmp_path / "vm2" / "checkpoint-000003.pt")
    assert_same_state(restored, states[-1])
    assert [listed.version for listed in fresh.list()] == [3]  # now also on the local disk

    # a second fresh VM that saves before loading still never reuses a number the mirror holds
    (tmp_path / "mirror" / "run" / "checkpoint-000001.pt").write_bytes(b"an upload that died before its manifest")
    other = CheckpointStore(tmp_path / "vm3", keep=2, mirror_url=mirror_url)
    assert other.save({"x": torch.ones(1)}, epoch=9, samples_seen=0).version == 4
    assert sorted(os.listdir(tmp_path / "mirror" / "run")) == [
        "checkpoint-000003.json", "checkpoint-000003.pt", "checkpoint-000004.json", "checkpoint-000004.pt"]
