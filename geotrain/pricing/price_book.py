"""Prices of the VMs and routes a running swarm uses, from the planner's price files.

The planner (``geotrain plan``) and the coordinator's live cost (:mod:`geotrain.telemetry.swarm_view`)
price a swarm with the same model: the instance catalog (:mod:`geotrain.pricing.catalog`), the
egress prices (:mod:`geotrain.pricing.egress`) and, on top, the overrides of the config's ``cost:``
section (:class:`geotrain.config.CostConfig`)::

    prices = PriceBook.from_config(config.cost)
    prices.instance_usd_per_hour("gcp", "us-central1", "t4-vm", "spot")          # 0.18
    prices.egress_usd_per_gb(("gcp", "us-central1"), ("gcp", "europe-west4"))   # 0.08
    prices.instance_usd_per_hour("aws", "eu-west-1", "g4dn.xlarge", "spot")     # None: not in the catalog

A VM or a route the files and the overrides do not price is ``None``: the caller counts it as
unpriced, and nothing here guesses a price from another region or a default.

Peers label their cloud as the startup scripts find it (``gcp``, ``aws``, ``azure``); the files
use ``gc`` for Google Cloud. :func:`catalog_cloud` is the one place where a label becomes the
files' name.
"""

from __future__ import annotations

import logging

from geotrain.pricing.catalog import Offer, load_catalog
from geotrain.pricing.egress import EgressPrices, load_egress
from geotrain.pricing.errors import InputFileError

logger = logging.getLogger(__name__)

# Labels peers use for a cloud -> the name the price files use.
CLOUD_ALIASES = {"gcp": "gc", "google": "gc", "gce": "gc"}
PURCHASES = ("spot", "on-demand")
WILDCARD = "*"

Site = tuple[str, str]  # (cloud, region): where a VM runs


def catalog_cloud(cloud: str) -> str:
    """The price files' name of a cloud a peer labels itself with: lowercase, ``gcp``/``google`` -> ``gc``."""
    name = cloud.strip().lower()
    return CLOUD_ALIASES.get(name, name)


def _site(cloud: str, region: str) -> Site:
    return (catalog_cloud(cloud), region.strip().lower())


class PriceBook:
    """Instance $/h and egress $/GB of what peers report, from the catalog, egress prices and overrides.

    ``instance_overrides``: $/h by instance type, winning over the catalog. ``egress_rules``: objects
    with ``source``, ``destination`` (a region or ``*``) and ``usd_per_gb`` (the config's
    :class:`geotrain.config.EgressPrice`) for traffic between regions; the most specific matching rule
    wins over the files. ``same_region_usd_per_gb``: traffic within a region (None: free, the planner's
    rule for VMs of one zone).
    """

    def __init__(self, offers: list[Offer], egress: EgressPrices,
                 instance_overrides: dict[str, float] | None = None, egress_rules=(),
                 same_region_usd_per_gb: float | None = None):
        self.egress = egress
        self.instance_overrides = {name.casefold(): price for name, price in (instance_overrides or {}).items()}
        self.egress_rules = [(rule.source.strip().lower(), rule.destination.strip().lower(), rule.usd_per_gb)
                             for rule in egress_rules]
        self.same_region_usd_per_gb = same_region_usd_per_gb
        self._prices: dict[tuple[str, str, str, str], float] = {}
        self._representative: dict[Site, Offer] = {}  # one offer per site: its cloud, region and continent
        for offer in offers:
            key = (offer.cloud, offer.region, offer.instance_type.casefold(), offer.purchase)
            self._prices.setdefault(key, offer.price_usd_per_hour)  # a repeated line: the first one counts
            self._representative.setdefault(offer.site, offer)
        egress.check_clouds({cloud for cloud, _ in self._representative})
        self._warned_routes: set[tuple[Site, Site]] = set()

    @classmethod
    def from_config(cls, cost) -> PriceBook:
        """The price book of a :class:`geotrain.config.CostConfig`: its files (or the shipped ones) and overrides."""
        try:
            offers = load_catalog(cost.catalog_path)
        except InputFileError as error:
            raise InputFileError(f"cost.catalog_path: {error}") from None
        try:
            egress = load_egress(cost.egress_prices_path)
        except InputFileError as error:
            raise InputFileError(f"cost.egress_prices_path: {error}") from None
        return cls(offers, egress, instance_overrides=cost.instance_usd_per_hour, egress_rules=cost.egress_usd_per_gb,
                   same_region_usd_per_gb=cost.same_region_usd_per_gb)

    def instance_usd_per_hour(self, cloud: str, region: str, instance_type: str, purchase: str) -> float | None:
        """$/h of one VM, or None when neither the overrides nor the catalog price it.

        ``cost.instance_usd_per_hour`` wins; else the catalog's line for exactly this cloud, region and
        instance type (case does not matter), at the spot or on-demand price.
        """
        if purchase not in PURCHASES:
            raise ValueError(f"purchase {purchase!r}: expected one of {', '.join(PURCHASES)}")
        override = self.instance_overrides.get(instance_type.casefold())
        if override is not None:
            return override
        cloud_name, region_name = _site(cloud, region)
        return self._prices.get((cloud_name, region_name, instance_type.casefold(), purchase))

    def egress_usd_per_gb(self, source: Site, destination: tuple[str | None, str]) -> float | None:
        """$/GB the source's cloud bills for bytes sent to the destination, or None when nothing prices it.

        Sites are ``(cloud, region)``; a destination's cloud may be None when it is not known (then only
        a config rule can price traffic to it). Within one region: ``same_region_usd_per_gb``, else the
        egress file's ``same_region`` price of the source's cloud (free for a site the catalog lacks).
        Between regions: the most specific config rule, else the planner's price
        (:meth:`geotrain.pricing.egress.EgressPrices.usd_per_gb`) when the catalog lists both sites.
        """
        source_site = _site(*source)
        destination_cloud, destination_region = destination
        destination_site = (None if destination_cloud is None else catalog_cloud(destination_cloud),
                            destination_region.strip().lower())
        if source_site == destination_site:
            if self.same_region_usd_per_gb is not None:
                return self.same_region_usd_per_gb
            sender = self._representative.get(source_site)  # the planner's same-region price of that cloud
            return 0.0 if sender is None else self.egress.usd_per_gb(sender, sender)
        rule_price = self._rule_usd_per_gb(source_site[1], destination_site[1])
        if rule_price is not None:
            return rule_price
        sender, receiver = self._representative.get(source_site), self._representative.get(destination_site)
        if sender is None or receiver is None:
            return None
        try:
            return self.egress.usd_per_gb(sender, receiver)
        except InputFileError as error:  # a gap in the egress file: unpriced, and said once per route
            if (source_site, destination_site) not in self._warned_routes:
                self._warned_routes.add((source_site, destination_site))
                logger.warning("egress %s/%s -> %s/%s is not priced: %s", *source_site, *destination_site, error)
            return None

    def _rule_usd_per_gb(self, source_region: str, destination_region: str) -> float | None:
        best, best_rank = None, -1
        for source, destination, usd_per_gb in self.egress_rules:
            if source not in (WILDCARD, source_region) or destination not in (WILDCARD, destination_region):
                continue
            rank = 2 * (source != WILDCARD) + (destination != WILDCARD)
            if rank > best_rank:
                best, best_rank = usd_per_gb, rank
        return best

    def clouds_in_region(self, region: str) -> set[str]:
        """The clouds of the catalog that have a region of this name (usually one)."""
        name = region.strip().lower()
        return {cloud for cloud, catalog_region in self._representative if catalog_region == name}
