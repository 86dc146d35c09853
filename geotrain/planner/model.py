"""The throughput and cost model of one configuration: how many VMs of which offer.

Per averaging round, in which the swarm accumulates ``S`` samples (:func:`samples_per_round`) and then
all-reduces ``M`` bytes:

- training mode (``Settings.mode``): ``sync`` (hivemind's default) all-reduces the gradients once per
  epoch, ``S = target_batch_size``; ``diloco`` (DiLoCo, arXiv 2311.08105; OpenDiLoCo, arXiv 2407.07852)
  steps each peer's inner optimizer locally on every micro-step and all-reduces the pseudo-gradient
  (outer minus local parameters, as large as a gradient) once per outer round, when the swarm has done
  ``S = H x b x N`` samples (``inner_steps`` H, ``batch_size_per_step`` b, N peers). The all-reduce is
  the same, so per sample DiLoCo moves ``TBS / (H b N)`` times sync's bytes (times
  ``M_diloco / M_sync``, which is 1 unless the profile averages state too). Its all-reduce blocks
  training, so it has no delayed-updates overlap.
- compute time ``T_calc = S / sum(rate of each peer)``. A peer's rate is the profile's samples/s
  for its GPU, times the profile's ``hivemind_efficiency`` when it trains in a swarm of two or more
  (a lone VM trains without hivemind), times ``1 - spot_interruption_rate`` on spot VMs: [EMJ24]
  saw throughput fall roughly in proportion to the interruption rate, a rejoining peer losing up to
  two epochs.
- communication time ``T_comm = round_overhead_s + max over used pairs (bytes_per_pair / bandwidth
  + LATENCY_ROUND_TRIPS x RTT)``. In hivemind's butterfly all-reduce each of N peers sends about
  ``2 M / N`` bytes to every other peer per round (M: compressed gradient or pseudo-gradient, plus
  parameters on sync rounds with state averaging), all transfers in parallel, so the slowest pair sets the pace.
- granularity ``G = T_calc / T_comm``; samples/s = ``S / (T_calc + T_comm)`` without overlap, or
  ``S / max(T_calc, T_comm)`` with delayed parameter updates (``overlap=True``, sync mode only).
- cost per hour: the VMs, the coordinator (an on-demand VM that holds durable state, unless a
  training VM is the on-demand anchor), egress for the all-reduce traffic priced by the sender's
  cloud and the receiver's region (VMs of one region pay the ``same_region`` price), and data loading
  (each VM reads its share of the samples at its continent's price); cost per 1M samples follows.
  Egress per round is the same in both modes, so per sample it scales with ``M / S``.

The same formulas, written as linear constraints, are what :mod:`geotrain.planner.solve` optimises;
:func:`evaluate` is the reference that reports, tests and the brute-force check use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from geotrain.config import OptimizerConfig
from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import EgressPrices
from geotrain.planner.errors import PlannerError
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
MODES = ("sync", "diloco")
# DiLoCo's inner steps per outer round: H = 500 is the DiLoCo paper's setting (arXiv 2311.08105), which
# OpenDiLoCo (arXiv 2407.07852) reproduced.
DEFAULT_INNER_STEPS = 500
# Samples per micro-step of one peer, where a plan does not say: geotrain's optimizer.batch_size_per_step
# default. Profiles do not hold it; it only matters in diloco mode (the outer round's size).
DEFAULT_BATCH_SIZE_PER_STEP = OptimizerConfig.model_fields["batch_size_per_step"].default


@dataclass(frozen=True)
class Settings:
    """How the swarm runs, beyond the model profile. Invalid combinations raise :class:`PlannerError`."""

    overlap: bool = False  # delayed parameter updates: communication hidden behind the next round's compute
    spread_zones: bool = False  # VMs of one region in different zones pay inter-zone egress
    spot_interruption_rate: float = DEFAULT_SPOT_INTERRUPTION_RATE
    anchor: str = "coordinator"  # "coordinator": separate on-demand VM; "trainer": one training VM is on demand
    mode: str = "sync"  # "sync": all-reduce gradients every TBS samples; "diloco": pseudo-gradients every H steps
    inner_steps: int = DEFAULT_INNER_STEPS  # H, diloco mode only: local steps of each peer per outer round
    batch_size_per_step: int = DEFAULT_BATCH_SIZE_PER_STEP  # b, diloco mode only: samples per local step

    def __post_init__(self):
        if self.mode not in MODES:
            raise PlannerError(f"--mode is {self.mode!r}; expected one of {', '.join(MODES)}")
        for flag, value, unit in (("--inner-steps", self.inner_steps, "inner steps per outer round"),
                                  ("--batch-size-per-step", self.batch_size_per_step, "samples per micro-step")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"{flag} is {value!r}; expected a whole number of {unit}, at least 1")
        if self.overlap and self.mode == "diloco":
            raise PlannerError("--overlap (delayed parameter updates) does not apply to --mode diloco: its outer "
                               "all-reduce blocks training until the pseudo-gradients are averaged; leave out "
                               "--overlap, or plan --mode sync")


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


def samples_per_round(profile: ModelProfile, settings: Settings, peers: int) -> int:
    """Samples the swarm of ``peers`` VMs trains between two all-reduces (S).

    sync: the target batch size. diloco: every peer runs H inner steps of b samples, so the swarm runs
    ``H x b x N`` (as geotrain's DiLoCo counts it: peers of different speeds contribute unequally).
    """
    if settings.mode == "diloco":
        return settings.inner_steps * settings.batch_size_per_step * peers
    return profile.target_batch_size


def bytes_averaged_per_round(profile: ModelProfile, settings: Settings = Settings()) -> float:
    """M: sync, the compressed gradient plus parameters on state-averaging rounds (the profile's); diloco,
    the compressed pseudo-gradient alone, as large as a gradient (its outer step keeps the peers in sync)."""
    return profile.gradient_bytes if settings.mode == "diloco" else profile.bytes_averaged_per_round


def bytes_per_pair(profile: ModelProfile, peers: int, settings: Settings = Settings()) -> float:
    """Bytes each peer sends to each other peer per round: 2 M / N of hivemind's butterfly all-reduce."""
    return 2.0 * bytes_averaged_per_round(profile, settings) / peers


def transfer_s(profile: ModelProfile, peers: int, bandwidth_gbit_per_s: float, rtt_ms: float,
               settings: Settings = Settings()) -> float:
    return bytes_per_pair(profile, peers, settings) * 8 / (bandwidth_gbit_per_s * 1e9) + \
        LATENCY_ROUND_TRIPS * rtt_ms / 1000


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
    samples_per_round: int = 0  # S: samples the swarm trains between two all-reduces
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

    @property
    def traffic_gb_per_million_samples(self) -> float:
        """The swarm's all-reduce traffic (what all peers send), in GB per 1M samples trained (0 for one VM)."""
        return self.traffic_gb_per_round / self.samples_per_round * 1e6 if self.samples_per_round else 0.0

    @property
    def egress_share(self) -> float:
        """Share of the $/h that pays for traffic: all-reduce egress and data loading."""
        return (self.egress_usd_per_hour + self.data_usd_per_hour) / self.usd_per_hour if self.usd_per_hour else 0.0

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
            "egress_share": self.egress_share,
            "samples_per_round": self.samples_per_round,
            "traffic_gb_per_round": self.traffic_gb_per_round,
            "traffic_gb_per_million_samples": self.traffic_gb_per_million_samples,
        }
        if train_samples:
            data["train_samples"] = train_samples
            data["hours_to_train"] = self.hours_to_train(train_samples)
            data["usd_to_train"] = self.usd_to_train(train_samples)
        return data


def data_loading_usd_per_round(profile: ModelProfile, egress: EgressPrices, items: list[tuple[Offer, int]],
                               peers: int, settings: Settings) -> float:
    """Object-storage egress for one round's S samples: each VM reads its share of them at its own price."""
    if not profile.data_bytes_per_sample:
        return 0.0
    rates = [(offer, count * peer_rate(profile, offer, peers, settings)) for offer, count in items]
    total = sum(rate for _, rate in rates)
    usd_per_gb = sum(rate * egress.data_loading_usd_per_gb(offer) for offer, rate in rates) / total
    return samples_per_round(profile, settings, peers) * profile.data_bytes_per_sample / GB * usd_per_gb


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
    round_samples = samples_per_round(profile, settings, peers)
    rate = sum(count * peer_rate(profile, offer, peers, settings) for offer, count in items)
    nominal_rate = sum(count * peer_rate(profile, offer, peers, settings, preemptions=False) for offer, count in items)
    if rate <= 0:
        raise ValueError("no VM of this configuration has a samples/s figure in the profile")
    compute_s = round_samples / rate

    comm_s, bottleneck, egress_usd_per_round, traffic_gb = 0.0, "none (one VM trains alone)", 0.0, 0.0
    if peers >= 2:
        per_site = Counter()
        representative: dict[tuple[str, str], Offer] = {}
        for offer, count in items:
            per_site[offer.site] += count
            representative.setdefault(offer.site, offer)
        sites = list(per_site)
        slowest = -1.0
        pair_gb = bytes_per_pair(profile, peers, settings) / GB
        for i, a in enumerate(sites):
            for b in sites[i:]:
                if a == b and per_site[a] < 2:
                    continue
                link = network.link(representative[a], representative[b])
                seconds = transfer_s(profile, peers, link.bandwidth_gbit_per_s, link.rtt_ms, settings)
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

    no_overlap = round_samples / _round_time(compute_s, comm_s, False)
    # DiLoCo's outer all-reduce blocks training: nothing to overlap.
    with_overlap = no_overlap if settings.mode == "diloco" else round_samples / _round_time(compute_s, comm_s, True)
    planned = with_overlap if settings.overlap else no_overlap
    nominal = round_samples / _round_time(round_samples / nominal_rate, comm_s, settings.overlap)
    rounds_per_hour = 3600 * planned / round_samples
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
        traffic_gb_per_round=traffic_gb, bottleneck=bottleneck, samples_per_round=round_samples,
        coordinator=coordinator)
