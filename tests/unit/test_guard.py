"""The checks against bad peers, piece by piece: the DHT token, admission, contribution and step checks."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing

import pytest
import torch
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from geotrain.config import ConfigError, GuardConfig, SwarmConfig, load_config
from geotrain.hive.dht.admission import (MAX_CLOCK_SKEW_S, AdmissionConfigError, Admission, SwarmTokenAuthorizer,
                                         load_allowed_peer_ids, load_swarm_token)
from geotrain.hive.guard.contributions import contribution_refusal
from geotrain.hive.guard.report import COUNTED, GuardReport
from geotrain.hive.dht.identity import IdentityError, peer_id_of
from geotrain.hive.optim.factory import with_step_guard
from geotrain.hive.guard.step import StepGuard

TOKEN = b"0123456789abcdef0123456789abcdef"
PEER_A = "QmRP5NLCmcd7p1XiyEeK5fH9Qf49jek37bWqo7rG6B7p12"
PEER_B = "QmXBX4MssEJ4AZTyARyspxupLMbCmskgkjWtWH2HhT154U"


def run(coroutine):
    return asyncio.run(coroutine)


# --- the swarm token on DHT messages ------------------------------------------------------------------
def signed_ping(authorizer) -> dht_pb2.PingRequest:
    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"node"), validate=True)
    run(authorizer.sign_request(request, None))
    return dht_pb2.PingRequest.FromString(request.SerializeToString())  # as the servicer receives it


def test_a_request_signed_with_the_token_is_accepted_once():
    authorizer = SwarmTokenAuthorizer(TOKEN)
    request = signed_ping(authorizer)
    assert run(authorizer.validate_request(request))
    assert not run(authorizer.validate_request(request)), "a replayed request must be refused"


def test_requests_with_another_token_tampered_or_stale_are_refused():
    ours, theirs = SwarmTokenAuthorizer(TOKEN), SwarmTokenAuthorizer(b"another token, long enough too")
    assert not run(ours.validate_request(signed_ping(theirs)))

    tampered = signed_ping(ours)
    tampered.validate = False
    assert not run(ours.validate_request(tampered))

    unsigned = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"node"))
    assert not run(ours.validate_request(unsigned))

    stale = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"node"))
    run(ours.sign_request(stale, None))
    stale.auth.time -= 2 * MAX_CLOCK_SKEW_S
    stale.auth.signature = b""
    stale.auth.signature = ours._mac(stale)  # a valid MAC over an old time: a recorded request
    assert not run(ours.validate_request(stale))


def test_answers_must_carry_the_token_and_the_request_nonce():
    client, server = SwarmTokenAuthorizer(TOKEN), SwarmTokenAuthorizer(TOKEN)
    request = signed_ping(client)
    response = dht_pb2.PingResponse(available=True)
    run(server.sign_response(response, request))
    assert run(client.validate_response(response, request))

    other_request = signed_ping(client)
    assert not run(client.validate_response(response, other_request))
    forged = dht_pb2.PingResponse(available=True)
    run(SwarmTokenAuthorizer(b"another token, long enough too").sign_response(forged, request))
    assert not run(client.validate_response(forged, request))


def test_the_replay_memory_is_bounded(monkeypatch):
    monkeypatch.setattr("geotrain.hive.dht.admission.MAX_REMEMBERED_NONCES", 100)
    authorizer = SwarmTokenAuthorizer(TOKEN)
    for _ in range(1000):
        assert run(authorizer.validate_request(signed_ping(authorizer)))
    assert len(authorizer._nonces) <= 100


# --- reading the token and the allow-list ---------------------------------------------------------------
def test_the_token_comes_from_the_environment_or_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GEOTRAIN_SWARM_TOKEN", raising=False)
    assert load_swarm_token(SwarmConfig()) is None
    path = tmp_path / "swarm.token"
    path.write_text("  " + TOKEN.decode() + "\n")
    assert load_swarm_token(SwarmConfig(token_file=path)) == TOKEN
    monkeypatch.setenv("GEOTRAIN_SWARM_TOKEN", "e" * 40)
    assert load_swarm_token(SwarmConfig(token_file=path)) == b"e" * 40


@pytest.mark.parametrize("content, message", [("short", "has 5 characters"), (None, "cannot read")])
def test_a_short_or_missing_token_is_a_clear_error(tmp_path, monkeypatch, content, message):
    monkeypatch.delenv("GEOTRAIN_SWARM_TOKEN", raising=False)
    path = tmp_path / "swarm.token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AdmissionConfigError, match=message):
        load_swarm_token(SwarmConfig(token_file=path))


def test_the_allow_file_is_read_with_comments_and_checked_line_by_line(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text(f"# the team's VMs\n{PEER_A}  # eu-1\n\n")
    assert load_allowed_peer_ids(SwarmConfig(allow_file=path, allow=[PEER_B])) == {PEER_A, PEER_B}
    path.write_text(f"{PEER_A}\nnot-a-peer-id\n")
    with pytest.raises(AdmissionConfigError, match=r"allow.txt:2: 'not-a-peer-id' is not a peer id"):
        load_allowed_peer_ids(SwarmConfig(allow_file=path))
    path.write_text("# nobody yet\n")
    with pytest.raises(AdmissionConfigError, match="admit nobody"):
        load_allowed_peer_ids(SwarmConfig(allow_file=path))
    assert load_allowed_peer_ids(SwarmConfig()) is None


def test_a_malformed_allowed_peer_id_in_the_config_is_a_config_error():
    with pytest.raises(ConfigError, match="swarm.allow"):
        load_config(None, set_args=["swarm.allow=[\"12D3KooWnot-base58-0OIl\"]"])


def test_the_allow_list_admits_only_its_peers():
    admission = Admission("run", None, frozenset({PEER_A}))
    assert run(admission.admits(PeerID.from_base58(PEER_A), dht=None))
    assert not run(admission.admits(PeerID.from_base58(PEER_B), dht=None))
    assert Admission("run", None, None).is_open


def test_membership_proofs_differ_by_peer_run_and_token():
    proof = Admission("run", TOKEN, None).proof(PeerID.from_base58(PEER_A).to_bytes())
    assert proof != Admission("run", TOKEN, None).proof(PeerID.from_base58(PEER_B).to_bytes())
    assert proof != Admission("other-run", TOKEN, None).proof(PeerID.from_base58(PEER_A).to_bytes())
    assert proof != Admission("run", b"x" * 32, None).proof(PeerID.from_base58(PEER_A).to_bytes())


def test_identity_files_give_stable_peer_ids(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    peer_id = peer_id_of(path, create=True)
    assert peer_id == peer_id_of(path) and PeerID.from_base58(peer_id).to_base58() == peer_id
    (tmp_path / "junk").write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="is not a peer's key file"):
        peer_id_of(tmp_path / "junk")
    with pytest.raises(IdentityError, match="cannot read"):
        peer_id_of(tmp_path / "missing.key")


# --- what a reducer accepts from a sender ---------------------------------------------------------------
OWN = torch.full((1000,), 0.01)


@pytest.mark.parametrize("part, weight, reason", [
    (torch.full((1000,), float("nan")), 32.0, "non-finite"),
    (torch.full((1000,), float("inf")), 32.0, "non-finite"),
    (OWN * 1e6, 32.0, "norm"),
    (OWN, 1e9, "weight"),
    (OWN, float("nan"), "weight"),
    (OWN, -1.0, "weight"),
])
def test_poisoned_contributions_are_refused_with_their_reason(part, weight, reason):
    refusal = contribution_refusal(part, weight, OWN, 32.0, norm_factor=30.0, max_weight=8224.0)
    assert refusal is not None and refusal[0] == reason


def test_honest_contributions_pass():
    noisy = OWN + 0.05 * torch.randn(1000, generator=torch.Generator().manual_seed(0))  # 5x the own norm
    assert contribution_refusal(noisy, 4096.0, OWN, 4096.0, norm_factor=30.0, max_weight=8224.0) is None
    # this peer contributes nothing (or all zeros): only finiteness and the weight can be judged
    assert contribution_refusal(OWN * 1e6, 32.0, None, 0.0, norm_factor=30.0, max_weight=8224.0) is None
    assert contribution_refusal(OWN * 1e6, 32.0, torch.zeros(1000), 32.0, norm_factor=30.0, max_weight=8224.0) is None
    assert contribution_refusal(OWN * 1e6, 32.0, OWN, 0.0, norm_factor=30.0, max_weight=8224.0) is None
    assert contribution_refusal(torch.full((1000,), float("nan")), 0.0, OWN, 32.0, norm_factor=30.0,
                                max_weight=8224.0)[0] == "non-finite"  # 0 x NaN is NaN in the mean


def test_a_sender_with_fewer_samples_may_be_noisier_but_pulls_no_harder():
    # one micro-batch (32 samples) against this peer's 32,768: sqrt(1024) = 32x the allowance
    assert contribution_refusal(OWN * 500, 32.0, OWN, 32768.0, norm_factor=30.0, max_weight=70000.0) is None
    assert contribution_refusal(OWN * 2000, 32.0, OWN, 32768.0, norm_factor=30.0, max_weight=70000.0)[0] == "norm"
    # claiming a tiny weight buys a larger norm, never a larger pull (weight x norm) on the average
    assert contribution_refusal(OWN * 1e3, 1e-3, OWN, 32.0, norm_factor=30.0, max_weight=8224.0) is None


def _count_in_a_child(report: GuardReport) -> None:
    report.count("contribution", "norm")
    report.event("contribution_refused", reason="norm")


def test_refusals_counted_in_hiveminds_processes_reach_the_peer(tmp_path):
    report = GuardReport(tmp_path / "events.jsonl")
    child = multiprocessing.get_context("fork").Process(target=_count_in_a_child, args=(report,))
    child.start()
    child.join(30)
    report.count("contribution", "norm")
    assert report.counts()[("contribution", "norm")] == 2
    assert sum(report.counts().values()) == 2 and len(report.counts()) == len(COUNTED)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["contribution_refused"]


# --- the step on the averaged gradients ------------------------------------------------------------------
def model_and_guarded_sgd(report, **guard):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    guard_ = StepGuard(GuardConfig(**guard), report, peer_id="me")
    optimizer = with_step_guard(torch.optim.SGD, guard_)(model.parameters(), lr=0.1)
    return model, optimizer, guard_


def step_with(model, optimizer, gradient_scale: float) -> torch.Tensor:
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter) * gradient_scale
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def test_steps_with_non_finite_or_outlying_averaged_gradients_are_skipped(tmp_path):
    report = GuardReport(tmp_path / "events.jsonl")
    model, optimizer, _ = model_and_guarded_sgd(report)
    assert step_with(model, optimizer, 0.0).abs().sum() == 0  # hivemind's all-zero initial step: allowed
    assert step_with(model, optimizer, float("nan")).abs().sum() == 0  # skipped, even before any history
    for scale in (1.0, 1.2, 0.9, 1.1):
        assert step_with(model, optimizer, scale).abs().sum() > 0
    assert step_with(model, optimizer, 1e6).abs().sum() == 0  # 1e6 x the median: skipped
    assert step_with(model, optimizer, 5.0).abs().sum() > 0  # large, but within 10 x the median
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert report.counts()[("step", "non-finite")] == 1 and report.counts()[("step", "norm")] == 1
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["reason"]) for e in events] == [("step_skipped", "non-finite"), ("step_skipped", "norm")]


def test_non_finite_parameters_after_a_step_are_restored(tmp_path):
    report = GuardReport(tmp_path / "events.jsonl")
    model, optimizer, _ = model_and_guarded_sgd(report)
    step_with(model, optimizer, 1.0)
    good = [p.detach().clone() for p in model.parameters()]
    optimizer.param_groups[0]["lr"] = float("inf")  # an overflow inside the optimizer
    step_with(model, optimizer, 1.0)
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), good))
    assert report.counts()[("parameters", "non-finite after step")] == 1
    assert not math.isnan(float(model.weight.detach().sum()))



def test_after_a_restore_the_state_can_still_be_served_to_a_peer_with_statistics(tmp_path):
    """The restore starts Adam's statistics afresh in place: the same tensors, zeroed, so that a peer whose
    optimizer has statistics can load this peer's state (a follower could not take a finalizer's final state
    for 60 s after the finalizer had restored its parameters: its statistics were gone, the layouts differed)."""
    report = GuardReport(tmp_path / "events.jsonl")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = with_step_guard(torch.optim.Adam, StepGuard(GuardConfig(), report, peer_id="me"))(
        model.parameters(), lr=0.1)
    step_with(model, optimizer, 1.0)
    statistics = {id(tensor) for state in optimizer.state.values() for tensor in state.values()}
    optimizer.param_groups[0]["lr"] = float("inf")
    step_with(model, optimizer, 1.0)
    assert report.counts()[("parameters", "non-finite after step")] == 1
    kept = [tensor for state in optimizer.state.values() for tensor in state.values()]
    assert {id(tensor) for tensor in kept} == statistics and all(not tensor.any() for tensor in kept)

    follower_model = torch.nn.Linear(8, 1)
    follower = torch.optim.Adam(follower_model.parameters(), lr=0.1)
    step_with(follower_model, follower, 1.0)
    load_optimizer_state(follower, *dump_optimizer_state(optimizer))
    assert all(not tensor.any() for state in follower.state.values() for tensor in state.values())
    optimizer.param_groups[0]["lr"] = 0.1
    assert step_with(model, optimizer, 1.0).abs().sum() > 0  # and it trains on, as from a first step

# --- a donor serves a bounded number of downloads at once --------------------------------------------------
class _SlowDonor:
    """Stands in for hivemind's averager below the guard: a download that takes a while."""

    async def rpc_download_state(self, request, context):
        for part in range(3):
            await asyncio.sleep(0.05)
            yield part


