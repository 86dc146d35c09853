"""The VM recipes in peers/: shell scripts, the systemd unit and the example configs.

The startup scripts run for real, in their dry-run mode (GEOTRAIN_DRY_RUN=1: no package installs, no
systemd), against HTTP servers on loopback that speak each cloud's metadata protocol and refuse requests
without its headers, on a PATH that makes the VM's GPUs what the test says: a fake nvidia-smi listing
them, or none at all. What they print is the command of every peer systemd would start (one trainer per
GPU), each parsed by geotrain's own command-line parser and config. run.sh in front of several trainers
runs for real, with a stand-in for geotrain.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from geotrain.config import load_config

from deploy_helpers import (GeotrainCommandLine, fake_geotrain, parse_key_values, recorded, run_script,
                            vm_path)
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


@pytest.fixture(scope="module")
def cpu_vm(tmp_path_factory) -> str:
    """PATH of a VM without GPUs: no nvidia-smi."""
    return vm_path(tmp_path_factory.mktemp("cpu-vm"))


@pytest.fixture(scope="module")
def gpu_vm(tmp_path_factory) -> str:
    """PATH of a VM with two T4s."""
    return vm_path(tmp_path_factory.mktemp("gpu-vm"), gpus=2)


def startup(cloud: str, server: MetadataServer, path: str, **settings: str):
    env = {"PATH": path, "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_SOURCE_DIR": str(REPO),
           "GEOTRAIN_METADATA_URL": server.url, "GEOTRAIN_INITIAL_PEERS": COORDINATOR, **settings}
    return run_script(STARTUP_SCRIPTS[cloud], env=env)


def trainers(facts: dict[str, str], config_paths: dict[str, Path] | None = None) -> list[GeotrainCommandLine]:
    """Every trainer a dry run would start, in order, through geotrain's own parser."""
    count = int(facts["trainers"])
    assert {key for key in facts if key.startswith("command")} == {f"command_{index}" for index in range(count)}
    return [GeotrainCommandLine.from_shell(facts[f"command_{index}"], config_paths=config_paths or config_sources())
            for index in range(count)]


def shell_scripts() -> list[Path]:
    scripts = set()
    for folder in ("peers", "docker", "benchmarks"):
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
def test_startup_script_announces_the_public_address_and_labels_from_metadata(cloud, cpu_vm):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = startup(cloud, server, cpu_vm)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert facts["cloud"] == cloud
    assert facts["region"] == vm["region"]
    assert facts["instance_type"] == vm["instance_type"]
    assert facts["announce_host"] == vm["address"]

    # no GPU (no nvidia-smi): one trainer, on whatever device its config says (auto: the CPU here)
    assert (facts["gpus"], facts["trainers"]) == ("0", "1")
    (peer,) = trainers(facts)
    assert peer.command == "peer"
    assert peer.value("--device") is None and peer.config.training.device == "auto"
    assert peer.value("--data-part") is None
    swarm, metrics = peer.config.swarm, peer.config.metrics
    assert swarm.initial_peers == [COORDINATOR]
    assert (swarm.host, swarm.port, swarm.announce_host) == ("0.0.0.0", 31337, vm["address"])
    assert swarm.announce_maddrs() == [f"/ip4/{vm['address']}/tcp/31337"]
    assert not swarm.client_mode
    # the identity on the boot disk, which survives a spot stop: the peer id survives it too
    assert str(swarm.identity_path) == f"{STATE_DIR}/identity-0.key"
    assert str(swarm.known_peers_file) == f"{STATE_DIR}/known-peers-0.txt"  # rejoins while the coordinator is down
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


def test_aws_startup_script_uses_an_imdsv2_session_token(cpu_vm):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        assert startup("aws", server, cpu_vm).returncode == 0
    first, *reads = server.requests
    assert (first.method, first.path) == ("PUT", "/latest/api/token")
    assert int(first.headers["x-aws-ec2-metadata-token-ttl-seconds"]) > 0
    assert {request.path for request in reads} == {
        "/latest/meta-data/public-ipv4", "/latest/meta-data/placement/region", "/latest/meta-data/instance-type"}
    assert all(request.headers.get("x-aws-ec2-metadata-token") for request in reads)


@pytest.mark.parametrize("cloud", sorted(STARTUP_SCRIPTS))
def test_a_vm_without_public_address_joins_in_client_mode(cloud, gpu_vm):
    with VMS[cloud]["server"](None) as server:
        result = startup(cloud, server, gpu_vm)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert facts["announce_host"] == ""
    for index, peer in enumerate(trainers(facts)):
        assert peer.config.swarm.client_mode
        assert peer.value("--announce-host") is None and peer.value("--port") is None
        assert peer.config.metrics.region == VMS[cloud]["region"]
        assert peer.config.training.device == f"cuda:{index}"
    assert "client mode" in result.stderr


