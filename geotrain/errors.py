"""What a command can end with, and the exit code each outcome gets.

- :class:`UserError` (exit 2): something the user must fix (a config key, a path, a port, a file). The
  shipped systemd unit does not restart on it: restarting cannot help. :class:`ConfigError` is one for a config.
- :class:`SwarmUnreachableError` (exit 3): no peer of the swarm answered; worth retrying later.
- :class:`StopRequested` (exit 0, or the stop request's own code such as 75): a stop (SIGINT, SIGTERM, a
  preemption notice) came while the command was still joining the swarm; it leaves at once.
- 75: a trainer left after a preemption notice (:data:`geotrain.stopping.notices.EXIT_PREEMPTED`).
- 143: a stop did not finish within its deadline and the watchdog ended the process.
- 1: :class:`OperatorError` (something outside the command failed, e.g. a bucket that cannot be read;
  the message says what to check, and a restart may help) or anything unexpected (a bug: the log has the
  traceback).

Every message says what was wrong, what was expected and what to do, and is printed as it is.
"""

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_SWARM_UNREACHABLE = 3


class UserError(ValueError):
    """The user must fix something; the message says what and how (exit code 2)."""


class ConfigError(UserError):
    """A config a user wrote is wrong; the message says which key and what was expected."""


class SwarmUnreachableError(RuntimeError):
    """No initial peer answered, so this peer could not join the swarm (exit code 3)."""


class OperatorError(RuntimeError):
    """Something outside this command failed (storage, network); the message says what to check (exit 1)."""


class StopRequested(Exception):
    """A stop was requested before the command had joined the swarm (it ends as the stop request says, 0 by
    default): Ctrl-C while a peer waits for its initial peers is a request to stop, not a failed join."""
