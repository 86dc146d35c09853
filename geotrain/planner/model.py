"""The throughput and cost model of one configuration: how many VMs of which offer.

Per averaging round (one hivemind epoch: the swarm accumulates ``target_batch_size`` samples,
then all-reduces the gradients):

- compute time ``T_calc = TBS / sum(rate of each peer)``. A peer's rate is the profile's samples/s
  for its GPU, times the profile's ``hivemind_efficiency`` when it trains in a swarm of two or more
  (a lone VM trains without hivemind), times ``1 - spot_interruption_rate`` on spot VMs: [EMJ24]
  saw throughput fall roughly in proportion to the interruption rate, a rejoining peer losing up to
  two epochs.
- communication time ``T_comm = round_overhead_s + max over used pairs (bytes_per_pair / bandwidth
  + LATENCY_ROUND_TRIPS x RTT)``. In hivemind's butterfly all-reduce each of N peers sends about
  ``2 M / N`` bytes to every other peer per round (M: compressed gradient, plus parameters on rounds
  with state averaging), all transfers in parallel, so the slowest pair sets the pace.
- granularity ``G = T_calc / T_comm``; samples/s = ``TBS / (T_calc + T_comm)`` without overlap, or
  ``TBS / max(T_calc, T_comm)`` with delayed parameter updates (``overlap=True``).
- cost per hour: the VMs, the coordinator (an on-demand VM that holds durable state, unless a
  training VM is the on-demand anchor), egress for the all-reduce traffic priced by the sender's
  cloud and the receiver's region (VMs of one region pay the ``same_region`` price), and data loading
  (each VM reads its share of the samples at its continent's price); cost per 1M samples follows.

The same formulas, written as linear constraints, are what :mod:`geotrain.planner.solve` optimises;
:func:`evaluate` is the reference that reports, tests and the brute-force check use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import EgressPrices
from geotrain.planner.network import NetworkMatrix
from geotrain.planner.profiles import ModelProfile

# Where the catalog gives no interruption rate: the rate [EMJ24] evaluated (about 5% slower at a
# 5% interruption rate). Not a market statistic; set the catalog column or --spot-interruption-rate.
DEFAULT_SPOT_INTERRUPTION_RATE = 0.05
# Round trips per averaging round that scale with RTT: matchmaking request and reply, and the
# reduce-scatter and all-gather phases of the all-reduce. An estimate, not fitted to any figure;
# fixed per-round costs are in the profile's round_overhead_s.
LATENCY_ROUND_TRIPS = 4
GB = 1e9


@dataclass(frozen=True)
class Settings:
    """How the swarm runs, beyond the model profile."""

    overlap: bool = False  # delayed parameter updates: communication hidden behind the next round's compute
    spread_zones: bool = False  # VMs of one region in different zones pay inter-zone egress
    spot_interruption_rate: float = DEFAULT_SPOT_INTERRUPTION_RATE
    anchor: str = "coordinator"  # "coordinator": separate on-demand VM; "trainer": one training VM is on demand


def standalone_samples_per_second(profile: ModelProfile, offer: Offer) -> float | None:
    """The profile's samples/s for one VM of this offer alone, or None where the profile has no figure."""
    rates = profile.samples_per_second
    if offer.gpu_count == 0:
        return rates.get("cpu")
    whole = f"{offer.gpu_count}x{offer.gpu}"
    if whole in rates:
        return rates[whole]
    if offer.gpu in rates:
        # Several GPUs in one VM train data-parallel on a fast local bus: counted as that many GPUs.
        return rates[offer.gpu] * offer.gpu_count
    return None


def interruption_rate(offer: Offer, settings: Settings) -> float:
    if not offer.spot:
        return 0.0
    return settings.spot_interruption_rate if offer.spot_interruption_rate is None else offer.spot_interruption_rate


def peer_rate(profile: ModelProfile, offer: Offer, peers: int, settings: Settings, preemptions: bool = True) -> float:
    """Samples/s one VM of this offer contributes in a swarm of ``peers`` VMs."""
    rate = standalone_samples_per_second(profile, offer) or 0.0
    if peers >= 2:
        rate *= profile.hivemind_efficiency
    if preemptions:
        rate *= 1.0 - interruption_rate(offer, settings)
    return rate


