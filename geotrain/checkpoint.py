"""Atomic, verified, versioned checkpoints of the training state, optionally mirrored to object storage.

The coordinator writes one checkpoint whenever it has fetched a newer state from the swarm, and reads the
newest one back when it starts::

    store = CheckpointStore(Path("geotrain-state/checkpoints"), keep=3,
                            mirror_url="s3://my-bucket/run1", config_yaml=config.to_yaml())
    info = store.save({"model": ..., "optimizer": ..., "epoch": 12}, epoch=12, samples_seen=49152)
    restored = store.load_latest()          # None on a fresh run
    if restored is not None:
        state, info = restored

What a caller can rely on:

- **A checkpoint exists only once its manifest exists.** A save writes the data file
  (``checkpoint-000007.pt``) under a temporary name, fsyncs it, renames it into place and fsyncs the
  directory; only then does it write the manifest (``checkpoint-000007.json``) the same way. A VM killed
  at any moment leaves either the previous checkpoints or the new one, never a half checkpoint that looks
  whole. Temporary files and data files without a manifest are ignored by every reader and removed by the
  next store's first save.
- **Every load is verified.** The manifest records the data file's size and sha256; ``load_latest`` walks
  the manifests newest first and skips, with a warning that names the file and the reason, any whose data
  file is missing, truncated, corrupt or unreadable, or whose manifest is not valid JSON.
- **Retention never removes the newest checkpoint.** After each save only the newest ``keep`` versions
  stay; the one just written, whose checksum was computed from the bytes on disk, is always among them. A
  manifest is removed before its data file, so no manifest ever points to a removed file.
- **Loading runs no code from the file.** Files are read with ``torch.load(weights_only=True)``, so a
  checkpoint from a shared bucket can hold tensors but not a pickled program. ``save`` therefore accepts
  only what that can read back (tensors, numbers, strings, bytes, None, torch dtypes/devices/sizes, and
  lists, tuples, sets and dicts of these) and names the offending key before it writes anything.
- **Mirror** (``mirror_url``, any fsspec URL; ``s3://`` needs ``pip install 'geotrain[s3]'``, ``gs://``
  ``geotrain[gcs]``, ``az://`` ``geotrain[azure]``; see :data:`MIRROR_EXTRAS`): after the local save
  the data object is uploaded under its final name and its remote size checked, then the manifest is
  uploaded last: object stores have no rename, so the manifest is what makes a remote checkpoint exist.
  The mirror keeps the same ``keep`` versions. A failed upload is logged and the local checkpoint stays;
  the next save uploads again. When the local directory holds no valid checkpoint (a new VM with an
  empty disk), ``load_latest`` downloads the newest one from the mirror that verifies.

Pass credentials and a custom endpoint (MinIO, Ceph, R2, a test server) through ``storage_options``, e.g.
``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "key": ..., "secret": ...}``; without them
s3fs finds credentials the way boto3 does (environment, ``~/.aws``, the instance's role), and the endpoint
from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. A mirror whose driver is not installed, an unknown
protocol, a URL without a bucket, or storage options that are not a mapping raise
:class:`~geotrain.errors.UserError` when the store is built, before anything is read or written; a mirror
that cannot be reached shows only when it is first used (see ``save`` and ``load_latest``).

One store writes to a directory (and a mirror URL) at a time: the coordinator. Any number of other stores
may read the same directory meanwhile (``list``, ``load_latest``, e.g. a test or an operator's script): a
store changes files only when it saves, or when it restores into an empty directory from the mirror.
Version numbers continue from the highest found locally or on the mirror, so a coordinator restarted on a
new VM never reuses one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from geotrain.errors import OperatorError, UserError

logger = logging.getLogger(__name__)

CRASH_BEFORE_RENAME_ENV = "GEOTRAIN_CRASH_BEFORE_RENAME"
CRASH_EXIT_CODE = 86
MANIFEST_FORMAT = "geotrain-checkpoint/1"
HASH_CHUNK_BYTES = 8 << 20

_MANIFEST_NAME = re.compile(r"^checkpoint-(\d+)\.json$")
_DATA_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
# temporaries start with a dot so that no glob for checkpoints ever matches one
_TEMPORARY_NAME = re.compile(r"^\.checkpoint-\d+\.(pt|json)\.tmp$")

# what torch.load(weights_only=True) reads back; anything else is refused by save (see _check_loadable)
# exact types, not isinstance: numpy.float64 is a float and a namedtuple a tuple, yet torch refuses both
_LEAF_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_MAPPING_TYPES = (dict, OrderedDict)
_SEQUENCE_TYPES = (list, tuple, set)

# mirror URL protocol -> (the extra of setup.cfg that installs its fsspec driver, the driver's package/module)
MIRROR_EXTRAS = {
    "s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
    "az": ("azure", "adlfs"), "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"), "adl": ("azure", "adlfs"),
}
_MIRROR_EXAMPLES = ("s3://bucket/run (pip install 'geotrain[s3]'), gs://bucket/run (pip install 'geotrain[gcs]'), "
                    "az://container/run (pip install 'geotrain[azure]') or a local path")
# a URL that is only a protocol, such as "s3://"
_PROTOCOL_ONLY = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/*$")


@dataclass(frozen=True)
class CheckpointInfo:
    version: int  # increasing 1, 2, 3 ... per store
    epoch: int
    samples_seen: int
    sha256: str  # of the data file's bytes
    size_bytes: int
    created_unix_s: float
    config_sha256: str  # of the config YAML text the checkpoint belongs to
    path: str  # the data file on the local disk (one restored from the mirror is downloaded there first)
    config_yaml: str = ""  # the config the checkpoint belongs to, as the coordinator that wrote it resolved it


class CheckpointError(OperatorError):
    """A checkpoint that fails to verify, or a mirror that cannot be read; the message says which and why."""


def data_file_name(version: int) -> str:
    return f"checkpoint-{version:06d}.pt"


def manifest_name(version: int) -> str:
    return f"checkpoint-{version:06d}.json"


def _sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    # a rename is durable only once the directory entry itself reaches the disk
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _write_atomically(final_path: Path, write, crash_hook: bool = False) -> None:
    """Write through ``write(file)`` into a temporary beside ``final_path``, fsync, rename, fsync the directory."""
    temporary = final_path.with_name(f".{final_path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if crash_hook and os.environ.get(CRASH_BEFORE_RENAME_ENV) == "1":
            os._exit(CRASH_EXIT_CODE)  # test hook: the coordinator killed between write and rename
        os.rename(temporary, final_path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    _fsync_directory(final_path.parent)


def _check_loadable(value: Any, where: str = "state") -> None:
    """Refuse, before writing, what ``torch.load(weights_only=True)`` would refuse at restore time."""
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{where} is a {type(value).__qualname__}, a tensor subclass that a checkpoint cannot "
                            "restore safely; store a plain tensor instead (e.g. tensor.detach().cpu())")
        return
    if type(value) in _LEAF_TYPES:
        return
    if type(value) in _MAPPING_TYPES:
        for key, item in value.items():
            if type(key) not in _LEAF_TYPES:
                raise TypeError(f"{where} has a key of type {type(key).__qualname__}; expected str or int keys")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    if type(value) in _SEQUENCE_TYPES:
        for index, item in enumerate(value):
            _check_loadable(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds only tensors, "
        "numbers, strings, bytes, None, torch dtypes/devices/sizes and lists, tuples, sets and dicts of these, "
        "because it is loaded with torch.load(weights_only=True) so that a file cannot run code; "
        "convert it first (e.g. float(x), x.tolist(), torch.from_numpy(x))")


def _parse_manifest(text: bytes | str, version: int, where: str) -> dict[str, Any]:
    """The manifest's fields, checked; raises CheckpointError naming ``where`` and what is wrong."""
    try:
        manifest = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{where}: manifest is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{where}: not a geotrain checkpoint manifest "
                              f"(expected \"format\": \"{MANIFEST_FORMAT}\")")
    expected_types = {"version": int, "epoch": int, "samples_seen": int, "sha256": str, "size_bytes": int,
                      "created_unix_s": (int, float), "config_sha256": str, "config_yaml": str, "data_file": str}
    for key, expected_type in expected_types.items():
        if not isinstance(manifest.get(key), expected_type) or isinstance(manifest.get(key), bool):
            raise CheckpointError(f"{where}: manifest field {key!r} is missing or has the wrong type")
    if manifest["version"] != version:
        raise CheckpointError(f"{where}: manifest says version {manifest['version']}, its name says {version}")
    # the data file name comes from a file that may have been downloaded: never let it point elsewhere
    if manifest["data_file"] != data_file_name(version):
        raise CheckpointError(f"{where}: manifest names data file {manifest['data_file']!r}, "
                              f"expected {data_file_name(version)!r}")
    return manifest


