"""Measured swarm traffic of one peer: the kernel's TCP byte counters of its libp2p daemon's sockets.

A peer's swarm traffic (DHT look-ups, gradient all-reduce, state downloads) all goes through the
``p2pd`` daemon that hivemind starts for it. The kernel counts, for every TCP connection, the bytes
sent (retransmissions included: what a cloud bills as egress) and received; ``ss -tinp`` lists them
with the process that owns the socket. Sampled every few seconds, per remote ``ip:port``, these give
what the peer sent to whom, with no estimate from the model size. The remote address is mapped to a
region with the addresses the other peers publish in their metric records (libp2p dials out from its
listen port, so a connection's remote port is the other peer's listen port).

Bytes of a connection that closes between two samples are counted up to the last sample; libp2p
keeps its connections open, so little is lost. Where ``ss`` (iproute2) is missing, the meter says so
once and the byte metrics stay at zero.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

from geotrain.stopping.processes import descendants

logger = logging.getLogger(__name__)

SS_TIMEOUT_S = 5.0
_USERS = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_acked|bytes_received):(\d+)")


def normalise_address(address: str) -> str:
    """``ss`` prints ``[::ffff:10.0.0.1]:4000`` or ``10.0.0.1:4000``; return ``10.0.0.1:4000``."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    return f"{host}:{port}"


@dataclass
class Connection:
    local: str
    remote: str
    pid: int
    sent_bytes: int
    received_bytes: int


def parse_ss(output: str) -> list[Connection]:
    """Connections from ``ss -tinpH`` output: a socket line, then an indented line of TCP info."""
    connections = []
    current: list[str] | None = None
    for line in output.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            current = line.split()
            continue
        if current is None:
            continue
        pids = _USERS.findall(" ".join(current[4:]))
        counters = dict(_COUNTER.findall(line))
        sent = int(counters.get("bytes_sent", counters.get("bytes_acked", 0)))
        # with a state filter ss drops the State column: Recv-Q Send-Q Local Peer Process
        local, remote = (current[2], current[3]) if current[0].isdigit() else (current[3], current[4])
        for pid in pids:
            connections.append(Connection(normalise_address(local), normalise_address(remote), int(pid), sent,
                                          int(counters.get("bytes_received", 0))))
        current = None
    return connections


@dataclass
class TrafficTotals:
    """Bytes since the meter started, by remote ``ip:port``."""

    sent_by_remote: dict[str, int] = field(default_factory=dict)
    received_by_remote: dict[str, int] = field(default_factory=dict)

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent_by_remote.values())

    @property
    def received_bytes(self) -> int:
        return sum(self.received_by_remote.values())


class TrafficMeter:
    """Cumulative TCP bytes of the ``p2pd`` processes below ``root_pid`` (this peer).

    A connection's bytes are read while it is open; one that closes between two samples keeps the bytes of
    the last sample that saw it. :meth:`start_sampling` samples in the background, so what a connection
    carries just before it closes (a final state that the other peer downloads, then hangs up) is lost for
    at most one period, not for the time between two publications of the peer's record.
    """

    def __init__(self, root_pid: int, daemon_name: str = "p2pd"):
        self.root_pid = root_pid
        self.daemon_name = daemon_name
        self._ss = shutil.which("ss")
        self._open: dict[tuple[str, str], tuple[int, int]] = {}
        self._closed = TrafficTotals()
        self._warned = False
        self._lock = threading.Lock()  # the background sampler and a caller's sample()
        self._stop_sampling = threading.Event()
        if self._ss is None:
            logger.warning("'ss' (iproute2) is not installed: this peer's sent and received bytes are not measured")

    def _daemon_pids(self) -> set[int]:
        pids = set()
        for pid in descendants(self.root_pid):
            try:
                with open(f"/proc/{pid}/comm") as handle:
                    if handle.read().strip() == self.daemon_name:
                        pids.add(pid)
            except OSError:
                continue
        return pids

    def sample(self) -> TrafficTotals:
        with self._lock:
            if self._ss is not None:
                self._update()
            totals = TrafficTotals(dict(self._closed.sent_by_remote), dict(self._closed.received_by_remote))
            for (_local, remote), (sent, received) in self._open.items():
                totals.sent_by_remote[remote] = totals.sent_by_remote.get(remote, 0) + sent
                totals.received_by_remote[remote] = totals.received_by_remote.get(remote, 0) + received
        return totals

    def start_sampling(self, period_s: float) -> None:
        """Sample every ``period_s`` in a daemon thread until :meth:`stop_sampling`."""
        def sample_until_stopped():
            while not self._stop_sampling.wait(period_s):
                try:
                    self.sample()
                except Exception as error:  # (ss vanished, /proc raced): the next period tries again
                    logger.debug("traffic not sampled: %s", error)

        if self._ss is not None:
            threading.Thread(target=sample_until_stopped, name="traffic-sampler", daemon=True).start()

    def stop_sampling(self) -> None:
        self._stop_sampling.set()

    def _update(self) -> None:
        pids = self._daemon_pids()
        if not pids:
            return
        try:
            output = subprocess.run([self._ss, "-tinpH", "state", "established"], capture_output=True, text=True,
                                    timeout=SS_TIMEOUT_S, check=True).stdout
        except (OSError, subprocess.SubprocessError) as error:
            if not self._warned:
                logger.warning("could not read TCP counters with ss (%s); traffic metrics pause", error)
                self._warned = True
            return
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        for connection in parse_ss(output):
            if connection.pid in pids:
                seen[(connection.local, connection.remote)] = (connection.sent_bytes, connection.received_bytes)
        for key, (sent, received) in self._open.items():
            now = seen.get(key)
            if now is None or now[0] < sent or now[1] < received:  # closed, or a new connection on the same ports
                self._add_closed(key[1], sent, received)
        self._open = seen

    def _add_closed(self, remote: str, sent: int, received: int) -> None:
        self._closed.sent_by_remote[remote] = self._closed.sent_by_remote.get(remote, 0) + sent
        self._closed.received_by_remote[remote] = self._closed.received_by_remote.get(remote, 0) + received

