"""A small builder for mixed-integer linear programs, solved by HiGHS through ``scipy.optimize.milp``.

Variables are added by name with bounds and integrality; constraints are sparse rows
``lower <= sum(coef * var) <= upper``. scipy is imported only when a program is solved, so
importing the planner stays instant.
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

    def solve(self, time_limit_s: float = 30.0) -> list[float] | None:
        """The optimal variable values, or None when the program is infeasible."""
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
        if result.x is None:
            return None
        return list(result.x)
