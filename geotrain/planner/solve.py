"""Choosing which VMs to rent: mixed-integer programs per swarm size, solved with HiGHS.

What is optimised
    ``cost-per-sample``: the lowest $ per sample, under an optional budget ($/h: VMs, coordinator,
    egress, data) and an optional minimum throughput; ``throughput``: the most samples/s within the
    budget. Constraints: at most ``max_peers`` training VMs, GPUs per region (quotas), allowed
    clouds/regions/continents, and an on-demand anchor for durable state (a separate coordinator
    VM, or at least one on-demand training VM).

How the non-linear model becomes MILPs (see README, "Planning which VMs to rent")
    Throughput ``TBS / (T_calc + T_comm)`` is not linear in the VM counts, cost per sample is a
    ratio, and egress is quadratic (every pair of peers talks). Three devices handle that:

    1. *Enumerated swarm size.* One search per peer count ``n = 1..max_peers`` (n = 1 is evaluated
       directly: a lone VM has no all-reduce). With n fixed, the bytes each pair exchanges per round
       (``2 M / n``), every link's time and the hivemind efficiency are constants.
    2. *Exact linearisations.* ``T_comm`` is the overhead plus the slowest link in use: the distinct
       link times are levels, one binary per level, and a level below a pair's time forbids using
       both ends of that pair. ``cost x T_comm`` is split over the levels. Egress, ``sum over sites
       of count x (price-weighted peers elsewhere)``, is linearised by writing each site's count in
       binary (one continuous variable per bit).
    3. *Branch and bound over compute time.* ``cost x T_calc`` with ``T_calc = TBS / R`` is the
       remaining non-linearity. A node is an interval [a, b] of ``T_calc``; its MILP bounds R to
       [TBS/b, TBS/a] and minimises a linear lower bound of the objective: ``cost x T_calc`` is
       ``TBS x sum(price/rate x throughput share)`` with each share bounded by the node's R interval.
       The MILP's configuration is evaluated with the exact model (:func:`model.evaluate`) and the
       node is split at its ``T_calc``, where the bound becomes exact; nodes whose bound cannot beat
       the best configuration found are dropped (HiGHS gets that bound as a constraint).

    The result is the exact optimum of the model, up to a relative tolerance of 1e-6 on compute
    time; the unit tests check it against brute-force search over every configuration of small
    catalogs. Sizes are visited in order of a closed-form bound, with n VMs of one offer as quick
    incumbents, and sizes that cannot enter the top ``top`` are skipped.

Pruning
    Exact: within a region, an offer is dropped when another is at least as fast after
    interruptions, no dearer, needs no more GPUs of a quota, and is on demand whenever it is; a whole
    region is dropped when another region of the same cloud and continent covers all its offers.
    Approximate, only above EXACT_OFFER_LIMIT offers: :func:`reduce_candidates` (the plan then says
    so, and the benchmark measures how often it changes the answer).

Why not one MILP over all n, Dinkelbach, or a grid: with n free, ``2 M / n`` multiplies every egress
term and link time; Dinkelbach handles a ratio of linear terms, but cost per sample is ``cost x
(TBS/R + T_comm) + egress``; a binary-encoded ``T_calc`` grid was tried and gave weak relaxations
(about 1 s per program). Enumerating n also yields the best configuration of every size, which the
table and the frontier plot show.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from geotrain.planner.catalog import Offer
from geotrain.planner.egress import EgressPrices
from geotrain.planner.errors import PlannerError
from geotrain.planner.milp import INF, Program
from geotrain.planner.model import (Prediction, Settings, evaluate, interruption_rate, peer_rate,
                                    standalone_samples_per_second, transfer_s, bytes_per_pair, GB)
from geotrain.planner.network import NetworkMatrix
from geotrain.planner.profiles import ModelProfile

OBJECTIVES = ("cost-per-sample", "throughput")
TANGENTS = 6
# Above this many offers (after exact pruning) the candidates are reduced; see reduce_candidates.
EXACT_OFFER_LIMIT = 100
CANDIDATES_PER_REGION = 3
CANDIDATE_REGIONS = 6
DEFAULT_MAX_PEERS = 16


@dataclass
class Request:
    objective: str = "cost-per-sample"
    budget_usd_per_hour: float | None = None
    min_samples_per_second: float | None = None
    max_peers: int = DEFAULT_MAX_PEERS
    clouds: frozenset[str] | None = None
    regions: frozenset[str] | None = None
    continents: frozenset[str] | None = None
    region_quota_gpus: dict[str, int] = field(default_factory=dict)


@dataclass
class Inputs:
    offers: list[Offer]
    profile: ModelProfile
    network: NetworkMatrix
    egress: EgressPrices
    settings: Settings = Settings()


@dataclass
class Plan:
    candidates: list[Prediction]  # the best configuration of each swarm size, best first
    coordinator: Offer | None
    offers_considered: int
    offers_after_pruning: int
    programs_solved: int
    solve_s: float
    exact: bool = True  # False when a large catalog was reduced to candidates (reduce_candidates)

    @property
    def best(self) -> Prediction:
        return self.candidates[0]


def ranking_key(objective: str):
    if objective == "throughput":
        return lambda p: (-round(p.samples_per_second, 9), p.usd_per_million_samples)
    return lambda p: (round(p.usd_per_million_samples, 12), -p.samples_per_second)


def satisfies(prediction: Prediction, request: Request, tolerance: float = 1e-9) -> bool:
    """Whether an evaluated configuration meets the request's budget and throughput floor."""
    if request.budget_usd_per_hour is not None and \
            prediction.usd_per_hour > request.budget_usd_per_hour * (1 + tolerance) + tolerance:
        return False
    if request.min_samples_per_second is not None and \
            prediction.samples_per_second < request.min_samples_per_second * (1 - tolerance):
        return False
    return True


