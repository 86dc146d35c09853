"""What a peer checks so that one bad peer cannot break the swarm: what others send, and each step."""
