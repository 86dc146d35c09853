"""The instance catalog: which VMs can be rented where, and at what price.

The catalog is a CSV file (shipped default: ``geotrain/data/planner/instances.csv``) with one line
per instance type and region::

    cloud,region,continent,instance_type,gpu,gpu_count,vcpus,memory_gb,on_demand_usd_per_hour,spot_usd_per_hour,spot_interruption_rate,source
    gc,us-central1,us,t4-vm,T4,1,,,0.572,0.180,,[EMJ24] Table 1

- ``gpu`` is the accelerator model as the model profiles name it (``T4``, ``A10``); ``none`` with
  ``gpu_count`` 0 for a CPU-only VM (profiles measured on a CPU use the key ``cpu``).
- Leave ``spot_usd_per_hour`` (or ``on_demand_usd_per_hour``) empty where that option is not sold.
- ``spot_interruption_rate`` is the expected share of a spot VM's time lost to interruptions
  (empty: the planner's default, see :data:`geotrain.planner.model.DEFAULT_SPOT_INTERRUPTION_RATE`).
- ``vcpus`` may be empty; the planner only shows it.
- ``memory_gb`` (optional column) is the VM's memory; a profile's ``min_vm_memory_gb`` leaves out VMs
  known to have less (empty: unknown, never left out).
- ``source`` says where the figures come from; every shipped line has one.
- One line per instance type and region: a second line for the same ``cloud``, ``region`` and
  ``instance_type`` is refused, naming both lines (which price would be meant is unknowable).

Each line becomes up to two :class:`Offer` objects, one per purchase option.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geotrain.pricing.errors import InputFileError
from geotrain.pricing.table import read_table

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "planner"
DEFAULT_CATALOG = DATA_DIR / "instances.csv"

CATALOG_COLUMNS = ["cloud", "region", "continent", "instance_type", "gpu", "gpu_count", "vcpus",
                   "on_demand_usd_per_hour", "spot_usd_per_hour", "spot_interruption_rate", "source"]
OPTIONAL_COLUMNS = ["memory_gb"]  # catalogs written before the column existed still load


@dataclass(frozen=True)
class Offer:
    """One way to rent one VM: an instance type in a region, on spot or on demand."""

    cloud: str
    region: str
    continent: str
    instance_type: str
    gpu: str
    gpu_count: int
    vcpus: int | None
    price_usd_per_hour: float
    spot: bool
    spot_interruption_rate: float | None
    source: str
    line: int
    memory_gb: float | None = None

    @property
    def site(self) -> tuple[str, str]:
        """Where the VM runs: traffic between VMs of one site is free and fast."""
        return (self.cloud, self.region)

    @property
    def device_key(self) -> str:
        """The key a model profile uses for this VM's accelerator: ``T4``, ``8xV100`` or ``cpu``."""
        return "cpu" if self.gpu_count == 0 else self.gpu

    @property
    def purchase(self) -> str:
        return "spot" if self.spot else "on-demand"

    @property
    def name(self) -> str:
        return f"{self.cloud}/{self.region} {self.instance_type} {self.purchase}"


def _row_offers(row) -> list[Offer]:
    cloud = row.text("cloud").lower()
    region = row.text("region").lower()
    continent = row.text("continent").lower()
    instance_type = row.text("instance_type")
    gpu = row.text("gpu")
    gpu_count = row.integer("gpu_count", minimum=0)
    if gpu.lower() == "none":
        gpu = "none"
        if gpu_count != 0:
            raise InputFileError(f"{row.where('gpu_count')}: a VM with gpu 'none' must have gpu_count 0, got {gpu_count}")
    elif gpu_count == 0:
        raise InputFileError(f"{row.where('gpu_count')}: gpu {gpu!r} needs gpu_count >= 1; "
                           "write gpu 'none' for a CPU-only VM")
    vcpus_raw = row.number("vcpus", optional=True, minimum=1)
    vcpus = int(vcpus_raw) if vcpus_raw is not None else None
    on_demand = row.number("on_demand_usd_per_hour", optional=True, minimum=0)
    spot = row.number("spot_usd_per_hour", optional=True, minimum=0)
    if on_demand is None and spot is None:
        raise InputFileError(f"{row.path}:{row.line}: neither on_demand_usd_per_hour nor spot_usd_per_hour is set; "
                           "give at least one price")
    interruption = row.number("spot_interruption_rate", optional=True, minimum=0, maximum=0.99)
    memory_gb = row.number("memory_gb", optional=True, minimum=0.001)
    source = row.text("source")
    common = dict(cloud=cloud, region=region, continent=continent, instance_type=instance_type, gpu=gpu,
                  gpu_count=gpu_count, vcpus=vcpus, source=source, line=row.line, memory_gb=memory_gb)
    offers = []
    if on_demand is not None:
        offers.append(Offer(price_usd_per_hour=on_demand, spot=False, spot_interruption_rate=None, **common))
    if spot is not None:
        offers.append(Offer(price_usd_per_hour=spot, spot=True, spot_interruption_rate=interruption, **common))
    return offers


def load_catalog(path: Path | None = None) -> list[Offer]:
    """All offers of a catalog file, checked line by line (errors name the line and column)."""
    path = Path(path) if path else DEFAULT_CATALOG
    offers: list[Offer] = []
    continent_of: dict[tuple[str, str], tuple[str, int]] = {}
    line_of: dict[tuple[str, str, str], int] = {}
    for row in read_table(path, required=CATALOG_COLUMNS):
        row_offers = _row_offers(row)  # at least one: a line without a price is refused
        for offer in row_offers:
            seen = continent_of.setdefault(offer.site, (offer.continent, row.line))
            if seen[0] != offer.continent:
                raise InputFileError(f"{row.where('continent')}: region {offer.region} of {offer.cloud} is on "
                                   f"{seen[0]!r} at line {seen[1]} but on {offer.continent!r} here; "
                                   "a region lies on one continent")
            offers.append(offer)
        first = row_offers[0]
        key = (first.cloud, first.region, first.instance_type.casefold())  # as the price book matches it
        if key in line_of:
            raise InputFileError(f"{path}:{row.line}: {first.cloud}/{first.region} {first.instance_type} is listed "
                                 f"twice, at line {line_of[key]} and at line {row.line}; the catalog has one line per "
                                 "instance type and region (spot and on-demand prices side by side), so delete one "
                                 "of the two lines")
        line_of[key] = row.line
    if not offers:
        raise InputFileError(f"{path}: the catalog has no instance lines; add at least one")
    return offers
