"""The swarm's training state: the snapshot and its hash, where a download comes from (donors, stripes),
and the end-of-run agreement on one final state."""
