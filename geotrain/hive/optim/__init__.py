"""hivemind.Optimizer as geotrain builds it: the sync and DiLoCo optimizer classes, and leaving the swarm."""
