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
    WebDataset tar shards, read by the ``webdataset`` library (its shard list, worker splitting, tar
    iteration and shuffle buffer) from streams that fsspec opens, so never unpacked to disk: a local path, a
    directory of ``*.tar``, a glob, a brace pattern (``/data/shard-{000..099}.tar``) or any fsspec URL
    (``file://``, ``s3://`` with s3fs installed, ``gs://``, ``memory://``...). Members are grouped into
    samples by the name before the first dot of their file name (``000123.jpg`` + ``000123.cls``):

    - cv: ``.jpg``/``.jpeg``/``.png``/``.webp`` image + ``.cls`` (the class index as text);
    - nlp: ``.txt``;
    - asr: ``.wav``/``.flac`` audio + ``.txt`` transcript.

    Every pass reads the shards in an order shuffled by ``data_seed`` and mixes samples through a
    shuffle buffer, so peers reading the same shards see different sequences. :class:`ShardStream` can
    also split the shards among peers (shard ``i`` to peer ``i % peer_count``) and among the workers of a
    ``torch.utils.data.DataLoader``, so that within a pass each sample is read once in all.

A user's mistake (missing folder, empty folder, missing transcript, unreadable shard, unknown URL
scheme) raises :class:`DataSourceError`, naming the path and what was expected.

Worker processes: a task's :meth:`~geotrain.tasks.base.Task.batch_stream` is a :class:`BatchStream`, an
``IterableDataset`` that reads, decodes, augments and collates whole batches where it is iterated: in the
calling process (``build_data``) or in each worker of a :class:`BatchLoader` (``build_loader``), a
``torch.utils.data.DataLoader`` with ``batch_size=None``. Each worker reads its own share: synthetic data a
stream seeded by ``data_seed`` and the worker's number; folders every ``workers``-th file of each pass's
shuffled order (:func:`worker_passes`); shards every ``workers``-th shard of the pass (:class:`ShardStream`).
A :class:`DataSourceError` raised in a worker reaches the caller as one, with its own message.
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import random
import re
import signal
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch.multiprocessing
import torch.utils.data
import webdataset as wds
from braceexpand import UnbalancedBracesError, braceexpand  # webdataset's own brace expansion, a dependency of it
from webdataset.tariterators import group_by_keys, tar_file_expander

from geotrain.errors import UserError
from geotrain.stopping.stopper import die_with_parent

Batch = dict[str, torch.Tensor]  # what a task's loss takes: named tensors, one row per sample

logger = logging.getLogger(__name__)

Sample = TypeVar("Sample")

# Samples held back to mix the order within shards; a few hundred decoded samples fit any peer's memory.
DEFAULT_SHUFFLE_BUFFER_SAMPLES = 256
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# Batches each DataLoader worker keeps ready (torch's default); they wait in shared memory (/dev/shm).
PREFETCH_BATCHES_PER_WORKER = 2


class DataSourceError(UserError):
    """The configured data cannot be read; the message names the path and what was expected."""


def epoch_rng(data_seed: int, epoch: int) -> random.Random:
    """The random stream of one pass over a source: equal for equal seeds in every process."""
    return random.Random(f"geotrain-data:{data_seed}:{epoch}")  # str seeds hash stably, unlike tuples


def derived_seed(data_seed: int, purpose: str) -> int:
    """A seed for one random stream of a pipeline: streams seeded alike would draw the same numbers."""
    return random.Random(f"geotrain-{purpose}:{data_seed}").getrandbits(63)


def worker_seed(data_seed: int, purpose: str, worker: int) -> int:
    """:func:`derived_seed` of DataLoader worker ``worker``: each worker draws a stream of its own.

    Worker 0 (and the calling process, which counts as worker 0 of 1) draws ``derived_seed``'s stream.
    """
    return derived_seed(data_seed, purpose if worker == 0 else f"{purpose}:worker{worker}")


def shuffle_buffer(samples: Iterable[Sample], buffer_size: int, rng: random.Random) -> Iterator[Sample]:
    """Samples in a locally shuffled order, holding at most ``buffer_size`` of them (webdataset's shuffle)."""
    return wds.shuffle(buffer_size, initial=buffer_size, rng=rng)(iter(samples))