def test_azure_asks_the_configured_echo_service_when_imds_lists_no_public_address(cpu_vm):
    # IMDS leaves Standard-SKU public addresses out; an echo service (opt-in) fills the gap
    echo = MetadataServer("echo", lambda method, path, query, headers: (200, "192.0.2.200\n", {}))
    with VMS["azure"]["server"](None) as server, echo:
        result = startup("azure", server, cpu_vm, GEOTRAIN_PUBLIC_IP_URL=echo.url + "/")
    assert result.returncode == 0, result.stderr
    assert parse_key_values(result.stdout)["announce_host"] == "192.0.2.200"


def test_operator_settings_win_over_the_metadata(cpu_vm):
    vm = VMS["gcp"]
    with vm["server"](vm["address"]) as server:
        result = startup("gcp", server, cpu_vm, GEOTRAIN_ANNOUNCE_HOST="192.0.2.8", GEOTRAIN_REGION="eu-lab",
                         GEOTRAIN_RUN_ID="imagenet", GEOTRAIN_TASK="nlp", GEOTRAIN_PRESET="roberta-base",
                         GEOTRAIN_NETWORK_PROFILE="continent",
                         GEOTRAIN_EXTRA_ARGS="--target-batch-size 32768 --max-epochs 10", GEOTRAIN_PREEMPTION="signal")
    assert result.returncode == 0, result.stderr
    (peer,) = trainers(parse_key_values(result.stdout))
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
def test_coordinator_from_a_startup_script(cloud, gpu_vm):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = startup(cloud, server, gpu_vm, GEOTRAIN_ROLE="coordinator", GEOTRAIN_INITIAL_PEERS="")
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    # one coordinator, however many GPUs the VM has
    assert not {key for key in facts if key.startswith("command_")} and "trainers" not in facts
    assert "geotrain@coordinator.service" in result.stderr and "geotrain@trainer" not in result.stderr
    coordinator = GeotrainCommandLine.from_shell(facts["command"], config_paths=config_sources())
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


def test_coordinator_listens_on_another_port_when_told(cpu_vm):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, cpu_vm, GEOTRAIN_ROLE="coordinator", GEOTRAIN_PORT="40000")
    assert result.returncode == 0, result.stderr
    coordinator = GeotrainCommandLine.from_shell(parse_key_values(result.stdout)["command"],
                                                 config_paths=config_sources())
    assert coordinator.config.swarm.port == 40000


def test_coordinator_without_a_public_address_is_refused(cpu_vm):
    with VMS["aws"]["server"](None) as server:
        result = startup("aws", server, cpu_vm, GEOTRAIN_ROLE="coordinator")
    assert result.returncode == 2
    assert "no public IPv4 address" in result.stderr and "GEOTRAIN_ANNOUNCE_HOST" in result.stderr


@pytest.mark.parametrize("initial_peers, complaint", [
    ("", "GEOTRAIN_INITIAL_PEERS is empty"),
    ("203.0.113.7:31337", "expected a full multiaddr"),
])
def test_trainer_without_a_usable_coordinator_address_stops_with_exit_2(initial_peers, complaint, cpu_vm):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, cpu_vm, GEOTRAIN_INITIAL_PEERS=initial_peers)
    # 2: systemd's RestartPreventExitStatus, so a wrong setting does not restart forever
    assert result.returncode == 2
    assert complaint in result.stderr


def test_settings_that_systemd_and_bash_would_read_differently_are_refused(cpu_vm):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, cpu_vm, GEOTRAIN_EXTRA_ARGS="--set task.data.path=$HOME/data")
    assert result.returncode == 2
    assert "GEOTRAIN_EXTRA_ARGS contains a quote, backslash, dollar or newline" in result.stderr


def test_unreachable_metadata_service_fails_so_systemd_retries(cpu_vm):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    result = run_script("peers/run.sh", "trainer", env={
        "PATH": cpu_vm, "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_CLOUD": "aws", "GEOTRAIN_METADATA_URL": url,
        "GEOTRAIN_METADATA_RETRIES": "0", "GEOTRAIN_INITIAL_PEERS": COORDINATOR})
    assert result.returncode == 1  # not 2: the unit restarts it
    assert "could not read this VM's address and region from the aws metadata service" in result.stderr


