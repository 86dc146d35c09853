"""End-of-run agreement: every trainer that finishes a run holds the very same parameters.

hivemind's all-reduce gives each peer the average as *its own tensor plus the (compressed)
difference to the average*, so after each round the peers agree to within rounding, not bit for
bit. A user who takes the model from any peer at the end expects one model. So when a run reaches
``max_epochs``, the trainers at the final epoch agree on one of them, the *finalizer* (the lowest
peer id among the non-client peers at the highest epoch; a finalizer that has already said so is
followed by peers that come later), and every other trainer downloads its exact state (parameters and
optimizer statistics, uncompressed). Trainers stop sharing their own state first.

The final state spreads as a tree, not a star: a follower takes it from the finalizer or from any follower
that already holds it, nearest first (geotrain.hive.state.donors), and then serves it too until every trainer
has it. A region without a holder sends one follower across (the lowest peer id of its unsynced
candidates); the others of that region wait for it, up to half the agreement time, and then take it
from anywhere. So across continents each region's thin link carries the state about once, not once per
trainer. A banned peer is never asked.

Every step is bounded by ``timeout_s``, raised where the state's bytes at the profile's minimum download
rate need more (two transfers in a row: into a region, then within it); a peer that can not agree in
time keeps its own parameters and says so.
"""

from __future__ import annotations

import logging
import time

import torch
from hivemind.utils import get_dht_time

from geotrain.hive.dht.keys import final_key, read_progress, read_subkeys
from geotrain.hive.state.snapshot import parameters_sha256

logger = logging.getLogger(__name__)

POLL_S = 0.5
# how long a peer that serves the final state waits for trainers the swarm counted in its last epoch but whose
# progress records show no part in it: such a record lags behind a peer that caught up by loading the state
# (hivemind does not report a peer that has not accumulated samples at the swarm's epoch)
LAGGING_RECORD_GRACE_S = 3.0
MAX_AGREEMENT_S = 1200.0


def _final_records(dht, run_id: str) -> dict[str, dict]:
    return {str(subkey): value for subkey, (value, _) in read_subkeys(dht, final_key(run_id)).items()
            if isinstance(value, dict) and isinstance(value.get("sha256"), str)}


def _store(dht, run_id: str, peer_id: str, value: dict, timeout_s: float) -> None:
    dht.store(final_key(run_id), subkey=peer_id, value=value, expiration_time=get_dht_time() + 2 * timeout_s)


def _downloads_ok(guard_report) -> int:
    """How many state downloads of this peer have ended well so far (0 without a report)."""
    return guard_report.downloads.snapshot()["attempts"]["ok"] if guard_report is not None else 0


def _holders(records: dict[str, dict], finalizer: str, sha256: str) -> set[str]:
    """The finalizer and the followers that already took its state."""
    return {finalizer} | {pid for pid, r in records.items() if r.get("role") == "synced" and r["sha256"] == sha256}


def _wait_for_followers(dht, run_id: str, peer_id: str, sha256: str, epoch: int, others: set[str],
                        expected_peers: int, banned, deadline: float, settle_deadline: float,
                        finalizer: str | None = None) -> bool:
    """Serve the final state until every peer that finishes the run has taken it; whether they all did.

    Those are the candidates seen so far, any whose candidate record or last-epoch progress shows up while
    it waits (records come late on a loaded machine), and until ``settle_deadline`` at least
    ``expected_peers - 1`` others: the trainers the swarm counted in its last epoch (one that left or died in it
    costs that wait). A follower that serves the state too passes the ``finalizer``, which it does not wait for.
    """
    synced: set[str] = set()
    not_followers = {peer_id} if finalizer is None else {peer_id, finalizer}
    grace_deadline = min(settle_deadline, time.monotonic() + LAGGING_RECORD_GRACE_S)
    while time.monotonic() < deadline:
        excluded = banned()
        records = _final_records(dht, run_id)
        synced = {pid for pid, r in records.items() if r.get("role") == "synced" and r["sha256"] == sha256}
        others |= {pid for pid, r in records.items() if r.get("epoch", -1) >= epoch and r.get("role") == "candidate"}
        # (a peer past the last epoch trains on, under another max_epochs or none: it takes no part here)
        progress = read_progress(dht, run_id)
        others |= {pid for pid, p in progress.items() if epoch - 1 <= p.epoch <= epoch}
        others -= excluded | not_followers
        wanted = followers_wanted(expected_peers, {pid: p.epoch for pid, p in progress.items()}, synced, peer_id,
                                  not_followers, excluded, epoch)
        now = time.monotonic()
        if others <= synced and enough_followers(len(synced - not_followers), wanted,
                                                 expected_peers - len(not_followers) - len(excluded),
                                                 past_grace=now > grace_deadline, past_settle=now > settle_deadline):
            return True
        time.sleep(POLL_S)
    logger.warning("%d peers did not take the final state in time",
                   max(len(others - synced), expected_peers - 1 - len(synced)))
    return False


