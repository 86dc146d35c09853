"""The lab's delay line: a userspace program that holds each packet for its region pair's latency.

The kernel here has no ``netem`` qdisc, so delay is added in userspace. Every packet that leaves a
region reaches the lab's hub namespace, where policy routing sends it into a TUN device; this relay
reads it there, looks up the pair (source region, destination region) from the third octet of the
addresses (region i owns 10.77.i.0/24), and writes it back to the TUN device when it is due. The
kernel then forwards it to the destination region.

Each direction of each pair is a link with a rate and a drop-tail queue: a packet starts "on the
wire" when the previous one of that direction has finished, takes ``size / bandwidth`` to send, and
arrives ``latency`` after that. A packet that would wait in the queue longer than the queue's depth
(one round trip at the link's rate, at least ``MIN_QUEUE_S``) is dropped, as a router's full buffer
would, so TCP finds the link's rate instead of filling an endless queue.

A region behind NAT (``nat: true`` in the topology) has its packets translated here too, before their delay, as
its NAT gateway would (geotrain.lab.nat): outbound ones get the gateway's address, and unsolicited inbound ones
are dropped.

Started by ``geotrain lab up`` inside the hub namespace::

    ip netns exec gtlab-hub python -m geotrain.lab.relay --config /run/geotrain/gtlab.relay.json

One Python thread serves every pair: it reads all waiting packets at once (``os.read`` on the
non-blocking TUN fd), keeps them in a heap ordered by due time and sleeps in ``select`` until the
next one is due. docs/lab.md gives the rate it sustains on this machine kind.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time
from pathlib import Path

from geotrain.lab.nat import NatGateway

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536
SUBNET_PREFIX = bytes((10, 77))  # 10.77.<region index>.x
MIN_QUEUE_S = 0.02
STATS_EVERY_S = 2.0


class Pipe:
    """One direction of one region pair: a rate, a propagation delay and a bounded queue."""

    __slots__ = ("latency_s", "seconds_per_byte", "queue_s", "free_at", "packets", "bytes", "drops")

    def __init__(self, latency_ms: float, bandwidth_mbit_s: float, queue_s: float | None = None):
        self.latency_s = latency_ms / 1000.0
        self.seconds_per_byte = 8.0 / (bandwidth_mbit_s * 1e6)
        # one round trip of buffering lets a single TCP stream fill the link (the classic BDP rule)
        self.queue_s = queue_s if queue_s is not None else max(MIN_QUEUE_S, 2 * self.latency_s)
        self.free_at = 0.0
        self.packets = 0
        self.bytes = 0
        self.drops = 0


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device ``name`` of this namespace; raw IP packets, no header."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def build_pipes(links: list[dict]) -> dict[tuple[int, int], Pipe]:
    """``links``: [{"a": 1, "b": 2, "latency_ms": .., "bandwidth_mbit_s": ..}] -> a Pipe per direction."""
    pipes = {}
    for link in links:
        for source, destination in ((link["a"], link["b"]), (link["b"], link["a"])):
            pipes[(source, destination)] = Pipe(link["latency_ms"], link["bandwidth_mbit_s"])
    return pipes


def write_stats(path: Path | None, pipes: dict[tuple[int, int], Pipe], started: float,
                gateways: dict[int, NatGateway] | None = None) -> None:
    if path is None:
        return
    stats = {"uptime_s": time.monotonic() - started,
             "pipes": {f"{a}->{b}": {"packets": p.packets, "bytes": p.bytes, "drops": p.drops}
                       for (a, b), p in pipes.items()},
             "nat": {str(index): {"translated": gateway.translated, "dropped": gateway.dropped}
                     for index, gateway in (gateways or {}).items()}}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(stats))
    temporary.replace(path)


def translate(packet: bytes, gateways: dict[int, NatGateway]) -> bytes | None:
    """``packet`` between two regions as it leaves a region behind NAT and as it enters one; None: dropped."""
    source, destination = gateways.get(packet[14]), gateways.get(packet[18])
    if (source is None and destination is None) or packet[14] == packet[18]:
        return packet
    translated: bytearray | None = bytearray(packet)
    if source is not None:
        translated = source.outgoing(translated)
    if translated is not None and destination is not None:
        translated = destination.incoming(translated)
    return None if translated is None else bytes(translated)


def serve(fd: int, pipes: dict[tuple[int, int], Pipe], stats_path: Path | None = None,
          gateways: dict[int, NatGateway] | None = None) -> None:
    """Relay packets until SIGTERM/SIGINT. Packets of unknown pairs are passed on without delay. ``gateways``:
    the NAT gateway of each region behind NAT (geotrain.lab.nat), by region index."""
    running = [True]

    def stop(*_):
        running[0] = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    heap: list[tuple[float, int, bytes]] = []
    sequence = 0
    clock = time.monotonic
    read, write, push, pop = os.read, os.write, heapq.heappush, heapq.heappop
    started = clock()
    next_stats = started + STATS_EVERY_S
    while running[0]:
        timeout = max(0.0, heap[0][0] - clock()) if heap else STATS_EVERY_S
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            now = clock()
            while True:
                try:
                    packet = read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4 or packet[12:14] != SUBNET_PREFIX \
                        or packet[16:18] != SUBNET_PREFIX:
                    continue  # not between two lab regions (IPv6 is off in the lab)
                if gateways:
                    packet = translate(packet, gateways)
                    if packet is None:
                        continue
                pipe = pipes.get((packet[14], packet[18]))
                if pipe is None:
                    write(fd, packet)
                    continue
                start = pipe.free_at if pipe.free_at > now else now
                if start - now > pipe.queue_s:
                    pipe.drops += 1
                    continue
                pipe.free_at = start + len(packet) * pipe.seconds_per_byte
                pipe.packets += 1
                pipe.bytes += len(packet)
                sequence += 1
                push(heap, (pipe.free_at + pipe.latency_s, sequence, packet))
        now = clock()
        while heap and heap[0][0] <= now:
            try:
                write(fd, pop(heap)[2])
            except OSError:
                pass  # the kernel refused one packet (e.g. no route during teardown): a loss, as on a wire
        if now >= next_stats:
            write_stats(stats_path, pipes, started, gateways)
            next_stats = now + STATS_EVERY_S
    write_stats(stats_path, pipes, started, gateways)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="geotrain lab delay relay (started by `geotrain lab up`)")
    parser.add_argument("--config", type=Path, required=True, help="JSON: {tun, links, stats, nat}")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text())
    fd = open_tun(config["tun"])
    pipes = build_pipes(config["links"])
    print("relay ready", flush=True)
    try:
        gateways = {index: NatGateway(index) for index in config.get("nat", [])}
        serve(fd, pipes, Path(config["stats"]) if config.get("stats") else None, gateways)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
