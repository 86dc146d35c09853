"""Benchmarks of geotrain: scripts with committed results; see docs/benchmarks.md."""
