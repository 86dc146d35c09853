"""What geotrain needs of hivemind beyond its public API, in one place.

geotrain runs on hivemind 1.1.12 (``setup.cfg`` pins it) and changes some of its behaviour by overriding or
reading private names, and by three patches installed once per process. Every such name is listed in
:data:`INTERNALS` with what geotrain does with it; ``tests/unit/test_hivemind_contract.py`` checks that each
still exists in the installed hivemind with the parameters listed, and that no module of geotrain touches a
private hivemind name that is not listed. An upgrade that renames or reshapes one fails that test instead of
silently bypassing an override.

:func:`check_hivemind_version` refuses any other hivemind version with what to install (a peer calls it before
it starts hivemind: :func:`geotrain.hive.dht.node.start_dht`, :func:`install_patches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from geotrain.errors import UserError
from geotrain.hive.patches.part_reducer import install as install_part_reducer_fix
from geotrain.hive.patches.quantization import install as install_quantization_decoder
from geotrain.hive.patches.task_references import install as install_task_references

HIVEMIND_VERSION = "1.1.12"

# what geotrain does with a name
OVERRIDE = "override"  # a geotrain subclass (or mixin) redefines it and calls hivemind's
REPLACE = "replace"  # a geotrain subclass redefines it without calling hivemind's
CALL = "call"  # geotrain calls it
READ = "read"  # geotrain reads (or sets) an attribute that hivemind assigns in the owner's code
PATCH = "patch"  # install_patches() replaces it on hivemind's class or module, for every instance


@dataclass(frozen=True)
class Internal:
    owner: str  # the hivemind class (or module) that defines the name
    name: str
    use: str
    parameters: tuple[str, ...] | None  # of the method as hivemind 1.1.12 defines it; None for an attribute
    why: str


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
_STATE_AVERAGER = "hivemind.optim.state_averager.TrainingStateAverager"
_OPTIMIZER = "hivemind.optim.optimizer.Optimizer"
_POWER_SGD = "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager"

INTERNALS: tuple[Internal, ...] = (
    # --- averagers: what peers send each other (geotrain.hive.guard.contributions, state.downloader, stripes) ---
    Internal(_AVERAGER, "rpc_join_group", OVERRIDE, ("self", "request", "context"),
             "refuse banned and unadmitted peers before they join a group (guard)"),
    Internal(_AVERAGER, "rpc_aggregate_part", OVERRIDE, ("self", "stream", "context"),
             "check every part a peer sends before hivemind's reducer reads it (guard)"),
    Internal(_AVERAGER, "rpc_download_state", OVERRIDE, ("self", "_request", "_context"),
             "refuse state downloads from unadmitted peers and beyond the concurrency limit (guard)"),
    Internal(_AVERAGER, "_load_state_from_peers", REPLACE, ("self", "future", "timeout"),
             "download from the nearest current donor, watched for stalls, and refuse non-finite states (downloader)"),
    Internal(_AVERAGER, "_get_current_state_from_host_process", CALL, ("self",),
             "serve a stripe of the state (stripes)"),
    Internal("hivemind.p2p.servicer.ServicerBase", "get_stub", CALL, ("cls", "p2p", "peer", "namespace"),
             "open a donor's download stream (state.stream)"),
    Internal(_AVERAGER, "_p2p", READ, None, "the averager's p2p client, for a donor's stub (state.stream)"),
    Internal(_AVERAGER, "_matchmaking", READ, None, "wrap its join requests so as never to join a banned leader"),
    Internal("hivemind.averaging.matchmaking.Matchmaking", "_request_join_group", OVERRIDE, ("self", "leader"),
             "(on the averager's matchmaking object) never ask a banned leader to join its group (guard)"),
    Internal(_AVERAGER, "_running_groups", READ, None,
             "find the round a received part belongs to, for this peer's own part of it (guard, powersgd)"),
    Internal(_AVERAGER, "_pending_groups_registered", READ, None, "wait for that round to be registered (guard)"),
    Internal("hivemind.p2p.servicer.ServicerBase", "_get_handle_name", REPLACE, ("cls", "namespace", "method_name"),
             "answer under the hivemind class's handler names whatever geotrain's class is called"),
    # --- the state averager (geotrain.hive.optim.optimizer, optim.diloco, state.snapshot) -------------------
    Internal(_STATE_AVERAGER, "_do", OVERRIDE, ("self", "wait_for_trigger", "optimizer_step", "zero_grad",
                                               "averaging_round", "averaging_control", "grad_scaler",
                                               "set_to_none", "timeout", "kwargs"),
             "check the averaged gradients before the step and the parameters after it (step guard)"),
    Internal(_STATE_AVERAGER, "_apply_averaging_results_", OVERRIDE, ("self",),
             "keep this peer's parameters when a state round returns non-finite values; DiLoCo's outer step"),
    Internal(_STATE_AVERAGER, "_apply_optimizer_parameters_", OVERRIDE, ("self",),
             "put the last good parameters back over non-finite ones averaged in place (offloaded optimizer); "
             "make the model the state a peer serves before the end-of-run agreement hashes it (finalize)"),
    Internal(_STATE_AVERAGER, "_load_local_tensors_into_averager_", OVERRIDE, ("self",),
             "after a download, drop a background round's delta that the loaded state supersedes; DiLoCo"),
    Internal(_STATE_AVERAGER, "_local_tensors", CALL, ("self",), "DiLoCo's local parameters at a round's boundary"),
    Internal(_STATE_AVERAGER, "_old_tensors", READ, None,
             "clear the delta rule's round start after a download (a later result is then copied, not added)"),
    Internal(_STATE_AVERAGER, "_update_scheduler", CALL, ("self",),
             "step the learning-rate schedule to the epoch of a restored or loaded state"),
    # --- the optimizer (geotrain.hive.optim: optimizer, diloco; averaging: local_gradients, missed_round) ----
    Internal(_OPTIMIZER, "_make_state_averager", REPLACE, ("self", "kwargs"),
             "build geotrain's state averager class (hivemind's hard-codes TrainingStateAverager)"),
    Internal(_OPTIMIZER, "_make_progress_tracker", OVERRIDE, ("self", "target_batch_size", "kwargs"),
             "a tracker without the progress of banned peers (geotrain.hive.optim.progress); DiLoCo's also counts a "
             "round in inner steps"),
    Internal(_OPTIMIZER, "_update_global_epoch", OVERRIDE, ("self", "grad_scaler"),
             "measure each round; DiLoCo's outer round in place of hivemind's step"),
    Internal(_OPTIMIZER, "_should_load_state_from_peers", OVERRIDE, ("self",),
             "load state only when the swarm really stepped past this peer (missed rounds)"),
    Internal(_OPTIMIZER, "_average_gradients_and_load_into_optimizer", OVERRIDE, ("self", "maybe_step_control"),
             "report how each gradient round ended and how long it took"),
    Internal(_OPTIMIZER, "_load_local_gradients_into_optimizer", OVERRIDE, ("self",),
             "step with this peer's own gradients when a round fails, not with zeros (local_gradients)"),
    Internal(_OPTIMIZER, "_load_averaged_gradients_into_optimizer_", CALL, ("self",),
             "load the averaged gradients as hivemind does, after geotrain's checks"),
    Internal(_OPTIMIZER, "_tag_along_with_zero_weight", CALL, ("self", "control"),
             "join a scheduled round with nothing to contribute, as hivemind does before it waits"),
    # --- PowerSGD (geotrain.hive.averaging.powersgd) ------------------------------------------------------------
    Internal(_POWER_SGD, "_register_allreduce_group", OVERRIDE, ("self", "group_info"),
             "give each phase of a round a future that shows the guard this peer's factor parts"),
    Internal(_POWER_SGD, "_aggregate_with_group", OVERRIDE, ("self", "group_info", "min_vector_size", "kwargs"),
             "take a failed round's gradient out of the error feedback again"),
    Internal(_AVERAGER, "_run_allreduce_inplace_", OVERRIDE, ("self", "tensors", "group_info", "group_id", "kwargs"),
             "note when a PowerSGD round's gradient is in the error feedback (between phases P and Q)"),
    Internal(_POWER_SGD, "_ms", READ, None, "the error-feedback buffers"),
    Internal(_POWER_SGD, "_qs", READ, None, "the factors, whose count and shapes a round's parts have"),
    Internal(_POWER_SGD, "_uncompressed_gradients_indexes", READ, None,
             "which gradients go uncompressed (the rest are in the feedback)"),
    # --- the progress tracker and the DHT (geotrain.hive.optim.diloco, optim.leave, dht.node) ------------------
    Internal("hivemind.optim.progress_tracker.ProgressTracker", "_parse_swarm_progress_data", OVERRIDE,
             ("self", "metadata"), "leave out the records of banned peers; DiLoCo: read the swarm's progress in "
             "inner steps"),
    Internal("hivemind.optim.progress_tracker.ProgressTracker", "_local_public_key", READ, None,
             "the subkey of this peer's progress record, removed when it leaves"),
    Internal("hivemind.p2p.p2p_daemon.P2P", "_client", READ, None,
             "dial an initial peer to name a wrong peer id in its address"),
    # --- global patches (install_patches) ------------------------------------------------------------
    Internal("hivemind.compression.quantization.Quantization", "extract", PATCH, ("self", "serialized_tensor"),
             "decode 8-bit parts under NumPy 2 (geotrain.hive.patches.quantization)"),
    Internal("hivemind.averaging.partition.TensorPartReducer", "reset_accumulators", PATCH, ("self",),
             "a sender that vanishes mid-round must not cancel the part for all (geotrain.hive.patches.part_reducer)"),
    Internal("hivemind.averaging.partition.TensorPartReducer", "current_part_future", READ, None,
             "replaced by a future that one cancelled sender cannot cancel (geotrain.hive.patches.part_reducer)"),
    Internal("hivemind.averaging.averager", "switch_to_uvloop", PATCH, (),
             "the averager's event loop keeps its running tasks (geotrain.hive.patches.task_references)"),
)


def check_hivemind_version(installed: str | None = None) -> None:
    """Refuse a hivemind other than the one geotrain's overrides are written for (``installed``: for tests)."""
    if installed is None:
        try:
            installed = metadata.version("hivemind")
        except metadata.PackageNotFoundError:
            installed = "none"
    if installed != HIVEMIND_VERSION:
        raise UserError(f"hivemind {installed} is installed; geotrain needs hivemind {HIVEMIND_VERSION} (it changes "
                        f"hivemind internals that other versions name or shape differently: "
                        f"geotrain/hive/hivemind_contract.py). Install it: pip install hivemind=={HIVEMIND_VERSION}")


def install_patches() -> None:
    """geotrain's three changes to hivemind's own classes, in this process and those it forks from now on
    (before hivemind's averagers start: they fork with them)."""
    check_hivemind_version()
    install_quantization_decoder()  # they decode the parts others send
    install_part_reducer_fix()  # ... and reduce them: a member that vanishes mid-round must not stall the round
    install_task_references()  # ... and keep their running tasks alive: a collected round wedges the averager
