"""A small builder for mixed-integer linear programs, solved by HiGHS through ``scipy.optimize.milp``.

Variables are added by name with bounds and integrality; constraints are sparse rows
``lower <= sum(coef * var) <= upper``. scipy is imported only when a program is solved, so
importing the planner stays instant.

:meth:`Program.solve` tells apart what ``milp`` reports in ``status``: 0 optimal, 1 time (or
iteration) limit reached, with or without a feasible solution, 2 infeasible (also 4 when HiGHS
says "unbounded or infeasible": the planner's programs are bounded); anything else is a bug.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

INF = float("inf")


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS's C++ code sometimes prints debug lines straight to file descriptor 1; keep them off the table."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


OPTIMAL = "optimal"
TIME_LIMIT = "time limit"
INFEASIBLE = "infeasible"


@dataclass
class Solution:
    """What HiGHS found: ``values`` is None when it is infeasible or stopped before finding a solution."""

    status: str  # OPTIMAL, TIME_LIMIT or INFEASIBLE
    values: list[float] | None = None
    gap: float | None = None  # relative MIP gap when stopped by the time limit with a solution

    @property
    def time_limited(self) -> bool:
        return self.status == TIME_LIMIT


@dataclass
class Program:
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    objective: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, lower: float = 0.0, upper: float = INF, integer: bool = False, cost: float = 0.0) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(1 if integer else 0)
        self.objective.append(cost)
        return len(self.lower) - 1

    def binary(self, cost: float = 0.0) -> int:
        return self.var(0.0, 1.0, integer=True, cost=cost)

    def row(self, terms: dict[int, float], lower: float = -INF, upper: float = INF) -> None:
        self.rows.append(({k: v for k, v in terms.items() if v != 0.0}, lower, upper))

    def solve(self, time_limit_s: float = 30.0) -> Solution:
        """Solve with HiGHS, stopping after ``time_limit_s`` seconds with the best solution found so far."""
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        data, row_index, col_index = [], [], []
        for i, (terms, _, _) in enumerate(self.rows):
            for j, coef in terms.items():
                row_index.append(i)
                col_index.append(j)
                data.append(coef)
        constraints = []
        if self.rows:
            matrix = coo_matrix((data, (row_index, col_index)), shape=(len(self.rows), len(self.lower))).tocsr()
            constraints.append(LinearConstraint(matrix, [r[1] for r in self.rows], [r[2] for r in self.rows]))
        with _quiet_stdout():
            result = milp(np.array(self.objective), integrality=np.array(self.integer),
                          bounds=Bounds(np.array(self.lower), np.array(self.upper)), constraints=constraints,
                          options={"time_limit": time_limit_s, "mip_rel_gap": 1e-7})
        values = None if result.x is None else list(result.x)
        if result.status == 0 and values is not None:
            return Solution(OPTIMAL, values)
        if result.status == 1:
            gap = getattr(result, "mip_gap", None)
            if values is None or gap is None or gap != gap:
                gap = None
            return Solution(TIME_LIMIT, values, gap)
        if result.status == 2 or (result.status == 4 and "infeasible" in str(result.message).lower()):
            return Solution(INFEASIBLE)
        raise RuntimeError(f"HiGHS could not solve a planner MILP (status {result.status}): {result.message}")
