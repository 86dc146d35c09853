"""Stopping a peer, in one place.

- :mod:`~geotrain.stopping.stopper`: SIGINT/SIGTERM and preemption notices become one stop request, handled
  cleanly within a deadline, and a watchdog ends the process when the deadline passes.
- :mod:`~geotrain.stopping.notices`: spot preemption notices from the clouds' metadata services.
- :mod:`~geotrain.stopping.processes`: no child process (hivemind's forks, p2pd) outlives its peer, nor the
  shared memory its processes made.

What a stopping peer does in the swarm (leaving the averaging rounds not begun, withdrawing its state, its
goodbye) talks to hivemind and lives with it: :mod:`geotrain.hive.optim.leave`.
"""
