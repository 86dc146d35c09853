"""What the planner is asked: the inputs (catalog, profile, network, prices) and the request (objective, limits).

Also the two rules every part shares: how configurations are ranked, and when one satisfies the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import EgressPrices
from geotrain.planner.model import Prediction, Settings
from geotrain.planner.network import NetworkMatrix
from geotrain.planner.profiles import ModelProfile

OBJECTIVES = ("cost-per-sample", "throughput")
DEFAULT_MAX_PEERS = 16
# Most seconds HiGHS may spend on one MILP; when reached, the best solution found so far is used and
# the plan says it may not be optimal (see geotrain.planner.milp.Solution).
DEFAULT_SOLVER_TIME_LIMIT_S = 30.0


@dataclass
class Request:
    objective: str = "cost-per-sample"
    budget_usd_per_hour: float | None = None
    min_samples_per_second: float | None = None
    max_peers: int = DEFAULT_MAX_PEERS
    clouds: frozenset[str] | None = None
    regions: frozenset[str] | None = None
    continents: frozenset[str] | None = None
    region_quota_gpus: dict[str, int] = field(default_factory=dict)
    solver_time_limit_s: float = DEFAULT_SOLVER_TIME_LIMIT_S  # per MILP


@dataclass
class Inputs:
    offers: list[Offer]
    profile: ModelProfile
    network: NetworkMatrix
    egress: EgressPrices
    settings: Settings = Settings()


def ranking_key(objective: str):
    if objective == "throughput":
        return lambda p: (-round(p.samples_per_second, 9), p.usd_per_million_samples)
    return lambda p: (round(p.usd_per_million_samples, 12), -p.samples_per_second)


def satisfies(prediction: Prediction, request: Request, tolerance: float = 1e-9) -> bool:
    """Whether an evaluated configuration meets the request's budget and throughput floor."""
    if request.budget_usd_per_hour is not None and \
            prediction.usd_per_hour > request.budget_usd_per_hour * (1 + tolerance) + tolerance:
        return False
    if request.min_samples_per_second is not None and \
            prediction.samples_per_second < request.min_samples_per_second * (1 - tolerance):
        return False
    return True