def bytes_per_pair(profile: ModelProfile, peers: int) -> float:
    """Bytes each peer sends to each other peer per round: 2 M / N of hivemind's butterfly all-reduce."""
    return 2.0 * profile.bytes_averaged_per_round / peers


def transfer_s(profile: ModelProfile, peers: int, bandwidth_gbit_per_s: float, rtt_ms: float) -> float:
    return bytes_per_pair(profile, peers) * 8 / (bandwidth_gbit_per_s * 1e9) + LATENCY_ROUND_TRIPS * rtt_ms / 1000


@dataclass
class Prediction:
    """Everything the model predicts for one configuration."""

    counts: list[tuple[Offer, int]]
    peers: int
    compute_s_per_round: float
    comm_s_per_round: float
    granularity: float
    samples_per_second: float
    samples_per_second_no_overlap: float
    samples_per_second_overlap: float
    preemption_loss_samples_per_second: float
    vm_usd_per_hour: float
    coordinator_usd_per_hour: float
    egress_usd_per_hour: float
    data_usd_per_hour: float
    traffic_gb_per_round: float
    bottleneck: str
    coordinator: Offer | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def compute_usd_per_hour(self) -> float:
        return self.vm_usd_per_hour + self.coordinator_usd_per_hour

    @property
    def usd_per_hour(self) -> float:
        return self.compute_usd_per_hour + self.egress_usd_per_hour + self.data_usd_per_hour

    @property
    def usd_per_million_samples(self) -> float:
        return self.usd_per_hour / (3600 * self.samples_per_second) * 1e6

    def hours_to_train(self, samples: float) -> float:
        return samples / self.samples_per_second / 3600

    def usd_to_train(self, samples: float) -> float:
        return self.hours_to_train(samples) * self.usd_per_hour

    def describe(self) -> str:
        return ", ".join(f"{count}x {offer.name}" for offer, count in self.counts)

    def to_dict(self, train_samples: float | None = None) -> dict:
        data = {
            "vms": [{"count": count, "cloud": o.cloud, "region": o.region, "continent": o.continent,
                     "instance_type": o.instance_type, "gpu": o.gpu, "gpu_count": o.gpu_count,
                     "purchase": o.purchase, "price_usd_per_hour": o.price_usd_per_hour} for o, count in self.counts],
            "peers": self.peers,
            "coordinator": None if self.coordinator is None else self.coordinator.name,
            "samples_per_second": self.samples_per_second,
            "samples_per_second_no_overlap": self.samples_per_second_no_overlap,
            "samples_per_second_overlap": self.samples_per_second_overlap,
            "preemption_loss_samples_per_second": self.preemption_loss_samples_per_second,
            "compute_s_per_round": self.compute_s_per_round,
            "comm_s_per_round": self.comm_s_per_round,
            "granularity": self.granularity,
            "bottleneck": self.bottleneck,
            "vm_usd_per_hour": self.vm_usd_per_hour,
            "coordinator_usd_per_hour": self.coordinator_usd_per_hour,
            "compute_usd_per_hour": self.compute_usd_per_hour,
            "egress_usd_per_hour": self.egress_usd_per_hour,
            "data_usd_per_hour": self.data_usd_per_hour,
            "usd_per_hour": self.usd_per_hour,
            "usd_per_million_samples": self.usd_per_million_samples,
            "traffic_gb_per_round": self.traffic_gb_per_round,
        }
        if train_samples:
            data["train_samples"] = train_samples
            data["hours_to_train"] = self.hours_to_train(train_samples)
            data["usd_to_train"] = self.usd_to_train(train_samples)
        return data


def data_loading_usd_per_round(profile: ModelProfile, egress: EgressPrices, items: list[tuple[Offer, int]],
                               peers: int, settings: Settings) -> float:
    """Object-storage egress for one round's TBS samples: each VM reads its share of them at its own price."""
    if not profile.data_bytes_per_sample:
        return 0.0
    rates = [(offer, count * peer_rate(profile, offer, peers, settings)) for offer, count in items]
    total = sum(rate for _, rate in rates)
    usd_per_gb = sum(rate * egress.data_loading_usd_per_gb(offer) for offer, rate in rates) / total
    return profile.target_batch_size * profile.data_bytes_per_sample / GB * usd_per_gb


