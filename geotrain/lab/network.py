"""Emulated regions on one machine: network namespaces, veth links, a TUN device and the delay relay.

Layout of a lab named ``gtlab`` (the default) with regions us (1) and eu (2)::

    netns gtlab-us  [eth: gtlab-r1 10.77.1.2/24] --veth-- [gtlab-h1 10.77.1.1/24]  netns gtlab-hub
    netns gtlab-eu  [eth: gtlab-r2 10.77.2.2/24] --veth-- [gtlab-h2 10.77.2.1/24]   |  ip rule iif gtlab-hI
                                                                                    |  -> table 77: dev gtlab-tun
                                                                  relay (geotrain.lab.relay) on gtlab-tun

A packet from us to eu leaves gtlab-us by its default route, enters the hub on gtlab-h1, is routed
into the TUN device by the policy rule, waits in the relay for the pair's latency and rate, comes
back out of the TUN device and is forwarded by the hub's main table to gtlab-h2. Peers of one region
share its namespace and its address (they differ by port) and talk over its loopback, unshaped.

Everything lives inside namespaces whose names start with ``<lab>-``: the host's own namespace gets
no link, route, rule or address, so ``down`` finds every leftover by that prefix alone, even when
the state file is gone or the relay was killed, and removing the namespaces removes their links,
TUN device, routes and rules with them. Processes still running in them (the relay, peers started
with ``geotrain lab run``) are stopped first.

Needs root (network namespaces), the ``ip`` tool and ``/dev/net/tun``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from geotrain.lab.nat import GATEWAY_HOST
from geotrain.lab.topology import Topology, parse_topology
from geotrain.stopping.processes import is_alive, terminate_tree

DEFAULT_LAB = "gtlab"
LAB_NAME = re.compile(r"^gtlab[a-z0-9]{0,7}$")
STATE_DIR = Path(os.environ.get("GEOTRAIN_LAB_STATE_DIR", "/run/geotrain"))
TUN_DEVICE = "gtlab-tun"
RELAY_TABLE = 77
# Jumbo frames (as inside a cloud VPC: GCP up to 8896, AWS 9001) cut the relay's packets per second
# six-fold against 1500; the figures in docs/benchmarks.md were measured with this MTU.
DEFAULT_MTU = 9000
RELAY_START_TIMEOUT_S = 15.0
STOP_GRACE_S = 3.0


class LabError(RuntimeError):
    """Something an operator can fix: the message says what and how."""


def subnet_address(index: int, host: int) -> str:
    return f"10.77.{index}.{host}"


@dataclass(frozen=True)
class LabNames:
    lab: str

    @property
    def prefix(self) -> str:
        return f"{self.lab}-"

    @property
    def hub(self) -> str:
        return f"{self.lab}-hub"

    def region(self, name: str) -> str:
        return f"{self.lab}-{name}"

    @property
    def state_path(self) -> Path:
        return STATE_DIR / f"{self.lab}.json"

    @property
    def relay_config_path(self) -> Path:
        return STATE_DIR / f"{self.lab}.relay.json"

    @property
    def relay_log_path(self) -> Path:
        return STATE_DIR / f"{self.lab}.relay.log"

    @property
    def relay_stats_path(self) -> Path:
        return STATE_DIR / f"{self.lab}.relay-stats.json"

    def files(self) -> list[Path]:
        return [self.state_path, self.relay_config_path, self.relay_log_path, self.relay_stats_path]


def check_lab_name(lab: str) -> LabNames:
    if not LAB_NAME.match(lab):
        raise LabError(f"lab name {lab!r} is not valid; expected 'gtlab' followed by up to 7 lower-case letters "
                       "or digits (the prefix lets `geotrain lab down` find leftovers)")
    return LabNames(lab)


def missing_requirements() -> list[str]:
    """What this machine lacks for the lab (empty: it can run one)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces); run it with sudo")
    if shutil.which("ip") is None:
        missing.append("the `ip` tool (iproute2); install it, e.g. apt-get install iproute2")
    if not os.path.exists("/dev/net/tun"):
        missing.append("/dev/net/tun (the TUN driver); load it with modprobe tun")
    return missing


def require_lab_support(command: str) -> None:
    missing = missing_requirements()
    if missing:
        raise LabError(f"geotrain lab {command} needs " + "; and ".join(missing))