def select_offers(inputs: Inputs, request: Request) -> list[Offer]:
    """The offers the request allows, failing with a message that names the filter that emptied the list."""
    offers = inputs.offers
    for name, allowed, attribute in (("--clouds", request.clouds, "cloud"), ("--regions", request.regions, "region"),
                                     ("--continents", request.continents, "continent")):
        if allowed is None:
            continue
        kept = [o for o in offers if getattr(o, attribute) in allowed]
        if not kept:
            present = sorted({getattr(o, attribute) for o in offers})
            raise PlannerError(f"{name} {','.join(sorted(allowed))} leaves no offer in the catalog; "
                               f"the remaining offers have {attribute} in: {', '.join(present)}")
        offers = kept
    return offers


def choose_coordinator(offers: list[Offer], settings: Settings) -> Offer | None:
    """The coordinator runs on the cheapest on-demand VM allowed (it needs no GPU)."""
    if settings.anchor != "coordinator":
        return None
    on_demand = [o for o in offers if not o.spot]
    if not on_demand:
        raise PlannerError("the coordinator needs an on-demand VM for durable state, but no allowed offer is "
                           "on demand; allow a cloud or region with on-demand prices, or use --anchor trainer")
    return min(on_demand, key=lambda o: (o.price_usd_per_hour, o.gpu_count, o.cloud, o.region, o.instance_type))


def trainable_offers(offers: list[Offer], profile: ModelProfile) -> list[Offer]:
    usable = [o for o in offers if standalone_samples_per_second(profile, o)]
    if not usable:
        devices = sorted({o.device_key if o.gpu_count <= 1 else f"{o.gpu_count}x{o.gpu}" for o in offers})
        raise PlannerError(f"profile {profile.name!r} has samples/s for {', '.join(sorted(profile.samples_per_second))} "
                           f"but the allowed offers have {', '.join(devices)}; add a figure to the profile, "
                           "measure one with `geotrain profile`, or allow other offers")
    return usable


def prune_dominated(offers: list[Offer], profile: ModelProfile, settings: Settings,
                    quotas: dict[str, int]) -> list[Offer]:
    """Drop offers that another offer of the same site beats on every count (exact, see module doc)."""
    by_site: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for offer in offers:
        by_site[offer.site].append(offer)
    kept: list[Offer] = []
    for site_offers in by_site.values():
        def rate(o: Offer) -> float:
            return peer_rate(profile, o, 1, settings)

        for i, o in enumerate(site_offers):
            dominated = False
            for j, other in enumerate(site_offers):
                if i == j:
                    continue
                better = (rate(other) >= rate(o) and other.price_usd_per_hour <= o.price_usd_per_hour
                          and (other.gpu_count <= o.gpu_count or o.region not in quotas)
                          and (o.spot or not other.spot))
                strictly = (rate(other) > rate(o) or other.price_usd_per_hour < o.price_usd_per_hour
                            or other.gpu_count < o.gpu_count or (other.spot is False and o.spot))
                if better and (strictly or j < i):
                    dominated = True
                    break
            if not dominated:
                kept.append(o)
    return kept


