"""Reading the kernel's TCP counters (ss -tinpH) and the schema that guards metric records."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from pydantic.v1 import ValidationError

from geotrain.hive.dht.metric_records import MetricRecord
from geotrain.telemetry.reporter import listen_addresses
from geotrain.telemetry.traffic import TrafficMeter, parse_ss

SS_OUTPUT = """\
0      0      127.0.0.1:46324 127.0.0.1:49065 users:(("p2pd",pid=4242,fd=4))
\t bbr wscale:10,10 rto:204 mss:47616 bytes_sent:100000 bytes_acked:100001 bytes_received:77 segs_out:5
0      0      [::ffff:10.1.0.2]:31337 [::ffff:10.2.0.2]:40000 users:(("p2pd",pid=4242,fd=9))
\t cubic rto:204 bytes_received:5000 segs_in:3
ESTAB 0 0 10.1.0.2:31337 10.3.0.2:41000 users:(("python3",pid=17,fd=3))
\t cubic bytes_acked:12 bytes_received:1
"""


def test_parse_ss_reads_bytes_per_connection_and_owner():
    connections = parse_ss(SS_OUTPUT)
    assert [(c.local, c.remote, c.pid, c.sent_bytes, c.received_bytes) for c in connections] == [
        ("127.0.0.1:46324", "127.0.0.1:49065", 4242, 100000, 77),
        ("10.1.0.2:31337", "10.2.0.2:40000", 4242, 0, 5000),
        ("10.1.0.2:31337", "10.3.0.2:41000", 17, 12, 1),
    ]


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_parse_ss_on_this_kernel_counts_what_was_sent():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                client.sendall(b"x" * 300_000)
                received = 0
                while received < 300_000:
                    received += len(accepted.recv(65536))
                output = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                                        text=True, check=True).stdout
                local = "%s:%d" % client.getsockname()
                sent = [c for c in parse_ss(output) if c.local == local]
    assert sent and sent[0].sent_bytes >= 300_000


def test_listen_addresses_from_multiaddrs():
    assert listen_addresses(["/ip4/10.1.0.2/tcp/31337/p2p/12D3KooW", "/ip4/10.1.0.2/tcp/31337",
                             "/ip6/::1/tcp/5/p2p/x"]) == ["10.1.0.2:31337"]


VALID = dict(peer_id="12D3KooW", role="trainer", region="us-central1", cloud="gcp", instance_type="n1-standard-8",
             time=1.0e9, epoch=3, samples_total=4096, samples_per_second=120.5, granularity=2.5,
             compute_seconds_total=30.0, communication_seconds_total=12.0, sent_bytes_by_region={"europe-west4": 10},
             received_bytes_total=20, addresses=["10.1.0.2:31337"])


@pytest.mark.parametrize("field, value", [
    ("samples_per_second", -1.0), ("samples_per_second", 3), ("samples_per_second", float("nan")),
    ("epoch", "7"), ("role", "admin"), ("region", "x" * 65), ("region", "us central"),
    ("sent_bytes_by_region", {"eu": -5}), ("addresses", ["a"] * 17),
])
def test_malformed_records_are_refused(field, value):
    MetricRecord.parse_obj(VALID)
    with pytest.raises(ValidationError):
        MetricRecord.parse_obj({**VALID, field: value})


def test_records_with_unknown_fields_are_refused():
    with pytest.raises(ValidationError):
        MetricRecord.parse_obj({**VALID, "admin": True})


CLOSING_SENDER = """
import socket, sys, time
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as connection:
    connection.sendall(b"x" * 300_000)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_the_bytes_of_a_connection_that_closes_between_two_reads_are_counted():
    """A peer that downloads the final state and hangs up before this peer reads its counters again: what
    the connection carried is still counted (sampled in the background), not lost with the connection."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", CLOSING_SENDER, str(port), "2.0"])
        try:
            with open(f"/proc/{sender.pid}/comm") as handle:
                meter = TrafficMeter(os.getpid(), daemon_name=handle.read().strip())
            meter.start_sampling(0.2)
            accepted, _ = server.accept()
            with accepted:
                received = 0
                while chunk := accepted.recv(65536):  # until the sender closes
                    received += len(chunk)
            assert sender.wait(timeout=30) == 0
        finally:
            sender.kill()
        meter.stop_sampling()
        sent = meter.sample().sent_by_remote.get(f"127.0.0.1:{port}", 0)
    assert received == 300_000
    assert sent >= 300_000, f"the meter counted {sent} bytes of the 300000 the closed connection sent"
