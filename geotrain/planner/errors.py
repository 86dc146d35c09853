"""The planner's errors: something a user wrote or asked for cannot be used, or the solver ran out of time.

Input files shared with the live swarm's pricing (catalog, egress prices) raise their base class,
:class:`geotrain.pricing.errors.InputFileError`; catch that to handle all of them (exit code 2).
"""

from __future__ import annotations

from typing import Any

from geotrain.pricing.errors import InputFileError


class PlannerError(InputFileError):
    """A planner input or request is wrong; the message is meant for the user as it is."""


class SolverTimeLimitError(PlannerError):
    """HiGHS stopped at ``--solver-time-limit`` on at least one program, so no plan is proven best.

    The message names the best plan found so far (or says there was none); ``best_so_far`` holds it as a
    :class:`geotrain.planner.solve.Plan` (None when none was found), for callers that can use it anyway.
    """

    def __init__(self, message: str, best_so_far: Any = None):
        super().__init__(message)
        self.best_so_far = best_so_far
