"""Checkpoints mirrored to a real S3-compatible server on loopback: a coordinator on a new VM with an empty
disk restores the newest checkpoint from the bucket, and a corrupted object there is caught and skipped."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from geotrain.checkpoint import CheckpointStore

try:
    import s3fs
except ImportError as missing:
    pytest.fail(f"s3fs is not installed ({missing}); install the test dependencies: pip install -e '.[dev]'",
                pytrace=False)

pytestmark = pytest.mark.integration

MIRROR_URL = "s3://geotrain-checkpoints/run1"


@pytest.fixture
def bucket(s3_server):
    """A new, empty bucket and an s3fs client of its own, apart from the store's."""
    filesystem = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    filesystem.mkdir("geotrain-checkpoints")
    yield filesystem
    filesystem.rm("geotrain-checkpoints", recursive=True)


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": seed}


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert actual["epoch"] == expected["epoch"]
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), name
    for index, statistics in expected["optimizer"]["state"].items():
        for key, value in statistics.items():
            assert torch.equal(actual["optimizer"]["state"][index][key], value), (index, key)


def objects(filesystem: s3fs.S3FileSystem) -> list[str]:
    filesystem.invalidate_cache()
    return sorted(path.rsplit("/", 1)[1] for path in filesystem.ls("geotrain-checkpoints/run1", detail=False))


def test_a_new_vm_restores_from_the_bucket_and_skips_a_corrupted_object(s3_server, bucket, tmp_path, caplog):
    options = s3_server.storage_options()
    first_vm = CheckpointStore(tmp_path / "vm1", keep=2, mirror_url=MIRROR_URL, storage_options=options,
                               config_yaml="swarm: {run_id: run1}\n")
    states = [model_state(seed) for seed in (1, 2)]
    infos = [first_vm.save(state, epoch=state["epoch"], samples_seen=state["epoch"] * 4096) for state in states]

    assert objects(bucket) == ["checkpoint-000001.json", "checkpoint-000001.pt",
                               "checkpoint-000002.json", "checkpoint-000002.pt"]
    for info in infos:
        manifest = json.loads(bucket.cat_file(f"geotrain-checkpoints/run1/checkpoint-{info.version:06d}.json"))
        assert (manifest["version"], manifest["sha256"], manifest["size_bytes"]) == (
            info.version, info.sha256, info.size_bytes)
        assert bucket.info(f"geotrain-checkpoints/run1/{manifest['data_file']}")["size"] == info.size_bytes

    # the coordinator's VM is gone with its disk; a new one starts with the same mirror
    shutil.rmtree(tmp_path / "vm1")
    second_vm = CheckpointStore(tmp_path / "vm2", keep=2, mirror_url=MIRROR_URL, storage_options=options)
    restored, info = second_vm.load_latest()
    assert info.version == 2 and info.sha256 == infos[1].sha256 and info.epoch == 2
    assert_same_tensors(restored, states[1])

    # a damaged object in the bucket (same size, one byte flipped) must not be restored
    newest_object = "geotrain-checkpoints/run1/checkpoint-000002.pt"
    data = bytearray(bucket.cat_file(newest_object))
    data[len(data) // 2] ^= 0xFF
    bucket.pipe_file(newest_object, bytes(data))
    third_vm = CheckpointStore(tmp_path / "vm3", keep=2, mirror_url=MIRROR_URL, storage_options=options)
    with caplog.at_level(logging.WARNING, logger="geotrain.checkpoint"):
        restored, info = third_vm.load_latest()
    assert info.version == 1
    assert_same_tensors(restored, states[0])
    assert f"{MIRROR_URL}/checkpoint-000002.pt: checksum mismatch: expected {infos[1].sha256}, got " in caplog.text
    assert sorted(path.name for path in (tmp_path / "vm3").iterdir()) == [
        "checkpoint-000001.json", "checkpoint-000001.pt"]  # the bad download left nothing behind

    # the restored VM goes on: its next version follows the bucket's, and retention applies there too
    info = third_vm.save(model_state(3), epoch=3, samples_seen=3 * 4096)
    assert info.version == 3
    assert objects(bucket) == ["checkpoint-000002.json", "checkpoint-000002.pt",
                               "checkpoint-000003.json", "checkpoint-000003.pt"]


def test_an_unreachable_bucket_keeps_the_local_checkpoint(s3_server, bucket, tmp_path, caplog):
    store = CheckpointStore(tmp_path / "vm", mirror_url="s3://no-such-bucket/run1",
                            storage_options=s3_server.storage_options())
    state = model_state(5)
    with caplog.at_level(logging.ERROR, logger="geotrain.checkpoint"):
        info = store.save(state, epoch=5, samples_seen=0)
    assert "could not mirror checkpoint 1 to s3://no-such-bucket/run1" in caplog.text
    restored, restored_info = store.load_latest()
    assert restored_info == info
    assert_same_tensors(restored, state)