@pytest.mark.parametrize("cloud", sorted(VMS))
def test_auto_detects_the_cloud_from_its_metadata_service(cloud, cpu_vm):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = run_script("peers/run.sh", "trainer", env={
            "PATH": cpu_vm, "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_CLOUD": "auto", "GEOTRAIN_METADATA_URL": server.url,
            "GEOTRAIN_INITIAL_PEERS": COORDINATOR})
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["cloud"], facts["region"], facts["announce_host"]) == (cloud, vm["region"], vm["address"])


def test_discover_alone_prints_what_a_peer_would_announce(gpu_vm):
    vm = VMS["gcp"]
    with vm["server"](vm["address"]) as server:
        result = run_script("peers/lib/discover.sh", "gcp", env={"GEOTRAIN_METADATA_URL": server.url, "PATH": gpu_vm})
    assert result.returncode == 0, result.stderr
    assert parse_key_values(result.stdout) == {"cloud": "gcp", "region": "us-central1",
                                               "instance_type": "n1-standard-8", "public_ip": vm["address"],
                                               "gpus": "2"}


def test_startup_scripts_share_one_bootstrap_and_name_their_cloud():
    bootstraps = set()
    for cloud, script in STARTUP_SCRIPTS.items():
        text = (REPO / script).read_text()
        assert f"\nGEOTRAIN_CLOUD={cloud}\n" in text
        bootstraps.add(text[text.index("# ---- bootstrap"):])
    assert len(bootstraps) == 1, "the bootstrap part of the startup scripts has drifted apart; keep them identical"


# ---- one trainer per GPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cloud", sorted(STARTUP_SCRIPTS))
def test_a_vm_with_two_gpus_runs_a_trainer_on_each(cloud, gpu_vm):
    vm = VMS[cloud]
    with vm["server"](vm["address"]) as server:
        result = startup(cloud, server, gpu_vm)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["gpus"], facts["trainers"]) == ("2", "2")
    # setup.sh enables a unit per GPU; its dry run says so
    assert "start geotrain@trainer-0.service geotrain@trainer-1.service" in result.stderr
    peers = trainers(facts)
    for index, peer in enumerate(peers):
        assert peer.command == "peer"
        swarm, metrics = peer.config.swarm, peer.config.metrics
        assert peer.config.training.device == f"cuda:{index}"
        # the VM's address for all, a port each
        assert (swarm.host, swarm.port, swarm.announce_host) == ("0.0.0.0", 31337 + index, vm["address"])
        assert swarm.announce_maddrs() == [f"/ip4/{vm['address']}/tcp/{31337 + index}"]
        assert str(swarm.identity_path) == f"{STATE_DIR}/identity-{index}.key"
        assert (metrics.port, metrics.host) == (9100 + index, "0.0.0.0")
        assert (metrics.region, metrics.cloud, metrics.instance_type) == (vm["region"], cloud, vm["instance_type"])
        assert swarm.initial_peers == [COORDINATOR]
        assert peer.config.preemption.source == cloud
        # the example config's data are synthetic: nothing to split
        assert peer.value("--data-part") is None and peer.config.task.data.part is None
    for values in ({p.config.swarm.port for p in peers}, {p.config.swarm.identity_path for p in peers},
                   {p.config.metrics.port for p in peers}, {p.config.training.device for p in peers}):
        assert len(values) == len(peers)


@pytest.mark.parametrize("nvidia_smi", ["absent", "failing"])
def test_a_vm_without_working_gpus_runs_one_trainer_on_its_configs_device(nvidia_smi, cpu_vm, tmp_path):
    path = cpu_vm if nvidia_smi == "absent" else vm_path(tmp_path, nvidia_smi_fails=True)
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        result = startup("aws", server, path)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["gpus"], facts["trainers"]) == ("0", "1")
    assert "start geotrain@trainer-0.service\n" in result.stderr
    (peer,) = trainers(facts)
    assert peer.value("--device") is None and peer.config.training.device == "auto"
    assert (peer.config.swarm.port, peer.config.metrics.port) == (31337, 9100)
    assert ("nvidia-smi failed" in result.stderr) == (nvidia_smi == "failing")


WEBDATASET = {"task": {"name": "cv", "preset": "tiny", "data": {"source": "webdataset",
                                                                 "path": "s3://bucket/shard-{000..099}.tar"}}}


