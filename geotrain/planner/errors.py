"""The one error type of the planner: something a user wrote or asked for cannot be used.

Its message says what was wrong, what was expected and what to do; `geotrain plan` prints it
and exits with code 2 instead of showing a traceback.
"""


class PlannerError(ValueError):
    """A planner input or request is wrong; the message is meant for the user as it is."""
