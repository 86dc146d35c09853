"""A peer's identity: the private key file behind its libp2p peer id (``--identity``, ``geotrain identity``).

A private swarm's allow-list (``swarm.allow``) names peers by these ids, so a peer that should be admitted
needs a key file that persists across restarts of its VM.

``geotrain peer`` and ``geotrain coordinator`` check their key file with :func:`check_identity_file` before the
DHT starts: hivemind would otherwise hand a corrupt or unreadable file to its daemon and fail half-way through
joining (exit 3, which a restart loop retries forever) with its parser's words.
"""

from __future__ import annotations

import os
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from geotrain.errors import UserError


class IdentityError(UserError):
    """The key file cannot be read, written or parsed."""


_REPLACE = ("delete it to make a new key (a new peer id: update the allow-lists and join addresses that name the "
            "old one), or put this peer's own key file there")


def peer_id_of(path: Path, create: bool = False, label: str | None = None) -> str:
    """The base58 peer id of the key in ``path``; with ``create``, a new key is written there first if missing.
    ``label`` names the file in messages (default: its path), e.g. ``--identity PATH``."""
    path = Path(path)
    label = label or str(path)
    if path.is_dir():
        raise IdentityError(f"{label} is a directory, expected a key file; give a file's path, e.g. "
                            f"{path / 'identity.key'} (a new key is made there if it is missing)")
    if create and not path.exists():
        _directory_for_new_key(path, label)
        try:
            P2P.generate_identity(str(path))  # an RSA key in libp2p's format, readable by its owner only
        except OSError as error:
            raise IdentityError(f"cannot write the key file {label}: {error.strerror or error}; give a path in a "
                                "directory this user can write") from None
    try:
        data = path.read_bytes()
    except OSError as error:
        if _blocking_file(path) is not None:
            _directory_for_new_key(path, label)  # raises: a file stands where a directory should be
        raise IdentityError(f"cannot read the key file {label}: {error.strerror or error}; make it readable by "
                            "this user (it is written readable by its owner only), or give another path") from None
    if not data:
        raise IdentityError(f"{label} is empty, not a peer's key file; {_REPLACE}")
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception:
        raise IdentityError(f"{label} is not a peer's key file (expected a private key made by `geotrain identity` "
                            f"or --identity); {_REPLACE}") from None


def check_identity_file(path: Path, label: str | None = None) -> None:
    """Refuse, with what to do, a key file that hivemind could not use (exit 2), before the DHT starts.

    A missing file is not an error: its directory is made here and hivemind writes a new key into it when the
    DHT starts (as it did before this check). An existing file must hold a key that ``geotrain identity``
    reads: :func:`peer_id_of` runs the same check.
    """
    path = Path(path)
    label = label or str(path)
    if not path.exists() and not path.is_symlink():
        _directory_for_new_key(path, label)
        return
    peer_id_of(path, label=label)


def _blocking_file(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a directory (``a-file.txt`` in
    ``a-file.txt/id.key``), else None."""
    for ancestor in path.parents:
        if ancestor.exists():
            return None if ancestor.is_dir() else ancestor
    return None


def _directory_for_new_key(path: Path, label: str) -> None:
    """Make the directory a new key file goes into, or say why it cannot be made or written."""
    blocking = _blocking_file(path)
    if blocking is not None:
        raise IdentityError(f"{label}: {blocking} is a file, not a directory; give a key file's path in a directory "
                            "(a new key is made there if it is missing)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise IdentityError(f"{label}: cannot make the directory {path.parent} for a new key "
                            f"({error.strerror or error}); give a path in a directory this user can write") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise IdentityError(f"{label}: cannot write a new key in {path.parent} (permission denied); give a path in "
                            "a directory this user can write, or make the key there with `geotrain identity PATH` "
                            "as a user who can")
