"""Prometheus metrics of one peer, served on ``metrics.port`` (loopback unless told otherwise).

Names follow Prometheus conventions: counters end in ``_total``, durations in ``_seconds``.
Every metric carries the run id, the peer's role, and its region, cloud and instance type (from the
``metrics`` section of its config) as labels.
"""

from __future__ import annotations

import errno

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from geotrain.config import MetricsConfig


class MetricsPortError(RuntimeError):
    pass


class PeerMetrics:
    def __init__(self, run_id: str, role: str, config: MetricsConfig | None = None):
        config = config or MetricsConfig()
        self.registry = CollectorRegistry()
        labels = {"run_id": run_id, "role": role, "region": config.region, "cloud": config.cloud,
                  "instance_type": config.instance_type}
        names = list(labels)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, names, registry=self.registry).labels(**labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, names, registry=self.registry).labels(**labels)

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