def followers_wanted(expected_peers: int, progress_epochs: dict[str, int], synced: set[str], own: str,
                     not_followers: set[str], excluded: set[str], epoch: int) -> int:
    """How many followers must hold the final state before the settle time is up: the trainers the swarm counted
    in its last epoch, but no more than have a progress record of the last round or later now, or took the state.
    A trainer counted then that died or left since is not waited for (it cost the whole settle time, up to 30 s,
    at the end of a run that lost a trainer), nor one whose record still shows an epoch before the last round: a
    dead one's lingers until it expires (14 s at the end of a loopback run whose trainer died two epochs before).
    A read without this peer's own record (a failed read) changes nothing."""
    wanted = expected_peers - len(not_followers) - len(excluded)
    if own in progress_epochs:
        in_the_last_round = {pid for pid, peer_epoch in progress_epochs.items() if peer_epoch >= epoch - 1}
        wanted = min(wanted, len((in_the_last_round | synced) - not_followers - excluded))
    return wanted


def enough_followers(synced: int, wanted: int, counted: int, past_grace: bool, past_settle: bool) -> bool:
    """Whether ``synced`` followers are enough to stop serving the final state (the peers seen meanwhile aside):
    the ``wanted`` ones (:func:`followers_wanted`), and the ``counted`` ones (the trainers the swarm counted in
    its last epoch, less the banned) until ``LAGGING_RECORD_GRACE_S`` is past; any number once the settle time is.
    (Without the count, a finalizer that finds no follower by the progress records leaves at once, while a trainer
    that caught up by loading the state, its record older than the last round, stores its candidate record later.)"""
    if past_settle:
        return True
    return synced >= wanted and (synced >= counted or past_grace)


def still_in_the_last_round(progress_epochs: dict[str, int], excluded: set[str], epoch: int) -> set[str]:
    """Peers one epoch behind by their progress records: still in the last round, about to finish too. A peer
    further behind is not (it loads the state when it steps, and finishes on its own), nor is a dead one whose
    record still shows the epoch it died in, an epoch or more before the last round."""
    return {pid for pid, peer_epoch in progress_epochs.items() if peer_epoch == epoch - 1 and pid not in excluded}


def not_heard_from(progress_epochs: dict[str, int], records: dict[str, dict], candidates: set[str],
                   excluded: set[str], epoch: int) -> set[str]:
    """Peers at the last epoch (by their progress records) that have not said they take part: the settle waits.

    A peer that already took the final state says so too (its record's role is "synced"): it is not waited for.
    (It was, until the settle time ran out: 30 s at the end of a run whose fastest follower had synced before
    the finalizer looked.) Nor is a peer past the last epoch: it trains on, under another ``max_epochs``.
    """
    synced = {pid for pid, record in records.items() if record.get("role") == "synced"}
    return {pid for pid, peer_epoch in progress_epochs.items()
            if peer_epoch == epoch and pid not in excluded and pid not in candidates and pid not in synced}


def settle_background_rounds(averager, timeout_s: float) -> bool:
    """End the state averaging round hivemind runs in the background, apply its result, and make the model's
    parameters equal the state this peer serves. Whether no round is left running (at most ``timeout_s``).

    A round still looking for a group is given up (``leave_rounds``), and no later one begins: every trainer
    takes the finalizer's state next, whatever it would average. A round whose group has formed is waited for
    (the others are in it) past hivemind's own wait, which gives up after the all-reduce timeout and leaves it
    running: hivemind serves the optimizer's copy of the parameters (``offload_optimizer``), and such a round
    averages into it in place, after this peer announced its hash (docs/state-transfer.md, the end of a run).
    """
    leave_rounds = getattr(averager, "leave_rounds", None)
    given_up = leave_rounds() if leave_rounds is not None else None
    if given_up:
        logger.info("end of the run: %s", given_up)
    deadline = time.monotonic() + timeout_s
    for update in list(averager.pending_updates):
        try:
            update.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # a failed or timed-out round leaves the parameters as they were; hivemind logs it
            pass
    # applies a finished round's result; no second wait (hivemind's would add its all-reduce timeout, up to
    # 600 s across continents, to a round still running after timeout_s)
    averager.step(wait_for_delayed_updates=False)
    running = any(not update.done() for update in averager.pending_updates)
    if running:
        logger.warning("a state averaging round still runs after %.0f s; the final state may change under it",
                       timeout_s)
    if averager.offload_optimizer:
        with torch.no_grad(), averager.lock_averaged_tensors:
            averager._apply_optimizer_parameters_()
    return not running


