"""Bad input gets a clear error, a non-zero exit and loses nothing: the refusals that come before a peer joins,
checked in-process through geotrain's command line (the ``run_cli`` fixture). That the same refusals end a real
process with that exit code and no traceback: tests/integration/test_bad_input.py."""

from __future__ import annotations

import socket

import pytest

BAD_INPUT = 2
GHOST_PEER_ID = "12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("text, expected", [
    ("optimizer:\n\ttarget_batch_size: 4096\n", "not valid YAML at line 2"),
    ("optimizer:\n  target_batch_sise: 4096\n", "optimizer.target_batch_sise: unknown key"),
    ("optimizer:\n  target_batch_size: lots\n", "optimizer.target_batch_size: input should be a valid integer"),
    ("optimizer:\n  target_batch_size: 16\n  batch_size_per_step: 32\n",
     "optimizer.target_batch_size (16) is below optimizer.batch_size_per_step (32)"),
    ("task:\n  name: cv\n  preset: resnet9000\n", "task.preset: unknown preset 'resnet9000'"),
    ("optimizer:\n  network_profile: moon\n", "optimizer.network_profile"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_malformed_config_names_the_key(run_cli, tmp_path, text, expected):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    result = run_cli("peer", "--config", str(config))
    assert result.returncode == BAD_INPUT
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_task_lists_the_choices(run_cli):
    result = run_cli("peer", "--task", "chess")
    assert result.returncode == BAD_INPUT
    assert "task.name" in result.stderr and "'cv', 'nlp', 'asr'" in result.stderr


def test_initial_peer_that_is_not_a_multiaddr(run_cli):
    result = run_cli("peer", "--initial-peers", "127.0.0.1:31337")
    assert result.returncode == BAD_INPUT
    assert "/ip4/HOST/tcp/PORT/p2p/PEER_ID" in result.stderr


@pytest.mark.parametrize("flag, what", [("--metrics-port", "metrics port"), ("--port", "DHT port")])
def test_port_already_in_use(run_cli, flag, what):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("peer", flag, str(port))
    assert result.returncode == BAD_INPUT
    assert f"{what} {port} on 127.0.0.1 is already in use" in result.stderr, result.stderr
    assert flag in result.stderr


# ---- checked before a peer joins the swarm (exit 2, no DHT daemon started) -------------------------------

def assert_user_error(result, *expected: str) -> None:
    assert result.returncode == BAD_INPUT, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    for text in expected:
        assert text in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "joined swarm" not in result.stderr


@pytest.mark.parametrize("command, address, expected", [
    ("peer", "/ip4/999.1.1.1/tcp/1/p2p/garbage", "'999.1.1.1' is not an IPv4 address"),
    ("peer", "/ip4/127.0.0.1/tcp/70000/p2p/" + GHOST_PEER_ID, "tcp port '70000' is not a port number"),
    ("status", "/p2p/notapeer", "peer id 'notapeer' is not a libp2p peer id"),
    ("coordinator", "/ip4/127.0.0.1/tcp/31337", "it does not end with /p2p/PEER_ID"),
])
def test_a_malformed_peer_address_is_a_config_error(run_cli, tmp_path, command, address, expected):
    extra = ["--once"] if command == "status" else ["--state-dir", str(tmp_path / "state")] \
        if command == "coordinator" else []
    result = run_cli(command, "--initial-peers", address, *extra)
    assert_user_error(result, "swarm.initial_peers", expected)


def test_negative_threads_is_a_config_error(run_cli):
    assert_user_error(run_cli("peer", "--threads", "-1"), "training.threads")


def unreachable_peer() -> str:
    """If a check ran after joining, this address would make the command wait, then exit 3 instead of 2."""
    return f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"


@pytest.mark.parametrize("arguments, expected", [
    (["--data-source", "folder", "--data-path", "/nonexistent/images"], "/nonexistent/images"),
    (["--preset", "resnet9000"], "task.preset: unknown preset 'resnet9000'"),
])
def test_data_and_model_are_checked_before_joining(run_cli, arguments, expected):
    result = run_cli("peer", "--task", "cv", *arguments, "--initial-peers", unreachable_peer(),
                      "--bootstrap-timeout", "30")
    assert_user_error(result, expected)


def test_a_state_dir_that_cannot_be_written_is_refused_before_joining(run_cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run_cli("coordinator", "--state-dir", str(blocker / "state"), "--initial-peers", unreachable_peer(),
                      "--bootstrap-timeout", "30")
    assert_user_error(result, f"--state-dir {blocker / 'state'}: cannot write there")


def test_metrics_ports_beyond_65535_are_refused_up_front(run_cli, tmp_path):
    result = run_cli("local", "--peers", "2", "--metrics-base-port", "65535", "--run-dir", str(tmp_path / "run"))
    assert_user_error(result, "--metrics-base-port", "expected a base port from 1 to 65533")
    assert not (tmp_path / "run").exists(), "nothing may start for a request that cannot work"


def test_lab_name_after_the_region_is_used_not_ignored(run_cli):
    result = run_cli("lab", "run", "eu", "--lab", "notalab", "--", "true")
    assert result.returncode == BAD_INPUT
    assert "lab name 'notalab' is not valid" in result.stderr, result.stderr
    result = run_cli("lab", "run", "eu", "--mtu", "1500", "--", "true")
    assert result.returncode == BAD_INPUT
    assert "unknown option --mtu" in result.stderr, result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_this_machine_lacks_is_refused_before_joining(run_cli):
    result = run_cli("peer", "--device", "cuda", "--initial-peers", unreachable_peer(), "--bootstrap-timeout", "30")
    assert_user_error(result, "--device cuda: this machine has no CUDA GPU")


def test_fp16_on_a_cpu_is_refused_before_joining(run_cli):
    result = run_cli("peer", "--device", "cpu", "--precision", "fp16", "--initial-peers", unreachable_peer(),
                      "--bootstrap-timeout", "30")
    assert_user_error(result, "--precision fp16: only on a CUDA GPU")

