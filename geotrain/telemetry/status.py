"""``geotrain status``: the swarm at a glance, live in the terminal, from the DHT alone.

    geotrain status --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --run-id imagenet

joins the swarm as a client (it opens no port and stores nothing), reads every peer's signed metric
record (:mod:`geotrain.hive.dht.metric_records`) and redraws a table in place every few seconds:

    swarm imagenet: epoch 42, 3 trainers, 1234.5 samples/s, granularity 3.10, $2.41/h, ETA 1h02m
    PEER          ROLE         REGION        CLOUD  INSTANCE     SAMPLES/S  EPOCH  SENT MB  LAST SEEN
    12D3KooWAbc…  trainer      us-central1   gcp    n1-std-8+T4      410.2     42    812.4       3 s

``--once`` prints one table and exits (for scripts; it looks twice, one publish period apart, since
traffic rates and so egress cost need two records of each peer); ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

from hivemind.utils import get_dht_time

from geotrain.config import GeotrainConfig
from geotrain.hive.dht.node import start_dht
from geotrain.hive.dht.metric_records import read_records
from geotrain.telemetry.swarm_view import SwarmView

CLEAR_SCREEN = "\x1b[H\x1b[2J"
FIRST_LOOK_TIMEOUT_S = 20.0  # records spread through the DHT within a few publish periods


@dataclass
class StatusRow:
    peer_id: str
    role: str
    region: str
    cloud: str
    instance_type: str
    samples_per_second: float
    epoch: int
    samples_total: int
    sent_bytes: int
    received_bytes: int
    last_seen_s: float


def rows_from_records(records: dict, now_dht_s: float) -> list[StatusRow]:
    rows = [StatusRow(peer_id=r.peer_id, role=r.role, region=r.region, cloud=r.cloud, instance_type=r.instance_type,
                      samples_per_second=r.samples_per_second, epoch=r.epoch, samples_total=r.samples_total,
                      sent_bytes=sum(r.sent_bytes_by_region.values()), received_bytes=r.received_bytes_total,
                      last_seen_s=max(0.0, now_dht_s - r.time))
            for r in (peer.record for peer in records.values())]
    return sorted(rows, key=lambda row: (row.role != "coordinator", row.region, row.peer_id))


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def format_table(run_id: str, snapshot, rows: list[StatusRow]) -> str:
    granularity = "-" if snapshot.granularity is None else f"{snapshot.granularity:.2f}"
    lines = [f"swarm {run_id}: epoch {snapshot.global_epoch}, {snapshot.peers} trainers, "
             f"{snapshot.samples_per_second:.1f} samples/s, granularity {granularity}, "
             f"${snapshot.usd_per_hour:.2f}/h, ETA {_duration(snapshot.eta_seconds)}"]
    header = f"{'PEER':<14}{'ROLE':<13}{'REGION':<16}{'CLOUD':<8}{'INSTANCE':<16}{'SAMPLES/S':>10}{'EPOCH':>7}" \
             f"{'SENT MB':>10}{'LAST SEEN':>11}"
    lines.append(header)
    for row in rows:
        lines.append(f"{_short(row.peer_id, 13):<14}{row.role:<13}{_short(row.region, 15):<16}"
                     f"{_short(row.cloud, 7):<8}{_short(row.instance_type, 15):<16}{row.samples_per_second:>10.1f}"
                     f"{row.epoch:>7}{row.sent_bytes / 1e6:>10.1f}{_duration(row.last_seen_s):>11}")
    if not rows:
        lines.append("(no peer has published metrics yet)")
    return "\n".join(lines)


def run_status(config: GeotrainConfig, once: bool, as_json: bool, interval_s: float, stop) -> int:
    run_id = config.swarm.run_id
    dht = start_dht(config.swarm.model_copy(update={"client_mode": True, "port": 0}), stop)
    view = SwarmView(config.cost, config.optimizer.target_batch_size,
                     config.metrics.target_epoch or config.training.max_epochs)
    try:
        deadline = time.monotonic() + FIRST_LOOK_TIMEOUT_S
        records = read_records(dht, run_id)
        while not records and once and time.monotonic() < deadline and not stop.is_set():
            time.sleep(1.0)
            records = read_records(dht, run_id)
        if once and records and not stop.wait(config.metrics.publish_interval_s + 1.0):
            # traffic rates (and so egress cost) need two records of each peer: look once more
            view.update({owner: peer.record for owner, peer in records.items()})
            records = read_records(dht, run_id)
        while True:
            snapshot = view.update({owner: peer.record for owner, peer in records.items()})
            rows = rows_from_records(records, get_dht_time())
            if as_json:
                print(json.dumps({"run_id": run_id, "epoch": snapshot.global_epoch, "trainers": snapshot.peers,
                                  "samples_per_second": snapshot.samples_per_second,
                                  "usd_per_hour": snapshot.usd_per_hour, "eta_seconds": snapshot.eta_seconds,
                                  "peers": [asdict(row) for row in rows]}), flush=True)
            else:
                prefix = CLEAR_SCREEN if (not once and sys.stdout.isatty()) else ""
                print(prefix + format_table(run_id, snapshot, rows), flush=True)
            if once or stop.wait(interval_s):
                return 0
            records = read_records(dht, run_id)
    finally:
        dht.shutdown()