def _round_time(compute_s: float, comm_s: float, overlap: bool) -> float:
    return max(compute_s, comm_s) if overlap else compute_s + comm_s


def evaluate(counts: dict[Offer, int] | list[tuple[Offer, int]], profile: ModelProfile, network: NetworkMatrix,
             egress: EgressPrices, settings: Settings = Settings(), coordinator: Offer | None = None) -> Prediction:
    """Predict throughput and cost of renting ``counts`` VMs per offer (plus the coordinator VM)."""
    items = sorted(((o, c) for o, c in dict(counts).items() if c > 0),
                   key=lambda item: (-item[1], item[0].cloud, item[0].region, item[0].instance_type, item[0].spot))
    peers = sum(count for _, count in items)
    if peers == 0:
        raise ValueError("a configuration needs at least one VM")
    tbs = profile.target_batch_size
    rate = sum(count * peer_rate(profile, offer, peers, settings) for offer, count in items)
    nominal_rate = sum(count * peer_rate(profile, offer, peers, settings, preemptions=False) for offer, count in items)
    if rate <= 0:
        raise ValueError("no VM of this configuration has a samples/s figure in the profile")
    compute_s = tbs / rate

    comm_s, bottleneck, egress_usd_per_round, traffic_gb = 0.0, "none (one VM trains alone)", 0.0, 0.0
    if peers >= 2:
        per_site = Counter()
        representative: dict[tuple[str, str], Offer] = {}
        for offer, count in items:
            per_site[offer.site] += count
            representative.setdefault(offer.site, offer)
        sites = list(per_site)
        slowest = -1.0
        pair_gb = bytes_per_pair(profile, peers) / GB
        for i, a in enumerate(sites):
            for b in sites[i:]:
                if a == b and per_site[a] < 2:
                    continue
                link = network.link(representative[a], representative[b])
                seconds = transfer_s(profile, peers, link.bandwidth_gbit_per_s, link.rtt_ms)
                if seconds > slowest:
                    slowest = seconds
                    where = a[0] + "/" + a[1] if a == b else f"{a[0]}/{a[1]} <-> {b[0]}/{b[1]}"
                    bottleneck = f"{where}: {link.bandwidth_gbit_per_s:g} Gbit/s, {link.rtt_ms:g} ms"
        for a in sites:
            for b in sites:
                pairs = per_site[a] * (per_site[b] - (1 if a == b else 0))
                if pairs:
                    price = egress.usd_per_gb(representative[a], representative[b], settings.spread_zones)
                    egress_usd_per_round += pairs * pair_gb * price
        comm_s = profile.round_overhead_s + slowest
        traffic_gb = peers * (peers - 1) * pair_gb

    no_overlap = tbs / _round_time(compute_s, comm_s, False)
    with_overlap = tbs / _round_time(compute_s, comm_s, True)
    planned = with_overlap if settings.overlap else no_overlap
    nominal = tbs / _round_time(tbs / nominal_rate, comm_s, settings.overlap)
    rounds_per_hour = 3600 * planned / tbs
    data_usd_per_round = data_loading_usd_per_round(profile, egress, items, peers, settings)
    return Prediction(
        counts=items, peers=peers, compute_s_per_round=compute_s, comm_s_per_round=comm_s,
        granularity=compute_s / comm_s if comm_s > 0 else float("inf"),
        samples_per_second=planned, samples_per_second_no_overlap=no_overlap, samples_per_second_overlap=with_overlap,
        preemption_loss_samples_per_second=nominal - planned,
        vm_usd_per_hour=sum(count * offer.price_usd_per_hour for offer, count in items),
        coordinator_usd_per_hour=coordinator.price_usd_per_hour if coordinator else 0.0,
        egress_usd_per_hour=egress_usd_per_round * rounds_per_hour,
        data_usd_per_hour=data_usd_per_round * rounds_per_hour,
        traffic_gb_per_round=traffic_gb, bottleneck=bottleneck, coordinator=coordinator)