def prune_dominated_sites(offers: list[Offer], inputs: Inputs, quotas: dict[str, int]) -> list[Offer]:
    """Drop whole regions that another region of the same cloud and continent beats (exact).

    Regions of one cloud on one continent have the same links and egress prices to every other
    place. If region B (without a quota) sells, for every offer of region A, one at least as fast,
    no dearer and on demand whenever A's is, then moving A's VMs to B never makes a configuration
    slower or dearer: pairs A-B become same-region pairs, which are checked to be no slower and no
    dearer than pairs between two regions.
    """
    profile, settings, network = inputs.profile, inputs.settings, inputs.network
    places = network.places()
    by_class: dict[tuple, dict[tuple[str, str], list[Offer]]] = defaultdict(lambda: defaultdict(list))
    for offer in offers:
        key = (offer.cloud, offer.continent, offer.region if offer.region in places else "")
        by_class[key][offer.site].append(offer)
    dropped: set[tuple[str, str]] = set()
    for sites in by_class.values():
        if len(sites) < 2:
            continue
        names = sorted(sites)
        first, second = sites[names[0]][0], sites[names[1]][0]
        between = network.link(first, second)
        if settings.spread_zones and inputs.egress.usd_per_gb(first, first, True) > \
                inputs.egress.usd_per_gb(first, second, True):
            continue
        for site in names:
            if network.link(sites[site][0], sites[site][0]).bandwidth_gbit_per_s < between.bandwidth_gbit_per_s or \
                    network.link(sites[site][0], sites[site][0]).rtt_ms > between.rtt_ms:
                break
        else:
            def covers(better: list[Offer], worse: list[Offer]) -> bool:
                return all(any(peer_rate(profile, b, 1, settings) >= peer_rate(profile, w, 1, settings)
                               and b.price_usd_per_hour <= w.price_usd_per_hour and (w.spot or not b.spot)
                               for b in better) for w in worse)

            for site in names:
                for other in names:
                    if other == site or other in dropped or other[1] in quotas:
                        continue
                    if covers(sites[other], sites[site]) and (not covers(sites[site], sites[other]) or other < site):
                        dropped.add(site)
                        break
    return [o for o in offers if o.site not in dropped]


def reduce_candidates(offers: list[Offer], inputs: Inputs) -> list[Offer]:
    """Large catalogs only (more than EXACT_OFFER_LIMIT offers after the exact pruning): an approximation.

    Each cloud and continent keeps its region with the lowest $ per sample/s, and of those the
    CANDIDATE_REGIONS cheapest stay; each kept region keeps its CANDIDATES_PER_REGION offers with the
    lowest $ per sample/s, its fastest spot and fastest on-demand offer, and its cheapest on-demand
    offer (an anchor). The MILPs are then exact over these candidates.
    benchmarks/planner_solve_time.py measures how often this changes the answer.
    """
    if len(offers) <= EXACT_OFFER_LIMIT:
        return offers
    profile, settings = inputs.profile, inputs.settings
    places = inputs.network.places()

    def ratio(o: Offer) -> float:
        return o.price_usd_per_hour / peer_rate(profile, o, 1, settings)

    by_site: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for offer in offers:
        by_site[offer.site].append(offer)
    by_class: dict[tuple, list[tuple[float, tuple[str, str]]]] = defaultdict(list)
    for site, members in by_site.items():
        o = members[0]
        by_class[(o.cloud, o.continent, o.region if o.region in places else "")].append(
            (min(ratio(m) for m in members), site))
    best_per_class = sorted(min(ranked) for ranked in by_class.values())
    kept_sites = {site for _, site in best_per_class[:CANDIDATE_REGIONS]}
    kept: list[Offer] = []
    for site in sorted(kept_sites):
        members = sorted(by_site[site], key=ratio)
        chosen = set(members[:CANDIDATES_PER_REGION])
        for group in ([m for m in members if m.spot], [m for m in members if not m.spot]):
            if group:
                chosen.add(max(group, key=lambda m: peer_rate(profile, m, 1, settings)))
        on_demand = [m for m in members if not m.spot]
        if on_demand:
            chosen.add(min(on_demand, key=lambda m: m.price_usd_per_hour))
        kept += [m for m in members if m in chosen]
    return kept


