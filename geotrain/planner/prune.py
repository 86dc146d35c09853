"""Shrinking the catalog before the MILPs: the request's filters, exact dominance, and (for large catalogs) candidates.

Exact: within a region an offer is dropped when another is at least as fast after interruptions,
no dearer, needs no more GPUs of a quota and is on demand whenever it is; a whole region is dropped
when another region of the same cloud and continent covers all its offers. Approximate, only above
EXACT_OFFER_LIMIT offers: :func:`reduce_candidates`.
"""

from __future__ import annotations

import difflib
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


def check_names(offers: list[Offer], request: Request) -> None:
    """Refuse a cloud, region or continent that no offer of the catalog has (``--regions europe-wes4``,
    ``--quota us-centrall=2``): left alone it would be ignored, and the plan silently differ from the request.
    The message suggests the closest name the catalog has."""
    requested = (("--clouds", request.clouds, "cloud"), ("--regions", request.regions, "region"),
                 ("--continents", request.continents, "continent"),
                 ("--quota", request.region_quota_gpus.keys() if request.region_quota_gpus else None, "region"))
    for flag, names, attribute in requested:
        known = sorted({getattr(o, attribute) for o in offers})
        unknown = sorted(set(names or ()) - set(known))
        if not unknown:
            continue
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            described.append(f"{name!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise PlannerError(f"{flag}: the catalog has no {attribute} {', '.join(described)}; its {attribute}s are "
                           f"{', '.join(known)}; fix the name, or add the {attribute}'s VMs to the catalog (--catalog)")


def select_offers(inputs: Inputs, request: Request) -> list[Offer]:
    """The offers the request allows, failing with a message that names the filter that emptied the list
    or a name the catalog does not have (:func:`check_names`)."""
    offers = inputs.offers
    check_names(offers, request)
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


def choose_coordinator(offers: list[Offer], settings: Settings, catalog: list[Offer] | None = None) -> Offer | None:
    """The coordinator needs no GPU: the cheapest on-demand CPU-only VM allowed, else of the whole catalog.

    Only when the catalog has no on-demand CPU-only VM at all does a GPU VM hold durable state (the
    cheapest on-demand one allowed): on a T4 at $0.572/h that adds 40% to 8 spot T4s.
    """
    if settings.anchor != "coordinator":
        return None

    def cheapest(candidates: list[Offer]) -> Offer | None:
        return min(candidates, default=None,
                   key=lambda o: (o.price_usd_per_hour, o.gpu_count, o.cloud, o.region, o.instance_type))

    for pool in (offers, catalog or []):
        cpu = cheapest([o for o in pool if not o.spot and o.gpu_count == 0])
        if cpu is not None:
            return cpu
    on_demand = cheapest([o for o in offers if not o.spot])
    if on_demand is None:
        raise PlannerError("the coordinator needs an on-demand VM for durable state, but no allowed offer is "
                           "on demand; allow a cloud or region with on-demand prices, or use --anchor trainer")
    return on_demand


