"""The best configuration of exactly n VMs: branch and bound over compute time per round, one MILP per node.

See :mod:`geotrain.planner.solve` for why the model is split this way; this module writes the node
programs (:meth:`SizeSearch.node_program`) and runs the search (:meth:`SizeSearch.solve`).

With n fixed, the samples per averaging round ``S`` (TBS in sync mode, ``H x b x n`` in diloco mode,
:func:`geotrain.planner.model.samples_per_round`) are a constant, so one program serves both modes. A
node program minimises a per-round figure (round seconds, or 3600 x $ per round); :meth:`SizeSearch.value`
puts it per 1M samples (:meth:`SizeSearch.per_million_samples`), which compares across sizes.
"""

from __future__ import annotations

from collections import defaultdict

from geotrain.pricing.catalog import Offer
from geotrain.planner.milp import INF, Program, Solution
from geotrain.planner.model import GB, Prediction, bytes_per_pair, evaluate, peer_rate, samples_per_round, transfer_s
from geotrain.planner.problem import Inputs, Request, ranking_key, satisfies

# Tangent points of T_calc = S / R per node: more make the bound tighter inside the node.
TANGENTS = 6


def budget_rate_bound(n: int, spend_usd_per_hour: float, prices: list[float], rates: list[float]) -> float:
    """The most samples/s n VMs can reach for ``spend_usd_per_hour``: the LP relaxation, solved in closed form.

    max sum(rate x) s.t. sum(x) = n, sum(price x) <= spend, x >= 0 has an optimal vertex with at most two
    offers: one alone (if n of it fit), or a cheap and a dear one mixed so that the spend is used up.
    Quotas, egress and integrality are left out, so this bounds every configuration from above.
    """
    best = 0.0
    # Per price, only the fastest offer matters; and a dearer offer is only useful if it is faster.
    frontier: list[tuple[float, float]] = []
    for price, rate in sorted(zip(prices, rates), key=lambda item: (item[0], -item[1])):
        if not frontier or rate > frontier[-1][1]:
            frontier.append((price, rate))
    for i, (cheap_price, cheap_rate) in enumerate(frontier):
        if n * cheap_price > spend_usd_per_hour * (1 + 1e-12):
            break
        best = max(best, n * cheap_rate)
        for dear_price, dear_rate in frontier[i + 1:]:
            dear_count = min(n, (spend_usd_per_hour - n * cheap_price) / (dear_price - cheap_price))
            best = max(best, n * cheap_rate + dear_count * (dear_rate - cheap_rate))
    return best