def _ip(*arguments: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(("-n", namespace) if namespace else ()), *arguments]
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise LabError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _sysctl(namespace: str, settings: dict[str, str]) -> None:
    script = "; ".join(f"echo {value} > /proc/sys/{key.replace('.', '/')}" for key, value in settings.items())
    result = subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c", script], capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"cannot set {', '.join(settings)} in namespace {namespace}: {result.stderr.strip()}")


def list_namespaces(prefix: str) -> list[str]:
    result = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def namespace_pids(namespace: str) -> list[int]:
    result = _ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def relay_pids(names: LabNames) -> list[int]:
    """Relays of this lab wherever they run (by the config path on their command line)."""
    marker = str(names.relay_config_path).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:
            continue
        if b"geotrain.lab.relay" in command and marker in command and is_alive(int(entry)):
            found.append(int(entry))
    return found


# --- state ---------------------------------------------------------------------------------------

def read_state(lab: str = DEFAULT_LAB) -> dict | None:
    names = check_lab_name(lab)
    try:
        return json.loads(names.state_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def require_state(lab: str = DEFAULT_LAB) -> dict:
    state = read_state(lab)
    names = LabNames(lab)
    if state is None or names.hub not in list_namespaces(names.prefix):
        flag = "" if lab == DEFAULT_LAB else f" --lab {lab}"
        raise LabError(f"lab {lab!r} is not up; run geotrain lab up{flag} --topology FILE")
    return state


def topology_of(state: dict) -> Topology:
    return parse_topology(state["topology"], f"lab state {state['lab']}")


# --- up / down -----------------------------------------------------------------------------------

def _relay_links(topology: Topology) -> list[dict]:
    index = {region.name: region.index for region in topology.regions}
    links = []
    for pair, link in topology.links.items():
        a, b = sorted(pair)
        links.append({"a": index[a], "b": index[b], "latency_ms": link.latency_ms,
                      "bandwidth_mbit_s": link.bandwidth_mbit_s})
    return links


def _start_relay(names: LabNames, topology: Topology) -> int:
    names.relay_config_path.write_text(json.dumps({"tun": TUN_DEVICE, "links": _relay_links(topology),
                                                   "stats": str(names.relay_stats_path),
                                                   "nat": [r.index for r in topology.regions if r.nat]}, indent=1))
    names.relay_log_path.write_text("")
    # The relay outlives this command, and geotrain stops every descendant of a command when it ends:
    # a shell starts it in the background and exits, so the relay is nobody's child.
    command = ["ip", "netns", "exec", names.hub, sys.executable, "-m", "geotrain.lab.relay",
               "--config", str(names.relay_config_path)]
    launcher = subprocess.run(["sh", "-c", 'setsid "$@" </dev/null >>"$LOG" 2>&1 & echo $!', "sh", *command],
                              capture_output=True, text=True, env=dict(os.environ, LOG=str(names.relay_log_path)))
    pid = int(launcher.stdout.strip() or 0)
    deadline = time.monotonic() + RELAY_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if "relay ready" in names.relay_log_path.read_text(errors="replace"):
            return pid
        if not is_alive(pid):
            break
        time.sleep(0.05)
    tail = names.relay_log_path.read_text(errors="replace")[-2000:]
    raise LabError(f"the lab's relay did not start (log {names.relay_log_path}):\n{tail}")


def up(topology: Topology, lab: str = DEFAULT_LAB, mtu: int = DEFAULT_MTU) -> dict:
    """Create the namespaces, links, TUN device, routes and the relay; returns the lab's state."""
    names = check_lab_name(lab)
    require_lab_support("up")
    if read_state(lab) is not None and list_namespaces(names.prefix):
        raise LabError(f"lab {lab!r} is already up; run geotrain lab down"
                       f"{'' if lab == DEFAULT_LAB else f' --lab {lab}'} first")
    if list_namespaces(names.prefix) or relay_pids(names):
        down(lab)  # leftovers of a lab that crashed: start clean
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        state = _build(names, topology, mtu)
    except BaseException:
        down(lab)
        raise
    names.state_path.write_text(json.dumps(state, indent=1))
    return state


def _build(names: LabNames, topology: Topology, mtu: int) -> dict:
    hub = names.hub
    _ip("netns", "add", hub)
    _ip("link", "set", "lo", "up", namespace=hub)
    _sysctl(hub, {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                  "net.ipv4.conf.default.rp_filter": "0", "net.ipv4.conf.all.send_redirects": "0",
                  "net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"})
    _ip("tuntap", "add", "dev", TUN_DEVICE, "mode", "tun", namespace=hub)
    _ip("link", "set", TUN_DEVICE, "mtu", str(mtu), "txqueuelen", "10000", "up", namespace=hub)
    _sysctl(hub, {f"net.ipv4.conf.{TUN_DEVICE}.rp_filter": "0"})
    _ip("route", "add", "default", "dev", TUN_DEVICE, "table", str(RELAY_TABLE), namespace=hub)
    regions = {}
    for region in topology.regions:
        namespace = names.region(region.name)
        hub_end, region_end = f"gtlab-h{region.index}", f"gtlab-r{region.index}"
        address, gateway = subnet_address(region.index, 2), subnet_address(region.index, 1)
        _ip("netns", "add", namespace)
        _sysctl(namespace, {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"})
        _ip("link", "set", "lo", "up", namespace=namespace)
        _ip("link", "add", hub_end, "mtu", str(mtu), "type", "veth", "peer", "name", region_end,
            "mtu", str(mtu), "netns", namespace, namespace=hub)
        _ip("addr", "add", f"{gateway}/24", "dev", hub_end, namespace=hub)
        _ip("link", "set", hub_end, "up", namespace=hub)
        _sysctl(hub, {f"net.ipv4.conf.{hub_end}.rp_filter": "0"})
        _ip("rule", "add", "iif", hub_end, "lookup", str(RELAY_TABLE), "priority", "100", namespace=hub)
        _ip("addr", "add", f"{address}/24", "dev", region_end, namespace=namespace)
        _ip("link", "set", region_end, "up", namespace=namespace)
        _ip("route", "add", "default", "via", gateway, namespace=namespace)
        regions[region.name] = {"namespace": namespace, "address": address, "index": region.index,
                                "peers": region.peers}
        if region.nat:  # the address the other regions see its peers at (geotrain.lab.nat)
            regions[region.name]["nat_gateway"] = subnet_address(region.index, GATEWAY_HOST)
    relay_pid = _start_relay(names, topology)
    return {"lab": names.lab, "topology": topology.to_dict(), "topology_source": topology.source, "mtu": mtu,
            "hub": hub, "regions": regions, "relay_pid": relay_pid, "created": time.time()}


def down(lab: str = DEFAULT_LAB) -> list[str]:
    """Remove everything of lab ``lab``; safe to run any number of times. Returns what it removed."""
    names = check_lab_name(lab)
    require_lab_support("down")
    removed = []
    namespaces = list_namespaces(names.prefix)
    pids = sorted({pid for namespace in namespaces for pid in namespace_pids(namespace)} | set(relay_pids(names)))
    if pids:
        terminate_tree(pids, STOP_GRACE_S)
        removed.append(f"{len(pids)} process(es)")
    for namespace in namespaces:
        _ip("netns", "del", namespace, check=False)
        removed.append(f"namespace {namespace}")
    for path in names.files():
        if path.exists():
            path.unlink()
            removed.append(str(path))
    return removed


def leftovers(lab: str = DEFAULT_LAB) -> dict[str, list]:
    """What of lab ``lab`` exists on this machine (all lists empty after ``down``)."""
    names = check_lab_name(lab)
    host_links = [line.split(":")[1].strip().split("@")[0]
                  for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
                  if line.count(":") >= 2 and line.split(":")[1].strip().startswith("gtlab")]
    return {"namespaces": list_namespaces(names.prefix), "relays": relay_pids(names),
            "files": [str(p) for p in names.files() if p.exists()], "host_links": host_links}


# --- run -----------------------------------------------------------------------------------------

def region_command(state: dict, region: str, command: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``command`` inside ``region`` of the lab."""
    regions = state["regions"]
    if region not in regions:
        raise LabError(f"region {region!r} is not in lab {state['lab']!r}; expected one of {', '.join(regions)}")
    if not command:
        raise LabError("no command given; expected geotrain lab run REGION -- COMMAND [ARGS...]")
    environment = dict(os.environ, GEOTRAIN_LAB=state["lab"], GEOTRAIN_LAB_REGION=region,
                       GEOTRAIN_LAB_ADDRESS=regions[region]["address"])
    return ["ip", "netns", "exec", regions[region]["namespace"], *command], environment