@pytest.mark.parametrize("config, extra_args, parts, added", [
    # shards named by the config, or by flags: each trainer reads its own part of them
    (WEBDATASET, "", ["0/2", "1/2"], True),
    (None, "--data-source webdataset --data-path s3://bucket/shard-{000..099}.tar", ["0/2", "1/2"], True),
    (None, "--set task.data.source=webdataset --data-path=s3://bucket/shard-{000..099}.tar", ["0/2", "1/2"], True),
    # a part the user chose wins, wherever it was set
    (None, "--data-source webdataset --data-path s3://b/{0..9}.tar --data-part 3/8", ["3/8", "3/8"], False),
    ({"task": {**WEBDATASET["task"], "data": {**WEBDATASET["task"]["data"], "part": "2/4"}}}, "", ["2/4", "2/4"],
     False),
    (WEBDATASET, "--set task.data.part=1/3", ["1/3", "1/3"], False),
    # not shards: no parts
    (WEBDATASET, "--data-source synthetic", [None, None], False),
    ({"task": {"name": "cv", "preset": "tiny"}}, "", [None, None], False),
], ids=["config", "flags", "set", "flag-part", "config-part", "set-part", "flag-not-shards", "synthetic"])
def test_trainers_of_a_vm_split_webdataset_shards_unless_told_otherwise(config, extra_args, parts, added, gpu_vm,
                                                                       tmp_path):
    settings = {"GEOTRAIN_EXTRA_ARGS": extra_args}
    config_paths = None
    if config is not None:
        config_file = tmp_path / "run.yaml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        settings["GEOTRAIN_CONFIG"] = str(config_file)
        config_paths = {"/etc/geotrain/trainer.yaml": config_file}
    vm = VMS["gcp"]
    with vm["server"](vm["address"]) as server:
        result = startup("gcp", server, gpu_vm, **settings)
    assert result.returncode == 0, result.stderr
    peers = trainers(parse_key_values(result.stdout), config_paths=config_paths)
    assert [peer.config.task.data.part for peer in peers] == parts
    for index, peer in enumerate(peers):
        assert (peer.argv.count("--data-part") == 1 and peer.value("--data-part") == f"{index}/2") == added
        if parts[index]:
            assert peer.config.task.data.source == "webdataset"


def test_gpus_setting_overrides_what_nvidia_smi_lists(gpu_vm):
    vm = VMS["aws"]
    with vm["server"](vm["address"]) as server:
        three = startup("aws", server, gpu_vm, GEOTRAIN_GPUS="3")
        none = startup("aws", server, gpu_vm, GEOTRAIN_GPUS="0")
        wrong = startup("aws", server, gpu_vm, GEOTRAIN_GPUS="two")
    assert three.returncode == 0, three.stderr
    assert [peer.config.training.device for peer in trainers(parse_key_values(three.stdout))] == [
        "cuda:0", "cuda:1", "cuda:2"]
    (cpu_peer,) = trainers(parse_key_values(none.stdout))
    assert cpu_peer.value("--device") is None
    assert wrong.returncode == 2 and "GEOTRAIN_GPUS is 'two'" in wrong.stderr


def test_trainers_ports_start_at_the_configured_ones(gpu_vm):
    vm = VMS["azure"]
    with vm["server"](vm["address"]) as server:
        result = startup("azure", server, gpu_vm, GEOTRAIN_PORT="40000", GEOTRAIN_METRICS_PORT="9200")
    assert result.returncode == 0, result.stderr
    peers = trainers(parse_key_values(result.stdout))
    assert [(peer.config.swarm.port, peer.config.metrics.port) for peer in peers] == [(40000, 9200), (40001, 9201)]


def run_sh_env(path: str, **settings: str) -> dict[str, str]:
    return {"PATH": path, "GEOTRAIN_CLOUD": "none", "GEOTRAIN_ANNOUNCE_HOST": "192.0.2.8",
            "GEOTRAIN_REGION": "lab", "GEOTRAIN_INITIAL_PEERS": COORDINATOR, **settings}


def test_each_systemd_unit_runs_the_trainer_of_its_gpu(gpu_vm):
    """setup.sh enables geotrain@trainer-N; the unit runs `run.sh trainer-N`: the same command as trainer N
    of the whole VM, and nothing else."""
    everything = run_script("peers/run.sh", "trainer", env=run_sh_env(gpu_vm, GEOTRAIN_DRY_RUN="1"))
    assert everything.returncode == 0, everything.stderr
    facts = parse_key_values(everything.stdout)
    assert exec_start_argument() == "%i"
    for index in range(2):
        unit = run_script("peers/run.sh", f"trainer-{index}", env=run_sh_env(gpu_vm, GEOTRAIN_DRY_RUN="1"))
        assert unit.returncode == 0, unit.stderr
        alone = parse_key_values(unit.stdout)
        assert {key for key in alone if key.startswith("command")} == {f"command_{index}"}
        assert alone[f"command_{index}"] == facts[f"command_{index}"]
    # a unit of a GPU the VM no longer has (resized) stops for good, saying what to do
    gone = run_script("peers/run.sh", "trainer-2", env=run_sh_env(gpu_vm, GEOTRAIN_DRY_RUN="1"))
    assert gone.returncode == 2 and "there is no trainer 2" in gone.stderr and "again" in gone.stderr
    for wrong in ("trainer-", "trainer-x", "trainers"):
        refused = run_script("peers/run.sh", wrong, env=run_sh_env(gpu_vm, GEOTRAIN_DRY_RUN="1"))
        assert refused.returncode == 2 and "unknown role" in refused.stderr


