"""Spot preemption notices from the clouds' metadata services, behind one interface.

A spot VM is told shortly before it is taken away: AWS two minutes ahead, Google Compute Engine and
Azure about 30 s ahead (provider documentation). A watcher turns that into one call of
``on_notice(notice)``; the trainer then stops starting micro-steps, leaves the swarm and exits with
:data:`EXIT_PREEMPTED` well inside the window. ``geotrain peer --preemption SOURCE``:

- ``aws``: IMDSv2 (``PUT /latest/api/token``, then ``GET /latest/meta-data/spot/instance-action``, 404 while
  nothing is pending, and ``/latest/meta-data/events/recommendations/rebalance``), polled every few seconds.
  A rebalance recommendation is logged but does not stop the peer: it is a hint, not a notice.
- ``gcp``: ``GET /computeMetadata/v1/instance/preempted?wait_for_change=true`` with ``Metadata-Flavor:
  Google``, a long poll that answers ``TRUE`` when the VM is preempted.
- ``azure``: Scheduled Events (``GET /metadata/scheduledevents`` with ``Metadata: true``); a ``Preempt``
  event for this VM is acknowledged at once (``POST StartRequests``) since the peer is leaving anyway.
- ``signal``: only SIGTERM/SIGINT (always handled, whatever the source).
- ``auto``: asks each metadata service briefly which cloud this is, and falls back to ``signal``.
- ``none``: same as ``signal``; kept for symmetry with configs that want to say so.

Metadata base URLs are configurable (``preemption.*_metadata_url``), which is also how the tests point
the watchers at real HTTP servers on loopback that speak each cloud's format.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from geotrain.config import PreemptionConfig

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: this VM is going away; start the peer again elsewhere
DETECT_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Notice:
    cloud: str
    action: str  # what the cloud will do: terminate, stop, hibernate, preempt
    not_before_unix_s: float | None  # when the VM may be taken away, if the cloud says
    received_unix_s: float

    def seconds_left(self, now_unix_s: float | None = None) -> float | None:
        if self.not_before_unix_s is None:
            return None
        return self.not_before_unix_s - (time.time() if now_unix_s is None else now_unix_s)

    def describe(self) -> str:
        left = self.seconds_left(self.received_unix_s)
        when = f", {left:.0f} s before the VM goes" if left is not None else ""
        return f"{self.cloud} {self.action} notice{when}"


def _parse_time(text: str | None) -> float | None:
    """ISO 8601 (AWS: 2026-11-30T12:00:00Z) or RFC 1123 (Azure: Mon, 30 Nov 2026 12:00:00 GMT)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        pass
    try:
        return datetime.strptime(text, "%a, %d %b %Y %H:%M:%S GMT").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def _request(url: str, method: str = "GET", headers: dict | None = None, data: bytes | None = None,
             timeout_s: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read() or b""


class NoticeWatcher:
    """Watches one source in a daemon thread and calls ``on_notice`` once. The base class watches nothing:
    signals are handled by :mod:`geotrain.stopping.stopper` for every source."""

    cloud = "signal"
    long_poll = False  # a long-polling check waits by itself; others are polled every poll_interval_s

    def __init__(self, config: PreemptionConfig):
        self.config = config
        self._stop = threading.Event()

    def start(self, on_notice: Callable[[Notice], None]) -> "NoticeWatcher":
        if type(self).check is not NoticeWatcher.check:
            threading.Thread(target=self._run, args=(on_notice,), name=f"preemption-{self.cloud}",
                             daemon=True).start()
        return self

    def _run(self, on_notice: Callable[[Notice], None]) -> None:
        while not self._stop.is_set():
            failed = False
            try:
                notice = self.check()
            except (OSError, ValueError, KeyError) as error:  # the metadata service hiccups; keep watching
                logger.debug("%s metadata check failed: %s", self.cloud, error)
                notice, failed = None, True
            if notice is not None:
                on_notice(notice)
                return
            if failed or not self.long_poll:
                self._stop.wait(self.config.poll_interval_s)

    def check(self) -> Notice | None:
        """One look at the source: a notice, or None."""
        return None

    def stop(self) -> None:
        self._stop.set()


class AwsWatcher(NoticeWatcher):
    cloud = "aws"
    TOKEN_TTL_S = 21600

    def _token(self) -> str:
        status, body = _request(f"{self.config.aws_metadata_url}/latest/api/token", method="PUT",
                                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
        if status != 200:
            raise OSError(f"IMDSv2 token request answered {status}")
        return body.decode()

    def check(self) -> Notice | None:
        headers = {"X-aws-ec2-metadata-token": self._token()}
        base = f"{self.config.aws_metadata_url}/latest/meta-data"
        status, body = _request(f"{base}/spot/instance-action", headers=headers)
        if status == 200:
            action = json.loads(body)
            return Notice("aws", action.get("action", "terminate"), _parse_time(action.get("time")), time.time())
        status, body = _request(f"{base}/events/recommendations/rebalance", headers=headers)
        if status == 200 and not getattr(self, "_rebalance_logged", False):
            self._rebalance_logged = True
            logger.warning("AWS rebalance recommendation (%s): this spot VM is at elevated risk of interruption",
                           json.loads(body).get("noticeTime", "no time given"))
        return None


class GcpWatcher(NoticeWatcher):
    cloud = "gcp"
    long_poll = True
    LONG_POLL_S = 60

    def check(self) -> Notice | None:
        url = (f"{self.config.gcp_metadata_url}/computeMetadata/v1/instance/preempted"
               f"?wait_for_change=true&timeout_sec={self.LONG_POLL_S}")
        status, body = _request(url, headers={"Metadata-Flavor": "Google"}, timeout_s=self.LONG_POLL_S + 5)
        if status != 200:
            raise OSError(f"GCE metadata answered {status}")
        if body.strip().upper() == b"TRUE":
            # GCE gives about 30 s between the soft-off signal and the hard stop (provider documentation)
            return Notice("gcp", "preempt", time.time() + 30, time.time())
        return None


class AzureWatcher(NoticeWatcher):
    cloud = "azure"
    API_VERSION = "2020-07-01"

    _vm_name: str | None = None

    def _this_vm(self) -> str | None:
        if self._vm_name is None:
            status, body = _request(f"{self.config.azure_metadata_url}/metadata/instance/compute/name"
                                    f"?api-version=2021-02-01&format=text", headers={"Metadata": "true"})
            self._vm_name = body.decode().strip() if status == 200 else ""
        return self._vm_name or None

    def check(self) -> Notice | None:
        url = f"{self.config.azure_metadata_url}/metadata/scheduledevents?api-version={self.API_VERSION}"
        status, body = _request(url, headers={"Metadata": "true"})
        if status != 200:
            raise OSError(f"Azure Scheduled Events answered {status}")
        for event in json.loads(body).get("Events", []):
            resources = event.get("Resources") or []
            if resources and self._this_vm() and self._this_vm() not in resources:
                continue  # an event for another VM of the same scale set or availability set
            if event.get("EventType") == "Preempt":
                acknowledgement = json.dumps({"StartRequests": [{"EventId": event["EventId"]}]}).encode()
                ack_status, _ = _request(url, method="POST", data=acknowledgement,
                                         headers={"Metadata": "true", "Content-Type": "application/json"})
                logger.info("acknowledged Azure event %s (HTTP %d)", event["EventId"], ack_status)
                return Notice("azure", "preempt", _parse_time(event.get("NotBefore")), time.time())
        return None


WATCHERS: dict[str, type[NoticeWatcher]] = {"aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher,
                                            "signal": NoticeWatcher, "none": NoticeWatcher}


def detect_cloud(config: PreemptionConfig) -> str:
    """Which cloud's metadata service answers here; ``signal`` when none does."""
    probes = [
        ("gcp", lambda: _request(f"{config.gcp_metadata_url}/computeMetadata/v1/instance/id",
                                 headers={"Metadata-Flavor": "Google"}, timeout_s=DETECT_TIMEOUT_S)),
        ("azure", lambda: _request(f"{config.azure_metadata_url}/metadata/instance?api-version=2021-02-01",
                                   headers={"Metadata": "true"}, timeout_s=DETECT_TIMEOUT_S)),
        ("aws", lambda: _request(f"{config.aws_metadata_url}/latest/api/token", method="PUT",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout_s=DETECT_TIMEOUT_S)),
    ]
    for cloud, probe in probes:
        try:
            status, _ = probe()
        except (OSError, ValueError):
            continue
        if status == 200:
            return cloud
    return "signal"


def start_watcher(config: PreemptionConfig, on_notice: Callable[[Notice], None]) -> NoticeWatcher:
    source = config.source
    if source == "auto":
        source = detect_cloud(config)
        logger.info("preemption notices: %s", "signals only (no cloud metadata service answered)"
                    if source == "signal" else f"watching the {source} metadata service")
    return WATCHERS[source](config).start(on_notice)
