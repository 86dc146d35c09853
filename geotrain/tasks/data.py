"""Where samples come from: file listing, WebDataset shard streaming, shuffling and batching.

The domain modules turn these raw samples into tensors; this module knows nothing of images, text
or audio. ``task.data.source`` selects one of three sources:

``synthetic`` (default)
    Generated on the fly from one fixed, learnable distribution per task; ``data_seed`` only picks
    which samples a peer draws. Needs no files; good for demos, tests and throughput measurements.

``folder`` with ``path``
    Local files, read in an order shuffled by ``data_seed`` and re-shuffled every pass:

    - cv: an image folder, one sub-folder per class (``path/cat/1.jpg``, ``path/dog/2.png``); the class
      index is the position of the sub-folder's name in sorted order. Images are resized (shorter side)
      and centre-cropped to the preset's image size.
    - nlp: text, as one file, a directory (every ``*.txt`` below it) or a glob (``/corpus/*.txt``).
    - asr: a directory of ``.wav``/``.flac`` files (searched recursively), each with its transcript in a
      same-named ``.txt`` next to it (``clips/a1.wav`` + ``clips/a1.txt``): the same layout as an
      unpacked WebDataset shard. Audio is mixed to mono and resampled to 16 kHz.

``webdataset`` with ``path``
    WebDataset tar shards, streamed (never unpacked to disk) with fsspec: a local path, a directory of
    ``*.tar``, a glob, a brace pattern (``/data/shard-{000..099}.tar``) or any fsspec URL (``file://``,
    ``s3://`` with s3fs installed, ``gs://``, ``memory://``...). Members are grouped into samples by the
    name before the first dot of their file name (``000123.jpg`` + ``000123.cls``):

    - cv: ``.jpg``/``.jpeg``/``.png``/``.webp`` image + ``.cls`` (the class index as text);
    - nlp: ``.txt``;
    - asr: ``.wav``/``.flac`` audio + ``.txt`` transcript.

    Every pass reads the shards in an order shuffled by ``data_seed`` and mixes samples through a
    shuffle buffer, so peers reading the same shards see different sequences.

A user's mistake (missing folder, empty folder, missing transcript, unreadable shard, unknown URL
scheme) raises :class:`DataSourceError`, naming the path and what was expected.
"""

from __future__ import annotations

import glob
import itertools
import random
import re
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

from geotrain.errors import UserError
from geotrain.tasks.base import Batch

Sample = TypeVar("Sample")

# Samples held back to mix the order within shards; a few hundred decoded samples fit any peer's memory.
DEFAULT_SHUFFLE_BUFFER_SAMPLES = 256
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class DataSourceError(UserError):
    """The configured data cannot be read; the message names the path and what was expected."""


def epoch_rng(data_seed: int, epoch: int) -> random.Random:
    """The random stream of one pass over a source: equal for equal seeds in every process."""
    return random.Random(f"geotrain-data:{data_seed}:{epoch}")  # str seeds hash stably, unlike tuples


def derived_seed(data_seed: int, purpose: str) -> int:
    """A seed for one random stream of a pipeline: streams seeded alike would draw the same numbers."""
    return random.Random(f"geotrain-{purpose}:{data_seed}").getrandbits(63)


def cycle_passes(make_pass: Callable[[random.Random], Iterable[Sample]], data_seed: int,
                 description: str) -> Iterator[Sample]:
    """Endless samples: pass after pass over a source, each pass with its own shuffling stream."""
    for epoch in itertools.count():
        produced = False
        for sample in make_pass(epoch_rng(data_seed, epoch)):
            produced = True
            yield sample
        if not produced:  # without this check an unusable source would spin forever
            raise DataSourceError(f"{description}: a full pass over it produced no samples")


def shuffle_buffer(samples: Iterable[Sample], buffer_size: int, rng: random.Random) -> Iterator[Sample]:
    """Samples in a locally shuffled order, holding at most ``buffer_size`` of them."""
    buffer: list[Sample] = []
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = sample
    rng.shuffle(buffer)
    yield from buffer


