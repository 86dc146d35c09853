"""Prometheus metrics of one peer, served on ``metrics.port`` (loopback unless told otherwise).

Names follow Prometheus conventions: counters end in ``_total``, durations in ``_seconds``, sizes in
``_bytes``. Every metric carries the run id, the peer's role, and its region, cloud and instance type
(from the ``metrics`` section of its config) as labels.

:class:`PeerMetrics` is what every peer exports about itself; :class:`SwarmMetrics` is what the
coordinator exports about the whole swarm, aggregated from the trainers' signed records in the DHT
(:mod:`geotrain.hive.dht.metric_records`, :mod:`geotrain.telemetry.swarm_view`).
"""

from __future__ import annotations

import errno

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from geotrain.config import MetricsConfig
from geotrain.errors import UserError

disable_created_metrics()  # no *_created series: they double every counter and no query here needs them


class MetricsPortError(UserError):
    """The metrics port cannot be served (in use, or not an address of this machine)."""


# Averaging rounds take well under a second on a LAN and tens of seconds between continents.
AVERAGING_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
# alone: given up because no other trainer was left to average with (geotrain.hive.averaging.missed_round)
ROUND_RESULTS = ("ok", "failed", "timeout", "alone")


class _Metrics:
    """A registry whose metrics all carry this peer's run id, role, region, cloud and instance type."""

    def __init__(self, run_id: str, role: str, config: MetricsConfig | None = None):
        config = config or MetricsConfig()
        self.registry = CollectorRegistry()
        self._labels = {"run_id": run_id, "role": role, "region": config.region, "cloud": config.cloud,
                        "instance_type": config.instance_type}
        self._series: dict[int, set[tuple[str, ...]]] = {}  # gauge -> extra-label values it has series for

    def _gauge(self, name: str, documentation: str, extra: tuple[str, ...] = (), optional: bool = False):
        """A gauge of this peer; with ``extra`` labels or ``optional`` (absent until set) the labelled parent."""
        gauge = Gauge(name, documentation, [*self._labels, *extra], registry=self.registry)
        return gauge if extra or optional else gauge.labels(**self._labels)

    def _counter(self, name: str, documentation: str, extra: tuple[str, ...] = ()):
        counter = Counter(name, documentation, [*self._labels, *extra], registry=self.registry)
        return counter if extra else counter.labels(**self._labels)

    def set_optional(self, gauge, value: float | None) -> None:
        """Set an optional gauge, or remove its series when the value is unknown."""
        if value is None:
            gauge.clear()
        else:
            gauge.labels(**self._labels).set(value)

    def set_series(self, gauge, names: tuple[str, ...], values: dict[tuple[str, ...], float]) -> None:
        """Make a gauge's series (by its extra labels) exactly ``values``: set the new, remove the gone.

        Series are replaced one by one, never cleared first, so a scrape in between sees no gap.
        """
        for key, value in values.items():
            self.labelled(gauge, **dict(zip(names, key))).set(value)
        for key in self._series.get(id(gauge), set()) - values.keys():
            gauge.remove(*self._labels.values(), *key)
        self._series[id(gauge)] = set(values)

    def labelled(self, metric, **extra):
        """The child of a metric with extra labels (e.g. destination_region), this peer's labels included."""
        return metric.labels(**self._labels, **extra)

    def serve(self, config: MetricsConfig) -> int | None:
        """Start the HTTP endpoint; return its port (None when disabled)."""
        if config.port is None:
            return None
        try:
            server, _thread = start_http_server(config.port, addr=config.host, registry=self.registry)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise MetricsPortError(
                    f"metrics port {config.port} on {config.host} is already in use; choose another with "
                    "--metrics-port (or 0 for any free port)") from None
            raise MetricsPortError(f"cannot serve metrics on {config.host}:{config.port}: {error.strerror}") from None
        return server.server_port