def _info_from_manifest(manifest: dict[str, Any], path: str) -> CheckpointInfo:
    return CheckpointInfo(version=manifest["version"], epoch=manifest["epoch"], samples_seen=manifest["samples_seen"],
                          sha256=manifest["sha256"], size_bytes=manifest["size_bytes"],
                          created_unix_s=float(manifest["created_unix_s"]), config_sha256=manifest["config_sha256"],
                          path=path, config_yaml=str(manifest.get("config_yaml", "")))


def _verify_data_file(path: Path, manifest: dict[str, Any], where: str) -> None:
    """Raise CheckpointError unless ``path`` has the manifest's size and sha256; ``where`` names it in messages."""
    try:
        size_bytes = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{where}: data file is missing") from None
    expected_size_bytes = manifest["size_bytes"]
    if size_bytes < expected_size_bytes:
        raise CheckpointError(f"{where}: truncated: {size_bytes} of {expected_size_bytes} bytes")
    if size_bytes > expected_size_bytes:
        raise CheckpointError(f"{where}: wrong size: {size_bytes} bytes, expected {expected_size_bytes}")
    sha256 = _sha256_of_file(path)
    if sha256 != manifest["sha256"]:
        raise CheckpointError(f"{where}: checksum mismatch: expected {manifest['sha256']}, got {sha256}")