def exec_start_argument() -> str:
    return read_unit()["Service"]["ExecStart"].split()[-1]


@pytest.fixture
def stand_in(tmp_path):
    """run.sh's environment with a stand-in geotrain that records its arguments (see fake_geotrain)."""
    record = tmp_path / "geotrain-calls.jsonl"
    geotrain = fake_geotrain(tmp_path / "venv" / "bin" / "geotrain", record)

    def env(path: str, **settings: str) -> dict[str, str]:
        return run_sh_env(path, GEOTRAIN_BIN=str(geotrain), GEOTRAIN_STATE_DIR=str(tmp_path / "state"), **settings)

    return env, record


def test_run_sh_starts_every_trainer_of_the_vm_and_labels_their_output(gpu_vm, stand_in):
    env, record = stand_in
    result = run_script("peers/run.sh", "trainer", env=env(gpu_vm))
    assert result.returncode == 0, result.stderr
    calls = recorded(record)
    assert len(calls) == 2
    peers = sorted((GeotrainCommandLine(argv) for argv in calls), key=lambda peer: peer.config.swarm.port)
    assert [(p.config.training.device, p.config.swarm.port, p.config.metrics.port) for p in peers] == [
        ("cuda:0", 31337, 9100), ("cuda:1", 31338, 9101)]
    assert {str(p.config.swarm.identity_path.name) for p in peers} == {"identity-0.key", "identity-1.key"}
    assert "trainer-0: cuda:0: training" in result.stdout.splitlines()
    assert "trainer-1: cuda:1: training" in result.stdout.splitlines()


def test_one_trainer_is_geotrain_itself(cpu_vm, stand_in):
    """With one trainer, run.sh execs geotrain: systemd's main process is geotrain, which gets its SIGTERM."""
    env, record = stand_in
    process = subprocess.Popen(["bash", str(REPO / "peers/run.sh"), "trainer-0"], env=env(cpu_vm),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.communicate(timeout=60)
    assert process.returncode == 0
    (call,) = record.read_text().splitlines()
    assert json.loads(call)["pid"] == process.pid


def test_when_one_trainer_fails_the_others_are_stopped_and_its_status_is_run_shs(gpu_vm, stand_in):
    # trainer 1 got a preemption notice (75); trainer 0 would train on for a minute
    env, record = stand_in
    started = time.monotonic()
    result = run_script("peers/run.sh", "trainer", env=env(
        gpu_vm, FAKE_GEOTRAIN=json.dumps({"cuda:0": "sleep:60", "cuda:1": "exit:75"})))
    assert result.returncode == 75, result.stderr
    assert time.monotonic() - started < 30
    assert Path(f"{record}.stopped").read_text().split() == ["cuda:0"]
    assert "trainer 1 exited with status 75" in result.stderr


def test_sigterm_reaches_every_trainer(gpu_vm, stand_in):
    env, record = stand_in
    process = subprocess.Popen(["bash", str(REPO / "peers/run.sh"), "trainer"], env=env(
        gpu_vm, FAKE_GEOTRAIN=json.dumps({"cuda:0": "sleep:60", "cuda:1": "sleep:60"})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(recorded(record)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(recorded(record)) == 2
        time.sleep(0.5)  # the stand-ins install their SIGTERM handlers right after recording
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert sorted(Path(f"{record}.stopped").read_text().split()) == ["cuda:0", "cuda:1"]
    assert "trainer-0: cuda:0: stopping on signal 15" in stdout


# ---- systemd -------------------------------------------------------------------------------------------------

def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(REPO / "peers/systemd/geotrain@.service")
    return unit


def test_systemd_unit_restarts_stops_gently_and_runs_as_its_own_user():
    from geotrain.cli import EXIT_BAD_INPUT, EXIT_SWARM_UNREACHABLE, EXIT_UNEXPECTED
    from geotrain.stopping.stopper import STOP_DEADLINE_S
    from geotrain.stopping.notices import EXIT_PREEMPTED

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
