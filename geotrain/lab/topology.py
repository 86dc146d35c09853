"""Lab topologies: which regions exist, how many peers each holds, and the network between them.

A topology is a small YAML file::

    name: B
    regions:                       # in order: the first region holds the coordinator
      us: {peers: 2}
      eu: {peers: 2}
    links:                         # every pair of regions, in either order, exactly once
      us-eu: {latency_ms: 51.55, bandwidth_mbit_s: 210}   # one-way latency; [EMJ24] Table 3
    within_region: {latency_ms: 0.325, bandwidth_mbit_s: 6800}   # optional, see below

- A region with ``nat: true`` sits behind a NAT gateway (geotrain.lab.nat): its peers dial out, and the
  others see them at the gateway's address and cannot dial them. Not the first region (the coordinator's).

- ``latency_ms`` is the one-way delay; a round trip between the two regions takes twice as long.
- ``bandwidth_mbit_s`` is the rate of each direction of the pair (a single link per direction).
- ``within_region`` describes the link between two VMs of one region. The lab does not emulate it
  (peers of one region share a network namespace and talk over its loopback); reports and the
  planner's prediction use it.

Shipped topologies (``geotrain/data/lab/``): ``A`` (one zone), ``B`` (US+EU), ``C`` (US, EU, ASIA,
AUS), the setups of [EMJ24] with its measured RTT and bandwidth. ``load_topology("C")`` reads a
shipped one; any other argument is a path.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from geotrain.text_files import load_yaml, read_user_text

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "lab"
REGION_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
# The lab gives region i (1-based) the subnet 10.77.i.0/24; the relay reads the region from that octet.
MAX_REGIONS = 200


class TopologyError(ValueError):
    """A topology file is wrong; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Link:
    """One direction's emulated network between two regions (the same both ways)."""

    latency_ms: float
    bandwidth_mbit_s: float

    @property
    def rtt_ms(self) -> float:
        return 2 * self.latency_ms

    def to_dict(self) -> dict[str, float]:
        return {"latency_ms": self.latency_ms, "bandwidth_mbit_s": self.bandwidth_mbit_s}


@dataclass(frozen=True)
class Region:
    name: str
    peers: int
    index: int  # 1-based position in the file; the lab's subnet 10.77.<index>.0/24
    continent: str = ""
    nat: bool = False  # behind a NAT gateway: its peers cannot be dialled from the other regions


@dataclass
class Topology:
    name: str
    regions: list[Region]
    links: dict[frozenset[str], Link]
    within_region: Link | None = None
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def peers(self) -> int:
        return sum(region.peers for region in self.regions)

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise TopologyError(f"region {name!r} is not in topology {self.name!r}; expected one of "
                            f"{', '.join(r.name for r in self.regions)}")

    def link(self, a: str, b: str) -> Link | None:
        """The link between two regions; None for two peers of one region without ``within_region``."""
        if a == b:
            return self.within_region
        return self.links[frozenset((a, b))]

    def used_links(self) -> list[tuple[str, str, Link]]:
        """Links that peers of this topology talk over (pairs of regions with peers, and regions with 2+)."""
        used = []
        populated = [r for r in self.regions if r.peers > 0]
        for a, b in itertools.combinations_with_replacement(populated, 2):
            if a is b and a.peers < 2:
                continue
            link = self.link(a.name, b.name)
            if link is not None:
                used.append((a.name, b.name, link))
        return used

    def with_peers(self, total: int) -> "Topology":
        """The same network with ``total`` peers spread evenly, earlier regions getting the remainder.

        This is how [EMJ24] names its runs: C-8 is setup C with 8 VMs, two in each of its four regions.
        """
        if total < 1:
            raise TopologyError(f"a setup needs at least 1 peer, got {total}")
        count = len(self.regions)
        regions = [replace(region, peers=total // count + (1 if position < total % count else 0))
                   for position, region in enumerate(self.regions)]
        return replace(self, regions=regions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "regions": {r.name: {"peers": r.peers, **({"continent": r.continent} if r.continent else {}),
                                 **({"nat": True} if r.nat else {})}
                        for r in self.regions},
            "links": {f"{sorted(pair)[0]}-{sorted(pair)[1]}": link.to_dict() for pair, link in self.links.items()},
            **({"within_region": self.within_region.to_dict()} if self.within_region else {}),
        }


def _number(value: Any, where: str, key: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where}: {key} is {value!r}; expected a number")
    if value < 0 or (positive and value == 0):
        raise TopologyError(f"{where}: {key} is {value}; expected a number {'>' if positive else '>='} 0")
    return float(value)


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: expected a mapping with latency_ms and bandwidth_mbit_s, got {data!r}")
    unknown = sorted(set(data) - {"latency_ms", "bandwidth_mbit_s"})
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; expected latency_ms "
                            "(one-way) and bandwidth_mbit_s")
    for key in ("latency_ms", "bandwidth_mbit_s"):
        if key not in data:
            raise TopologyError(f"{where}: {key} is missing")
    return Link(latency_ms=_number(data["latency_ms"], where, "latency_ms", positive=False),
                bandwidth_mbit_s=_number(data["bandwidth_mbit_s"], where, "bandwidth_mbit_s", positive=True))