class _Caller:
    def __init__(self, peer_id: str):
        self.remote_id = PeerID.from_base58(peer_id)


def test_a_donor_serves_at_most_its_limit_of_downloads_at_once():
    from geotrain.hive.guard.contributions import GuardedAveragerMixin

    class Donor(GuardedAveragerMixin, _SlowDonor):
        guard_config = GuardConfig(max_concurrent_downloads=2)
        guard_report = GuardReport(None)
        peer_id = PeerID.from_base58(PEER_A)

    donor = Donor()

    async def download() -> int:
        return len([part async for part in donor.rpc_download_state(None, _Caller(PEER_B))])

    async def five_at_once() -> list[int]:
        return await asyncio.gather(*(download() for _ in range(5)))

    assert sorted(run(five_at_once())) == [0, 0, 0, 3, 3]  # two served in full, three sent on to other donors
    assert donor.guard_report.counts()[("download_state", "busy")] == 3
    assert run(download()) == 3  # the slots are free again


def test_from_the_first_step_an_average_far_above_this_peers_own_gradient_is_skipped(tmp_path):
    report = GuardReport(tmp_path / "events.jsonl")
    model, optimizer, guard = model_and_guarded_sgd(report)
    own_norm = torch.ones(9).norm().item()  # this peer's own contribution: gradients of 1 (Linear(8, 1): 9 values)
    guard.own_gradient_norm = lambda: own_norm
    assert step_with(model, optimizer, 1e6).abs().sum() == 0  # no median yet, but 1e6 x its own: skipped
    assert step_with(model, optimizer, 50.0).abs().sum() > 0  # 50 x: an honest average can be that far off
    assert report.counts()[("step", "norm")] == 1
