"""build_loader: batches made in DataLoader worker processes, each worker reading its own share of the data.

Sources are the small files that test_data_sources.py writes. Which sample a worker read is recorded by
wrapping the two places where every sample of a folder or shard is taken (``data.worker_passes`` and
``data._read_shards``); forked workers inherit the wrappers and append ``pid key`` lines to a file.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from test_data_sources import TEXT, _audio, _image_shards, _png, _tar, audio_folder, image_folder  # noqa: F401

from geotrain.config import TaskConfig
from geotrain.tasks import build_task, data
from geotrain.tasks.data import BatchLoader, BatchStream, DataSourceError

WORKERS = 2
BATCH_SIZE = 3
SHAPES = {"cv": {"images": (BATCH_SIZE, 3, 32, 32), "labels": (BATCH_SIZE,)},
          "nlp": {"input_ids": (BATCH_SIZE, 64), "attention_mask": (BATCH_SIZE, 64), "labels": (BATCH_SIZE, 64)},
          "asr": {"features": (BATCH_SIZE, 40, 150), "feature_lengths": (BATCH_SIZE,),
                  "target_lengths": (BATCH_SIZE,)}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _task(name: str, source: str, path: str | None, preset: str = "tiny"):
    return build_task(TaskConfig(name=name, preset=preset, data={"source": source, "path": path}))


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """``reads()``: {pid: [key of each sample that process took, in order]} (a folder's file, a shard's __key__)."""
    log = tmp_path / "reads.log"
    worker_passes, read_shards = data.worker_passes, data._read_shards

    def record(key: str) -> None:
        with open(log, "a") as stream:  # one short append per line: lines of two workers never interleave
            stream.write(f"{os.getpid()} {key}\n")

    def recorded_passes(items, *args, **kwargs):
        for epoch, item in worker_passes(items, *args, **kwargs):
            record(str(item[0] if isinstance(item, tuple) else item))  # cv items are (file, label)
            yield epoch, item

    def recorded_shards(shards):
        for sample in read_shards(shards):
            record(sample["__key__"])
            yield sample

    monkeypatch.setattr(data, "worker_passes", recorded_passes)
    monkeypatch.setattr(data, "_read_shards", recorded_shards)

    def read_back() -> dict[int, list[str]]:
        keys = defaultdict(list)
        for line in log.read_text().splitlines():
            pid, key = line.split(" ", 1)
            keys[int(pid)].append(key)
        return dict(keys)

    return read_back


# Every source holds 12 samples: 12 files, or 6 shards of 2. Two workers take 6 of them each in every pass.
SAMPLES = 12


def _cv_folder(root: Path) -> tuple[str, set[str]]:
    for index in range(SAMPLES):
        (root / f"class{index % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"class{index % 3}" / f"{index}.png").write_bytes(_png(40, 34, 20 * index))
    return str(root), {str(file) for file in root.rglob("*.png")}


def _nlp_folder(root: Path) -> tuple[str, set[str]]:
    root.mkdir()
    for index in range(SAMPLES):
        (root / f"doc{index}.txt").write_text(f"document {index}: {TEXT[:200]}")
    return str(root), {str(file) for file in root.glob("*.txt")}


def _asr_folder(root: Path) -> tuple[str, set[str]]:
    root.mkdir()
    for index in range(SAMPLES):
        (root / f"clip{index}.wav").write_bytes(_audio(0.2, 16_000, 300.0 + 50 * index, "WAV"))
        (root / f"clip{index}.txt").write_text("abcdefghijkl"[:index + 1])
    return str(root), {str(file) for file in root.glob("*.wav")}


def _shards(root: Path, samples: list[tuple[str, dict[str, bytes]]]) -> tuple[str, set[str]]:
    root.mkdir()
    for shard in range(len(samples) // 2):
        (root / f"shard-{shard}.tar").write_bytes(_tar(samples[2 * shard:2 * shard + 2]))
    return f"{root}/shard-{{0..{len(samples) // 2 - 1}}}.tar", {key for key, _ in samples}


SOURCES = {
    ("cv", "folder"): _cv_folder,
    ("nlp", "folder"): _nlp_folder,
    ("asr", "folder"): _asr_folder,
    ("cv", "webdataset"): lambda root: _shards(root, [(f"img{index:02d}", {"png": _png(36, 36, 20 * index),
                                                                          "cls": str(index % 10).encode()})
                                                      for index in range(SAMPLES)]),
    ("nlp", "webdataset"): lambda root: _shards(root, [(f"doc{index:02d}", {"txt": f"{index} {TEXT[:300]}".encode()})
                                                       for index in range(SAMPLES)]),
    ("asr", "webdataset"): lambda root: _shards(root, [(f"clip{index:02d}",
                                                        {"wav": _audio(0.2, 16_000, 300.0 + 50 * index, "WAV"),
                                                         "txt": b"hello"}) for index in range(SAMPLES)]),
}


@pytest.mark.parametrize("name, source", list(SOURCES))
def test_two_workers_make_full_batches_and_read_each_sample_once_per_pass(tmp_path, reads, name, source):
    path, keys = SOURCES[name, source](tmp_path / "data")
    assert len(keys) == SAMPLES
    with _task(name, source, path).build_loader(BATCH_SIZE, data_seed=4, workers=WORKERS, pin_memory=False) as loader:
        batches = [next(loader) for _ in range(4)]  # two of each worker: 6 samples each, a full pass of both
    for batch in batches:
        assert {key: tuple(batch[key].shape) for key in SHAPES[name]} == SHAPES[name]
    taken = reads()
    assert len(taken) == WORKERS and os.getpid() not in taken  # read in the two workers, not here
    first_passes = [worker_keys[:SAMPLES // WORKERS] for worker_keys in taken.values()]
    assert all(len(keys_of_pass) == SAMPLES // WORKERS for keys_of_pass in first_passes)
    assert sorted(first_passes[0] + first_passes[1]) == sorted(keys)  # every sample once, by one of the workers


def test_parts_of_the_shards_are_disjoint_and_cover_them_all(tmp_path, reads):
    for index, shard in enumerate(_image_shards(7, per_shard=2)):
        (tmp_path / f"shard-{index}.tar").write_bytes(shard)
    task = _task("cv", "webdataset", f"{tmp_path}/shard-{{0..6}}.tar")
    shards_of_part = []
    for part in range(3):
        with task.build_loader(2, data_seed=part, workers=0, pin_memory=False, part=(part, 3)) as loader:
            next(loader)  # in this process; the shuffle buffer takes the whole first pass of the part first
        keys = reads()[os.getpid()]
        reads_of_pass = len({key[:3] for key in keys}) * 2
        assert len(set(keys[:reads_of_pass])) == reads_of_pass  # each sample of the part once
        shards_of_part.append({int(key[:3]) for key in keys})
        (tmp_path / "reads.log").unlink()
    assert shards_of_part == [{0, 3, 6}, {1, 4}, {2, 5}]  # shard i belongs to part i % 3
    with pytest.raises(ValueError, match=r"only WebDataset shards"):
        _task("cv", "synthetic", None).build_loader(2, 0, workers=0, pin_memory=False, part=(1, 2))


def test_synthetic_workers_draw_streams_of_their_own_from_the_data_seed():
    task = _task("cv", "synthetic", None)

    def first_batches(workers: int) -> list[torch.Tensor]:
        with task.build_loader(4, data_seed=9, workers=workers, pin_memory=False) as loader:
            return [next(loader)["images"] for _ in range(2)]

    first, again = first_batches(WORKERS), first_batches(WORKERS)
    assert not torch.equal(first[0], first[1])  # worker 0's batch, then worker 1's
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    in_process = first_batches(0)
    assert torch.equal(in_process[0], first[0])  # worker 0 draws the stream build_data draws
    assert torch.equal(next(task.build_data(4, data_seed=9))["images"], first[0])


@pytest.mark.parametrize("name", ["cv", "nlp", "asr"])
def test_a_loader_without_workers_gives_the_batches_of_build_data(name):
    task = _task(name, "synthetic", None)
    with task.build_loader(4, data_seed=2, workers=0, pin_memory=False) as loader:
        from_loader = [next(loader) for _ in range(2)]
    in_loop = task.build_data(4, data_seed=2)
    for batch in from_loader:
        expected = next(in_loop)
        assert batch.keys() == expected.keys() and all(torch.equal(batch[key], expected[key]) for key in batch)


def test_timm_presets_augment_images_like_imagenet_training(image_folder):
    with _task("cv", "folder", str(image_folder), preset="resnet18").build_loader(
            2, data_seed=0, workers=WORKERS, pin_memory=False) as loader:
        batch = next(loader)
    assert batch["images"].shape == (2, 3, 224, 224) and torch.isfinite(batch["images"]).all()
    assert "RandomResizedCrop" in repr(_task("cv", "folder", str(image_folder), preset="resnet18")._train_transform)


@pytest.mark.parametrize("case", ["shard without labels", "undecodable audio", "empty text"])
def test_a_data_error_in_a_worker_arrives_with_its_own_message(tmp_path, audio_folder, case):
    if case == "shard without labels":
        (tmp_path / "unlabelled.tar").write_bytes(_tar([("x1", {"png": _png(32, 32, 0)})]))
        task, expected = _task("cv", "webdataset", str(tmp_path / "unlabelled.tar")), (
            f"webdataset shard '{tmp_path}/unlabelled.tar', sample 'x1': no .cls member (it has ['png']); expected "
            "the class index as text, e.g. 000123.cls")
    elif case == "undecodable audio":
        (audio_folder / "b.flac").write_bytes(b"this is not audio")
        task, expected = _task("asr", "folder", str(audio_folder)), f"{audio_folder}/b.flac: cannot decode audio ("
    else:
        (tmp_path / "empty.txt").write_text("")
        task, expected = _task("nlp", "folder", str(tmp_path / "empty.txt")), (
            f"text files '{tmp_path}/empty.txt': all 1 file(s) are empty; expected text")
    loader = task.build_loader(2, data_seed=0, workers=WORKERS, pin_memory=False)
    with pytest.raises(DataSourceError) as raised:
        for _ in range(4):  # the undecodable clip is one of two: a batch or two may come first
            next(loader)
    message = str(raised.value)
    assert message.startswith(expected)
    assert "\n" not in message and "Traceback" not in message and "worker process" not in message
    assert list(loader) == []  # the loader stopped its workers


def _worker_facts(_worker: int, _workers: int):
    death_signal = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death_signal))  # PR_GET_PDEATHSIG
    while True:
        yield {"pid": torch.tensor(os.getpid()), "death_signal": torch.tensor(death_signal.value),
               "ignores_sigint": torch.tensor(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)}


def test_workers_ignore_ctrl_c_and_die_with_their_parent():
    with BatchLoader(BatchStream(_worker_facts, "facts"), workers=WORKERS, pin_memory=False, data_seed=0) as loader:
        facts = [next(loader) for _ in range(WORKERS)]
        pids = {int(fact["pid"]) for fact in facts}
        assert len(pids) == WORKERS and os.getpid() not in pids
        assert all(fact["ignores_sigint"] and int(fact["death_signal"]) == signal.SIGTERM for fact in facts)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
        for pid in pids:  # still running (a dead worker would also make torch raise in this process)
            state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                         if line.startswith("State:"))
            assert "Z" not in state.split()[1], state
        later = {int(next(loader)["pid"]) for _ in range(4 * WORKERS)}  # more than the prefetched batches
        assert later == pids


def test_the_emulated_task_makes_its_batches_in_this_process():
    task = build_task(TaskConfig(name="emulated", preset="tiny"))
    with task.build_loader(8, data_seed=1, workers=WORKERS, pin_memory=True) as loader:
        assert loader.workers == 0
        assert next(loader)["targets"].shape == (8,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_pinned_batches_from_workers(image_folder):
    with _task("cv", "folder", str(image_folder)).build_loader(4, 0, workers=WORKERS, pin_memory=True) as loader:
        batch = next(loader)
    assert all(value.is_pinned() for value in batch.values())
