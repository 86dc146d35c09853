"""Real hivemind averagers that offer and download states, on loopback (tests of geotrain.hive.state.donors and
geotrain.hive.state.stripes)."""

from __future__ import annotations

import time

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager

from geotrain.config import GuardConfig
from geotrain.hive.guard.contributions import GuardedAveragerMixin
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.state.downloader import StateDownloadMixin

CHUNK = 2**16


class GoodDonor(GuardedAveragerMixin, DecentralizedAverager):
    guard_config = GuardConfig()


class UncheckedDonor(GoodDonor):
    """A donor that serves whatever state it holds, non-finite too, as a hostile or broken peer's would."""

    def _state_is_servable(self, tensors) -> bool:
        return True


class Downloader(GuardedAveragerMixin, StateDownloadMixin, DecentralizedAverager):
    guard_config = GuardConfig()
    donor_stall_s = 2.0
    donor_probation_s = 1.5
    donor_min_rate_bytes_s = 1e6  # a tricker of 64 KiB per 0.5 s is far below


class Swarm:
    """One DHT node (and peer) per averager, all on loopback; everything is shut down at the end."""

    def __init__(self):
        self.first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.nodes = [self.first]
        self.averagers = []

    def averager(self, cls, value: float, priority: float, tensors: int = 1, **kwargs):
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=[str(a) for a in self.first.get_visible_maddrs()])
        self.nodes.append(dht)
        averager = cls([torch.full((4 * CHUNK,), value) for _ in range(tensors)], dht=dht, prefix="donors", start=True,
                       **kwargs)
        averager.state_sharing_priority = priority
        self.averagers.append(averager)
        return averager

    def downloader(self, *donors, events_path=None, downloader_class=None, tensors: int = 1):
        """After ``donors`` (class, value, priority) announce their states of ``tensors`` tensors, an averager
        that downloads (with geotrain's donor choice) and its report."""
        made = [self.averager(cls, value, priority=priority, tensors=tensors) for cls, value, priority in donors]
        report = GuardReport(events_path)
        downloader_class = type("TestDownloader", (downloader_class or Downloader,), {"guard_report": report})
        downloader = self.averager(downloader_class, 0.0, priority=0.0, tensors=tensors, allow_state_sharing=False)
        # as the downloader's own DHT node sees them: another node's view may hold a donor this one does not yet
        # (a full run once downloaded from one donor where the test asked for stripes from two)
        _wait_for_donors(self.nodes[-1], len(donors))
        return made, downloader, report

    def shutdown(self):
        for averager in self.averagers:
            averager.shutdown()
        for node in self.nodes:
            node.shutdown()


def _wait_for_donors(dht, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = dht.get("donors.all_averagers", latest=True)
        if found is not None and len([v for v in found.value.values() if v.value is not None]) >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the donors did not announce themselves")
