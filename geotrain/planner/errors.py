"""The one error type of the planner: something a user wrote or asked for cannot be used.

Input files shared with the live swarm's pricing (catalog, egress prices) raise their base class,
:class:`geotrain.pricing.errors.InputFileError`; catch that to handle both.
"""

from geotrain.pricing.errors import InputFileError


class PlannerError(InputFileError):
    """A planner input or request is wrong; the message is meant for the user as it is."""
