"""The swarm as a whole, from the trainers' metric records: throughput, who is where, progress, cost.

The coordinator (and ``geotrain status``) reads every trainer's record from the DHT
(:mod:`geotrain.hive.metric_records`) a few times a minute and folds them into one :class:`SwarmSnapshot`:

- samples/s: the sum of the alive trainers' own samples/s over their last epoch;
- peers by region and cloud, joins and departures since the last look;
- global epoch (the newest any trainer reached) and the ETA to a target epoch at the current speed;
- granularity: the mean of the trainers' compute/communication ratios over their last epoch;
- cost per hour: the alive peers' instance prices (the coordinator's included) (``cost.instance_usd_per_hour``) plus egress: the
  bytes each trainer sent to each region per second (from the difference of two of its records, so
  measured, not estimated) times the price of that route (``cost.egress_usd_per_gb``); and the cost of
  1M samples at that cost and throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.config import CostConfig
from geotrain.hive.metric_records import MetricRecord

BYTES_PER_GB = 1e9  # clouds bill egress per decimal GB
SECONDS_PER_HOUR = 3600.0

# monitoring tests wait for this: the coordinator exports the swarm view on --metrics-port
SWARM_METRICS_READY = True


def egress_usd_per_gb(cost: CostConfig, source_region: str, destination_region: str) -> float:
    """Price of one GB from one region to another: same region, else the most specific matching rule."""
    if source_region == destination_region:
        return cost.same_region_usd_per_gb
    best, best_rank = None, -1
    for rule in cost.egress_usd_per_gb:
        if rule.source not in ("*", source_region) or rule.destination not in ("*", destination_region):
            continue
        rank = 2 * (rule.source != "*") + (rule.destination != "*")
        if rank > best_rank:
            best, best_rank = rule.usd_per_gb, rank
    return 0.0 if best is None else best


@dataclass
class SwarmSnapshot:
    peers: int = 0
    samples_per_second: float = 0.0
    global_epoch: int = 0
    granularity: float | None = None
    eta_seconds: float | None = None
    peers_by_place: dict[tuple[str, str], int] = field(default_factory=dict)  # (region, cloud) -> trainers
    joined: int = 0
    departed: int = 0
    instance_usd_per_hour: float = 0.0
    egress_usd_per_hour: float = 0.0
    unpriced_peers: int = 0  # peers (coordinator included) whose instance type has no price
    egress_bytes_per_second: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> B/s

    @property
    def usd_per_hour(self) -> float:
        return self.instance_usd_per_hour + self.egress_usd_per_hour

    @property
    def usd_per_million_samples(self) -> float | None:
        if self.samples_per_second <= 0:
            return None
        return self.usd_per_hour / (self.samples_per_second * SECONDS_PER_HOUR) * 1e6


class SwarmView:
    """Folds successive sets of records (owner -> record) into snapshots; keeps what rates need."""

    def __init__(self, cost: CostConfig, target_batch_size: int, target_epoch: int | None = None):
        self.cost = cost
        self.target_batch_size = target_batch_size
        self.target_epoch = target_epoch
        self._previous: dict[str, MetricRecord] = {}
        self._rates: dict[str, dict[str, float]] = {}  # owner -> destination region -> bytes/s

    def update(self, records: dict[str, MetricRecord]) -> SwarmSnapshot:
        """A snapshot from the alive peers' records (trainers and coordinator; only trainers count as peers)."""
        trainers = {owner for owner, record in records.items() if record.role == "trainer"}
        trainers_before = {owner for owner, record in self._previous.items() if record.role == "trainer"}
        snapshot = SwarmSnapshot(peers=len(trainers), joined=len(trainers - trainers_before),
                                 departed=len(trainers_before - trainers))
        granularities = []
        for owner, record in records.items():
            if owner in trainers:
                snapshot.samples_per_second += record.samples_per_second
                snapshot.global_epoch = max(snapshot.global_epoch, record.epoch)
                if record.granularity is not None:
                    granularities.append(record.granularity)
                place = (record.region, record.cloud)
                snapshot.peers_by_place[place] = snapshot.peers_by_place.get(place, 0) + 1
            price = self.cost.instance_usd_per_hour.get(record.instance_type)
            if price is None:
                snapshot.unpriced_peers += 1
            else:
                snapshot.instance_usd_per_hour += price
            for destination, rate in self._egress_rates(owner, record).items():
                route = (record.region, destination)
                snapshot.egress_bytes_per_second[route] = snapshot.egress_bytes_per_second.get(route, 0.0) + rate
                snapshot.egress_usd_per_hour += (rate * SECONDS_PER_HOUR / BYTES_PER_GB
                                                 * egress_usd_per_gb(self.cost, record.region, destination))
        if granularities:
            snapshot.granularity = sum(granularities) / len(granularities)
        snapshot.eta_seconds = self._eta_seconds(snapshot)
        self._previous = dict(records)
        self._rates = {owner: rates for owner, rates in self._rates.items() if owner in records}
        return snapshot

    def _egress_rates(self, owner: str, record: MetricRecord) -> dict[str, float]:
        """Bytes/s by destination between this record and the owner's previous one (kept until a newer one)."""
        previous = self._previous.get(owner)
        if previous is not None and record.time > previous.time:
            elapsed_s = record.time - previous.time
            self._rates[owner] = {
                destination: max(0, sent - previous.sent_bytes_by_region.get(destination, 0)) / elapsed_s
                for destination, sent in record.sent_bytes_by_region.items()}
        return self._rates.get(owner, {})

    def _eta_seconds(self, snapshot: SwarmSnapshot) -> float | None:
        if self.target_epoch is None:
            return None
        if snapshot.global_epoch >= self.target_epoch:
            return 0.0
        if snapshot.samples_per_second <= 0:
            return None
        remaining_samples = (self.target_epoch - snapshot.global_epoch) * self.target_batch_size
        return remaining_samples / snapshot.samples_per_second


def export(snapshot: SwarmSnapshot, metrics, cost: CostConfig) -> None:
    """Set the coordinator's :class:`geotrain.telemetry.metrics.SwarmMetrics` from a snapshot."""
    metrics.samples_per_second.set(snapshot.samples_per_second)
    metrics.global_epoch.set(snapshot.global_epoch)
    if snapshot.granularity is not None:
        metrics.granularity.set(snapshot.granularity)
    metrics.set_optional(metrics.eta_seconds, snapshot.eta_seconds)
    metrics.set_series(metrics.peers, ("peer_region", "peer_cloud"), snapshot.peers_by_place)
    metrics.peer_joins.inc(snapshot.joined)
    metrics.peer_departures.inc(snapshot.departed)
    metrics.instance_cost.set(snapshot.instance_usd_per_hour)
    metrics.egress_cost.set(snapshot.egress_usd_per_hour)
    metrics.cost.set(snapshot.usd_per_hour)
    metrics.set_optional(metrics.cost_per_million_samples, snapshot.usd_per_million_samples)
    metrics.unpriced_peers.set(snapshot.unpriced_peers)
    metrics.set_series(metrics.egress_bytes_per_second, ("peer_region", "destination_region"),
                       snapshot.egress_bytes_per_second)
    metrics.set_optional(metrics.egress_budget, cost.egress_budget_usd_per_hour)
