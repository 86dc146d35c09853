"""The averagers a checked peer runs: each of geotrain's averagers with the guard's checks first in its bases
(:class:`~geotrain.hive.guard.contributions.GuardedAveragerMixin`), configured by their ``guard`` argument (a
:class:`~geotrain.hive.guard.contributions.GuardSettings`), which is set before hivemind's constructor forks the
averager's process; the state averagers also choose their donors
(:class:`~geotrain.hive.state.downloader.StateDownloadMixin`). They answer under hivemind's handler names, whatever
their own (``hivemind_handle_name``).
"""

from __future__ import annotations

from geotrain.hive.averaging.local_gradients import LocalGradientsKeepingAverager
from geotrain.hive.averaging.powersgd import PowerSGDKeepingAverager
from geotrain.hive.guard.contributions import GuardedAveragerMixin
from geotrain.hive.optim.diloco import DiLoCoStateAverager
from geotrain.hive.optim.optimizer import RecordingStateAverager
from geotrain.hive.state.downloader import StateDownloadMixin


class GuardedGradientAverager(GuardedAveragerMixin, LocalGradientsKeepingAverager):
    """Sync mode's gradient averager, checked."""


class GuardedPowerSGDAverager(GuardedAveragerMixin, PowerSGDKeepingAverager):
    """Sync mode's gradient averager with PowerSGD, checked."""


class GuardedStateAverager(GuardedAveragerMixin, StateDownloadMixin, RecordingStateAverager):
    """Sync mode's state averager, checked, downloading from the nearest donors."""


class GuardedDiLoCoStateAverager(GuardedAveragerMixin, StateDownloadMixin, DiLoCoStateAverager):
    """DiLoCo's state averager (its outer rounds), checked, downloading from the nearest donors."""