def trainable_offers(offers: list[Offer], profile: ModelProfile) -> tuple[list[Offer], list[str]]:
    """The offers this profile can train on, and one note per kind of VM left out (why, for the plan's output).

    Left out: VMs whose GPU has no samples/s in the profile (no published or measured figure), and
    VMs the catalog lists with less memory than the profile's ``min_vm_memory_gb``.
    """
    usable, no_rate, too_small = [], {}, {}
    for o in offers:
        kind = f"{o.cloud} {o.instance_type} ({o.gpu_count}x{o.gpu})" if o.gpu_count > 1 else \
            f"{o.cloud} {o.instance_type} ({o.device_key})"
        if not standalone_samples_per_second(profile, o):
            if o.gpu_count:  # CPU-only VMs are coordinators, not worth a note
                no_rate.setdefault(kind, o)
        elif o.memory_gb is not None and o.memory_gb < profile.min_vm_memory_gb:
            too_small.setdefault(kind, o)
        else:
            usable.append(o)
    notes = []
    if no_rate:
        notes.append(f"{', '.join(sorted(no_rate))}: profile {profile.name!r} has no samples/s for "
                     f"{'this GPU' if len(no_rate) == 1 else 'these GPUs'} (add a measured figure to use them)")
    if too_small:
        sizes = sorted({f"{o.memory_gb:g} GB" for o in too_small.values()})
        notes.append(f"{', '.join(sorted(too_small))}: {'/'.join(sizes)} of memory, below the "
                     f"{profile.min_vm_memory_gb:g} GB that {profile.name!r} needs (min_vm_memory_gb)")
    if not usable:
        devices = sorted({o.device_key if o.gpu_count <= 1 else f"{o.gpu_count}x{o.gpu}" for o in offers})
        if too_small:
            raise PlannerError(f"no allowed offer can train {profile.name!r}: {'; '.join(notes)}; allow other "
                               "offers, or lower min_vm_memory_gb in the profile if the model fits")
        raise PlannerError(f"profile {profile.name!r} has samples/s for {', '.join(sorted(profile.samples_per_second))} "
                           f"but the allowed offers have {', '.join(devices)}; add a figure to the profile, "
                           "measure one with `geotrain profile`, or allow other offers")
    return usable, notes


def prune_dominated(offers: list[Offer], profile: ModelProfile, settings: Settings,
                    quotas: dict[str, int]) -> list[Offer]:
    """Drop offers that another offer of the same site beats on every count (exact, see module doc).

    Per site, offers are visited from the fastest down (ties: cheaper, fewer GPUs, on demand, earlier
    first), so every offer that could dominate one is visited before it; only the kept offers are
    compared, which keeps this near-linear on catalogs of thousands of offers.
    """
    by_site: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for offer in offers:
        by_site[offer.site].append(offer)
    kept: list[Offer] = []
    for site_offers in by_site.values():
        quota = site_offers[0].region in quotas
        # (rate, price, GPUs, spot, index) per offer; Offer objects hash slowly, so the loop uses tuples.
        facts = [(peer_rate(profile, o, 1, settings), o.price_usd_per_hour, o.gpu_count, o.spot, i)
                 for i, o in enumerate(site_offers)]
        survivors: list[tuple[float, float, int, bool, int]] = []
        for rate, price, gpus, spot, i in sorted(facts, key=lambda f: (-f[0], f[1], f[2], f[3], f[4])):
            dominated = False
            for other_rate, other_price, other_gpus, other_spot, j in survivors:
                better = (other_rate >= rate and other_price <= price and (other_gpus <= gpus or not quota)
                          and (spot or not other_spot))
                strictly = (other_rate > rate or other_price < price or other_gpus < gpus
                            or (other_spot is False and spot))
                if better and (strictly or j < i):
                    dominated = True
                    break
            if not dominated:
                survivors.append((rate, price, gpus, spot, i))
        kept += [site_offers[i] for i in sorted(f[4] for f in survivors)]
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
        spread = settings.spread_zones
        if inputs.egress.usd_per_gb(first, first, spread) > inputs.egress.usd_per_gb(first, second, spread):
            continue
        for site in names:
            if network.link(sites[site][0], sites[site][0]).bandwidth_gbit_per_s < between.bandwidth_gbit_per_s or \
                    network.link(sites[site][0], sites[site][0]).rtt_ms > between.rtt_ms:
                break
        else:
            facts = {site: [(peer_rate(profile, o, 1, settings), o.price_usd_per_hour, o.spot) for o in sites[site]]
                     for site in names}

            def covers(better: str, worse: str) -> bool:
                return all(any(b_rate >= w_rate and b_price <= w_price and (w_spot or not b_spot)
                               for b_rate, b_price, b_spot in facts[better])
                           for w_rate, w_price, w_spot in facts[worse])

            for site in names:
                for other in names:
                    if other == site or other in dropped or other[1] in quotas:
                        continue
                    if covers(other, site) and (not covers(site, other) or other < site):
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