def serve_these_parameters(averager, model) -> None:
    """From now on this peer serves its state with the model's parameters as they are now (what it announces),
    whatever a late round writes into the optimizer's copy (RecordingStateAverager.freeze_served_state)."""
    freeze = getattr(averager, "freeze_served_state", None)
    if freeze is not None:
        freeze(list(model.parameters()))


def agreement_timeout_s(optimizer, timeout_s: float) -> float:
    """``timeout_s``, or two state transfers at the minimum download rate when that is longer (at most
    MAX_AGREEMENT_S: the agreement's records must not outlive the DHT's one-hour limit)."""
    bound = getattr(optimizer.state_averager, "state_download_bound_s", None)
    transfer_s = bound(donors=1) if bound is not None else 0.0
    return min(MAX_AGREEMENT_S, max(timeout_s, 2 * transfer_s))


def agree_on_final_state(dht, optimizer, model, run_id: str, epoch: int, client_mode: bool,
                         timeout_s: float, guard_report=None, region: str | None = None) -> tuple[str, bool]:
    """Make this peer's parameters equal the finalizer's. Returns (parameters sha256, agreed).

    Only peers that take part say so (a ``candidate`` record under the run's final key), and only they can
    be the finalizer: a peer that merely publishes progress, or one this peer banned (``guard_report.bans``:
    its gradients were refused), is neither waited for nor downloaded from.
    """
    peer_id = str(dht.peer_id)
    timeout_s = agreement_timeout_s(optimizer, timeout_s)
    expected_peers = optimizer.tracker.global_progress.num_peers  # trainers the swarm counted in the last epoch
    settle_background_rounds(optimizer.state_averager, timeout_s)
    _store(dht, run_id, peer_id, {"role": "candidate", "sha256": parameters_sha256(model), "epoch": epoch,
                                  "client_mode": client_mode, "region": region}, timeout_s)

    def banned() -> set[str]:
        return guard_report.bans.active() if guard_report is not None else set()

    # Peers still in the last round are about to finish too: wait for them (at most timeout_s), so that
    # everyone picks the same finalizer. A peer that is later still is left to finish on its own.
    laggards_deadline = time.monotonic() + timeout_s
    while True:
        behind = still_in_the_last_round({pid: p.epoch for pid, p in read_progress(dht, run_id).items()}, banned(),
                                         epoch)
        if not behind or time.monotonic() > laggards_deadline:
            break
        time.sleep(POLL_S)
    # Then the peers at the last epoch say that they take part: a moment for their records to arrive.
    own = {"epoch": epoch, "client_mode": client_mode}
    # (a peer that just finished its last epoch stores its record within seconds, later on loaded machines; a
    # peer that publishes progress but never says it takes part costs this wait once)
    settle_s = min(30.0, timeout_s / 2)
    settle_deadline = time.monotonic() + settle_s
    while True:
        excluded = banned()
        records = _final_records(dht, run_id)
        candidates = {pid: r for pid, r in records.items()
                      if pid not in excluded and r.get("epoch", -1) >= epoch and r.get("role") != "synced"}
        candidates[peer_id] = own
        waiting_for = not_heard_from({pid: p.epoch for pid, p in read_progress(dht, run_id).items()}, records,
                                     set(candidates), excluded, epoch)
        if not waiting_for or time.monotonic() > settle_deadline:
            break
        time.sleep(POLL_S)
    deadline = time.monotonic() + timeout_s
    # a finalizer that has already said so is followed (a peer whose records came late, on a loaded machine,
    # must not pick another one); otherwise every peer computes the same list from the same records: the
    # non-client candidates at the newest epoch
    declared = sorted(pid for pid, r in _final_records(dht, run_id).items()
                      if r.get("role") == "finalizer" and r.get("epoch", -1) >= epoch and pid not in banned())
    top_epoch = max(int(r.get("epoch", -1)) for r in candidates.values())
    donors = declared or sorted(pid for pid, r in candidates.items()
                                if r.get("epoch") == top_epoch and not r.get("client_mode"))
    if not donors:
        logger.warning("no peer can share the final state; keeping this peer's own parameters")
        return parameters_sha256(model), False
    finalizer = donors[0]

    if finalizer == peer_id:
        serve_these_parameters(optimizer.state_averager, model)
        sha256 = parameters_sha256(model)
        _store(dht, run_id, peer_id, {"role": "finalizer", "sha256": sha256, "epoch": epoch, "region": region},
               timeout_s)
        progress_epochs = {pid: p.epoch for pid, p in read_progress(dht, run_id).items()}
        followers = max(len(candidates) - 1, followers_wanted(expected_peers, progress_epochs, set(), peer_id,
                                                               {peer_id}, banned(), epoch))
        logger.info("final state %s is this peer's; waiting for the %d other trainers of the last epoch to take it",
                    sha256[:16], followers)
        agreed = _wait_for_followers(dht, run_id, peer_id, sha256, epoch, set(candidates) - {peer_id},
                                     expected_peers, banned, deadline, time.monotonic() + settle_s)
        return sha256, agreed

    sharing = [a for a in (optimizer.state_averager, getattr(optimizer, "grad_averager", None))
               if a is not None and not client_mode]
    for averager in sharing:
        averager.allow_state_sharing = False  # no one may take this peer's state until it is the final one
    # a region without a holder sends its lowest unsynced peer across; the others wait for it (for a while)
    cross_after = time.monotonic() + (deadline - time.monotonic()) / 2
    while time.monotonic() < deadline:
        records = _final_records(dht, run_id)
        target = records.get(finalizer)
        if target is None:
            time.sleep(POLL_S)
            continue
        holders = _holders(records, finalizer, target["sha256"]) - banned() - {peer_id}
        holders = {pid for pid in holders if not records.get(pid, {}).get("client_mode")}
        regional = {pid for pid in holders if region is not None and records.get(pid, {}).get("region") == region}
        unsynced_here = sorted(pid for pid, r in records.items() if r.get("role") == "candidate" and region is not None
                               and r.get("region") == region and r.get("epoch", -1) >= epoch
                               and not r.get("client_mode") and pid not in banned())
        goes_across = not unsynced_here or unsynced_here[0] == peer_id
        if not regional and not goes_across and time.monotonic() < cross_after:
            time.sleep(POLL_S)  # a peer of this region is taking it across; take it from that peer
            continue
        downloaded_before = _downloads_ok(guard_report)
        try:
            remaining_s = max(1.0, deadline - time.monotonic())
            if guard_report is not None:
                guard_report.set_allowed_donors(regional or holders)
            optimizer.state_averager.load_state_from_peers(timeout=remaining_s)
        except Exception as error:  # a holder may be busy or gone; retry until the deadline
            logger.info("final state download failed (%s); retrying", error)
        finally:
            if guard_report is not None:
                guard_report.set_allowed_donors(None)
        sha256 = parameters_sha256(model)
        if sha256 == target["sha256"]:
            donor, donor_region = guard_report.last_donor() if guard_report is not None else (None, None)
            logger.info("took the final state %s from %s (%s)", sha256[:16], donor or finalizer,
                        donor_region or "region unknown")
            serve_these_parameters(optimizer.state_averager, model)
            for averager in sharing:
                averager.allow_state_sharing = True  # now it is: serve it to the others of this region
            _store(dht, run_id, peer_id, {"role": "synced", "sha256": sha256, "epoch": epoch, "region": region,
                                          "client_mode": client_mode}, timeout_s)
            if sharing:
                _wait_for_followers(dht, run_id, peer_id, sha256, epoch, set(candidates), expected_peers, banned,
                                    deadline, time.monotonic() + settle_s, finalizer=finalizer)
            return sha256, True
        if _downloads_ok(guard_report) > downloaded_before:  # hivemind refuses some states quietly: say it here
            logger.info("a state was downloaded, but this peer's parameters hash to %s, not to the final state's %s;"
                        " retrying", sha256[:16], target["sha256"][:16])
        time.sleep(POLL_S)
    logger.warning("could not take the final state from %s within %.0f s; keeping own parameters",
                   finalizer, timeout_s)
    return parameters_sha256(model), False