def worker_share() -> tuple[int, int]:
    """(this worker's number, number of workers) inside a DataLoader worker; (0, 1) anywhere else."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def worker_passes(items: Sequence[Sample], data_seed: int, worker: int, workers: int,
                  description: str) -> Iterator[tuple[int, Sample]]:
    """(pass number, item): this worker's share of ``items``, pass after pass, endlessly.

    Every pass shuffles all of ``items`` by ``data_seed`` and the pass number (an order equal in every
    worker) and worker ``w`` of ``workers`` takes its items ``w``, ``w + workers``, ... So within a pass
    every item goes to one worker once. A worker left without an item (more workers than items) ends at
    once, with a warning; the DataLoader goes on with the others.
    """
    if worker >= len(items):
        logger.warning("%s: DataLoader worker %d of %d has none of its %d file(s) to read; use at most %d workers",
                       description, worker, workers, len(items), len(items))
        return
    for epoch in itertools.count():
        order = list(items)
        epoch_rng(data_seed, epoch).shuffle(order)
        for item in order[worker::workers]:
            yield epoch, item


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
    """``shard-{000..002}.tar`` -> shard-000.tar, shard-001.tar, shard-002.tar; ``{a,b}`` lists alternatives.

    The expansion is webdataset's own (the ``braceexpand`` package it requires), not ``expand_urls``: that
    also splits at ``::``, which would cut fsspec's chained URLs (``simplecache::s3://...``) in two.
    """
    expected = "a range like {000..099} or alternatives like {train,extra}"
    try:
        expanded = list(braceexpand(pattern))
    except UnbalancedBracesError:
        raise DataSourceError(f"task.data.path {pattern!r}: unbalanced braces; expected {expected}") from None
    for name in expanded:
        leftover = _BRACE.search(name)  # braceexpand leaves what it cannot expand, e.g. {foo}, as it is
        if leftover is not None:
            raise DataSourceError(f"task.data.path {pattern!r}: cannot expand {leftover.group(0)}; expected {expected}")
    return expanded


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


def split_by_peer(src: Iterable[Sample], peer_index: int, peer_count: int) -> Iterator[Sample]:
    """A webdataset nodesplitter for geotrain peers: item ``i`` of ``src`` goes to peer ``i % peer_count``.

    webdataset's own ``split_by_node`` takes the rank from ``torch.distributed`` or ``RANK``/``WORLD_SIZE``,
    which swarm peers do not have; here the caller says which peer it is.
    """
    if peer_count < 1 or not 0 <= peer_index < peer_count:
        raise ValueError(f"peer_index must be in 0..peer_count-1 and peer_count at least 1, got peer_index="
                         f"{peer_index}, peer_count={peer_count}")
    return itertools.islice(src, peer_index, None, peer_count)


def _raise_shard_error(error: Exception, url: str) -> bool:
    """webdataset error handler for one shard: every failure becomes a :class:`DataSourceError` naming it.

    webdataset appends context (stream, URL) to the ``args`` of an exception on its way out of each stage
    and hands it to the handler again, so one raised here can come back: its message is ``args[0]``.
    """
    if isinstance(error, DataSourceError):
        raise DataSourceError(error.args[0]) from None
    reason = str(error.args[0]).split(" @ ")[0] if error.args else type(error).__name__
    if isinstance(error, FileNotFoundError):
        raise DataSourceError(f"webdataset shard {url!r} does not exist; expected a tar shard there") from None
    if isinstance(error, (tarfile.TarError, EOFError, OSError)):
        raise DataSourceError(f"webdataset shard {url!r} is not a readable tar archive ({reason}); expected "
                              "WebDataset tar shards") from None
    raise DataSourceError(f"webdataset shard {url!r} cannot be read as WebDataset samples ({reason}); expected "
                          "members named KEY.EXTENSION, those of one sample next to each other") from None


def _read_shards(shards: Iterable[dict[str, str]]) -> Iterator[dict[str, bytes | str]]:
    """Pipeline stage: ``{"url": ...}`` -> the shard's samples, opened through fsspec and split by webdataset.

    Samples are ``{"__key__": key, "__url__": url, "jpg": b"...", "cls": b"3"}``: members are grouped by
    their name up to the first dot of the file name, so ``a/000123.seg.png`` belongs to sample ``a/000123``
    under the extension ``seg.png``; members of one sample must be adjacent, as WebDataset writers put them.
    """
    for shard in shards:
        url = shard["url"]
        handler = functools.partial(_raise_shard_error, url=url)
        filesystem, fs_path = _filesystem(url)
        try:
            stream = filesystem.open(fs_path, "rb")
        except Exception as error:  # noqa: BLE001 - whatever the filesystem raises, the message names the shard
            handler(error)  # raises
            raise
        with stream:
            files = tar_file_expander([{**shard, "stream": stream}], handler=handler)
            yield from group_by_keys(files, handler=handler)


def _shuffle_buffer_stage(samples: Iterator[Sample], buffer_samples: int, data_seed: int,
                          epoch: int) -> Iterator[Sample]:
    """Pipeline stage: webdataset's shuffle buffer, seeded per pass and per DataLoader worker."""
    worker = wds.utils.pytorch_worker_info()[2]
    return shuffle_buffer(samples, buffer_samples, random.Random(f"geotrain-buffer:{data_seed}:{epoch}:{worker}"))


