"""The network matrix: bandwidth and round-trip time between two VMs, by cloud and place.

The file (shipped default: ``geotrain/data/planner/network.csv``, figures from [EMJ24]) has
one link per line::

    scope,cloud_a,place_a,cloud_b,place_b,bandwidth_gbit_per_s,rtt_ms,source
    same-region,gc,*,gc,*,6.35,0.65,[EMJ24] within GC
    between-regions,*,us,*,eu,0.21,103.1,[EMJ24] Table 3

- ``scope`` is ``same-region`` (two VMs of one cloud in one region) or ``between-regions``.
- ``cloud_*`` is a cloud or ``*``; ``place_*`` is a region, a continent or ``*``.
- A line matches a pair of VMs in either direction. Of all matching lines the most specific wins
  (a named region beats a continent beats ``*``; a named cloud beats ``*``); on a tie, the later
  line wins, so a measured link appended at the end overrides the defaults.

Bandwidths are single-TCP-stream figures, as [EMJ24] measured them, which is what one hivemind
peer-to-peer transfer gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from geotrain.pricing.catalog import DATA_DIR, Offer
from geotrain.planner.errors import PlannerError
from geotrain.pricing.table import read_table

DEFAULT_NETWORK = DATA_DIR / "network.csv"
SCOPES = ("same-region", "between-regions")


@dataclass(frozen=True)
class Link:
    bandwidth_gbit_per_s: float
    rtt_ms: float
    source: str


@dataclass(frozen=True)
class _Rule:
    scope: str
    cloud_a: str
    place_a: str
    cloud_b: str
    place_b: str
    link: Link
    order: int


@dataclass
class NetworkMatrix:
    rules: list[_Rule] = field(default_factory=list)
    path: Path | None = None

    def places(self) -> set[str]:
        """Every region or continent some line names: a site's link depends on no other part of its region name."""
        return {place for rule in self.rules for place in (rule.place_a, rule.place_b)}

    def _side_score(self, cloud: str, place: str, offer: Offer) -> int | None:
        if cloud != "*" and cloud != offer.cloud:
            return None
        score = 0 if cloud == "*" else 1
        if place == "*":
            return score
        if place == offer.region:
            return score + 4
        if place == offer.continent:
            return score + 2
        return None

    def link(self, a: Offer, b: Offer) -> Link:
        """The link between a VM like ``a`` and a VM like ``b`` (their sites; the instance type is ignored)."""
        scope = "same-region" if a.site == b.site else "between-regions"
        best: tuple[int, int] | None = None
        chosen: _Rule | None = None
        for rule in self.rules:
            if rule.scope != scope:
                continue
            for x, y in ((a, b), (b, a)):
                left = self._side_score(rule.cloud_a, rule.place_a, x)
                right = self._side_score(rule.cloud_b, rule.place_b, y)
                if left is None or right is None:
                    continue
                key = (left + right, rule.order)
                if best is None or key > best:
                    best, chosen = key, rule
        if chosen is None:
            raise PlannerError(f"{self.path or 'network matrix'}: no {scope} line matches {a.cloud}/{a.region} "
                               f"<-> {b.cloud}/{b.region}; add one, e.g. a fallback line "
                               f"'{scope},*,*,*,*,BANDWIDTH_GBIT_PER_S,RTT_MS,SOURCE'")
        return chosen.link


def load_network(path: Path | None = None) -> NetworkMatrix:
    path = Path(path) if path else DEFAULT_NETWORK
    matrix = NetworkMatrix(path=path)
    required = ["scope", "cloud_a", "place_a", "cloud_b", "place_b", "bandwidth_gbit_per_s", "rtt_ms", "source"]
    for order, row in enumerate(read_table(path, required=required)):
        link = Link(bandwidth_gbit_per_s=row.number("bandwidth_gbit_per_s", minimum=1e-6),
                    rtt_ms=row.number("rtt_ms", minimum=0), source=row.text("source"))
        matrix.rules.append(_Rule(scope=row.choice("scope", SCOPES),
                                  cloud_a=row.text("cloud_a").lower(), place_a=row.text("place_a").lower(),
                                  cloud_b=row.text("cloud_b").lower(), place_b=row.text("place_b").lower(),
                                  link=link, order=order))
    return matrix
