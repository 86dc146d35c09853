"""Live metrics: what peers publish, the Prometheus exporter, the swarm view and status."""
