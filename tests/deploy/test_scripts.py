"""The VM recipes in peers/: shell scripts, the systemd unit and the example configs.

The startup scripts run for real, in their dry-run mode (GEOTRAIN_DRY_RUN=1: no package installs, no
systemd), against HTTP servers on loopback that speak each cloud's metadata protocol and refuse requests
without its headers. What they print is the command systemd would start, which is parsed by geotrain's
own command-line parser and config.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from geotrain.config import load_config

from deploy_helpers import GeotrainCommandLine, parse_key_values, run_script
from deploy_tools import REPO
from metadata_servers import MetadataServer, aws_imds, azure_imds, gce_metadata

COORDINATOR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
STARTUP_SCRIPTS = {"aws": "peers/aws/user-data.sh", "gcp": "peers/gcp/startup-script.sh",
                   "azure": "peers/azure/custom-data.sh"}
# The VM each fake metadata service describes, and what a peer on it must announce and label.
VMS = {
    "aws": dict(server=lambda ip: aws_imds("eu-west-1", "g4dn.xlarge", ip), address="198.51.100.4",
                region="eu-west-1", instance_type="g4dn.xlarge"),
    "gcp": dict(server=lambda ip: gce_metadata("us-central1-a", "n1-standard-8", ip), address="203.0.113.9",
                region="us-central1", instance_type="n1-standard-8"),
    "azure": dict(server=lambda ip: azure_imds("westeurope", "Standard_NC4as_T4_v3", ip or ""),
                  address="192.0.2.44", region="westeurope", instance_type="Standard_NC4as_T4_v3"),
}
STATE_DIR = "/var/lib/geotrain"


def config_sources() -> dict[str, Path]:
    # setup.sh installs peers/configs/ROLE.yaml as /etc/geotrain/ROLE.yaml
    return {f"/etc/geotrain/{role}.yaml": REPO / f"peers/configs/{role}.yaml" for role in ("trainer", "coordinator")}


def startup(cloud: str, server: MetadataServer, **settings: str):
    env = {"GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_SOURCE_DIR": str(REPO), "GEOTRAIN_METADATA_URL": server.url,
           "GEOTRAIN_INITIAL_PEERS": COORDINATOR, **settings}
    return run_script(STARTUP_SCRIPTS[cloud], env=env)


def shell_scripts() -> list[Path]:
    scripts = set()
    for folder in ("peers", "docker"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and (path.suffix == ".sh" or path.read_bytes()[:30].startswith(b"#!/usr/bin/env bash")):
                scripts.add(path)
    return sorted(scripts)


# ---- shellcheck ---------------------------------------------------------------------------------------

def test_shellcheck_passes_on_every_script(tools):
    scripts = shell_scripts()
    assert {REPO / p for p in STARTUP_SCRIPTS.values()} <= set(scripts)
    assert {REPO / "docker/entrypoint.sh", REPO / "peers/skypilot/setup.sh", REPO / "peers/run.sh"} <= set(scripts)
    result = subprocess.run([str(tools.bin("shellcheck")), "--external-sources", *map(str, scripts)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"shellcheck found problems:\n{result.stdout}{result.stderr}"


# ---- the metadata servers are as strict as the real ones -------------------------------------------------

@pytest.mark.parametrize("cloud, path, method, refused", [
    ("aws", "/latest/api/token", "PUT", 400),                    # no TTL header
    ("aws", "/latest/meta-data/placement/region", "GET", 401),   # IMDSv2: no token
    ("gcp", "/computeMetadata/v1/instance/zone", "GET", 403),    # no Metadata-Flavor
    ("azure", "/metadata/instance?api-version=2021-02-01", "GET", 400),  # no Metadata: true
])
def test_metadata_servers_refuse_requests_without_the_clouds_headers(cloud, path, method, refused):
    with VMS[cloud]["server"](VMS[cloud]["address"]) as server:
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(urllib.request.Request(server.url + path, method=method), timeout=5)
        assert error.value.code == refused


# ---- startup scripts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cloud", sorted(STARTUP_SCRIPTS))
def test_startup_script_announces_the_public_address_and_labels_from_metadata(cloud):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = startup(cloud, server)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert facts["cloud"] == cloud
    assert facts["region"] == vm["region"]
    assert facts["instance_type"] == vm["instance_type"]
    assert facts["announce_host"] == vm["address"]

    peer = GeotrainCommandLine.from_shell(facts["command"], config_paths=config_sources())
    assert peer.command == "peer"
    swarm, metrics = peer.config.swarm, peer.config.metrics
    assert swarm.initial_peers == [COORDINATOR]
    assert (swarm.host, swarm.port, swarm.announce_host) == ("0.0.0.0", 31337, vm["address"])
    assert swarm.announce_maddrs() == [f"/ip4/{vm['address']}/tcp/31337"]
    assert not swarm.client_mode
    # the identity on the boot disk, which survives a spot stop: the peer id survives it too
    assert str(swarm.identity_path) == f"{STATE_DIR}/identity.key"
    assert (metrics.port, metrics.host) == (9100, "0.0.0.0")
    assert (metrics.region, metrics.cloud, metrics.instance_type) == (vm["region"], cloud, vm["instance_type"])
    # preemption notices from this cloud's metadata service (the same one the script asked)
    assert peer.config.preemption.source == cloud
    assert getattr(peer.config.preemption, f"{cloud}_metadata_url") == server.url
    # the example trainer config is the one installed
    assert peer.value("--config") == "/etc/geotrain/trainer.yaml"
    assert peer.config.optimizer.network_profile == "intercontinental"
    # every answer was a 200: the script sent each cloud's headers (the servers refuse requests without)
    assert server.requests and all(request.status == 200 for request in server.requests), server.requests


def test_aws_startup_script_uses_an_imdsv2_session_token():
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        assert startup("aws", server).returncode == 0
    first, *reads = server.requests
    assert (first.method, first.path) == ("PUT", "/latest/api/token")
    assert int(first.headers["x-aws-ec2-metadata-token-ttl-seconds"]) > 0
    assert {request.path for request in reads} == {
        "/latest/meta-data/public-ipv4", "/latest/meta-data/placement/region", "/latest/meta-data/instance-type"}
    assert all(request.headers.get("x-aws-ec2-metadata-token") for request in reads)


@pytest.mark.parametrize("cloud", sorted(STARTUP_SCRIPTS))
def test_a_vm_without_public_address_joins_in_client_mode(cloud):
    with VMS[cloud]["server"](None) as server:
        result = startup(cloud, server)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert facts["announce_host"] == ""
    peer = GeotrainCommandLine.from_shell(facts["command"], config_paths=config_sources())
    assert peer.config.swarm.client_mode
    assert peer.value("--announce-host") is None and peer.value("--port") is None
    assert peer.config.metrics.region == VMS[cloud]["region"]
    assert "client mode" in result.stderr


def test_azure_asks_the_configured_echo_service_when_imds_lists_no_public_address():
    # IMDS leaves Standard-SKU public addresses out; an echo service (opt-in) fills the gap
    echo = MetadataServer("echo", lambda method, path, query, headers: (200, "192.0.2.200\n", {}))
    with VMS["azure"]["server"](None) as server, echo:
        result = startup("azure", server, GEOTRAIN_PUBLIC_IP_URL=echo.url + "/")
    assert result.returncode == 0, result.stderr
    assert parse_key_values(result.stdout)["announce_host"] == "192.0.2.200"


def test_operator_settings_win_over_the_metadata():
    vm = VMS["gcp"]
    with vm["server"](vm["address"]) as server:
        result = startup("gcp", server, GEOTRAIN_ANNOUNCE_HOST="192.0.2.8", GEOTRAIN_REGION="eu-lab",
                         GEOTRAIN_RUN_ID="imagenet", GEOTRAIN_TASK="nlp", GEOTRAIN_PRESET="roberta-base",
                         GEOTRAIN_NETWORK_PROFILE="continent",
                         GEOTRAIN_EXTRA_ARGS="--target-batch-size 32768 --max-epochs 10", GEOTRAIN_PREEMPTION="signal")
    assert result.returncode == 0, result.stderr
    peer = GeotrainCommandLine.from_shell(parse_key_values(result.stdout)["command"], config_paths=config_sources())
    assert peer.config.swarm.announce_host == "192.0.2.8"
    assert peer.config.metrics.region == "eu-lab"
    assert peer.config.metrics.instance_type == "n1-standard-8"
    assert peer.config.swarm.run_id == "imagenet"
    assert (peer.config.task.name, peer.config.task.preset) == ("nlp", "roberta-base")
    assert peer.config.optimizer.network_profile == "continent"
    assert peer.config.optimizer.target_batch_size == 32768
    assert peer.config.training.max_epochs == 10
    assert peer.config.preemption.source == "signal"


@pytest.mark.parametrize("cloud", sorted(STARTUP_SCRIPTS))
def test_coordinator_from_a_startup_script(cloud):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = startup(cloud, server, GEOTRAIN_ROLE="coordinator", GEOTRAIN_INITIAL_PEERS="")
    assert result.returncode == 0, result.stderr
    coordinator = GeotrainCommandLine.from_shell(parse_key_values(result.stdout)["command"],
                                                 config_paths=config_sources())
    assert coordinator.command == "coordinator"
    assert coordinator.config.swarm.announce_host == vm["address"]
    assert (coordinator.config.swarm.host, coordinator.config.swarm.port) == ("0.0.0.0", 31337)
    assert coordinator.config.metrics.region == vm["region"]
    # geotrain keeps the coordinator's identity (and checkpoints) in STATE_DIR: the printed address and the
    # swarm's state survive restarts
    assert str(coordinator.state_dir) == STATE_DIR
    assert str(coordinator.initial_peers_file).startswith(STATE_DIR + "/")
    # it holds the swarm's state, so it builds the trainers' model
    trainer = load_config(REPO / "peers/configs/trainer.yaml")
    assert (coordinator.config.task, coordinator.config.optimizer) == (trainer.task, trainer.optimizer)


def test_coordinator_listens_on_another_port_when_told():
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, GEOTRAIN_ROLE="coordinator", GEOTRAIN_PORT="40000")
    assert result.returncode == 0, result.stderr
    coordinator = GeotrainCommandLine.from_shell(parse_key_values(result.stdout)["command"],
                                                 config_paths=config_sources())
    assert coordinator.config.swarm.port == 40000


def test_coordinator_without_a_public_address_is_refused():
    with VMS["aws"]["server"](None) as server:
        result = startup("aws", server, GEOTRAIN_ROLE="coordinator")
    assert result.returncode == 2
    assert "no public IPv4 address" in result.stderr and "GEOTRAIN_ANNOUNCE_HOST" in result.stderr


@pytest.mark.parametrize("initial_peers, complaint", [
    ("", "GEOTRAIN_INITIAL_PEERS is empty"),
    ("203.0.113.7:31337", "expected a full multiaddr"),
])
def test_trainer_without_a_usable_coordinator_address_stops_with_exit_2(initial_peers, complaint):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, GEOTRAIN_INITIAL_PEERS=initial_peers)
    # 2: systemd's RestartPreventExitStatus, so a wrong setting does not restart forever
    assert result.returncode == 2
    assert complaint in result.stderr


def test_settings_that_systemd_and_bash_would_read_differently_are_refused():
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, GEOTRAIN_EXTRA_ARGS="--set task.data.path=$HOME/data")
    assert result.returncode == 2
    assert "GEOTRAIN_EXTRA_ARGS contains a quote, backslash, dollar or newline" in result.stderr


def test_unreachable_metadata_service_fails_so_systemd_retries():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    result = run_script("peers/run.sh", "trainer", env={
        "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_CLOUD": "aws", "GEOTRAIN_METADATA_URL": url,
        "GEOTRAIN_METADATA_RETRIES": "0", "GEOTRAIN_INITIAL_PEERS": COORDINATOR})
    assert result.returncode == 1  # not 2: the unit restarts it
    assert "could not read this VM's address and region from the aws metadata service" in result.stderr


@pytest.mark.parametrize("cloud", sorted(VMS))
def test_auto_detects_the_cloud_from_its_metadata_service(cloud):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = run_script("peers/run.sh", "trainer", env={
            "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_CLOUD": "auto", "GEOTRAIN_METADATA_URL": server.url,
            "GEOTRAIN_INITIAL_PEERS": COORDINATOR})
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["cloud"], facts["region"], facts["announce_host"]) == (cloud, vm["region"], vm["address"])


def test_discover_alone_prints_what_a_peer_would_announce():
    vm = VMS["gcp"]
    with vm["server"](vm["address"]) as server:
        result = run_script("peers/lib/discover.sh", "gcp", env={"GEOTRAIN_METADATA_URL": server.url})
    assert result.returncode == 0, result.stderr
    assert parse_key_values(result.stdout) == {"cloud": "gcp", "region": "us-central1",
                                               "instance_type": "n1-standard-8", "public_ip": vm["address"]}


def test_startup_scripts_share_one_bootstrap_and_name_their_cloud():
    bootstraps = set()
    for cloud, script in STARTUP_SCRIPTS.items():
        text = (REPO / script).read_text()
        assert f"\nGEOTRAIN_CLOUD={cloud}\n" in text
        bootstraps.add(text[text.index("# ---- bootstrap"):])
    assert len(bootstraps) == 1, "the bootstrap part of the startup scripts has drifted apart; keep them identical"


# ---- systemd -------------------------------------------------------------------------------------------------

def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(REPO / "peers/systemd/geotrain@.service")
    return unit


def test_systemd_unit_restarts_stops_gently_and_runs_as_its_own_user():
    from geotrain.cli import EXIT_BAD_INPUT, EXIT_SWARM_UNREACHABLE, EXIT_UNEXPECTED
    from geotrain.lifecycle import STOP_DEADLINE_S
    from geotrain.preemption import EXIT_PREEMPTED

    service = read_unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert float(service["RestartSec"]) > 0
    # not restarted: a wrong config (retrying cannot fix it) and a preemption notice (the VM is going away)
    not_restarted = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert not_restarted == {EXIT_BAD_INPUT, EXIT_PREEMPTED}
    assert EXIT_SWARM_UNREACHABLE not in not_restarted and EXIT_UNEXPECTED not in not_restarted
    assert service["KillSignal"] == "SIGTERM"
    assert service["KillMode"] == "mixed"               # SIGTERM to geotrain, which stops its own children
    timeout_s = float(service["TimeoutStopSec"])
    assert timeout_s >= 30 and timeout_s > STOP_DEADLINE_S
    assert service["User"] == "geotrain" and service["User"] != "root"
    assert read_unit()["Unit"]["StartLimitIntervalSec"] == "0"


def test_systemd_unit_points_where_setup_installs():
    setup = (REPO / "peers/setup.sh").read_text()
    service = read_unit()["Service"]
    prefix = re.search(r"^readonly prefix=(\S+)", setup, re.M).group(1)
    state_dir = re.search(r"^readonly state_dir=(\S+)", setup, re.M).group(1)
    etc_dir = re.search(r"^readonly etc_dir=(\S+)", setup, re.M).group(1)
    assert service["ExecStart"] == f"{prefix}/libexec/run.sh %i"
    assert 'install -m 0755 "$here/run.sh" "$prefix/libexec/run.sh"' in setup
    assert service["EnvironmentFile"] == f"{etc_dir}/geotrain.env"
    assert f"/var/lib/{service['StateDirectory']}" == state_dir == STATE_DIR
    assert re.search(r"^readonly user=(\S+)", setup, re.M).group(1) == service["User"]


def test_systemd_accepts_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing; install systemd (apt-get install systemd) to verify the unit"
    # verify checks that ExecStart exists; point it at a stand-in for the installed run.sh
    run_sh = tmp_path / "run.sh"
    run_sh.write_text("#!/bin/sh\n")
    run_sh.chmod(0o755)
    unit_text = (REPO / "peers/systemd/geotrain@.service").read_text()
    unit = tmp_path / "geotrain@trainer.service"
    unit.write_text(unit_text.replace("/opt/geotrain/libexec/run.sh", str(run_sh)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if str(unit) in line or "geotrain@" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


# ---- example configs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((REPO / "peers/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid_geotrain_configs(path):
    config = load_config(path)
    # per-VM values come from the startup scripts, never from a config shared by all VMs
    assert config.swarm.initial_peers == [] and config.swarm.announce_host is None
    assert config.swarm.identity_path is None


def test_example_coordinator_builds_the_example_trainers_model():
    trainer = load_config(REPO / "peers/configs/trainer.yaml")
    coordinator = load_config(REPO / "peers/configs/coordinator.yaml")
    assert coordinator.task == trainer.task
    assert coordinator.optimizer == trainer.optimizer
    assert (coordinator.swarm.host, coordinator.swarm.port) == ("0.0.0.0", 31337)
    assert coordinator.coordinator.hold_state
    assert trainer.metrics.port == 9100


def test_startup_defaults_name_existing_configs():
    for role in ("trainer", "coordinator"):
        assert (REPO / f"peers/configs/{role}.yaml").is_file()
    text = (REPO / STARTUP_SCRIPTS["aws"]).read_text()
    assert "GEOTRAIN_CONFIG=${GEOTRAIN_CONFIG:-peers/configs/$GEOTRAIN_ROLE.yaml}" in text
