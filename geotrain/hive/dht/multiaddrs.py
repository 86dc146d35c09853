"""Checking libp2p addresses and peer ids as a user writes them (flags, config, initial peers files), before a
peer starts hivemind: a typo is then a config error (exit 2), not a swarm that cannot be reached (exit 3).
No torch, no hivemind."""

from __future__ import annotations

import ipaddress
import re

_BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_HOST_PROTOCOLS = {"ip4", "ip6", "dns", "dns4", "dns6"}
_MULTIHASH_IDENTITY, _MULTIHASH_SHA256 = 0x00, 0x12


def _base58_decode(text: str) -> bytes | None:
    number = 0
    for character in text:
        digit = _BASE58_ALPHABET.find(character)
        if digit < 0:
            return None
        number = number * 58 + digit
    leading_zeros = len(text) - len(text.lstrip("1"))
    return b"\0" * leading_zeros + number.to_bytes((number.bit_length() + 7) // 8, "big")


def peer_id_problem(peer_id: str) -> str | None:
    """Why ``peer_id`` is not a libp2p peer id (base58 of a sha256 or identity multihash), or None."""
    decoded = _base58_decode(peer_id)
    if decoded is None:
        return f"peer id {peer_id!r} is not base58"
    if len(decoded) < 3 or decoded[0] not in (_MULTIHASH_IDENTITY, _MULTIHASH_SHA256) or decoded[1] != len(decoded) - 2:
        return f"peer id {peer_id!r} is not a libp2p peer id"
    return None


def multiaddr_problem(address: str) -> str | None:
    """Why ``address`` cannot be dialled as /ip4|ip6|dns*/HOST/tcp/PORT/p2p/PEER_ID, or None.

    Checked here, before a peer starts its DHT daemon, so that a typo is a config error (exit 2)
    rather than a swarm that cannot be reached (exit 3).
    """
    parts = address.split("/")
    if len(parts) < 2 or parts[0] != "" or len(parts) % 2 == 0:
        return "a multiaddr is /PROTOCOL/VALUE pairs"
    pairs = list(zip(parts[1::2], parts[2::2]))
    protocols = [name for name, _ in pairs]
    for name, value in pairs:
        if name == "ip4":
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                return f"{value!r} is not an IPv4 address"
        elif name == "ip6":
            try:
                ipaddress.IPv6Address(value)
            except ValueError:
                return f"{value!r} is not an IPv6 address"
        elif name in ("dns", "dns4", "dns6"):
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
                return f"{value!r} is not a host name"
        elif name in ("tcp", "udp"):
            if not value.isdigit() or not 1 <= int(value) <= 65535:
                return f"{name} port {value!r} is not a port number 1-65535"
        elif name == "p2p":
            problem = peer_id_problem(value)
            if problem:
                return problem
    if not protocols or protocols[0] not in _HOST_PROTOCOLS:
        return "it does not start with a host (/ip4/, /ip6/ or /dns4/)"
    if "tcp" not in protocols:
        return "it has no /tcp/PORT"
    if protocols[-1] != "p2p":
        return "it does not end with /p2p/PEER_ID"
    return None


def split_peer_address(address: str) -> tuple[str, int, str]:
    """(host, TCP port, peer id) of an address that :func:`multiaddr_problem` accepts."""
    parts = address.split("/")
    values = dict(zip(parts[1::2], parts[2::2]))
    host = next(values[name] for name in ("ip4", "ip6", "dns", "dns4", "dns6") if name in values)
    return host, int(values["tcp"]), values["p2p"]