def batches(samples: Iterator[Sample], batch_size: int, collate: Callable[[list[Sample]], Batch]) -> Iterator[Batch]:
    """Full batches of ``batch_size`` samples, each collated into a :data:`Batch`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    while True:
        group = list(itertools.islice(samples, batch_size))
        if len(group) < batch_size:
            return  # only finite sample streams end; every source here is endless
        yield collate(group)


def list_files(path: str, suffixes: tuple[str, ...], expected: str) -> list[Path]:
    """Files named by ``path``: one file, a directory (searched recursively for ``suffixes``) or a glob."""
    local = Path(path).expanduser()
    if glob.has_magic(path):
        files = sorted(Path(name) for name in glob.glob(str(local), recursive=True) if Path(name).is_file())
    elif local.is_dir():
        files = sorted(file for file in local.rglob("*") if file.is_file() and file.name.lower().endswith(suffixes))
    elif local.is_file():
        files = [local]
    else:
        raise DataSourceError(f"task.data.path {path!r}: no such file or directory; expected {expected}")
    if not files:
        raise DataSourceError(f"task.data.path {path!r}: no {'/'.join(suffixes)} files found; expected {expected}")
    return files


# ---------------------------------------------------------------------------------------------- WebDataset

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``shard-{000..002}.tar`` -> shard-000.tar, shard-001.tar, shard-002.tar; ``{a,b}`` lists alternatives."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    numeric_range = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric_range:
        first, last = numeric_range.groups()
        # zero padding follows the first bound, as in shell brace expansion: {000..099} keeps 3 digits
        options = [str(number).zfill(len(first)) for number in range(int(first), int(last) + 1)]
    elif "," in body:
        options = body.split(",")
    else:
        raise DataSourceError(f"task.data.path {pattern!r}: cannot expand {{{body}}}; expected a range like "
                              "{000..099} or alternatives like {train,extra}")
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [expanded for option in options for expanded in expand_braces(head + option + tail)]


def _filesystem(url: str):
    import fsspec.core

    try:
        return fsspec.core.url_to_fs(url)
    except ValueError as error:  # fsspec: "Protocol not known: ..."
        scheme = url.split("://", 1)[0]
        raise DataSourceError(f"task.data.path {url!r}: unknown URL scheme {scheme + '://'!r} ({error}); expected "
                              "a local path or an fsspec URL such as file://, s3://, gs://, memory://") from None
    except ImportError as error:  # a known scheme whose filesystem package is missing, e.g. s3fs
        raise DataSourceError(f"task.data.path {url!r}: this URL scheme needs a package that is not installed "
                              f"({error})") from None


def resolve_shards(path: str) -> list[str]:
    """The shard URLs that ``path`` names (brace pattern, glob, directory, single shard or list of shards).

    Only the first shard is checked for existence here: on object storage each check is a request, and a
    run over thousands of shards should not wait for all of them. A shard that is missing later fails
    when it is read, with its URL in the message.
    """
    patterns = expand_braces(path)
    if len(patterns) > 1:
        urls = patterns
        filesystem, first_path = _filesystem(urls[0])
    else:
        filesystem, fs_path = _filesystem(path)
        if glob.has_magic(fs_path):
            urls = [filesystem.unstrip_protocol(name) for name in sorted(filesystem.glob(fs_path))]
        elif filesystem.isdir(fs_path):
            urls = [filesystem.unstrip_protocol(name) for name in sorted(filesystem.find(fs_path))
                    if name.endswith(SHARD_SUFFIXES)]
        else:
            urls = [path]
        if not urls:
            raise DataSourceError(f"task.data.path {path!r}: no WebDataset shards (*.tar) found there; expected "
                                  "a shard, a directory or pattern of shards, e.g. /data/shard-{000..009}.tar")
        filesystem, first_path = _filesystem(urls[0])
    if not filesystem.exists(first_path):
        raise DataSourceError(f"task.data.path {path!r}: shard {urls[0]!r} does not exist; expected WebDataset "
                              "tar shards at that path")
    return urls


def read_shard(url: str) -> Iterator[dict[str, bytes | str]]:
    """Samples of one tar shard, streamed: ``{"__key__": key, "__url__": url, "jpg": b"...", "cls": b"3"}``.

    Members are grouped by their name up to the first dot of the file name, so ``a/000123.seg.png``
    belongs to sample ``a/000123`` under the extension ``seg.png``; members of one sample must be
    adjacent, as WebDataset writers put them.
    """
    import fsspec

    sample: dict[str, bytes | str] | None = None
    try:
        with fsspec.open(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|*") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                directory, _, file_name = member.name.rpartition("/")
                stem, dot, extension = file_name.partition(".")
                if not stem or not dot:
                    continue  # hidden files and files without an extension belong to no sample
                key = f"{directory}/{stem}" if directory else stem
                if sample is not None and sample["__key__"] != key:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key, "__url__": url}
                sample[extension.lower()] = archive.extractfile(member).read()
    except FileNotFoundError:
        raise DataSourceError(f"webdataset shard {url!r} does not exist; expected a tar shard there") from None
    except (tarfile.TarError, EOFError, OSError) as error:
        raise DataSourceError(f"webdataset shard {url!r} is not a readable tar archive ({error}); expected "
                              "WebDataset tar shards") from None
    if sample is not None:
        yield sample


def stream_shards(path: str, data_seed: int,
                  shuffle_buffer_samples: int = DEFAULT_SHUFFLE_BUFFER_SAMPLES) -> Iterator[dict[str, bytes | str]]:
    """Endless raw samples of the shards at ``path``: shard order and sample order shuffled by ``data_seed``."""
    urls = resolve_shards(path)

    def one_pass(rng: random.Random) -> Iterator[dict[str, bytes | str]]:
        order = list(urls)
        rng.shuffle(order)
        samples = itertools.chain.from_iterable(read_shard(url) for url in order)
        return shuffle_buffer(samples, shuffle_buffer_samples, rng)

    return cycle_passes(one_pass, data_seed, f"webdataset shards {path!r}")


def require_field(sample: dict[str, bytes | str], extensions: tuple[str, ...], expected: str) -> tuple[str, bytes]:
    """The first of ``extensions`` present in a WebDataset sample, as (extension, bytes)."""
    for extension in extensions:
        if extension in sample:
            return extension, sample[extension]  # type: ignore[return-value]
    present = sorted(name for name in sample if not name.startswith("__"))
    raise DataSourceError(f"webdataset shard {sample['__url__']!r}, sample {sample['__key__']!r}: no "
                          f"{'/'.join('.' + e for e in extensions)} member (it has {present}); expected {expected}")