class PeerMetrics(_Metrics):
    def __init__(self, run_id: str, role: str, config: MetricsConfig | None = None):
        super().__init__(run_id, role, config)
        gauge, counter = self._gauge, self._counter

        self.samples = counter("geotrain_samples", "Samples this peer has processed")
        self.compute_seconds = counter("geotrain_compute_seconds", "Seconds spent in forward and backward passes")
        self.communication_seconds = counter(
            "geotrain_communication_seconds", "Seconds spent averaging with peers or waiting for them")
        self.state_loads = counter("geotrain_state_loads", "Times this peer loaded the swarm's state from peers")
        self.preemption_notices = counter("geotrain_preemption_notices", "Spot preemption notices received")
        self.samples_per_second = gauge("geotrain_samples_per_second", "This peer's samples/s over its last epoch")
        self.local_epoch = gauge("geotrain_local_epoch", "Epoch of this peer's parameters")
        self.global_epoch = gauge("geotrain_global_epoch", "Newest epoch any peer of the swarm has reached")
        self.loss = gauge("geotrain_loss", "Mean training loss of this peer over its last epoch")
        self.peers = gauge("geotrain_peers", "Trainer peers this peer sees in the swarm")
        self.granularity = gauge("geotrain_granularity", "Compute time over communication time, last epoch")
        self.averaging_rounds = counter("geotrain_averaging_rounds", "Gradient averaging rounds by result",
                                        ("result",))
        for result in ROUND_RESULTS:  # every series exists from the start, so rates work at once
            self.labelled(self.averaging_rounds, result=result)
        self.averaging_duration = Histogram(
            "geotrain_averaging_duration_seconds", "Time this peer waited for a gradient averaging round to end",
            list(self._labels), buckets=AVERAGING_BUCKETS_S, registry=self.registry).labels(**self._labels)
        self.sent_bytes = counter("geotrain_sent_bytes", "Bytes this peer's swarm connections sent, by destination "
                                  "region (the kernel's TCP counters)", ("destination_region",))
        self.received_bytes = counter("geotrain_received_bytes",
                                      "Bytes this peer's swarm connections received (the kernel's TCP counters)")
        self.data_seconds = counter("geotrain_data_seconds",
                                    "Seconds the training loop waited for its next batch (a starved GPU shows here)")
        self.peak_gpu_memory = gauge("geotrain_peak_gpu_memory_bytes",
                                     "Peak GPU memory this peer's tensors took during its last epoch (absent on CPU)",
                                     optional=True)
        self.outer_rounds = counter("geotrain_outer_rounds", "DiLoCo outer rounds by result: ok, alone (no other "
                                    "trainer), timeout, failed, refused (a non-finite or outlying average)",
                                    ("result",))
        self.outer_round_seconds = gauge("geotrain_outer_round_seconds",
                                         "How long the last DiLoCo outer round blocked this trainer")
        self.outer_round_group_size = gauge("geotrain_outer_round_group_size",
                                            "Trainers in this trainer's last DiLoCo outer round (itself included)")
        self.pseudo_gradient_norm = gauge("geotrain_pseudo_gradient_norm",
                                          "L2 norm of the pseudo-gradient of the last DiLoCo outer step",
                                          optional=True)
        self.outer_round_sent_bytes = gauge("geotrain_outer_round_sent_bytes",
                                            "Bytes this trainer sent in its last DiLoCo outer round (estimated "
                                            "from the compressed pseudo-gradient's size)")
        self.compute_info = gauge("geotrain_compute_info", "1, labelled with where and how this peer computes",
                                  ("device", "precision"))

    def outer_round(self, result: str, duration_s: float, group_size: int, pseudo_gradient_norm: float | None,
                    sent_bytes: float) -> None:
        """One DiLoCo outer round (optimizer.mode diloco): how it ended, how long it blocked this peer, the norm
        of the pseudo-gradient applied and the bytes this peer sent for it (estimated from the compressed size)."""
        self.labelled(self.outer_rounds, result=result).inc()
        self.outer_round_seconds.set(duration_s)
        self.outer_round_group_size.set(group_size)
        self.set_optional(self.pseudo_gradient_norm, pseudo_gradient_norm)
        self.outer_round_sent_bytes.set(sent_bytes)

    def watch_guard(self, report) -> None:
        """Export the guard's refusals (:class:`geotrain.hive.guard.report.GuardReport`), counted in every
        process of this peer, as ``geotrain_guard_refusals_total{what,reason}``."""
        self.registry.register(_GuardCollector(report, self._labels))
        self.registry.register(_DownloadCollector(report.downloads, self._labels))

    def set_compute(self, device: str, precision: str) -> None:
        """Which device and precision this peer trains with (one series, value 1)."""
        self.set_series(self.compute_info, ("device", "precision"), {(device, precision): 1.0})

    def averaging_round(self, result: str, duration_s: float) -> None:
        self.labelled(self.averaging_rounds, result=result).inc()
        self.averaging_duration.observe(duration_s)


class _GuardCollector:
    def __init__(self, report, labels: dict[str, str]):
        self.report = report
        self.labels = labels

    def describe(self):
        return list(self._families())

    def _families(self):
        refusals = CounterMetricFamily(
            "geotrain_guard_refusals", "What this peer refused from other peers or skipped itself, by what "
            "(contribution, join_group, aggregate, download_state, step, microstep, parameters) and reason",
            labels=[*self.labels, "what", "reason"])
        averaging = CounterMetricFamily(
            "geotrain_averaging_payload_bytes", "All-reduce messages of the averaging rounds this peer reduced, by "
            "direction: the parts other peers sent it (received) and the averages it returned (sent); summed over "
            "the swarm, every averaging byte exchanged between peers once", labels=[*self.labels, "direction"])
        return refusals, averaging

    def collect(self):
        refusals, averaging = self._families()
        for (what, reason), count in self.report.counts().items():
            refusals.add_metric([*self.labels.values(), what, reason], count)
        for direction, size_bytes in self.report.averaging_bytes().items():
            averaging.add_metric([*self.labels.values(), direction], size_bytes)
        yield refusals
        yield averaging