def _missing_driver_message(url: str, protocol: str) -> str:
    extra, package = MIRROR_EXTRAS[protocol]
    return f"checkpoint mirror {url} needs the {package} package: pip install 'geotrain[{extra}]'"


def _check_storage_options(url: str, storage_options) -> None:
    """Refuse options that no fsspec driver could take; drivers check their values only on first use."""
    if not isinstance(storage_options, Mapping):
        raise UserError(f"checkpoint mirror {url}: storage options must be a mapping of option names to values, "
                        "e.g. {key: ..., secret: ..., client_kwargs: {endpoint_url: https://...}}; got "
                        f"{type(storage_options).__name__} {storage_options!r:.80}")
    for name, value in storage_options.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"checkpoint mirror {url}: storage option names must be words such as key, secret, "
                            f"client_kwargs; got {name!r}")
        # client_kwargs, config_kwargs, s3_additional_kwargs ...: fsspec drivers pass these on as keyword arguments
        if name.endswith("_kwargs") and value is not None and not isinstance(value, Mapping):
            raise UserError(f"checkpoint mirror {url}: storage option {name} must be a mapping, e.g. "
                            f"{{endpoint_url: https://...}}; got {type(value).__name__} {value!r:.80}")


class CheckpointStore:
    """Atomic, versioned checkpoints in a local directory, optionally mirrored to an fsspec URL (s3://bucket/run).

    :param directory: where checkpoints live on this VM; created if missing. Use a durable disk.
    :param keep: how many of the newest versions to keep, locally and on the mirror (at least 1).
    :param mirror_url: fsspec URL of a "folder" to mirror to, e.g. ``s3://bucket/run1``; None keeps them local.
    :param config_yaml: the resolved config the state belongs to; stored in every manifest with its sha256,
        so that a checkpoint says which run and settings produced it.
    :param storage_options: passed to the fsspec filesystem of ``mirror_url`` (credentials, endpoint).
    :raises geotrain.errors.UserError: for a mirror that cannot be opened (driver not installed, unknown
        protocol, no bucket, storage options that are not a mapping); nothing is written before.
    """

    def __init__(self, directory: Path, keep: int = 3, mirror_url: str | None = None,
                 config_yaml: str = "", storage_options: dict | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never removed), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.config_yaml = config_yaml
        self.config_sha256 = hashlib.sha256(config_yaml.encode()).hexdigest()
        self.mirror_url = mirror_url.rstrip("/") if mirror_url else None
        self._mirror_fs = None
        self._mirror_root = ""
        # the highest version seen on the mirror, so that a store on a fresh disk never reuses a number
        self._mirror_highest_version: int | None = None
        self._mirror_numbering_asked = False
        self._leftovers_removed = False
        if self.mirror_url:
            # the URL as given: "s3://" must be refused, not read as a local folder "s3:" once stripped
            self._mirror_fs, self._mirror_root = self._open_mirror(
                mirror_url, {} if storage_options is None else storage_options)
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _open_mirror(url: str, storage_options) -> tuple[Any, str]:
        """The mirror's fsspec filesystem and root; raises UserError for what the user must fix.

        Nothing is contacted here (fsspec drivers connect on first use), so a wrong endpoint or credentials
        show at the first listing or upload, with the driver's message.
        """
        _check_storage_options(url, storage_options)
        parts = url.split("::")  # fsspec chains, e.g. simplecache::s3://bucket/run
        if _PROTOCOL_ONLY.match(parts[-1]):
            raise UserError(f"checkpoint mirror {url}: names no bucket or folder; expected e.g. "
                            f"{_MIRROR_EXAMPLES}")
        for part in parts:
            protocol = fsspec.utils.get_protocol(part)
            extra = MIRROR_EXTRAS.get(protocol)
            if extra is not None and importlib.util.find_spec(extra[1]) is None:
                raise UserError(_missing_driver_message(url, protocol))
            if protocol not in fsspec.available_protocols() and protocol not in fsspec.registry:
                raise UserError(f"checkpoint mirror {url}: unknown storage protocol {protocol}://; expected "
                                f"{_MIRROR_EXAMPLES}, or another protocol of fsspec with its package installed")
        try:
            filesystem, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as error:
            # the driver is there but does not import (a dependency missing or of the wrong version)
            protocol = next((p for p in map(fsspec.utils.get_protocol, parts) if p in MIRROR_EXTRAS), None)
            reason = str(error) if error.__cause__ is None else f"{error}: {error.__cause__}"
            if protocol is not None:
                raise UserError(f"{_missing_driver_message(url, protocol)} (importing it failed: {reason})") from None
            raise UserError(f"checkpoint mirror {url}: its fsspec driver is not installed or does not import "
                            f"({reason})") from None
        except (ValueError, TypeError) as error:
            raise UserError(f"checkpoint mirror {url}: cannot open it with the storage options "
                            f"{sorted(storage_options)}: {error}") from None
        return filesystem, root.rstrip("/")

    def _remove_leftovers(self) -> None:
        """A crash mid-save leaves temporaries, or a data file whose manifest was never written: neither is a
        checkpoint, and left behind they would hold disk space forever. Only the writer may do this, at its
        first save: a store that merely reads could otherwise delete the files of a save in progress."""
        manifest_versions = self._local_versions()
        for path in self.directory.iterdir():
            data_match = _DATA_NAME.match(path.name)
            if _TEMPORARY_NAME.match(path.name) or (data_match and int(data_match.group(1)) not in manifest_versions):
                logger.info("removing %s, left by an interrupted save", path)
                _remove_quietly(path)

    def _local_versions(self) -> list[int]:
        versions = [int(match.group(1)) for path in self.directory.iterdir()
                    if (match := _MANIFEST_NAME.match(path.name))]
        return sorted(versions, reverse=True)

    # ---------------------------------------------------------------- saving

    def save(self, state: dict, epoch: int, samples_seen: int) -> CheckpointInfo:
        """Write ``state`` as the next version, durably, then mirror it; returns the local checkpoint's info.

        Raises TypeError (before writing anything) for a state that could not be loaded back, and OSError
        when the local disk fails; a mirror that fails is logged, not raised.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
        if epoch < 0 or samples_seen < 0:
            raise ValueError(f"epoch and samples_seen must be >= 0, got epoch={epoch}, samples_seen={samples_seen}")
        _check_loadable(state)
        if not self._leftovers_removed:
            self._remove_leftovers()
            self._leftovers_removed = True
        if self._mirror_fs is not None and not self._mirror_numbering_asked:
            # once per store, so that a fresh disk continues the mirror's numbering; not on every save, since
            # a mirror that is down would delay each local write by its timeouts
            self._mirror_numbering_asked = True
            self._mirror_versions_or_none()
        highest_local = max(self._local_versions(), default=0)
        version = max(highest_local, self._mirror_highest_version or 0) + 1

        data_path = self.directory / data_file_name(version)
        _write_atomically(data_path, lambda file: torch.save(state, file), crash_hook=True)
        # hashed from the file, not from memory: the checksum vouches for the bytes that are on disk
        sha256 = _sha256_of_file(data_path)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": version,
            "epoch": int(epoch),
            "samples_seen": int(samples_seen),
            "sha256": sha256,
            "size_bytes": data_path.stat().st_size,
            "created_unix_s": time.time(),
            "config_sha256": self.config_sha256,
            "config_yaml": self.config_yaml,
            "data_file": data_path.name,
        }
        manifest_bytes = (json.dumps(manifest, indent=2) + "\n").encode()
        _write_atomically(self.directory / manifest_name(version), lambda file: file.write(manifest_bytes))
        info = _info_from_manifest(manifest, str(data_path))
        logger.debug("checkpoint %d written to %s (%d bytes)", version, data_path, info.size_bytes)

        self._apply_retention_locally()
        if self._mirror_fs is not None:
            self._mirror(info, manifest_bytes)
        return info

    def _apply_retention_locally(self) -> None:
        for version in self._local_versions()[self.keep:]:
            # the manifest goes first: a manifest must never point to a data file that is gone
            _remove_quietly(self.directory / manifest_name(version))
            _remove_quietly(self.directory / data_file_name(version))

    # ---------------------------------------------------------------- mirror

    def _remote(self, name: str) -> str:
        return f"{self._mirror_root}/{name}"

    def _url(self, name: str) -> str:
        return f"{self.mirror_url}/{name}"

    def _mirror_listing(self) -> tuple[list[int], list[int]]:
        """Versions with a manifest, and versions with a data object, on the mirror, newest first."""
        filesystem = self._mirror_fs
        filesystem.invalidate_cache(self._mirror_root)  # another coordinator may have written since we looked
        try:
            names = [posixpath.basename(entry.rstrip("/")) for entry in filesystem.ls(self._mirror_root, detail=False)]
        except FileNotFoundError:
            names = []  # nothing uploaded under this prefix yet
        manifest_versions = sorted((int(match.group(1)) for name in names if (match := _MANIFEST_NAME.match(name))),
                                   reverse=True)
        data_versions = sorted((int(match.group(1)) for name in names if (match := _DATA_NAME.match(name))),
                               reverse=True)
        return manifest_versions, data_versions

    def _mirror_versions(self) -> list[int]:
        """Versions with a manifest on the mirror, newest first; raises what the filesystem raises."""
        versions, _ = self._mirror_listing()
        if versions:
            self._mirror_highest_version = max(versions[0], self._mirror_highest_version or 0)
        elif self._mirror_highest_version is None:
            self._mirror_highest_version = 0
        return versions

    def _mirror_versions_or_none(self) -> list[int] | None:
        try:
            return self._mirror_versions()
        except Exception as error:  # any driver error (network, credentials); the local save goes on
            logger.warning("cannot list the checkpoint mirror %s (%s: %s); numbering from the local directory",
                           self.mirror_url, type(error).__name__, error)
            return None

    def _mirror(self, info: CheckpointInfo, manifest_bytes: bytes) -> None:
        filesystem = self._mirror_fs
        data_name, manifest_file_name = data_file_name(info.version), manifest_name(info.version)
        try:
            remote_versions = self._mirror_versions()
            if remote_versions and remote_versions[0] >= info.version:
                # two histories must not mix: retention would keep the other one's newer versions and drop ours
                logger.error("not mirroring checkpoint %d: %s already holds version %d, written by another store; "
                             "the next save continues after it", info.version, self.mirror_url, remote_versions[0])
                return
            if isinstance(filesystem, LocalFileSystem):
                # a mounted disk needs its folder; object stores have none, and s3fs's makedirs would even
                # create a missing bucket, so it is called only here
                filesystem.makedirs(self._mirror_root, exist_ok=True)
            filesystem.put_file(info.path, self._remote(data_name))
            filesystem.invalidate_cache(self._remote(data_name))
            remote_size_bytes = filesystem.info(self._remote(data_name))["size"]
            if remote_size_bytes != info.size_bytes:
                raise CheckpointError(f"{self._url(data_name)} holds {remote_size_bytes} bytes after the upload, "
                                      f"expected {info.size_bytes}")
            # uploaded last: object stores have no rename, so the manifest's existence is the commit
            filesystem.pipe_file(self._remote(manifest_file_name), manifest_bytes)
            logger.info("checkpoint %d mirrored to %s", info.version, self._url(data_name))
            manifest_versions, data_versions = self._mirror_listing()
            kept = set(manifest_versions[:self.keep])
            for version in manifest_versions[self.keep:]:
                # the manifest goes first: a manifest must never point to a data object that is gone
                filesystem.rm(self._remote(manifest_name(version)))
            for version in data_versions:
                # also the data objects of uploads that failed before their manifest, older than ours
                if version not in kept and version < info.version:
                    filesystem.rm(self._remote(data_file_name(version)))
        except Exception as error:  # any driver error: the mirror is a second copy, the local one is safe
            logger.error("could not mirror checkpoint %d to %s (%s: %s); the local copy %s is intact and the next "
                         "save uploads again; check the bucket, the credentials and the network",
                         info.version, self.mirror_url, type(error).__name__, error, info.path)

    # ---------------------------------------------------------------- loading

    def list(self) -> list[CheckpointInfo]:
        """The local checkpoints, newest first, as their manifests describe them (data files not verified)."""
        infos = []
        for version in self._local_versions():
            path = self.directory / manifest_name(version)
            try:
                manifest = _parse_manifest(path.read_bytes(), version, str(path))
            except (OSError, CheckpointError):
                continue  # load_latest reports unreadable manifests; a listing just leaves them out
            infos.append(_info_from_manifest(manifest, str(self.directory / manifest["data_file"])))
        return infos

    def load_latest(self, map_location="cpu") -> tuple[dict, CheckpointInfo] | None:
        """The newest checkpoint that verifies, as ``(state, info)``; None when there is none anywhere.

        Local checkpoints come first; the mirror is read only when none of them verifies. Raises
        CheckpointError when no local checkpoint verifies and the mirror cannot be listed, since an
        unreachable mirror must not look like a fresh run.
        """
        local_versions = self._local_versions()
        for version in local_versions:
            loaded = self._load_local(version, map_location)
            if loaded is not None:
                return loaded
        if local_versions:
            logger.warning("none of the %d checkpoints in %s verifies", len(local_versions), self.directory)
        if self._mirror_fs is None:
            return None
        return self._load_from_mirror(map_location)

    def _load_local(self, version: int, map_location) -> tuple[dict, CheckpointInfo] | None:
        manifest_path = self.directory / manifest_name(version)
        try:
            manifest = _parse_manifest(manifest_path.read_bytes(), version, str(manifest_path))
            data_path = self.directory / manifest["data_file"]
            _verify_data_file(data_path, manifest, str(data_path))
            state = self._deserialize(data_path, map_location)
        except (OSError, CheckpointError) as error:
            logger.warning("skipping checkpoint %d: %s; trying the previous one", version, error)
            return None
        return state, _info_from_manifest(manifest, str(data_path))

    @staticmethod
    def _deserialize(data_path: Path, map_location) -> dict:
        try:
            state = torch.load(data_path, map_location=map_location, weights_only=True)
        except Exception as error:  # torch raises many types for a damaged or foreign file
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise CheckpointError(f"{data_path}: cannot be deserialized "
                                  f"({type(error).__name__}: {first_line})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{data_path}: holds a {type(state).__qualname__}, expected a dict")
        return state

    def _load_from_mirror(self, map_location) -> tuple[dict, CheckpointInfo] | None:
        try:
            remote_versions = self._mirror_versions()
        except Exception as error:  # any driver error; reported as one message the operator can act on
            raise CheckpointError(
                f"no valid checkpoint in {self.directory}, and the mirror {self.mirror_url} cannot be listed "
                f"({type(error).__name__}: {error}); check the endpoint, the credentials and the network, "
                "or start without a mirror to begin a fresh run") from None
        if not remote_versions:
            return None
        logger.info("no valid local checkpoint in %s; looking in the mirror %s", self.directory, self.mirror_url)
        for version in remote_versions:
            try:
                loaded = self._download_and_load(version, map_location)
            except CheckpointError as error:
                logger.warning("skipping mirrored checkpoint %d: %s; trying the previous one", version, error)
                continue
            except Exception as error:  # a driver error while reading one object; an older one may still work
                logger.warning("skipping mirrored checkpoint %d: cannot read it from %s (%s: %s); "
                               "trying the previous one", version, self.mirror_url, type(error).__name__, error)
                continue
            logger.info("restored checkpoint %d from the mirror %s into %s", version, self.mirror_url, self.directory)
            return loaded
        return None

    def _download_and_load(self, version: int, map_location) -> tuple[dict, CheckpointInfo]:
        filesystem = self._mirror_fs
        manifest_bytes = filesystem.cat_file(self._remote(manifest_name(version)))
        manifest = _parse_manifest(manifest_bytes, version, self._url(manifest_name(version)))
        data_path = self.directory / manifest["data_file"]
        temporary = data_path.with_name(f".{data_path.name}.tmp")
        try:
            filesystem.get_file(self._remote(manifest["data_file"]), str(temporary))
            with open(temporary, "rb") as file:
                os.fsync(file.fileno())
            _verify_data_file(temporary, manifest, self._url(manifest["data_file"]))
            os.rename(temporary, data_path)
        finally:
            _remove_quietly(temporary)
        _fsync_directory(self.directory)
        try:
            state = self._deserialize(data_path, map_location)
        except CheckpointError:
            _remove_quietly(data_path)
            raise
        # the manifest last, as in save: the local copy becomes a checkpoint only once it is whole
        _write_atomically(self.directory / manifest_name(version), lambda file: file.write(manifest_bytes))
        return state, _info_from_manifest(manifest, str(data_path))
