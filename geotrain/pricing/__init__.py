"""Prices and egress costs of the clouds: the catalog the planner reads (no torch, no hivemind)."""
