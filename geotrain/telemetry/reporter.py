"""A peer's reporter: every few seconds it measures the peer's traffic and publishes its metric record.

Each period (``metrics.publish_interval_s``) the reporter

1. reads the kernel's TCP counters of the peer's connections (:mod:`geotrain.telemetry.traffic`),
2. attributes the new bytes of each connection to the region of the peer at its far end (from the
   addresses in the other peers' records; ``unknown`` while that peer has published none),
3. adds them to the peer's Prometheus counters (``geotrain_sent_bytes_total{destination_region}``,
   ``geotrain_received_bytes_total``), and
4. stores the peer's signed record (:mod:`geotrain.hive.dht.metric_records`) with its progress and traffic,
   and what its VM is (cloud, region, instance type, and ``metrics.purchase``: spot for a trainer and
   on-demand for the coordinator unless set), from which the coordinator prices it.

On leaving it stores an empty record, so the swarm view drops the peer at once.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from geotrain.config import MetricsConfig
from geotrain.hive.dht.node import visible_addresses
from geotrain.hive.dht.metric_records import MetricRecord, finite, publish, read_records, record_ttl_s, store_record
from geotrain.telemetry.traffic import TrafficMeter

logger = logging.getLogger(__name__)

UNKNOWN_REGION = "unknown"
# how often the TCP counters are read between publications: a connection that closes loses at most this much
# of its bytes (one `ss` run, a few milliseconds of CPU)
TRAFFIC_SAMPLE_S = 1.0
LEAVE_TIMEOUT_S = 2.0


@dataclass
class PeerProgress:
    """What the peer's main loop updates and the reporter publishes."""

    epoch: int = 0
    samples_total: int = 0
    samples_per_second: float = 0.0
    granularity: float | None = None
    compute_seconds_total: float = 0.0
    communication_seconds_total: float = 0.0


def listen_addresses(maddrs: list[str]) -> list[str]:
    """``ip:port`` of each ``/ip4/IP/tcp/PORT/...`` multiaddr (what the others see as the remote end)."""
    found = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 4 and parts[1] == "ip4" and parts[3] == "tcp" and f"{parts[2]}:{parts[4]}" not in found:
            found.append(f"{parts[2]}:{parts[4]}")
    return found[:16]


class MetricsReporter(threading.Thread):
    def __init__(self, dht, run_id: str, role: str, config: MetricsConfig, progress: PeerProgress,
                 peer_metrics=None):
        super().__init__(name="metrics-reporter", daemon=True)
        self.dht = dht
        self.run_id = run_id
        self.role = role
        self.config = config
        self.progress = progress
        self.peer_metrics = peer_metrics
        self.peer_id = str(dht.peer_id)
        self.addresses = listen_addresses(visible_addresses(dht))
        self.meter = TrafficMeter(os.getpid())
        self.meter.start_sampling(min(TRAFFIC_SAMPLE_S, config.publish_interval_s))
        self.ttl_s = record_ttl_s(config.publish_interval_s)
        self._stop_event = threading.Event()
        self._counted_sent: dict[str, int] = {}  # remote -> bytes already attributed
        self._counted_received: dict[str, int] = {}
        self.sent_bytes_by_region: dict[str, int] = {}
        self.received_bytes_total = 0

    def run(self) -> None:
        while not self._stop_event.wait(self.config.publish_interval_s):
            try:
                self.report_once()
            except Exception as error:  # the DHT may be busy or shutting down; the next period tries again
                logger.debug("metric record not published: %s", error)

    def report_once(self) -> None:
        self.count_traffic()
        progress = self.progress
        record = MetricRecord(
            peer_id=self.peer_id, role=self.role, region=self.config.region, cloud=self.config.cloud,
            instance_type=self.config.instance_type, purchase=self.config.purchase_for(self.role),
            time=float(get_dht_time()), epoch=int(progress.epoch),
            samples_total=int(progress.samples_total), samples_per_second=finite(progress.samples_per_second),
            granularity=None if progress.granularity is None else finite(progress.granularity),
            compute_seconds_total=finite(progress.compute_seconds_total),
            communication_seconds_total=finite(progress.communication_seconds_total),
            sent_bytes_by_region=dict(self.sent_bytes_by_region), received_bytes_total=self.received_bytes_total,
            addresses=self.addresses)
        publish(self.dht, self.run_id, record, self.ttl_s)

    def count_traffic(self) -> None:
        """Attribute the bytes sent and received since the last call (also called once more when leaving)."""
        totals = self.meter.sample()
        region_of_address = {address: peer.record.region for peer in read_records(self.dht, self.run_id).values()
                             for address in peer.record.addresses}
        for remote, total in totals.sent_by_remote.items():
            new_bytes = total - self._counted_sent.get(remote, 0)
            if new_bytes <= 0:
                continue
            self._counted_sent[remote] = total
            region = region_of_address.get(remote) or _region_of_host(remote, region_of_address)
            self.sent_bytes_by_region[region] = self.sent_bytes_by_region.get(region, 0) + new_bytes
            if self.peer_metrics is not None:
                self.peer_metrics.labelled(self.peer_metrics.sent_bytes, destination_region=region).inc(new_bytes)
        for remote, total in totals.received_by_remote.items():
            new_bytes = total - self._counted_received.get(remote, 0)
            if new_bytes <= 0:
                continue
            self._counted_received[remote] = total
            self.received_bytes_total += new_bytes
            if self.peer_metrics is not None:
                self.peer_metrics.received_bytes.inc(new_bytes)

    def stop(self) -> None:
        """Publish no more records (returns at once; a publication under way finishes on its own)."""
        self._stop_event.set()
        self.meter.stop_sampling()

    def withdraw(self):
        """Start withdrawing this peer's record; a future (the record expires on its own if it fails)."""
        self.stop()
        return store_record(self.dht, self.run_id, None, self.ttl_s)

    def leave(self) -> None:
        """Stop publishing and withdraw the record (best effort)."""
        try:
            self.withdraw().result(timeout=LEAVE_TIMEOUT_S)
        except Exception as error:
            logger.debug("metric record not withdrawn: %s", error)


def _region_of_host(remote: str, region_of_address: dict[str, str]) -> str:
    """A peer that dialled from another port: its IP alone names the region when only one region uses it."""
    host = remote.rpartition(":")[0]
    regions = {region for address, region in region_of_address.items() if address.rpartition(":")[0] == host}
    return regions.pop() if len(regions) == 1 else UNKNOWN_REGION
