"""TCP ports on this machine: is one free to listen on, and which ones are free now.

Checked before anything starts, so that a taken port is a message naming the flag to change (exit 2),
not a daemon that fails half-way through joining the swarm.
"""

from __future__ import annotations

import errno
import socket

from geotrain.errors import UserError


class PortError(UserError):
    """This process cannot listen where it was told to (port in use, or not an address of this machine)."""


def ensure_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Raise :class:`PortError` naming ``flag`` if ``host:port`` cannot be bound (port 0 always can)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortError(
                    f"{what} port {port} on {host} is already in use (another peer or program listens there); "
                    f"choose another with {flag} or stop the other program") from None
            if error.errno == errno.EADDRNOTAVAIL:
                raise PortError(
                    f"{what} address {host} is not an address of this machine; use 0.0.0.0 to listen on all "
                    "interfaces and --announce-host for the public address") from None
            raise PortError(f"cannot listen on {host}:{port} for the {what}: {error.strerror}") from None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago (the kernel's choices for port 0)."""
    probes = []
    try:
        for _ in range(count):  # all held open at once, so the kernel cannot hand out one twice
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()
