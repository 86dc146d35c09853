"""The swarm's DHT: joining it, its keys and records, their limits, and who may talk to a private swarm."""
