"""Regions behind NAT in the lab: the relay translates their packets as a NAT gateway would.

A region behind NAT (``nat: true`` in its topology) reaches the other regions through its gateway's address,
10.77.I.254 (:data:`GATEWAY_HOST`). Its outbound TCP and UDP packets leave with that address and a port the
gateway picks (the inside port when it is free: port preservation); a packet comes back in only from the remote
address and port an inside socket sent to. In RFC 4787's terms: endpoint-independent mapping,
address-and-port-dependent filtering, the defaults of a cloud's NAT gateway. Everything else addressed to the
region is dropped: a connection from outside (to the gateway or to an inside address), and other protocols.

Checksums are updated incrementally (RFC 1624), so a packet costs a few integer operations, not a sum over it.
"""

from __future__ import annotations

GATEWAY_HOST = 254
TCP, UDP = 6, 17
FIRST_FREE_PORT, LAST_PORT = 40000, 65535


def checksum_replace(checksum: int, old: bytes, new: bytes) -> int:
    """The one's-complement checksum ``checksum`` after the 16-bit words ``old`` became ``new`` (RFC 1624, eqn 3)."""
    total = ~checksum & 0xFFFF
    for i in range(0, len(old), 2):
        total += (~int.from_bytes(old[i:i + 2], "big") & 0xFFFF) + int.from_bytes(new[i:i + 2], "big")
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _rewrite(packet: bytearray, address_at: int, port_at: int, address: bytes, port: int) -> None:
    """Put ``address`` (IPv4, at byte ``address_at``) and ``port`` (at ``port_at``) into ``packet`` and fix the IP
    header's and the TCP or UDP checksum."""
    header = (packet[0] & 0x0F) * 4
    old = bytes(packet[address_at:address_at + 4]) + bytes(packet[port_at:port_at + 2])
    new = address + port.to_bytes(2, "big")
    packet[10:12] = checksum_replace(int.from_bytes(packet[10:12], "big"), old[:4], new[:4]).to_bytes(2, "big")
    at = header + (16 if packet[9] == TCP else 6)
    transport = int.from_bytes(packet[at:at + 2], "big")
    if packet[9] == TCP or transport != 0:  # UDP's 0: sent without a checksum
        transport = checksum_replace(transport, old, new)
        packet[at:at + 2] = (transport or (0xFFFF if packet[9] == UDP else 0)).to_bytes(2, "big")
    packet[address_at:address_at + 4] = address
    packet[port_at:port_at + 2] = port.to_bytes(2, "big")


class NatGateway:
    """The NAT gateway of lab region ``index`` (10.77.index.0/24)."""

    def __init__(self, index: int):
        self.index = index
        self.address = bytes((10, 77, index, GATEWAY_HOST))
        # (protocol, inside address, inside port) -> gateway port, and back, with the remote ends sent to
        self._mapped: dict[tuple[int, bytes, int], int] = {}
        self._inside: dict[tuple[int, int], tuple[bytes, int, set[tuple[bytes, int]]]] = {}
        self._next_port = FIRST_FREE_PORT
        self.translated = 0
        self.dropped = 0

    def _gateway_port(self, protocol: int, address: bytes, port: int) -> int | None:
        key = (protocol, address, port)
        if key in self._mapped:
            return self._mapped[key]
        chosen = port if (protocol, port) not in self._inside else None
        while chosen is None and self._next_port <= LAST_PORT:
            if (protocol, self._next_port) not in self._inside:
                chosen = self._next_port
            self._next_port += 1
        if chosen is not None:
            self._mapped[key] = chosen
            self._inside[(protocol, chosen)] = (address, port, set())
        return chosen

    def outgoing(self, packet: bytearray) -> bytearray | None:
        """A packet from inside the region to another region, translated; None to drop it."""
        protocol, header = packet[9], (packet[0] & 0x0F) * 4
        if protocol not in (TCP, UDP) or len(packet) < header + 8:
            self.dropped += 1
            return None
        source, source_port = bytes(packet[12:16]), int.from_bytes(packet[header:header + 2], "big")
        port = self._gateway_port(protocol, source, source_port)
        if port is None:  # every gateway port taken
            self.dropped += 1
            return None
        self._inside[(protocol, port)][2].add((bytes(packet[16:20]), int.from_bytes(packet[header + 2:header + 4], "big")))
        _rewrite(packet, 12, header, self.address, port)
        self.translated += 1
        return packet

    def incoming(self, packet: bytearray) -> bytearray | None:
        """A packet from another region to this one, translated back to the inside socket that is expecting it;
        None (dropped) for anything else."""
        protocol, header = packet[9], (packet[0] & 0x0F) * 4
        if bytes(packet[16:20]) != self.address or protocol not in (TCP, UDP) or len(packet) < header + 8:
            self.dropped += 1
            return None
        inside = self._inside.get((protocol, int.from_bytes(packet[header + 2:header + 4], "big")))
        remote = (bytes(packet[12:16]), int.from_bytes(packet[header:header + 2], "big"))
        if inside is None or remote not in inside[2]:
            self.dropped += 1  # unsolicited: no inside socket sent to this remote address and port
            return None
        _rewrite(packet, 16, header + 2, inside[0], inside[1])
        self.translated += 1
        return packet
