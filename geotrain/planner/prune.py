"""Shrinking the catalog before the MILPs: the request's filters, exact dominance, and (for large catalogs) candidates.

Exact: within a region an offer is dropped when another is at least as fast after interruptions,
no dearer, needs no more GPUs of a quota and is on demand whenever it is; a whole region is dropped
when another region of the same cloud and continent covers all its offers. Approximate, only above
EXACT_OFFER_LIMIT offers: :func:`reduce_candidates`.
"""

from __future__ import annotations

from collections import defaultdict

from geotrain.pricing.catalog import Offer
from geotrain.planner.errors import PlannerError
from geotrain.planner.model import Settings, peer_rate, standalone_samples_per_second
from geotrain.planner.problem import Inputs, Request
from geotrain.planner.profiles import ModelProfile

# Above this many offers (after exact pruning) the candidates are reduced; see reduce_candidates.
EXACT_OFFER_LIMIT = 100
CANDIDATES_PER_REGION = 3
CANDIDATE_REGIONS = 6


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


def reduce_candidates(offers: list[Offer], inputs: Inputs, request: Request) -> list[Offer]:
    """Large catalogs only (more than EXACT_OFFER_LIMIT offers after the exact pruning): an approximation.

    Each cloud and continent keeps its region with the lowest $ per sample/s, and of those the
    CANDIDATE_REGIONS cheapest stay; each kept region keeps its CANDIDATES_PER_REGION offers with the
    lowest $ per sample/s, its fastest spot and fastest on-demand offer, the two fastest of each that
    fit the budget, and its cheapest on-demand offer (an anchor). The MILPs are then exact over these
    candidates.
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
            fastest_first = sorted(group, key=lambda m: -peer_rate(profile, m, 1, settings))
            chosen.update(fastest_first[:1])
            if request.budget_usd_per_hour is not None:
                chosen.update([m for m in fastest_first if m.price_usd_per_hour <= request.budget_usd_per_hour][:2])
        on_demand = [m for m in members if not m.spot]
        if on_demand:
            chosen.add(min(on_demand, key=lambda m: m.price_usd_per_hour))
        kept += [m for m in members if m in chosen]
    return kept