class ShardStream(torch.utils.data.IterableDataset):
    """One peer's share of WebDataset shards, read pass after pass, endlessly; a torch ``IterableDataset``.

    Shard ``i`` of ``urls`` (as :func:`resolve_shards` lists them) belongs to peer ``i % peer_count``.
    Every pass shuffles this peer's shards by ``data_seed`` and the pass number (an order equal in all of
    the peer's processes); in a ``torch.utils.data.DataLoader`` with workers, each worker then reads every
    ``num_workers``-th shard of that order (webdataset's ``split_by_worker``). So within one pass every sample of the dataset is read
    once, by one worker of one peer. Samples are mixed through a shuffle buffer of ``shuffle_buffer_samples``.

    A worker left without a shard (more workers than the peer has shards) ends at once, with a warning; the
    DataLoader goes on with the others. The object pickles, for DataLoaders that spawn their workers.
    """

    def __init__(self, urls: list[str], data_seed: int, *, peer_index: int = 0, peer_count: int = 1,
                 shuffle_buffer_samples: int = DEFAULT_SHUFFLE_BUFFER_SAMPLES, source: str | None = None) -> None:
        super().__init__()
        self.source = source if source is not None else (urls[0] if len(urls) == 1 else f"{len(urls)} shards")
        self.peer_urls = list(split_by_peer(list(urls), peer_index, peer_count))
        if not self.peer_urls:
            raise DataSourceError(f"webdataset shards {self.source!r}: {len(urls)} shard(s) cannot be split among "
                                  f"{peer_count} peers; expected at least one shard per peer")
        self.data_seed = data_seed
        self.peer_index, self.peer_count = peer_index, peer_count
        self.shuffle_buffer_samples = shuffle_buffer_samples

    def one_pass(self, epoch: int) -> wds.DataPipeline:
        """A ``webdataset.DataPipeline`` (an ``IterableDataset``) of pass ``epoch`` over this peer's shards."""
        order_seed = epoch_rng(self.data_seed, epoch).getrandbits(63)  # the same in every worker of this peer
        stages = [wds.SimpleShardList(self.peer_urls, seed=order_seed), wds.split_by_worker,
                  _read_shards]
        if self.shuffle_buffer_samples > 1:
            stages.append(wds.pipelinefilter(_shuffle_buffer_stage)(self.shuffle_buffer_samples, self.data_seed, epoch))
        return wds.DataPipeline(*stages)

    def __iter__(self) -> Iterator[dict[str, bytes | str]]:
        _, _, worker, num_workers = wds.utils.pytorch_worker_info()
        if worker >= len(self.peer_urls):
            logger.warning("webdataset shards %s: DataLoader worker %d of %d has none of this peer's %d shard(s) to "
                           "read; use at most %d workers", self.source, worker, num_workers, len(self.peer_urls),
                           len(self.peer_urls))
            return
        for epoch in itertools.count():
            produced = False
            for sample in self.one_pass(epoch):
                produced = True
                yield sample
            if not produced:  # without this check shards without samples would spin forever
                raise DataSourceError(f"webdataset shards {self.source!r}: a full pass over them produced no samples")


def open_shards(path: str, data_seed: int, part: tuple[int, int] = (0, 1)) -> ShardStream:
    """Part ``part`` = (I, N) of the shards at ``path`` (``task.data.part``), checked now, read when iterated."""
    peer_index, peer_count = part
    return ShardStream(resolve_shards(path), data_seed, peer_index=peer_index, peer_count=peer_count, source=path)


def stream_shards(path: str, data_seed: int, shuffle_buffer_samples: int = DEFAULT_SHUFFLE_BUFFER_SAMPLES, *,
                  peer_index: int = 0, peer_count: int = 1) -> Iterator[dict[str, bytes | str]]:
    """Endless raw samples of the shards at ``path`` (this peer's share of them; see :class:`ShardStream`)."""
    stream = ShardStream(resolve_shards(path), data_seed, peer_index=peer_index, peer_count=peer_count,
                         shuffle_buffer_samples=shuffle_buffer_samples, source=path)
    return iter(stream)


