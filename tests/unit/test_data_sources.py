"""Real data sources: image/text/audio folders and WebDataset shards, read from fixtures each test writes."""

from __future__ import annotations

import io
import itertools
import logging
import math
import pickle
import tarfile
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from geotrain.config import TaskConfig
from geotrain.tasks import build_task
from geotrain.tasks.data import DataSourceError, ShardStream, expand_braces, stream_shards


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _task(name: str, source: str, path: str, **data):
    return build_task(TaskConfig(name=name, preset="tiny", data={"source": source, "path": path, **data}))


def _png(width_px: int, height_px: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width_px, height_px), (shade, 255 - shade, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def _audio(duration_s: float, sample_rate_hz: int, pitch_hz: float, audio_format: str) -> bytes:
    time_s = np.arange(round(duration_s * sample_rate_hz)) / sample_rate_hz
    buffer = io.BytesIO()
    soundfile.write(buffer, 0.5 * np.sin(2 * math.pi * pitch_hz * time_s), sample_rate_hz, format=audio_format)
    return buffer.getvalue()


def _tar(samples: list[tuple[str, dict[str, bytes]]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for key, fields in samples:
            for extension, payload in fields.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def _labels(batches, count: int) -> list[int]:
    return [label for batch in itertools.islice(batches, count) for label in batch["labels"].tolist()]


# --------------------------------------------------------------------------------------------------- images

@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for label, class_name in enumerate(["ant", "bee", "cat"]):
        (root / class_name).mkdir(parents=True)
        for index in range(4):
            (root / class_name / f"{index}.png").write_bytes(_png(40 + 7 * index, 30 + 5 * label, 80 * label))
    return root


def test_image_folder_yields_full_batches_with_sorted_class_indices(image_folder):
    batches = _task("cv", "folder", str(image_folder)).build_data(batch_size=8, data_seed=0)
    batch = next(batches)
    assert batch["images"].shape == (8, 3, 32, 32) and batch["images"].dtype == torch.float32
    labels = _labels(batches, 3)  # 24 labels from 12 images: the folder is read pass after pass
    assert sorted(set(labels)) == [0, 1, 2]
    # the "cat" images are the reddest: class index 2 is the last folder name in sorted order
    red_minus_green = batch["images"][:, 0].mean(dim=(1, 2)) - batch["images"][:, 1].mean(dim=(1, 2))
    assert red_minus_green[batch["labels"] == 2].min() > red_minus_green[batch["labels"] == 0].max()


def test_image_folder_order_depends_on_the_data_seed(image_folder):
    task = _task("cv", "folder", str(image_folder))
    assert _labels(task.build_data(12, 0), 1) == _labels(task.build_data(12, 0), 1)
    assert _labels(task.build_data(12, 0), 1) != _labels(task.build_data(12, 1), 1)


def test_image_folder_errors_name_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataSourceError, match=r"empty.*no class sub-folders"):
        _task("cv", "folder", str(empty)).build_data(4, 0)
    with pytest.raises(DataSourceError, match=r"missing.*not a directory"):
        _task("cv", "folder", str(tmp_path / "missing")).build_data(4, 0)
    (empty / "cat").mkdir()
    (empty / "cat" / "notes.md").write_text("no images here")
    with pytest.raises(DataSourceError, match=r"no image files"):
        _task("cv", "folder", str(empty)).build_data(4, 0)
    many = tmp_path / "many"
    for index in range(11):  # the tiny preset has 10 classes
        (many / f"class{index}").mkdir(parents=True)
    with pytest.raises(DataSourceError, match=r"11 class sub-folders.*10 classes"):
        _task("cv", "folder", str(many)).build_data(4, 0)


# ----------------------------------------------------------------------------------------------------- text

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


@pytest.mark.parametrize("layout", ["file", "directory", "glob"])
def test_text_files_become_masked_sequences(tmp_path, layout):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(3):
        (corpus / f"part{index}.txt").write_text(f"document {index}: {TEXT}")
    (corpus / "README.md").write_text("not part of the corpus")
    path = {"file": corpus / "part0.txt", "directory": corpus, "glob": f"{corpus}/part*.txt"}[layout]
    task = _task("nlp", "folder", str(path))
    batch = next(task.build_data(batch_size=6, data_seed=0))
    assert batch["input_ids"].shape == batch["labels"].shape == (6, 64)
    originals = torch.where(batch["labels"] == -100, batch["input_ids"], batch["labels"])
    # built-in byte tokenizer: byte b is token 5 + b; lower ids are <s>, </s> and the like
    text = bytes(token - 5 for token in originals[0].tolist() if token >= 5).decode()
    assert "fox" in text  # 62 characters of any stretch of this corpus hold it
    model = task.build_model()
    assert torch.isfinite(task.loss(model, batch))


def test_text_sources_reject_missing_and_empty_paths(tmp_path):
    with pytest.raises(DataSourceError, match=r"nowhere.*no such file or directory"):
        _task("nlp", "folder", str(tmp_path / "nowhere")).build_data(2, 0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataSourceError, match=r"empty\.txt.*empty"):
        next(_task("nlp", "folder", str(tmp_path / "empty.txt")).build_data(2, 0))
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataSourceError, match=r"dir.*no \.txt files"):
        _task("nlp", "folder", str(tmp_path / "dir")).build_data(2, 0)


def test_a_tokenizer_json_sets_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer.train_from_iterator([TEXT, "pack my box with five dozen liquor jugs"] * 50, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(TEXT * 5)
    task = _task("nlp", "folder", str(tmp_path / "corpus.txt"), tokenizer_path=str(tmp_path / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    batch = next(task.build_data(4, 0))
    assert batch["input_ids"].max() < max(vocab_size, 261)
    assert (batch["input_ids"] == tokenizer.token_to_id("<mask>")).any()
    assert torch.isfinite(task.loss(task.build_model(), batch))
    # the synthetic source draws from the tokenizer's vocabulary too
    assert next(_task("nlp", "synthetic", None, tokenizer_path=str(tmp_path / "tokenizer.json")).build_data(2, 0))


def test_a_tokenizer_without_a_mask_token_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    task = _task("nlp", "synthetic", None, tokenizer_path=str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataSourceError, match=r"tokenizer\.json.*<mask>"):
        task.build_model()


# ---------------------------------------------------------------------------------------------------- audio

@pytest.fixture
def audio_folder(tmp_path: Path) -> Path:
    root = tmp_path / "clips"
    (root / "speaker1").mkdir(parents=True)
    (root / "speaker1" / "a.wav").write_bytes(_audio(0.5, 8_000, 440.0, "WAV"))  # resampled to 16 kHz
    (root / "speaker1" / "a.txt").write_text("Hello, World!\n")
    (root / "b.flac").write_bytes(_audio(1.0, 16_000, 880.0, "FLAC"))
    (root / "b.txt").write_text("it's  fine")
    return root


def test_audio_folder_yields_log_mel_batches_with_character_targets(audio_folder):
    task = _task("asr", "folder", str(audio_folder))
    batch = next(task.build_data(batch_size=4, data_seed=0))
    assert batch["features"].shape == (4, 40, 150)  # tiny: 40 Mel bins, 1.5 s window at 100 frames/s
    lengths = sorted(set(batch["feature_lengths"].tolist()))
    assert lengths == [51, 101]  # 0.5 s and 1.0 s of audio
    transcripts = {int(n): row[:n].tolist() for row, n in zip(batch["targets"], batch["target_lengths"])}
    from geotrain.tasks.speech import CHARACTERS

    decoded = {"".join(CHARACTERS[i - 1] for i in ids) for ids in transcripts.values()}
    assert decoded == {"hello world", "it's fine"}
    assert torch.isfinite(task.loss(task.build_model(), batch))


def test_audio_without_transcript_is_named(audio_folder):
    (audio_folder / "b.txt").unlink()
    with pytest.raises(DataSourceError, match=r"b\.flac.*no transcript.*b\.txt"):
        _task("asr", "folder", str(audio_folder)).build_data(2, 0)


def test_clips_longer_than_the_window_are_skipped(audio_folder, caplog):
    (audio_folder / "long.wav").write_bytes(_audio(2.0, 16_000, 300.0, "WAV"))
    (audio_folder / "long.txt").write_text("too long")
    with caplog.at_level(logging.WARNING):
        batch = next(_task("asr", "folder", str(audio_folder)).build_data(6, 0))
    assert batch["feature_lengths"].max() <= 150
    assert "longer than the 1.5 s window" in caplog.text


def test_undecodable_audio_is_named(audio_folder):
    (audio_folder / "b.flac").write_bytes(b"this is not audio")
    with pytest.raises(DataSourceError, match=r"b\.flac.*cannot decode audio"):
        next(_task("asr", "folder", str(audio_folder)).build_data(4, 0))


# ----------------------------------------------------------------------------------------------- webdataset

def _image_shards(count: int, per_shard: int = 5) -> list[bytes]:
    return [_tar([(f"{shard:03d}{index:03d}", {"png": _png(36, 36, 60 * (index % 3)), "cls": str(index % 3).encode()})
                  for index in range(per_shard)]) for shard in range(count)]


def test_webdataset_from_a_local_brace_pattern(tmp_path):
    for index, shard in enumerate(_image_shards(2)):
        (tmp_path / f"shard-{index:03d}.tar").write_bytes(shard)
    task = _task("cv", "webdataset", str(tmp_path / "shard-{000..001}.tar"))
    batch = next(task.build_data(batch_size=8, data_seed=0))
    assert batch["images"].shape == (8, 3, 32, 32)
    assert set(batch["labels"].tolist()) <= {0, 1, 2}
    assert _labels(task.build_data(10, 0), 2) != _labels(task.build_data(10, 1), 2)


def test_webdataset_from_file_and_memory_urls(tmp_path):
    (tmp_path / "shards").mkdir()
    memory_root = f"memory://geotrain-test-{uuid.uuid4().hex}"
    memory = fsspec.filesystem("memory")
    for index, shard in enumerate(_image_shards(3)):
        (tmp_path / "shards" / f"train-{index}.tar").write_bytes(shard)
        memory.pipe(f"{memory_root}/train-{index}.tar", shard)
    for path in (f"file://{tmp_path}/shards/train-{{0..2}}.tar", f"{memory_root}/train-*.tar", f"{memory_root}",
                 str(tmp_path / "shards")):
        batch = next(_task("cv", "webdataset", path).build_data(batch_size=16, data_seed=3))
        assert batch["images"].shape == (16, 3, 32, 32), path


def test_webdataset_text_and_audio_shards(tmp_path):
    text_shard = _tar([(f"doc{index}", {"txt": f"{index} {TEXT}".encode()}) for index in range(3)])
    (tmp_path / "text.tar").write_bytes(text_shard)
    batch = next(_task("nlp", "webdataset", str(tmp_path / "text.tar")).build_data(4, 0))
    assert batch["input_ids"].shape == (4, 64)

    audio_shard = _tar([("clip1", {"flac": _audio(0.4, 22_050, 500.0, "FLAC"), "txt": b"abc"}),
                        ("clip2", {"wav": _audio(0.8, 16_000, 700.0, "WAV"), "txt": b"de f"})])
    (tmp_path / "audio.tar").write_bytes(audio_shard)
    batch = next(_task("asr", "webdataset", f"file://{tmp_path}/audio.tar").build_data(3, 0))
    assert batch["features"].shape == (3, 40, 150)
    assert set(batch["target_lengths"].tolist()) == {3, 4}


def test_webdataset_errors_name_the_shard(tmp_path):
    (tmp_path / "broken.tar").write_bytes(b"definitely not a tar archive" * 40)
    with pytest.raises(DataSourceError, match=r"broken\.tar.*not a readable tar archive"):
        next(_task("cv", "webdataset", str(tmp_path / "broken.tar")).build_data(2, 0))
    with pytest.raises(DataSourceError, match=r"nosuch://bucket.*unknown URL scheme"):
        _task("cv", "webdataset", "nosuch://bucket/shard-0.tar").build_data(2, 0)
    with pytest.raises(DataSourceError, match=r"shard-000\.tar.*does not exist"):
        _task("cv", "webdataset", str(tmp_path / "shard-{000..003}.tar")).build_data(2, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSourceError, match=r"empty.*no WebDataset shards"):
        _task("cv", "webdataset", str(tmp_path / "empty")).build_data(2, 0)
    (tmp_path / "unlabelled.tar").write_bytes(_tar([("x1", {"png": _png(32, 32, 0)})]))
    with pytest.raises(DataSourceError, match=r"unlabelled\.tar.*x1.*no \.cls member"):
        next(_task("cv", "webdataset", str(tmp_path / "unlabelled.tar")).build_data(2, 0))
    (tmp_path / "silent.tar").write_bytes(_tar([("c1", {"wav": _audio(0.2, 16_000, 300.0, "WAV")})]))
    with pytest.raises(DataSourceError, match=r"silent\.tar.*c1.*no \.txt member"):
        next(_task("asr", "webdataset", str(tmp_path / "silent.tar")).build_data(2, 0))


def test_brace_patterns_expand_like_a_shell():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}/{8..10}") == ["a/8", "a/9", "a/10", "b/8", "b/9", "b/10"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_unexpandable_braces_are_named():
    with pytest.raises(DataSourceError, match=r"shard-\{x\}\.tar.*cannot expand \{x\}"):
        expand_braces("/data/shard-{x}.tar")
    with pytest.raises(DataSourceError, match=r"shard-\{0\.\.3\.tar.*unbalanced braces"):
        expand_braces("/data/shard-{0..3.tar")


# ------------------------------------------------------------------------- webdataset: peers and workers

def _numbered_shards(directory: Path, count: int, per_shard: int = 3) -> tuple[list[str], set[str]]:
    """``count`` text shards of ``per_shard`` samples each: their paths and every sample key."""
    directory.mkdir(exist_ok=True)
    urls = []
    for shard in range(count):
        path = directory / f"part-{shard:02d}.tar"
        path.write_bytes(_tar([(f"s{shard:02d}-{index}", {"txt": f"{shard} {index}".encode()})
                               for index in range(per_shard)]))
        urls.append(str(path))
    return urls, {f"s{shard:02d}-{index}" for shard in range(count) for index in range(per_shard)}


def _shard_number(sample) -> int:
    return int(Path(sample["__url__"]).stem.split("-")[1])


@pytest.mark.parametrize("peers, workers", [(1, 1), (1, 3), (2, 2), (3, 2), (4, 1)])
def test_peers_and_workers_read_every_sample_once_per_pass(tmp_path, monkeypatch, peers, workers):
    urls, expected = _numbered_shards(tmp_path, 7)
    for epoch in (0, 1):
        keys = []
        for peer in range(peers):
            stream = ShardStream(urls, data_seed=100 + peer, peer_index=peer, peer_count=peers)
            for worker in range(workers):
                # webdataset's split_by_worker reads these when no DataLoader worker is running
                monkeypatch.setenv("WORKER", str(worker))
                monkeypatch.setenv("NUM_WORKERS", str(workers))
                samples = list(stream.one_pass(epoch))
                assert all(_shard_number(sample) % peers == peer for sample in samples)  # shard i -> peer i % peers
                keys += [sample["__key__"] for sample in samples]
        assert len(keys) == len(expected) and set(keys) == expected


def test_a_dataloader_with_two_workers_reads_each_sample_once(tmp_path):
    urls, expected = _numbered_shards(tmp_path, 9)
    keys = []
    for peer in range(2):
        one_pass = ShardStream(urls, data_seed=peer, peer_index=peer, peer_count=2).one_pass(epoch=0)
        loader = torch.utils.data.DataLoader(one_pass, batch_size=None, num_workers=2)
        keys += [sample["__key__"] for sample in loader]
    assert len(keys) == len(expected) and set(keys) == expected

    # the endless stream: peer 0 of 2 has 5 shards; worker 0 reads 3 of them in each pass, worker 1 two
    stream = ShardStream(urls, data_seed=5, peer_index=0, peer_count=2, shuffle_buffer_samples=4)
    loader = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2))
    first = [sample["__key__"] for sample in itertools.islice(loader, 12)]  # in turn: 6 of each worker
    del loader
    assert len(set(first)) == 12 and {key[:3] for key in first} <= {"s00", "s02", "s04", "s06", "s08"}


def test_shard_streams_are_endless_and_reshuffled_every_pass(tmp_path):
    urls, expected = _numbered_shards(tmp_path, 4)
    stream = stream_shards(f"{tmp_path}/part-{{00..03}}.tar", data_seed=1, shuffle_buffer_samples=2)
    passes = [[sample["__key__"] for sample in itertools.islice(stream, 12)] for _ in range(3)]
    assert all(sorted(keys) == sorted(expected) for keys in passes)  # a pass reads every sample once
    assert len({tuple(keys) for keys in passes}) > 1
    again = stream_shards(f"{tmp_path}/part-*.tar", data_seed=1, shuffle_buffer_samples=2)
    assert [sample["__key__"] for sample in itertools.islice(again, 12)] == passes[0]
    other = stream_shards(str(tmp_path), data_seed=2, shuffle_buffer_samples=2)
    assert [sample["__key__"] for sample in itertools.islice(other, 12)] != passes[0]


def test_shard_streams_pickle_and_check_their_share(tmp_path, monkeypatch):
    urls, _ = _numbered_shards(tmp_path, 2)
    stream = ShardStream(urls, data_seed=0, peer_index=1, peer_count=2)
    copy = pickle.loads(pickle.dumps(stream))  # DataLoaders that spawn workers pickle the dataset
    assert [sample["__key__"] for sample in pickle.loads(pickle.dumps(copy.one_pass(0)))] != []
    with pytest.raises(DataSourceError, match=r"2 shard\(s\) cannot be split among 3 peers"):
        ShardStream(urls, data_seed=0, peer_index=2, peer_count=3)
    with pytest.raises(ValueError, match=r"peer_index"):
        ShardStream(urls, data_seed=0, peer_index=2, peer_count=2)
    monkeypatch.setenv("WORKER", "1")  # a worker without a shard ends instead of spinning over empty passes
    monkeypatch.setenv("NUM_WORKERS", "2")
    assert list(stream) == []


def test_a_corrupt_shard_among_good_ones_is_named(tmp_path):
    urls, _ = _numbered_shards(tmp_path, 3)
    # cut off inside a member's data: tarfile takes a cut between members for the end of the archive
    Path(urls[1]).write_bytes(_tar([("s01-0", {"txt": b"x" * 5000})])[:2000])
    with pytest.raises(DataSourceError, match=r"part-01\.tar.*not a readable tar archive"):
        list(ShardStream(urls, data_seed=0).one_pass(0))
    Path(urls[1]).unlink()
    with pytest.raises(DataSourceError, match=r"part-01\.tar.*does not exist"):
        list(ShardStream(urls, data_seed=0).one_pass(0))
