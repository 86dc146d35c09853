"""The swarm as a whole, from the peers' metric records: throughput, who is where, progress, cost.

The coordinator (and ``geotrain status``) reads every peer's record from the DHT
(:mod:`geotrain.hive.dht.metric_records`) a few times a minute and folds them into one :class:`SwarmSnapshot`:

- samples/s: the sum of the alive trainers' own samples/s over their last epoch;
- peers by region and cloud, joins and departures since the last look;
- global epoch (the newest any trainer reached) and the ETA to a target epoch at the current speed;
- granularity: the mean of the trainers' compute/communication ratios over their last epoch;
- cost per hour, priced as ``geotrain plan`` prices a planned swarm (:class:`geotrain.pricing.price_book.PriceBook`:
  the planner's catalog and egress files, and the overrides of the config's ``cost:`` section):

  - instances: each alive peer's VM (the coordinator's included) at the catalog's price for its cloud,
    region, instance type and purchase (spot or on-demand, from its record);
  - egress: the bytes each peer sent to each region per second (from the difference of two of its
    records, so measured, not estimated) times the $/GB its cloud bills on that route. A destination
    region's cloud is the cloud of the alive peers there (else the catalog's cloud of that region);
    traffic within a region is free, as the planner assumes;
  - what nothing prices is counted, never guessed at: ``unpriced_peers`` (their VMs add nothing to the
    $/h) and ``unpriced_routes`` (routes with traffic whose bytes add nothing);

  and the cost of 1M samples at that cost and throughput.

For the same swarm and the traffic the planner predicts, instances and egress $/h equal the planner's
(``tests/unit/test_pricing.py``); the planner's data-loading cost is not measured here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.config import CostConfig, MetricsConfig
from geotrain.hive.dht.metric_records import MetricRecord
from geotrain.pricing.price_book import PriceBook, catalog_cloud

BYTES_PER_GB = 1e9  # clouds bill egress per decimal GB
SECONDS_PER_HOUR = 3600.0

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
    unpriced_peers: int = 0  # peers (coordinator included) whose VM has no price: not in instance_usd_per_hour
    unpriced_routes: set[tuple[str, str]] = field(default_factory=set)  # (from, to) regions with unpriced traffic
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
    """Folds successive sets of records (owner -> record) into snapshots; keeps what rates need.

    ``cost`` is the config's ``cost:`` section; its price files are read once, here (a wrong file is a
    :class:`geotrain.pricing.errors.InputFileError` naming the line). ``prices`` replaces them.
    """

    def __init__(self, cost: CostConfig, target_batch_size: int, target_epoch: int | None = None,
                 prices: PriceBook | None = None):
        self.prices = prices if prices is not None else PriceBook.from_config(cost)
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
        clouds_by_region: dict[str, set[str]] = {}
        for record in records.values():
            clouds_by_region.setdefault(record.region, set()).add(catalog_cloud(record.cloud))
        granularities = []
        for owner, record in records.items():
            if owner in trainers:
                snapshot.samples_per_second += record.samples_per_second
                snapshot.global_epoch = max(snapshot.global_epoch, record.epoch)
                if record.granularity is not None:
                    granularities.append(record.granularity)
                place = (record.region, record.cloud)
                snapshot.peers_by_place[place] = snapshot.peers_by_place.get(place, 0) + 1
            # a record of an older geotrain has no purchase: the one its role runs on by default
            purchase = record.purchase or MetricsConfig.default_purchase(record.role)
            price = self.prices.instance_usd_per_hour(record.cloud, record.region, record.instance_type, purchase)
            if price is None:
                snapshot.unpriced_peers += 1
            else:
                snapshot.instance_usd_per_hour += price
            for destination, rate in self._egress_rates(owner, record).items():
                route = (record.region, destination)
                snapshot.egress_bytes_per_second[route] = snapshot.egress_bytes_per_second.get(route, 0.0) + rate
                if rate <= 0:
                    continue
                destination_site = (self._cloud_of(destination, clouds_by_region), destination)
                usd_per_gb = self.prices.egress_usd_per_gb((record.cloud, record.region), destination_site)
                if usd_per_gb is None:
                    snapshot.unpriced_routes.add(route)
                else:
                    snapshot.egress_usd_per_hour += rate * SECONDS_PER_HOUR / BYTES_PER_GB * usd_per_gb
        if granularities:
            snapshot.granularity = sum(granularities) / len(granularities)
        snapshot.eta_seconds = self._eta_seconds(snapshot)
        self._previous = dict(records)
        self._rates = {owner: rates for owner, rates in self._rates.items() if owner in records}
        return snapshot

    def _cloud_of(self, region: str, clouds_by_region: dict[str, set[str]]) -> str | None:
        """The cloud of a destination region: its alive peers', else the catalog's; None when not one cloud."""
        clouds = clouds_by_region.get(region) or self.prices.clouds_in_region(region)
        return next(iter(clouds)) if len(clouds) == 1 else None

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
    metrics.unpriced_routes.set(len(snapshot.unpriced_routes))
    metrics.set_series(metrics.egress_bytes_per_second, ("peer_region", "destination_region"),
                       snapshot.egress_bytes_per_second)
    metrics.set_optional(metrics.egress_budget, cost.egress_budget_usd_per_hour)