class _DownloadCollector:
    """State downloads of this peer (geotrain.hive.state.donors.DownloadProgress, written by its averagers)."""

    def __init__(self, progress, labels: dict[str, str]):
        self.progress = progress
        self.labels = labels

    def describe(self):
        return list(self._families())

    def _families(self, snapshot: dict | None = None):
        names = list(self.labels)
        values = list(self.labels.values())
        attempts = CounterMetricFamily("geotrain_state_download_attempts", "State downloads this peer tried, by "
                                       "result (ok; stalled, slow, failed, refused: the next donor was asked; "
                                       "empty: the donor did not share; held: it would have ended after the "
                                       "swarm's step, and began again after it)", labels=[*names, "result"])
        received = CounterMetricFamily("geotrain_state_download_received_bytes", "State bytes this peer received "
                                       "from donors, every attempt", labels=names)
        progress = GaugeMetricFamily("geotrain_state_download_progress_bytes", "The download in progress: bytes "
                                     "received (0 when none runs)", labels=names)
        expected = GaugeMetricFamily("geotrain_state_download_expected_bytes", "The download in progress: the "
                                     "state's size as its donor says (0 when none runs)", labels=names)
        rate = GaugeMetricFamily("geotrain_state_download_rate_bytes_per_second", "The download in progress: "
                                 "bytes per second so far (0 when none runs)", labels=names)
        if snapshot is not None:
            for result, count in snapshot["attempts"].items():
                attempts.add_metric([*values, result], count)
            received.add_metric(values, snapshot["bytes_total"])
            progress.add_metric(values, snapshot["received_bytes"])
            expected.add_metric(values, snapshot["expected_bytes"])
            rate.add_metric(values, snapshot["bytes_per_second"])
        return attempts, received, progress, expected, rate

    def collect(self):
        yield from self._families(self.progress.snapshot())


class SwarmMetrics(_Metrics):
    """The coordinator's view of the whole swarm, from the trainers' records (see geotrain.telemetry.swarm_view)."""

    def __init__(self, run_id: str, config: MetricsConfig | None = None):
        super().__init__(run_id, "coordinator", config)
        gauge, counter = self._gauge, self._counter
        self.samples_per_second = gauge("geotrain_swarm_samples_per_second",
                                        "Sum of the alive trainers' samples/s over their last epoch")
        self.global_epoch = gauge("geotrain_swarm_global_epoch", "Newest epoch any trainer has reached")
        self.granularity = gauge("geotrain_swarm_granularity",
                                 "The trainers' compute time over communication time, last epoch (mean)")
        # absent while unknown: no target epoch, no throughput yet, no budget, no checkpoint yet
        self.eta_seconds = gauge("geotrain_swarm_eta_seconds",
                                 "Seconds until the target epoch at the current samples/s", optional=True)
        self.peers = gauge("geotrain_swarm_peers", "Alive trainers by region and cloud", ("peer_region", "peer_cloud"))
        self.peer_joins = counter("geotrain_swarm_peer_joins", "Trainers that joined the swarm")
        self.peer_departures = counter("geotrain_swarm_peer_departures",
                                       "Trainers that left the swarm (goodbye or record expired)")
        self.instance_cost = gauge("geotrain_swarm_instance_cost_dollars_per_hour",
                                   "What the alive peers' priced VMs cost per hour (the planner's catalog, "
                                   "cost.instance_usd_per_hour)")
        self.egress_cost = gauge("geotrain_swarm_egress_cost_dollars_per_hour",
                                 "What the peers' measured traffic on priced routes costs per hour (the planner's "
                                 "egress prices, cost.egress_usd_per_gb)")
        self.cost = gauge("geotrain_swarm_cost_dollars_per_hour", "Instances plus egress, per hour")
        self.cost_per_million_samples = gauge("geotrain_swarm_cost_dollars_per_million_samples",
                                              "Dollars per 1M samples at the current cost and throughput",
                                              optional=True)
        self.egress_bytes_per_second = gauge("geotrain_swarm_egress_bytes_per_second",
                                             "Trainers' measured traffic by source and destination region",
                                             ("peer_region", "destination_region"))
        self.unpriced_peers = gauge("geotrain_swarm_unpriced_peers",
                                    "Alive peers (the coordinator included) whose VM has no price in the catalog "
                                    "or cost.instance_usd_per_hour: left out of the instance cost")
        self.unpriced_routes = gauge("geotrain_swarm_unpriced_routes",
                                     "Routes (source and destination region) with measured traffic but no egress "
                                     "price in the egress prices or cost.egress_usd_per_gb: left out of the egress "
                                     "cost")
        self.egress_budget = gauge("geotrain_swarm_egress_budget_dollars_per_hour",
                                   "cost.egress_budget_usd_per_hour, for the alert rule", optional=True)
        self.checkpoints = counter("geotrain_checkpoints", "Checkpoints this coordinator wrote")
        self.checkpoint_last_success = gauge("geotrain_checkpoint_last_success_timestamp_seconds",
                                             "Unix time of this coordinator's newest checkpoint", optional=True)