class SizeSearch:
    """What every per-n program shares (offers, sites, network classes, prices), and the search itself."""

    def __init__(self, offers: list[Offer], inputs: Inputs, request: Request, coordinator: Offer | None):
        self.offers = offers
        self.inputs = inputs
        self.request = request
        self.coordinator = coordinator
        self.coordinator_usd_per_hour = coordinator.price_usd_per_hour if coordinator else 0.0
        self.sites = sorted({o.site for o in offers})
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
        # Data loading per round: S x bytes per sample at the price of the VM that reads each sample;
        # the cheapest reader's price bounds it from below where no MILP is solved.
        self.data_gb_per_sample = profile.data_bytes_per_sample / GB
        self.data_usd_per_gb = [egress.data_loading_usd_per_gb(o) for o in offers]
        self.cheapest_data_usd_per_gb = min(self.data_usd_per_gb, default=0.0)
        self.programs_solved = 0
        # Programs that HiGHS stopped at the time limit: with a solution (used, maybe not optimal, with
        # the largest gap HiGHS reported) and without one (that part of the search is unknown).
        self.time_limited = 0
        self.time_limited_unsolved = 0
        self.largest_gap: float | None = None

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

    def cheapest_single_vm(self) -> Prediction | None:
        """The one VM (with the coordinator, if any) of lowest $/h that the quotas and the anchor allow.

        More VMs add their prices and egress, so this is the cheapest configuration per hour (up to
        data loading, which grows with samples/s); it needs no MILP.
        """
        options = [self.evaluate({offer: 1}) for offer in self.offers
                   if not (self.inputs.settings.anchor == "trainer" and offer.spot)
                   and not (offer.region in self.request.region_quota_gpus
                            and offer.gpu_count > self.request.region_quota_gpus[offer.region])]
        return min(options, key=lambda p: p.usd_per_hour, default=None)

    def samples_per_round(self, n: int) -> int:
        """S: samples a swarm of n VMs trains per averaging round (TBS, or H x b x n in diloco mode)."""
        return samples_per_round(self.inputs.profile, self.inputs.settings, n)

    def data_usd_per_round(self, n: int) -> float:
        """Data loading of one round of n VMs at the cheapest reader's price (a lower bound)."""
        return self.samples_per_round(n) * self.data_gb_per_sample * self.cheapest_data_usd_per_gb

    def per_million_samples(self, n: int, objective: str) -> float:
        """Turns what a node program of n VMs minimises per round into :meth:`value`'s units.

        Throughput: round seconds to seconds per 1M samples; cost: 3600 x $ per round to $ per 1M samples.
        """
        factor = 1e6 / self.samples_per_round(n)
        return factor if objective == "throughput" else factor / 3600

    def evaluate(self, counts: dict[Offer, int]) -> Prediction:
        inputs = self.inputs
        return evaluate(counts, inputs.profile, inputs.network, inputs.egress, inputs.settings, self.coordinator)

    def _fastest_comm_s(self, n: int) -> float:
        if n < 2:
            return 0.0
        profile, settings = self.inputs.profile, self.inputs.settings
        links = [*self.same_site_link.values(), *self.class_internal_link.values(), *self.class_pair_link.values()]
        return profile.round_overhead_s + min(transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms, settings)
                                              for link in links)

    def could_meet(self, n: int, request: Request) -> bool:
        """False when n VMs can reach neither the throughput floor nor stay within the budget (no MILP needed)."""
        profile, settings = self.inputs.profile, self.inputs.settings
        if request.budget_usd_per_hour is not None and \
                n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour > \
                request.budget_usd_per_hour * (1 + 1e-9):
            return False
        if request.min_samples_per_second is not None:
            round_samples = self.samples_per_round(n)
            compute = round_samples / (n * max(peer_rate(profile, o, n, settings) for o in self.offers))
            comm = self._fastest_comm_s(n)
            fastest = round_samples / (max(compute, comm) if settings.overlap else compute + comm)
            if fastest < request.min_samples_per_second * (1 - 1e-9):
                return False
        return True

    def lower_bound(self, n: int, objective: str) -> float:
        """A bound no configuration of n VMs beats, found without a MILP (orders and prunes the sizes)."""
        profile, overlap = self.inputs.profile, self.inputs.settings.overlap
        round_samples = self.samples_per_round(n)
        rates = [peer_rate(profile, o, n, self.inputs.settings) for o in self.offers]
        comm = self._fastest_comm_s(n)
        fastest = n * max(rates)
        budget = self.request.budget_usd_per_hour
        if budget is not None:
            # Within the budget: each VM costs at most what the other n-1 cheapest leave, and R is at
            # most the best samples/s per dollar times the dollars available.
            spend = budget - self.coordinator_usd_per_hour
            cheapest = min(o.price_usd_per_hour for o in self.offers)
            affordable = [r for o, r in zip(self.offers, rates) if o.price_usd_per_hour <= spend - (n - 1) * cheapest]
            if not affordable:
                return INF
            fastest = min(n * max(affordable), budget_rate_bound(n, spend, [o.price_usd_per_hour for o in self.offers],
                                                                rates))
        compute = round_samples / fastest
        if objective == "throughput":
            return (max(compute, comm) if overlap else compute + comm) * self.per_million_samples(n, objective)
        # cost x T_calc >= S x min(price / rate) + coordinator x T_calc; cost x T_comm >= cheapest cost x T_comm
        cost_compute = round_samples * min(o.price_usd_per_hour / r for o, r in zip(self.offers, rates)) \
            + self.coordinator_usd_per_hour * compute
        cost_comm = (n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour) * comm
        vm = max(cost_compute, cost_comm) if overlap else cost_compute + cost_comm
        return (vm + 3600 * self.data_usd_per_round(n)) * self.per_million_samples(n, objective)

    def value(self, prediction: Prediction, objective: str) -> float:
        """The number the objective minimises, comparable across sizes and modes: seconds per 1M samples for
        throughput, $ per 1M samples otherwise."""
        if objective == "throughput":
            return 1e6 / prediction.samples_per_second
        return prediction.usd_per_million_samples

    def homogeneous(self, n: int, objective: str, request: Request) -> dict[Offer, int] | None:
        """A quick incumbent that lets the MILPs prune: the best n VMs of one site, of one or two offers.

        Within one site the link, the egress per round and the data price do not depend on the mix, so
        every split of n between two offers is scored in closed form; only the winner is evaluated
        with the full model (which decides: the closed form only ranks).
        """
        inputs = self.inputs
        profile, settings = inputs.profile, inputs.settings
        round_samples, overlap = self.samples_per_round(n), settings.overlap
        quotas = request.region_quota_gpus
        budget, min_sps = request.budget_usd_per_hour, request.min_samples_per_second
        pair_gb = bytes_per_pair(profile, n, settings) / GB if n > 1 else 0.0
        by_site: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, offer in enumerate(self.offers):
            by_site[offer.site].append(i)
        rates = [peer_rate(profile, o, n, settings) for o in self.offers]
        scored = []
        for site, members in by_site.items():
            rep = self.representative[site]
            comm = 0.0
            if n > 1:
                link = self.same_site_link[site]
                comm = profile.round_overhead_s + transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms,
                                                             settings)
            traffic_usd = n * (n - 1) * pair_gb * inputs.egress.usd_per_gb(rep, rep, settings.spread_zones) \
                + round_samples * self.data_gb_per_sample * inputs.egress.data_loading_usd_per_gb(rep)
            quota = quotas.get(site[1])
            for a_index, i in enumerate(members):
                for j in members[a_index:]:
                    for k in range(n, 0, -1) if i != j else (n,):
                        counts = {i: k, j: n - k} if i != j else {i: n}
                        if quota is not None and sum(c * self.offers[o].gpu_count for o, c in counts.items()) > quota:
                            continue
                        if settings.anchor == "trainer" and all(self.offers[o].spot for o, c in counts.items() if c):
                            continue
                        rate = sum(c * rates[o] for o, c in counts.items())
                        round_s = max(round_samples / rate, comm) if overlap else round_samples / rate + comm
                        usd_per_hour = sum(c * self.offers[o].price_usd_per_hour for o, c in counts.items()) \
                            + self.coordinator_usd_per_hour + traffic_usd * 3600 / round_s
                        if budget is not None and usd_per_hour > budget * (1 + 1e-9):
                            continue
                        if min_sps is not None and round_samples / round_s < min_sps * (1 - 1e-9):
                            continue
                        value = round_s if objective == "throughput" else usd_per_hour * round_s / round_samples
                        scored.append((value, -rate, site, tuple(sorted(counts.items()))))
        key = ranking_key(objective)
        best, best_key = None, None
        for *_, items in sorted(scored)[:3]:
            counts = {self.offers[o]: c for o, c in items if c}
            prediction = self.evaluate(counts)
            if satisfies(prediction, request) and (best_key is None or key(prediction) < best_key):
                best, best_key = counts, key(prediction)
        return best

    def solve(self, n: int, objective: str, budget: float | None, min_sps: float | None,
              threshold: float = INF, start: dict[Offer, int] | None = None) -> dict[Offer, int] | None:
        """The best configuration of exactly n VMs, or None if none meets the constraints (or beats threshold).

        Branch and bound over the compute time per round ``T_calc = S / R``: a node is an interval
        [a, b] of it; its MILP bounds R to [S/b, S/a] and minimises a linear lower bound of the
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
        round_samples = self.samples_per_round(n)
        best, best_counts = None, None
        if start:
            best, best_counts = self.evaluate(start), start
        # The root interval of T_calc, narrowed by what no better configuration can escape: the budget's
        # most samples/s (LP bound), the throughput floor, and for the throughput objective the incumbent.
        low, high = round_samples / (n * max(rates)), round_samples / (n * min(rates))
        comm = self._fastest_comm_s(n)
        overlap = settings.overlap
        if budget is not None:
            most = budget_rate_bound(n, budget - self.coordinator_usd_per_hour,
                                     [o.price_usd_per_hour for o in self.offers], rates)
            low = max(low, round_samples / most * (1 - 1e-9)) if most > 0 else INF
        if min_sps is not None:
            high = min(high, (round_samples / min_sps - (0.0 if overlap else comm)) * (1 + 1e-9))
        incumbent = min(threshold, self.value(best, objective) if best else INF)
        if objective == "throughput":
            round_s = incumbent / self.per_million_samples(n, objective)
            high = min(high, (round_s - (0.0 if overlap else comm)) * (1 + 1e-9))
        elif incumbent < INF:
            # $ per 1M samples = $/h x round time / (3600 S) x 1e6, and $/h is at least the n cheapest VMs.
            cheapest_usd_per_hour = n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour
            if cheapest_usd_per_hour > 0:
                round_s = incumbent / self.per_million_samples(n, objective) / cheapest_usd_per_hour
                high = min(high, (round_s - (0.0 if overlap else comm)) * (1 + 1e-9))
        if low > high:
            nodes = []
        else:
            nodes = [(-INF, (low, high))]
        while nodes:
            nodes.sort(key=lambda item: item[0])
            bound, (a, b) = nodes.pop(0)
            incumbent = min(threshold, self.value(best, objective) if best else INF)
            if bound >= incumbent * (1 - 1e-7):
                break
            solved = self._solve_node(n, objective, budget, min_sps, a, b, incumbent)
            if solved is None:
                continue
            counts, node_bound, time_limited = solved
            if not time_limited and node_bound >= incumbent * (1 - 1e-7):
                continue
            prediction = self.evaluate(counts)
            feasible = satisfies(prediction, request, tolerance=1e-9)
            if feasible and (best is None or key(prediction) < key(best)):
                best, best_counts = prediction, counts
                if node_bound >= self.value(best, objective) * (1 - 1e-7):
                    continue
            if time_limited:
                # HiGHS's answer is the best it found, not a bound: keep it, but search this interval
                # no further (each child could take as long); the plan then says it may not be optimal.
                continue
            omega = prediction.compute_s_per_round
            if feasible and a < omega <= b:
                children = [(a, omega * (1 - 1e-6)), (omega, b)]
            elif not feasible and a < omega < b * (1 - 1e-6):
                # Over the budget only because the node relaxes it with T_calc <= b: below omega the relaxation
                # is exact at this configuration, above it the configuration is out of the interval.
                children = [(a, omega), (omega * (1 + 1e-6), b)]
            elif not feasible and a < omega * (1 - 1e-6) and omega >= b * (1 - 1e-6):
                # Over the budget at the node's upper end (by a margin the relaxation's tolerances let
                # through): only the sliver within the 1e-6 tolerance goes.
                children = [(a, omega * (1 - 1e-6))]
            elif (b - a) > 1e-7 * b:
                children = [(a, (a + b) / 2), ((a + b) / 2, b)]
            else:
                children = []
            for child in children:
                nodes.append((max(node_bound, self._interval_bound(n, objective, child[0])), child))
        if best is None or self.value(best, objective) >= threshold * (1 - 1e-9):
            return None
        return best_counts

    def _interval_bound(self, n: int, objective: str, compute_s: float) -> float:
        """A bound for every configuration of n VMs computing at least ``compute_s`` per round (no MILP)."""
        overlap = self.inputs.settings.overlap
        comm = self._fastest_comm_s(n)
        round_s = max(compute_s, comm) if overlap else compute_s + comm
        if objective == "throughput":
            return round_s * self.per_million_samples(n, objective)
        cheapest = n * min(o.price_usd_per_hour for o in self.offers) + self.coordinator_usd_per_hour
        return (cheapest * round_s + 3600 * self.data_usd_per_round(n)) * self.per_million_samples(n, objective)

    def _solve_node(self, n: int, objective: str, budget: float | None, min_sps: float | None,
                    a: float, b: float, cutoff: float = INF) -> tuple[dict[Offer, int], float, bool] | None:
        """The node MILP's configuration, its objective bound, and whether HiGHS stopped at the time limit.

        None when the node is infeasible, or when HiGHS stopped at the time limit without a solution
        (counted in ``time_limited_unsolved``).
        """
        built = self.node_program(n, objective, budget, min_sps, a, b)
        if built is None:
            return None
        program, x, bound_terms, constant = built
        if cutoff < INF:
            # Only configurations whose bound beats the incumbent are of interest: say so to HiGHS.
            program.row(dict(bound_terms), upper=cutoff / self.per_million_samples(n, objective) - constant)
        self.programs_solved += 1
        solution = program.solve(time_limit_s=self.request.solver_time_limit_s)
        self._note(solution)
        values = solution.values
        if values is None:
            return None
        bound = constant + sum(c * values[var] for var, c in bound_terms.items())
        counts = {offer: int(round(values[var])) for offer, var in zip(self.offers, x) if round(values[var]) > 0}
        return counts, bound * self.per_million_samples(n, objective), solution.time_limited

    def _note(self, solution: Solution) -> None:
        if not solution.time_limited:
            return
        self.time_limited += 1
        if solution.values is None:
            self.time_limited_unsolved += 1
        elif solution.gap is not None:
            self.largest_gap = max(self.largest_gap or 0.0, solution.gap)

    def node_program(self, n: int, objective: str, budget: float | None, min_sps: float | None, a: float, b: float):
        """The MILP of one node: n VMs, compute time per round within [a, b]."""
        inputs, request = self.inputs, self.request
        profile, settings = inputs.profile, inputs.settings
        round_samples = self.samples_per_round(n)  # S: TBS in sync mode, H x b x n in diloco mode
        p = Program()
        rates = [peer_rate(profile, o, n, settings) for o in self.offers]
        prices = [o.price_usd_per_hour for o in self.offers]

        # Per-offer counts, site counts and the quota/anchor/size constraints.
        x = [p.var(0, n, integer=True) for _ in self.offers]
        p.row({v: 1.0 for v in x}, n, n)
        rate_terms = {x[i]: r for i, r in enumerate(rates)}
        p.row(rate_terms, lower=round_samples / b * (1 - 1e-12), upper=round_samples / a * (1 + 1e-12))
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
            link_s[("site", site)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms, settings)
        for cls, link in self.class_internal_link.items():
            link_s[("class", cls)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms, settings)
        for pair, link in self.class_pair_link.items():
            link_s[("pair", pair)] = transfer_s(profile, n, link.bandwidth_gbit_per_s, link.rtt_ms, settings)
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
        pair_gb = bytes_per_pair(profile, n, settings) / GB
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

        # T_calc = S / R is convex in R: tangents at a few points of [S/b, S/a] bound it from below.
        compute = p.var(a, b)
        r_lo, r_hi = round_samples / b, round_samples / a
        for j in range(TANGENTS):
            r0 = r_lo * (r_hi / r_lo) ** (j / (TANGENTS - 1)) if TANGENTS > 1 else r_hi
            # compute >= S/r0 - S/r0^2 (R - r0) = 2 S/r0 - S/r0^2 R
            p.row({compute: 1.0, **{v: round_samples / r0 ** 2 * coef for v, coef in rate_terms.items()}},
                  lower=2 * round_samples / r0)
        # cost x T_calc = S x sum(price/rate of each offer x its share of the throughput) + coordinator x T_calc.
        # The shares s_o = rate_o x_o / R lie within [rate_o x_o / R_hi, rate_o x_o / R_lo] and sum to 1:
        # linear, and exact once the node is narrow.
        shares = {}
        for i, (offer, rate) in enumerate(zip(self.offers, rates)):
            share = p.var(0, 1)
            p.row({share: 1.0, x[i]: -rate / r_hi}, lower=0)
            p.row({share: 1.0, x[i]: -rate / r_lo}, upper=0)
            shares[share] = round_samples * prices[i] / rate
        p.row({v: 1.0 for v in shares}, 1, 1)
        vm_compute = p.var(0, INF)
        p.row({vm_compute: 1.0, **{v: -c for v, c in shares.items()}, compute: -coordinator}, lower=0)
        # Data loading: each VM reads its share of the round's samples at its own price (3600 x $ per round).
        data_terms: dict[int, float] = {}
        if self.data_gb_per_sample and any(self.data_usd_per_gb):
            data = p.var(0, INF)
            p.row({data: 1.0, **{share: -3600 * round_samples * self.data_gb_per_sample * self.data_usd_per_gb[i]
                                 for i, share in enumerate(shares)}}, lower=0)
            data_terms[data] = 1.0
        # 3600 x cost per round >= cost x T_calc + cost x T_comm (or the larger of them, with overlap)
        # + 3600 x (egress + data); exact when T_calc is at either end of the node.
        if settings.overlap:
            vm_cost = p.var(0, INF)
            p.row({vm_cost: 1.0, vm_compute: -1.0}, lower=0)
            p.row({vm_cost: 1.0, **{k: -v for k, v in cost_comm.items()}}, lower=0)
            round_cost, round_cost_const = {vm_cost: 1.0, **data_terms}, 0.0
            round_time = p.var(0, INF)
            p.row({round_time: 1.0, compute: -1.0}, lower=0)
            p.row({round_time: 1.0, **{k: -v for k, v in comm_terms.items()}}, lower=0)
            time_terms, time_const = {round_time: 1.0}, 0.0
        else:
            round_cost = {vm_compute: 1.0, **cost_comm, **data_terms}
            round_cost_const = 0.0
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
            for k, v in data_terms.items():
                terms[k] = terms.get(k, 0.0) - v
            p.row(terms, lower=b * coordinator - budget * b)
        if min_sps is not None:
            # S / R + T_comm <= S / min_sps, exact per level: R >= S / (S / min_sps - level).
            limit = round_samples / min_sps
            r_cap = n * max(rates)
            for value, lv in zip(levels, level):
                if (settings.overlap and value > limit) or (not settings.overlap and value >= limit):
                    p.row({lv: 1.0}, upper=0)
                    continue
                need = round_samples / limit if settings.overlap else round_samples / (limit - value)
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
