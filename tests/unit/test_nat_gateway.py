"""The lab's NAT gateway (geotrain.lab.nat) on raw IPv4 packets: what it translates, with checksums a kernel
accepts, and what it drops. The gateway in a live lab, with sockets and a swarm: tests/lab/test_lab_nat.py."""

from __future__ import annotations

import struct

from geotrain.lab.nat import TCP, UDP, NatGateway

INSIDE, OUTSIDE, GATEWAY = bytes((10, 77, 2, 2)), bytes((10, 77, 1, 2)), bytes((10, 77, 2, 254))


def ones_complement_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def packet(protocol: int, source: bytes, source_port: int, destination: bytes, destination_port: int,
           payload: bytes = b"hello") -> bytearray:
    """An IPv4 packet with a TCP or UDP segment, both checksums computed in full."""
    if protocol == TCP:
        segment = bytearray(struct.pack("!HHIIBBHHH", source_port, destination_port, 1, 0, 5 << 4, 0x02, 65535, 0, 0))
        checksum_at = 16
    else:
        segment = bytearray(struct.pack("!HHHH", source_port, destination_port, 8 + len(payload), 0))
        checksum_at = 6
    segment += payload
    pseudo = source + destination + struct.pack("!BBH", 0, protocol, len(segment))
    segment[checksum_at:checksum_at + 2] = struct.pack("!H", ~ones_complement_sum(pseudo + bytes(segment)) & 0xFFFF)
    header = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 1, 0, 64, protocol, 0, source,
                                   destination))
    header[10:12] = struct.pack("!H", ~ones_complement_sum(bytes(header)) & 0xFFFF)
    return header + segment


def checksums_valid(ip_packet: bytes) -> bool:
    header, segment = ip_packet[:20], ip_packet[20:]
    pseudo = ip_packet[12:16] + ip_packet[16:20] + struct.pack("!BBH", 0, ip_packet[9], len(segment))
    return ones_complement_sum(header) == 0xFFFF and ones_complement_sum(pseudo + segment) == 0xFFFF


def ports(ip_packet: bytes) -> tuple[int, int]:
    return struct.unpack("!HH", ip_packet[20:24])


def test_an_outbound_packet_leaves_with_the_gateways_address_and_the_answer_comes_back_to_its_socket():
    gateway = NatGateway(2)
    for protocol in (TCP, UDP):
        out = gateway.outgoing(packet(protocol, INSIDE, 31337, OUTSIDE, 4001))
        assert out[12:16] == GATEWAY and ports(out) == (31337, 4001)  # port preserved while free
        assert checksums_valid(out)
        back = gateway.incoming(packet(protocol, OUTSIDE, 4001, GATEWAY, 31337))
        assert back[16:20] == INSIDE and ports(back) == (4001, 31337) and checksums_valid(back)


def test_a_second_inside_socket_on_a_taken_port_gets_another_gateway_port():
    gateway = NatGateway(2)
    gateway.outgoing(packet(TCP, INSIDE, 5000, OUTSIDE, 4001))
    other = gateway.outgoing(packet(TCP, bytes((10, 77, 2, 3)), 5000, OUTSIDE, 4001))
    assert ports(other)[0] != 5000 and checksums_valid(other)
    back = gateway.incoming(packet(TCP, OUTSIDE, 4001, GATEWAY, ports(other)[0]))
    assert back[16:20] == bytes((10, 77, 2, 3)) and ports(back) == (4001, 5000)


def test_unsolicited_packets_and_other_protocols_are_dropped():
    gateway = NatGateway(2)
    gateway.outgoing(packet(TCP, INSIDE, 31337, OUTSIDE, 4001))
    assert gateway.incoming(packet(TCP, OUTSIDE, 50000, GATEWAY, 31337)) is None  # another port of that host
    assert gateway.incoming(packet(TCP, bytes((10, 77, 3, 2)), 4001, GATEWAY, 31337)) is None  # another host
    assert gateway.incoming(packet(TCP, OUTSIDE, 4001, INSIDE, 31337)) is None  # to the inside address
    assert gateway.incoming(packet(TCP, OUTSIDE, 4001, GATEWAY, 9)) is None  # no mapping
    icmp = packet(UDP, INSIDE, 1, OUTSIDE, 1)
    icmp[9] = 1
    assert gateway.outgoing(icmp) is None
    assert gateway.dropped == 5 and gateway.translated == 1


def test_a_udp_datagram_sent_without_a_checksum_keeps_none():
    gateway = NatGateway(2)
    datagram = packet(UDP, INSIDE, 7000, OUTSIDE, 53)
    datagram[26:28] = b"\0\0"
    assert gateway.outgoing(datagram)[26:28] == b"\0\0"