def _regions(data: Any, where: str) -> list[Region]:
    if not isinstance(data, dict) or not data:
        raise TopologyError(f"{where}: 'regions' must map region names to {{peers: N}}, e.g. "
                            "regions: {us: {peers: 2}, eu: {peers: 2}}")
    if len(data) > MAX_REGIONS:
        raise TopologyError(f"{where}: {len(data)} regions; the lab supports at most {MAX_REGIONS}")
    regions = []
    for index, (name, spec) in enumerate(data.items(), start=1):
        name = str(name)
        if not REGION_NAME.match(name):
            raise TopologyError(f"{where}: region name {name!r} is not valid; expected a lower-case letter "
                                "followed by up to 11 lower-case letters or digits (no '-': it separates pairs)")
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise TopologyError(f"{where}: region {name!r} must be a mapping like {{peers: 2}}, got {spec!r}")
        unknown = sorted(set(spec) - {"peers", "continent", "nat"})
        if unknown:
            raise TopologyError(f"{where}: region {name!r} has unknown key(s) {', '.join(map(str, unknown))}; "
                                "expected peers, continent and nat")
        nat = spec.get("nat", False)
        if not isinstance(nat, bool):
            raise TopologyError(f"{where}: region {name!r}: nat is {nat!r}; expected true or false")
        if nat and index == 1:
            raise TopologyError(f"{where}: region {name!r} is the first region, which holds the coordinator that "
                                "every peer dials; it cannot be behind NAT (put another region first)")
        peers = spec.get("peers", 1)
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
            raise TopologyError(f"{where}: region {name!r}: peers is {peers!r}; expected a whole number >= 0")
        regions.append(Region(name=name, peers=peers, index=index, continent=str(spec.get("continent", "")),
                              nat=nat))
    return regions


def _links(data: Any, regions: list[Region], where: str) -> dict[frozenset[str], Link]:
    names = [r.name for r in regions]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: 'links' must map pairs 'a-b' to {{latency_ms, bandwidth_mbit_s}}")
    links: dict[frozenset[str], Link] = {}
    for key, spec in data.items():
        pair = str(key)
        parts = pair.split("-")
        if len(parts) != 2 or not all(parts):
            raise TopologyError(f"{where}: link {pair!r} is not a pair; expected 'a-b' with two region names")
        for part in parts:
            if part not in names:
                raise TopologyError(f"{where}: region {part!r} in pair {pair!r} is not in regions "
                                    f"({', '.join(names)})")
        if parts[0] == parts[1]:
            raise TopologyError(f"{where}: link {pair!r} joins a region to itself; use within_region for that")
        members = frozenset(parts)
        if members in links:
            raise TopologyError(f"{where}: pair {pair!r} is given twice (in either order); give each pair once")
        links[members] = _link(spec, f"{where}: link {pair!r}")
    missing = [f"{a.name}-{b.name}" for a, b in itertools.combinations(regions, 2)
               if frozenset((a.name, b.name)) not in links]
    if missing:
        raise TopologyError(f"{where}: no link for pair(s) {', '.join(missing)}; every pair of regions needs "
                            "latency_ms and bandwidth_mbit_s")
    return links


def parse_topology(data: Any, where: str) -> Topology:
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: expected a mapping with regions and links")
    unknown = sorted(set(data) - {"name", "regions", "links", "within_region", "notes"})
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; expected name, regions, "
                            "links, within_region, notes")
    if "regions" not in data:
        raise TopologyError(f"{where}: 'regions' is missing")
    regions = _regions(data["regions"], where)
    links = _links(data.get("links"), regions, where)
    within = data.get("within_region")
    notes = data.get("notes") or {}
    if not isinstance(notes, dict):
        raise TopologyError(f"{where}: 'notes' must map keys to text (where the figures come from)")
    return Topology(name=str(data.get("name") or Path(where).stem), regions=regions, links=links,
                    within_region=None if within is None else _link(within, f"{where}: within_region"),
                    source=where, notes={str(k): str(v) for k, v in notes.items()})


def shipped_topologies() -> list[str]:
    return sorted(path.stem for path in SHIPPED_DIR.glob("*.yaml"))


def load_topology(name_or_path: str | Path) -> Topology:
    """A shipped topology by name (``A``, ``B``, ``C``) or a YAML file."""
    path = Path(name_or_path)
    shipped = SHIPPED_DIR / f"{name_or_path}.yaml"
    if not path.exists() and shipped.exists():
        path = shipped
    text = read_user_text(path, "topology", TopologyError, unreadable_hint="expected a YAML file or one of the "
                          f"shipped topologies {', '.join(shipped_topologies())}")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None)
        raise TopologyError(f"topology {path} is not valid YAML{at}{': ' + problem if problem else ''}") from None
    return parse_topology(data, str(path))