class _Context:
    """What every per-n program shares: offers, sites, network classes, prices."""

    def __init__(self, offers: list[Offer], inputs: Inputs, request: Request, coordinator: Offer | None):
        self.offers = offers
        self.inputs = inputs
        self.request = request
        self.coordinator = coordinator
        self.coordinator_usd_per_hour = coordinator.price_usd_per_hour if coordinator else 0.0
        self.sites = sorted({o.site for o in offers})
        self.site_index = {site: i for i, site in enumerate(self.sites)}
        self.representative = {}
        for o in offers:
            self.representative.setdefault(o.site, o)
        places = inputs.network.places()
        self.site_class = {}
        for site in self.sites:
            rep = self.representative[site]
            self.site_class[site] = (rep.cloud, rep.continent, rep.region if rep.region in places else "")
        self.classes = sorted(set(self.site_class.values()))
        self.class_sites = defaultdict(list)
        for site in self.sites:
            self.class_sites[self.site_class[site]].append(site)
        network = inputs.network
        self.same_site_link = {s: network.link(self.representative[s], self.representative[s]) for s in self.sites}
        self.class_internal_link = {}
        for a, members in self.class_sites.items():
            if len(members) >= 2:
                self.class_internal_link[a] = network.link(self.representative[members[0]],
                                                           self.representative[members[1]])
        self.class_pair_link = {}
        for i, a in enumerate(self.classes):
            for b in self.classes[i + 1:]:
                self.class_pair_link[(a, b)] = network.link(self.representative[self.class_sites[a][0]],
                                                            self.representative[self.class_sites[b][0]])
        spread = inputs.settings.spread_zones
        egress = inputs.egress
        self.egress_usd_per_gb = [[egress.usd_per_gb(self.representative[s], self.representative[t], spread)
                                   for t in self.sites] for s in self.sites]
        profile = inputs.profile
        self.data_usd_per_round = (profile.target_batch_size * profile.data_bytes_per_sample / GB
                                   * egress.data_loading_usd_per_gb("*"))
        self.programs_solved = 0

    # -- one swarm size --------------------------------------------------------------------------

    def single_vm(self, objective: str, budget: float | None, min_sps: float | None) -> dict[Offer, int] | None:
        """n = 1: every offer alone, evaluated directly (no all-reduce, nothing to optimise jointly)."""
        best, best_key = None, None
        request = Request(budget_usd_per_hour=budget, min_samples_per_second=min_sps)
        key = ranking_key(objective)
        for offer in self.offers:
            if self.inputs.settings.anchor == "trainer" and offer.spot:
                continue
            if offer.region in self.request.region_quota_gpus and \
                    offer.gpu_count > self.request.region_quota_gpus[offer.region]:
                continue
            prediction = self.evaluate({offer: 1})
            if satisfies(prediction, request) and (best_key is None or key(prediction) < best_key):
                best, best_key = {offer: 1}, key(prediction)
        return best

    def evaluate(self, counts: dict[Offer, int]) -> Prediction:
        inputs = self.inputs
        return evaluate(counts, inputs.profile, inputs.network, inputs.egress, inputs.settings, self.coordinator)

    def _fastest_comm_s(self, n: int) -> float:
        if n < 2:
            return 0.0
        profile = self.inputs.profile
        links = [*self.same_site_link.values(), *self.class_internal_link.values(), *self.class_pair_link.values()]
        return profile.round_overhead_s + min(transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms)
                                              for link in links)

    def could_meet(self, n: int, request: Request) -> bool:
        """False when n VMs can reach neither the throughput floor nor stay within the budget (no MILP needed)."""
        profile, settings = self.inputs.profile, self.inputs.settings
        if request.budget_usd_per_hour is not None and \
                n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour > \
                request.budget_usd_per_hour * (1 + 1e-9):
            return False
        if request.min_samples_per_second is not None:
            compute = profile.target_batch_size / (n * max(peer_rate(profile, o, n, settings) for o in self.offers))
            comm = self._fastest_comm_s(n)
            fastest = profile.target_batch_size / (max(compute, comm) if settings.overlap else compute + comm)
            if fastest < request.min_samples_per_second * (1 - 1e-9):
                return False
        return True

    def lower_bound(self, n: int, objective: str) -> float:
        """A bound no configuration of n VMs beats, found without a MILP (orders and prunes the sizes)."""
        profile, overlap = self.inputs.profile, self.inputs.settings.overlap
        tbs = profile.target_batch_size
        rates = [peer_rate(profile, o, n, self.inputs.settings) for o in self.offers]
        comm = self._fastest_comm_s(n)
        compute = tbs / (n * max(rates))
        if objective == "throughput":
            return max(compute, comm) if overlap else compute + comm
        # cost x T_calc >= TBS x min(price / rate) + coordinator x T_calc; cost x T_comm >= cheapest cost x T_comm
        cost_compute = tbs * min(o.price_usd_per_hour / r for o, r in zip(self.offers, rates)) \
            + self.coordinator_usd_per_hour * compute
        cost_comm = (n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour) * comm
        vm = max(cost_compute, cost_comm) if overlap else cost_compute + cost_comm
        return (vm / 3600 + self.data_usd_per_round) / tbs * 1e6

    def value(self, prediction: Prediction, objective: str) -> float:
        """The number the objective minimises: round time for throughput, $ per 1M samples otherwise."""
        if objective == "throughput":
            return self.inputs.profile.target_batch_size / prediction.samples_per_second
        return prediction.usd_per_million_samples

    def homogeneous(self, n: int, objective: str, request: Request) -> dict[Offer, int] | None:
        """The best configuration of n VMs of one offer: a quick incumbent that lets the MILPs prune."""
        best, best_key = None, None
        key = ranking_key(objective)
        quotas = request.region_quota_gpus
        for offer in self.offers:
            if n > 1 and offer.region in quotas and n * offer.gpu_count > quotas[offer.region]:
                continue
            if self.inputs.settings.anchor == "trainer" and offer.spot:
                continue
            prediction = self.evaluate({offer: n})
            if satisfies(prediction, request) and (best_key is None or key(prediction) < best_key):
                best, best_key = {offer: n}, key(prediction)
        return best

    def solve(self, n: int, objective: str, budget: float | None, min_sps: float | None,
              threshold: float = INF, start: dict[Offer, int] | None = None) -> dict[Offer, int] | None:
        """The best configuration of exactly n VMs, or None if none meets the constraints (or beats threshold).

        Branch and bound over the compute time per round ``T_calc = TBS / R``: a node is an interval
        [a, b] of it; its MILP bounds R to [TBS/b, TBS/a] and minimises a linear lower bound of the
        objective that is exact at T_calc = a. The configuration it returns is evaluated exactly;
        the node is split at that configuration's own T_calc, so the bound becomes exact there.
        ``start`` is a known configuration of n VMs (an incumbent to prune with).
        """
        if n == 1:
            return self.single_vm(objective, budget, min_sps)
        key = ranking_key(objective)
        request = Request(budget_usd_per_hour=budget, min_samples_per_second=min_sps)
        profile, settings = self.inputs.profile, self.inputs.settings
        rates = [peer_rate(profile, o, n, settings) for o in self.offers]
        tbs = profile.target_batch_size
        best, best_counts = None, None
        if start:
            best, best_counts = self.evaluate(start), start
        nodes = [(-INF, (tbs / (n * max(rates)), tbs / (n * min(rates))))]
        while nodes:
            nodes.sort(key=lambda item: item[0])
            bound, (a, b) = nodes.pop(0)
            incumbent = min(threshold, self.value(best, objective) if best else INF)
            if bound >= incumbent * (1 - 1e-7):
                break
            solved = self._solve_node(n, objective, budget, min_sps, a, b, incumbent)
            if solved is None:
                continue
            counts, node_bound = solved
            if node_bound >= incumbent * (1 - 1e-7):
                continue
            prediction = self.evaluate(counts)
            feasible = satisfies(prediction, request, tolerance=1e-9)
            if feasible and (best is None or key(prediction) < key(best)):
                best, best_counts = prediction, counts
                if node_bound >= self.value(best, objective) * (1 - 1e-7):
                    continue
            omega = prediction.compute_s_per_round
            if feasible and a < omega <= b:
                nodes.append((node_bound, (a, omega * (1 - 1e-6))))
                nodes.append((node_bound, (omega, b)))
            elif (b - a) > 1e-7 * b:
                middle = (a + b) / 2
                nodes.append((node_bound, (a, middle)))
                nodes.append((node_bound, (middle, b)))
        if best is None or self.value(best, objective) >= threshold * (1 - 1e-9):
            return None
        return best_counts

    def _solve_node(self, n: int, objective: str, budget: float | None, min_sps: float | None,
                    a: float, b: float, cutoff: float = INF) -> tuple[dict[Offer, int], float] | None:
        built = self._build(n, objective, budget, min_sps, a, b)
        if built is None:
            return None
        program, x, bound_terms, constant = built
        if cutoff < INF:
            # Only configurations whose bound beats the incumbent are of interest: say so to HiGHS.
            scale = 1.0 if objective == "throughput" else 3600 * self.inputs.profile.target_batch_size / 1e6
            program.row(dict(bound_terms), upper=cutoff * scale - constant)
        self.programs_solved += 1
        values = program.solve()
        if values is None:
            return None
        bound = constant + sum(c * values[var] for var, c in bound_terms.items())
        counts = {offer: int(round(values[var])) for offer, var in zip(self.offers, x) if round(values[var]) > 0}
        if objective != "throughput":
            bound = bound / 3600 / self.inputs.profile.target_batch_size * 1e6
        return counts, bound

    def _build(self, n: int, objective: str, budget: float | None, min_sps: float | None, a: float, b: float):
        """The MILP of one node: n VMs, compute time per round within [a, b]."""
        inputs, request = self.inputs, self.request
        profile, settings = inputs.profile, inputs.settings
        tbs = profile.target_batch_size
        p = Program()
        rates = [peer_rate(profile, o, n, settings) for o in self.offers]
        prices = [o.price_usd_per_hour for o in self.offers]

        # Per-offer counts, site counts and the quota/anchor/size constraints.
        x = [p.var(0, n, integer=True) for _ in self.offers]
        p.row({v: 1.0 for v in x}, n, n)
        rate_terms = {x[i]: r for i, r in enumerate(rates)}
        p.row(rate_terms, lower=tbs / b * (1 - 1e-12), upper=tbs / a * (1 + 1e-12))
        quotas = request.region_quota_gpus
        for region, gpus in quotas.items():
            terms = {x[i]: float(o.gpu_count) for i, o in enumerate(self.offers) if o.region == region}
            if terms:
                p.row(terms, upper=gpus)
        if settings.anchor == "trainer":
            terms = {x[i]: 1.0 for i, o in enumerate(self.offers) if not o.spot}
            if not terms:
                return None
            p.row(terms, lower=1)
        site_capacity = {}
        for site in self.sites:
            members = [o for o in self.offers if o.site == site]
            cap = n
            if site[1] in quotas:
                cap = min(n, max(n if o.gpu_count == 0 else quotas[site[1]] // o.gpu_count for o in members))
            site_capacity[site] = cap
        y = {}
        for site in self.sites:
            y[site] = p.var(0, site_capacity[site])
            terms = {x[i]: -1.0 for i, o in enumerate(self.offers) if o.site == site}
            terms[y[site]] = 1.0
            p.row(terms, 0, 0)

        # Network level: one-hot over the distinct slowest-link times.
        link_s = {}
        for site in self.sites:
            link = self.same_site_link[site]
            link_s[("site", site)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms)
        for cls, link in self.class_internal_link.items():
            link_s[("class", cls)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms)
        for pair, link in self.class_pair_link.items():
            link_s[("pair", pair)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms)
        levels = sorted({round(profile.round_overhead_s + s, 9) for s in link_s.values()})
        level = [p.binary() for _ in levels]
        p.row({v: 1.0 for v in level}, 1, 1)

        def allowed(seconds: float) -> dict[int, float]:
            limit = round(profile.round_overhead_s + seconds, 9)
            return {level[i]: 1.0 for i, value in enumerate(levels) if value >= limit - 1e-9}

        for site in self.sites:
            if site_capacity[site] >= 2:
                terms = {v: -(n - 1.0) for v in allowed(link_s[("site", site)])}
                terms[y[site]] = 1.0
                p.row(terms, upper=1)
        site_used = {}
        class_used = {}
        multi_class = len(self.classes) >= 2
        for site in self.sites:
            if multi_class or len(self.class_sites[self.site_class[site]]) >= 2:
                site_used[site] = p.binary()
                p.row({y[site]: 1.0, site_used[site]: -float(site_capacity[site])}, upper=0)
        for cls, members in self.class_sites.items():
            if len(members) >= 2:
                terms = {site_used[s]: 1.0 for s in members}
                for v in allowed(link_s[("class", cls)]):
                    terms[v] = -(len(members) - 1.0)
                p.row(terms, upper=1)
            if multi_class:
                class_used[cls] = p.binary()
                for s in members:
                    p.row({site_used[s]: 1.0, class_used[cls]: -1.0}, upper=0)
        for (first, second) in self.class_pair_link:
            terms = {class_used[first]: 1.0, class_used[second]: 1.0}
            for v in allowed(link_s[("pair", (first, second))]):
                terms[v] = -1.0
            p.row(terms, upper=1)

        # Egress per round: sum over sites of count x (price-weighted peers it sends to), linearised
        # exactly by writing each site's count in binary.
        egress_round: dict[int, float] = {}
        pair_gb = bytes_per_pair(profile, n) / GB
        if any(price > 0 for row in self.egress_usd_per_gb for price in row):
            for si, site in enumerate(self.sites):
                row_prices = self.egress_usd_per_gb[si]
                top = max(row_prices) * n
                if top <= 0:
                    continue
                bit_vars = [p.binary() for _ in range(max(1, site_capacity[site].bit_length()))]
                terms = {bv: -(2.0 ** k) for k, bv in enumerate(bit_vars)}
                terms[y[site]] = 1.0
                p.row(terms, 0, 0)
                for k, bv in enumerate(bit_vars):
                    w = p.var(0, top)
                    # w >= D_s - top * (1 - bit), with D_s = sum_t price(s->t) y_t - price(s->s)
                    terms = {w: 1.0, bv: -top}
                    for ti, t in enumerate(self.sites):
                        if row_prices[ti]:
                            terms[y[t]] = terms.get(y[t], 0.0) - row_prices[ti]
                    p.row(terms, lower=-row_prices[si] - top)
                    egress_round[w] = pair_gb * (2.0 ** k)

        # cost x T_comm, with T_comm = sum(level value x level binary): the cost is split over the
        # levels (c_l = cost if level l is chosen, else 0), which keeps the LP relaxation tight.
        coordinator = self.coordinator_usd_per_hour
        cost_lo, cost_hi = n * min(prices) + coordinator, n * max(prices) + coordinator
        cost_comm: dict[int, float] = {}
        split = {x[i]: -price for i, price in enumerate(prices)}
        for value, lv in zip(levels, level):
            c = p.var(0, cost_hi)
            p.row({c: 1.0, lv: -cost_hi}, upper=0)
            p.row({c: 1.0, lv: -cost_lo}, lower=0)
            split[c] = 1.0
            cost_comm[c] = value
        p.row(split, coordinator, coordinator)
        comm_terms = {lv: value for value, lv in zip(levels, level)}
        cost_terms = {x[i]: price for i, price in enumerate(prices)}
        fixed = 3600 * self.data_usd_per_round

        # T_calc = TBS / R is convex in R: tangents at a few points of [TBS/b, TBS/a] bound it from below.
        compute = p.var(a, b)
        r_lo, r_hi = tbs / b, tbs / a
        for j in range(TANGENTS):
            r0 = r_lo * (r_hi / r_lo) ** (j / (TANGENTS - 1)) if TANGENTS > 1 else r_hi
            # compute >= TBS/r0 - TBS/r0^2 (R - r0) = 2 TBS/r0 - TBS/r0^2 R
            p.row({compute: 1.0, **{v: tbs / r0 ** 2 * coef for v, coef in rate_terms.items()}}, lower=2 * tbs / r0)
        # cost x T_calc = TBS x sum(price/rate of each offer x its share of the throughput) + coordinator x T_calc.
        # The shares s_o = rate_o x_o / R lie within [rate_o x_o / R_hi, rate_o x_o / R_lo] and sum to 1:
        # linear, and exact once the node is narrow.
        shares = {}
        for i, (offer, rate) in enumerate(zip(self.offers, rates)):
            share = p.var(0, 1)
            p.row({share: 1.0, x[i]: -rate / r_hi}, lower=0)
            p.row({share: 1.0, x[i]: -rate / r_lo}, upper=0)
            shares[share] = tbs * prices[i] / rate
        p.row({v: 1.0 for v in shares}, 1, 1)
        vm_compute = p.var(0, INF)
        p.row({vm_compute: 1.0, **{v: -c for v, c in shares.items()}, compute: -coordinator}, lower=0)
        # 3600 x cost per round >= cost x T_calc + cost x T_comm (or the larger of them, with overlap)
        # + 3600 x (egress + data); exact when T_calc is at either end of the node.
        if settings.overlap:
            vm_cost = p.var(0, INF)
            p.row({vm_cost: 1.0, vm_compute: -1.0}, lower=0)
            p.row({vm_cost: 1.0, **{k: -v for k, v in cost_comm.items()}}, lower=0)
            round_cost, round_cost_const = {vm_cost: 1.0}, fixed
            round_time = p.var(0, INF)
            p.row({round_time: 1.0, compute: -1.0}, lower=0)
            p.row({round_time: 1.0, **{k: -v for k, v in comm_terms.items()}}, lower=0)
            time_terms, time_const = {round_time: 1.0}, 0.0
        else:
            round_cost = {vm_compute: 1.0, **cost_comm}
            round_cost_const = fixed
            time_terms, time_const = {compute: 1.0, **comm_terms}, 0.0
        for k, v in egress_round.items():
            round_cost[k] = round_cost.get(k, 0.0) + 3600 * v

        if budget is not None:
            # cost/h <= budget  <=>  (budget - cost) x round time >= 3600 x (egress + data) per round.
            # Relaxed with T_calc <= b (exactness comes from evaluating the result):
            # budget x (b + T_comm) - cost x b - cost x T_comm - 3600 x (egress + data) >= 0
            p.row(cost_terms, upper=budget - coordinator)
            terms = {x[i]: -b * pr for i, pr in enumerate(prices)}
            for k, v in comm_terms.items():
                terms[k] = terms.get(k, 0.0) + budget * v
            for k, v in cost_comm.items():
                terms[k] = -v
            for k, v in egress_round.items():
                terms[k] = terms.get(k, 0.0) - 3600 * v
            p.row(terms, lower=fixed + b * coordinator - budget * b)
        if min_sps is not None:
            # TBS / R + T_comm <= TBS / min_sps, exact per level: R >= TBS / (TBS / min_sps - level).
            limit = tbs / min_sps
            r_cap = n * max(rates)
            for value, lv in zip(levels, level):
                if (settings.overlap and value > limit) or (not settings.overlap and value >= limit):
                    p.row({lv: 1.0}, upper=0)
                    continue
                need = tbs / limit if settings.overlap else tbs / (limit - value)
                p.row({**rate_terms, lv: -r_cap}, lower=need - r_cap)

        if objective == "throughput":
            # Lower bound of the round time, and a small pull towards more compute (a tie-break only).
            for k, v in time_terms.items():
                p.objective[k] += v
            r_scale = 1e-6 * a / (n * max(rates))
            for k, v in rate_terms.items():
                p.objective[k] -= r_scale * v
            return p, x, time_terms, time_const
        for k, v in round_cost.items():
            p.objective[k] += v
        return p, x, round_cost, round_cost_const


def plan(inputs: Inputs, request: Request, objective: str | None = None, top: int = 5) -> Plan:
    """The best configuration of each swarm size, the ``top`` best of them ranked by the objective.

    Sizes are visited in order of a cheap bound; a size whose bound cannot beat the ``top``-th best
    found so far is skipped, so ``top=request.max_peers`` yields every size (the frontier plot).
    """
    objective = objective or request.objective
    if objective not in OBJECTIVES:
        raise PlannerError(f"objective {objective!r} is unknown; expected one of {', '.join(OBJECTIVES)}")
    if request.max_peers < 1:
        raise PlannerError(f"--max-peers is {request.max_peers}; expected at least 1")
    started = time.perf_counter()
    allowed = select_offers(inputs, request)
    coordinator = choose_coordinator(allowed, inputs.settings)
    usable = trainable_offers(allowed, inputs.profile)
    pruned = prune_dominated(usable, inputs.profile, inputs.settings, request.region_quota_gpus)
    pruned = prune_dominated_sites(pruned, inputs, request.region_quota_gpus)
    exact = len(pruned) <= EXACT_OFFER_LIMIT
    pruned = reduce_candidates(pruned, inputs)
    context = _Context(pruned, inputs, request, coordinator)
    found: list[Prediction] = []
    sizes = [n for n in range(1, request.max_peers + 1) if context.could_meet(n, request)]
    # Quick incumbents (n VMs of one offer) give every size a start and the top-k a first threshold:
    # the k-th best of the sizes' known values bounds the k-th best size from above.
    starts = {n: context.homogeneous(n, objective, request) for n in sizes if n > 1}
    known = {n: context.value(context.evaluate(c), objective) for n, c in starts.items() if c}
    for bound, n in sorted((context.lower_bound(n, objective), n) for n in sizes):
        own = known.pop(n, None)
        others = sorted(known.values())
        threshold = others[top - 1] if len(others) >= top else INF
        if bound >= threshold * (1 - 1e-9):
            continue  # this size cannot enter the top
        if own is not None and own <= bound * (1 + 1e-9):
            counts = starts[n]  # its quick incumbent already meets the bound: optimal, no MILP needed
        else:
            counts = context.solve(n, objective, request.budget_usd_per_hour, request.min_samples_per_second,
                                   threshold, starts.get(n))
        if counts:
            prediction = context.evaluate(counts)
            if satisfies(prediction, request, tolerance=1e-9):
                found.append(prediction)
                known[n] = context.value(prediction, objective)
    found.sort(key=ranking_key(objective))
    if not found:
        raise PlannerError(diagnose(context, request))
    return Plan(candidates=found[:top], coordinator=coordinator, offers_considered=len(usable),
                offers_after_pruning=len(pruned), programs_solved=context.programs_solved,
                solve_s=time.perf_counter() - started, exact=exact)


def diagnose(context: _Context, request: Request) -> str:
    """Name the constraint that makes the request infeasible, with what would be reachable instead."""
    max_peers = request.max_peers
    quota_note = " and the region quotas" if request.region_quota_gpus else ""

    def best(objective_name: str, budget: float | None, min_sps: float | None) -> Prediction | None:
        options = []
        for n in range(1, max_peers + 1):
            counts = context.solve(n, objective_name, budget, min_sps)
            if counts:
                options.append(context.evaluate(counts))
        options.sort(key=ranking_key(objective_name))
        return options[0] if options else None

    fastest = best("throughput", None, None)
    if fastest is None:
        return (f"no configuration satisfies --max-peers {max_peers}{quota_note} with the on-demand anchor "
                f"({context.inputs.settings.anchor}); allow more GPUs per region or another anchor")
    budget, min_sps = request.budget_usd_per_hour, request.min_samples_per_second
    if min_sps is not None and fastest.samples_per_second < min_sps:
        return (f"--min-samples-per-second {min_sps:g} is out of reach: with --max-peers {max_peers}{quota_note} "
                f"the fastest configuration ({fastest.describe()}) reaches {fastest.samples_per_second:.1f} samples/s; "
                "raise --max-peers, allow more regions/clouds, or lower --min-samples-per-second")
    if budget is not None:
        cheapest = min((context.evaluate({o: 1}) for o in context.offers
                        if context.inputs.settings.anchor != "trainer" or not o.spot),
                       key=lambda p: p.usd_per_hour, default=None)
        if cheapest is not None and cheapest.usd_per_hour > budget:
            return (f"--budget-usd-per-hour {budget:g} is below the cheapest configuration, "
                    f"{cheapest.describe()} with its coordinator at ${cheapest.usd_per_hour:.3f}/h; raise the budget")
        within = best("throughput", budget, None)
        if within is not None and min_sps is not None:
            return (f"--budget-usd-per-hour {budget:g} and --min-samples-per-second {min_sps:g} cannot both hold: "
                    f"within the budget the fastest configuration ({within.describe()}) reaches "
                    f"{within.samples_per_second:.1f} samples/s at ${within.usd_per_hour:.2f}/h; "
                    "raise the budget or lower the minimum throughput")
    return "no configuration satisfies the request; relax --budget-usd-per-hour or --min-samples-per-second"
