"""Talking to hivemind: the DHT, the optimizer and what peers send each other."""
