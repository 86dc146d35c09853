"""A peer's identity: the private key file behind its libp2p peer id (``--identity``, ``geotrain identity``).

A private swarm's allow-list (``swarm.allow``) names peers by these ids, so a peer that should be admitted
needs a key file that persists across restarts of its VM.
"""

from __future__ import annotations

from pathlib import Path

from hivemind.p2p import P2P, PeerID

from geotrain.errors import UserError


class IdentityError(UserError):
    """The key file cannot be read, written or parsed."""


def peer_id_of(path: Path, create: bool = False) -> str:
    """The base58 peer id of the key in ``path``; with ``create``, a new key is written there first if missing."""
    path = Path(path)
    if create and not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            P2P.generate_identity(str(path))  # an RSA key in libp2p's format, readable by its owner only
        except OSError as error:
            raise IdentityError(f"cannot write the key file {path}: {error.strerror or error}") from None
    try:
        data = path.read_bytes()
    except OSError as error:
        raise IdentityError(f"cannot read the key file {path}: {error.strerror or error}") from None
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception:
        raise IdentityError(f"{path} is not a peer's key file (expected one made by `geotrain identity` or "
                            "--identity)") from None