def require_field(sample: dict[str, bytes | str], extensions: tuple[str, ...], expected: str) -> tuple[str, bytes]:
    """The first of ``extensions`` present in a WebDataset sample, as (extension, bytes)."""
    for extension in extensions:
        if extension in sample:
            return extension, sample[extension]  # type: ignore[return-value]
    present = sorted(name for name in sample if not name.startswith("__"))
    raise DataSourceError(f"webdataset shard {sample['__url__']!r}, sample {sample['__key__']!r}: no "
                          f"{'/'.join('.' + e for e in extensions)} member (it has {present}); expected {expected}")


# ----------------------------------------------------------------------------------- batches and workers

class _WorkerFailure:
    """What a worker sends instead of a batch when its source fails with a user's mistake.

    torch re-raises a worker's exception in the caller with the worker's traceback folded into the
    message ("Caught DataSourceError in DataLoader worker process 0. Original Traceback ..."); a user
    should see only what is wrong with the data, so the worker sends the message and the caller raises.
    """

    def __init__(self, error_type: type[UserError], message: str) -> None:
        self.error_type, self.message = error_type, message


class BatchStream(torch.utils.data.IterableDataset):
    """Endless whole batches, read, decoded and collated wherever this is iterated.

    ``make_batches(worker, workers)`` gives the batches of worker ``worker`` of ``workers`` (0 of 1 outside
    a DataLoader worker); a task passes a bound method with its prepared source (file list, shard stream),
    so the stream pickles when the task does. Iterated in the calling process, errors propagate as they
    are; in a worker, a :class:`~geotrain.errors.UserError` such as :class:`DataSourceError` ends the
    worker and travels to the caller as a message (see :class:`BatchLoader`).
    """

    def __init__(self, make_batches: Callable[[int, int], Iterator[Batch]], description: str) -> None:
        super().__init__()
        self.make_batches = make_batches
        self.description = description

    def __iter__(self) -> Iterator[Batch]:
        worker, workers = worker_share()
        if torch.utils.data.get_worker_info() is None:
            yield from self.make_batches(worker, workers)
            return
        try:
            yield from self.make_batches(worker, workers)
        except UserError as error:
            yield _WorkerFailure(type(error), str(error))  # type: ignore[misc]


def init_worker(_worker_id: int) -> None:
    """``worker_init_fn`` of every loader: Ctrl-C is the main process's to handle, and a worker dies with it.

    Batches go to the trainer as file descriptors (torch's default on Linux). hivemind switches the whole
    process to the ``file_system`` strategy when it is imported, which starts a ``torch_shm_manager`` daemon
    per worker; those outlive the worker and the trainer, so workers set their own strategy back.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")


class BatchLoader:
    """Endless batches of a :class:`BatchStream` from a ``torch.utils.data.DataLoader``; ``close()`` stops it.

    ``workers`` > 0: that many persistent worker processes (the platform's default start method, fork on
    Linux), started here, each keeping :data:`PREFETCH_BATCHES_PER_WORKER` batches ready; batches arrive
    from the workers in turn. 0: batches are made in the calling process when asked for. ``pin_memory``:
    batches come in page-locked memory, for faster and asynchronous copies to a GPU. Worker seeds (Python,
    NumPy and torch, which augmentations draw from) derive from ``data_seed``.
    """

    def __init__(self, stream: BatchStream, *, workers: int, pin_memory: bool, data_seed: int) -> None:
        if workers < 0:
            raise ValueError(f"workers must be at least 0, got {workers}")
        options = {}
        if workers > 0:
            options = {"persistent_workers": True, "prefetch_factor": PREFETCH_BATCHES_PER_WORKER,
                       "worker_init_fn": init_worker}
        self.description = stream.description
        self.workers = workers
        self._loader: torch.utils.data.DataLoader | None = torch.utils.data.DataLoader(
            stream, batch_size=None, num_workers=workers, pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(derived_seed(data_seed, "loader")), **options)
        self._iterator = iter(self._loader)  # starts the workers now, so that they read ahead

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> Batch:
        if self._loader is None:
            raise StopIteration
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.close()
            raise DataSourceError(f"{self.description}: every DataLoader worker stopped reading (the log says "
                                  "why); expected batches without end") from None
        except BaseException:
            self.close()
            raise
        if isinstance(batch, _WorkerFailure):
            self.close()
            raise batch.error_type(batch.message) from None
        return batch

    def close(self) -> None:
        """Stop the workers (at once, not when the garbage collector finds the loader); idempotent."""
        loader, iterator = self._loader, self._iterator
        self._loader = self._iterator = None
        if loader is None:
            return
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own clean stop of its workers
        if shutdown is not None:
            shutdown()
        loader._iterator = None  # the loader keeps persistent workers' iterator

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
