"""Egress prices: what a cloud bills per GB leaving a VM, by where the bytes go.

The file (shipped default: ``geotrain/data/planner/egress.csv``) has one price per line::

    cloud,kind,continent,usd_per_gb,source
    gc,inter_region,eu,0.02,[EMJ24] Table 1

``cloud`` is the *source* cloud (the sender pays). ``kind`` is one of

- ``same_region``: to another VM of the same region, the default placement (a missing line: free);
- ``inter_zone``: to another zone of the same region (used instead with ``--spread-zones``);
- ``inter_region``: to another region of the same cloud on the same continent; ``continent`` is
  that continent;
- ``between_continents``: to a region of the same cloud on another continent; ``continent`` is
  the destination continent, or ``*`` for any;
- ``internet``: to another cloud; ``continent`` is the destination continent or ``*``;
- ``data_loading``: reading training data from object storage (cloud ``*`` allowed); ``continent`` is
  the reading VM's continent, so a line can make reads next to the bucket free.

A line naming a continent wins over a ``*`` line, a line naming a cloud over a ``*`` cloud.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from geotrain.pricing.catalog import DATA_DIR, Offer
from geotrain.pricing.errors import InputFileError
from geotrain.pricing.table import read_table

DEFAULT_EGRESS = DATA_DIR / "egress.csv"
KINDS = ("same_region", "inter_zone", "inter_region", "between_continents", "internet", "data_loading")


@dataclass
class EgressPrices:
    prices: dict[tuple[str, str, str], float] = field(default_factory=dict)
    path: Path | None = None

    def _lookup(self, cloud: str, kind: str, continent: str) -> float | None:
        for key in ((cloud, kind, continent), (cloud, kind, "*"), ("*", kind, continent), ("*", kind, "*")):
            if key in self.prices:
                return self.prices[key]
        return None

    def usd_per_gb(self, source: Offer, destination: Offer, spread_zones: bool = False) -> float:
        """Price per GB that the source VM's cloud bills for bytes sent to the destination VM."""
        if source.cloud != destination.cloud:
            kind = "internet"
        elif source.region == destination.region:
            if not spread_zones:
                return self._lookup(source.cloud, "same_region", destination.continent) or 0.0
            kind = "inter_zone"
        elif source.continent == destination.continent:
            kind = "inter_region"
        else:
            kind = "between_continents"
        price = self._lookup(source.cloud, kind, destination.continent)
        if price is None:
            raise InputFileError(f"{self.path or 'egress prices'}: no {kind} price for cloud {source.cloud!r} "
                               f"(to continent {destination.continent!r}); add a line "
                               f"'{source.cloud},{kind},{destination.continent},USD_PER_GB,SOURCE'")
        return price

    def data_loading_usd_per_gb(self, reader: Offer) -> float:
        """Price per GB of training data that a VM like ``reader`` reads from object storage (0 without a line)."""
        price = self._lookup(reader.cloud, "data_loading", reader.continent)
        return 0.0 if price is None else price

    def check_clouds(self, clouds: set[str]) -> None:
        """Fail early, naming the cloud, when the catalog has a cloud that the price file lacks."""
        known = {cloud for cloud, kind, _ in self.prices if kind not in ("data_loading", "same_region")}
        missing = sorted(clouds - known)
        if missing and "*" not in known:
            raise InputFileError(f"{self.path or 'egress prices'}: no egress prices for cloud(s) {', '.join(missing)} "
                               "that the catalog lists; add their lines (kind inter_region, between_continents, "
                               "internet)")


def load_egress(path: Path | None = None) -> EgressPrices:
    path = Path(path) if path else DEFAULT_EGRESS
    prices = EgressPrices(path=path)
    for row in read_table(path, required=["cloud", "kind", "continent", "usd_per_gb", "source"]):
        kind = row.choice("kind", KINDS)
        key = (row.text("cloud").lower(), kind, row.text("continent").lower())
        row.text("source")
        prices.prices[key] = row.number("usd_per_gb", minimum=0)
    return prices
