"""peers/skypilot/: every task file parses with SkyPilot's own ``sky.Task.from_yaml``, in SkyPilot's venv.

SkyPilot runs in .venv-sky (its dependencies pin versions geotrain's would clash with), so a small script
runs there and reports what SkyPilot made of each file as JSON. Validating resources against clouds needs
SkyPilot's online catalog and credentials, so it stops at what SkyPilot checks offline: the schema, the
envs, the resources it would request and the workdir. The task's `run` step then runs here, in dry-run
mode, against a metadata service on loopback, and for real with a stand-in for geotrain that records how
it was started: one trainer per GPU SkyPilot gave the node.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from deploy_helpers import GeotrainCommandLine, fake_bin, fake_geotrain, parse_key_values, recorded
from deploy_tools import REPO
from metadata_servers import gce_metadata

COORDINATOR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
TASKS = sorted((REPO / "peers/skypilot").glob("*.yaml"))

# Runs inside .venv-sky: argv[1] is a JSON list of [path, env overrides] pairs.
PARSE_TASKS = r"""
import json, sys
import yaml
import sky

report = {}
for path, overrides in json.loads(sys.argv[1]):
    entry = {}
    try:
        sky.Task.from_yaml(path)
        entry["from_yaml"] = "ok"
    except Exception as error:  # the report says what SkyPilot objected to
        entry["from_yaml"] = f"{type(error).__name__}: {error}"
    # what `sky launch FILE --env KEY=VALUE` builds (the CLI passes --env as env_overrides)
    with open(path) as handle:
        task = sky.Task.from_yaml_config(yaml.safe_load(handle), env_overrides=list(overrides.items()))
    task.validate_name()
    task.validate_run()
    task.expand_and_validate_workdir()
    entry.update(
        name=task.name, envs=dict(task.envs), setup=task.setup, run=task.run, workdir=task.workdir,
        num_nodes=task.num_nodes,
        resources=[dict(cloud=str(r.cloud) if r.cloud else None, use_spot=r.use_spot, ports=r.ports,
                        accelerators=r.accelerators, job_recovery=r.job_recovery,
                        cpus=r.cpus, memory=r.memory) for r in task.resources])
    report[path] = entry
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def parsed(sky, tmp_path_factory) -> dict[str, dict]:
    home = tmp_path_factory.mktemp("sky-home")  # SkyPilot keeps state under ~/.sky; not the user's
    request = [[str(path), {"GEOTRAIN_INITIAL_PEERS": COORDINATOR} if path.name == "trainer.yaml" else {}]
               for path in TASKS]
    result = subprocess.run([str(sky.python), "-c", PARSE_TASKS, json.dumps(request)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, f"SkyPilot could not parse the task files:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return {str(path.relative_to(REPO)): report[str(path)] for path in TASKS}


def test_there_are_task_files_for_a_coordinator_and_trainers():
    assert {path.name for path in TASKS} == {"coordinator.yaml", "trainer.yaml"}


def test_coordinator_task_parses_with_from_yaml_on_demand_with_the_dht_port_open(parsed):
    from geotrain.config import COORDINATOR_PORT as DEFAULT_PORT

    task = parsed["peers/skypilot/coordinator.yaml"]
    assert task["from_yaml"] == "ok"
    (resources,) = task["resources"]
    assert resources["use_spot"] is False
    assert resources["ports"] == [str(DEFAULT_PORT)]


def test_trainer_task_refuses_to_launch_without_the_coordinators_address(parsed):
    # GEOTRAIN_INITIAL_PEERS is null in the file: SkyPilot's from_yaml refuses it until --env sets it,
    # so no VM is ever started that could not join
    message = parsed["peers/skypilot/trainer.yaml"]["from_yaml"]
    assert message.startswith("ValueError") and "GEOTRAIN_INITIAL_PEERS" in message


def test_trainer_task_runs_on_spot_vms_of_any_cloud_and_recovers(parsed):
    from geotrain.stopping.notices import EXIT_PREEMPTED

    task = parsed["peers/skypilot/trainer.yaml"]
    assert task["envs"]["GEOTRAIN_INITIAL_PEERS"] == COORDINATOR
    assert {r["cloud"] for r in task["resources"]} == {"AWS", "GCP", "Azure"}
    for resources in task["resources"]:
        assert resources["use_spot"] is True
        # trainer N of a VM listens on 31337 + N: open enough for a VM of 8 GPUs
        assert resources["ports"] == ["31337-31344"]
        assert resources["accelerators"] == {"T4": 1}
        assert EXIT_PREEMPTED in resources["job_recovery"]["recover_on_exit_codes"]


@pytest.mark.parametrize("name", ["coordinator.yaml", "trainer.yaml"])
def test_tasks_install_and_run_geotrain_from_the_synced_repository(parsed, name):
    task = parsed[f"peers/skypilot/{name}"]
    assert task["workdir"] == str(REPO)
    assert task["setup"].strip() == "bash peers/skypilot/setup.sh"
    role = name.removesuffix(".yaml")
    assert task["run"].strip().endswith(f"exec bash peers/run.sh {role}")
    assert (REPO / task["envs"]["GEOTRAIN_CONFIG"]).is_file()


@pytest.mark.parametrize("name", ["coordinator.yaml", "trainer.yaml"])
def test_task_run_step_starts_geotrain_with_the_vms_address(parsed, name):
    """The task's own `run` script, with its envs, on a (loopback) GCE VM: the command it would start."""
    task = parsed[f"peers/skypilot/{name}"]
    with gce_metadata("europe-west4-a", "n1-standard-8", "203.0.113.50") as server:
        # SkyPilot tells every task how many GPUs it got (0 for the coordinator's CPU VM)
        env = {**task["envs"], "HOME": "/home/sky", "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_METADATA_URL": server.url,
               "SKYPILOT_NUM_GPUS_PER_NODE": "1" if name == "trainer.yaml" else "0"}
        result = subprocess.run(["bash", "-c", task["run"]], cwd=task["workdir"], env={"PATH": "/usr/bin:/bin", **env},
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["cloud"], facts["region"], facts["announce_host"]) == ("gcp", "europe-west4", "203.0.113.50")
    line = facts["command_0" if name == "trainer.yaml" else "command"]
    command = GeotrainCommandLine.from_shell(line)
    assert shlex.split(line)[0] == "/home/sky/geotrain-venv/bin/geotrain"
    assert command.config.swarm.announce_host == "203.0.113.50"
    if name == "trainer.yaml":
        assert command.config.swarm.initial_peers == [COORDINATOR]
        assert str(command.config.swarm.identity_path) == "/home/sky/geotrain-state/identity-0.key"
        assert command.config.preemption.source == "gcp"
        assert command.config.training.device == "cuda:0"
    else:
        assert str(command.state_dir) == "/home/sky/geotrain-state"



def run_trainer_task(parsed, home: Path, gpus: str, **env: str) -> subprocess.CompletedProcess:
    """The trainer task's `run`, for real, as SkyPilot runs it on a node with ``gpus`` GPUs; geotrain in
    ~/geotrain-venv (where setup.sh installs it) is a stand-in that records its arguments."""
    task = parsed["peers/skypilot/trainer.yaml"]
    # no nvidia-smi on this PATH: the count must come from SkyPilot
    path = f"{fake_bin(home / 'bin')}:/usr/bin:/bin"
    with gce_metadata("europe-west4-a", "n1-standard-8", "203.0.113.50") as server:
        return subprocess.run(["bash", "-c", task["run"]], cwd=task["workdir"], capture_output=True, text=True,
                              timeout=120, env={"PATH": path, **task["envs"], "HOME": str(home),
                                                "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
                                                "GEOTRAIN_METADATA_URL": server.url, **env})


@pytest.mark.parametrize("gpus", [2, 0])
def test_trainer_task_starts_one_trainer_per_gpu_it_got(parsed, tmp_path, gpus):
    record = tmp_path / "calls.jsonl"
    fake_geotrain(tmp_path / "home/geotrain-venv/bin/geotrain", record)
    result = run_trainer_task(parsed, tmp_path / "home", str(gpus))
    assert result.returncode == 0, result.stderr
    peers = sorted((GeotrainCommandLine(argv) for argv in recorded(record)), key=lambda peer: peer.config.swarm.port)
    assert len(peers) == max(gpus, 1)
    state = tmp_path / "home/geotrain-state"
    for index, peer in enumerate(peers):
        assert peer.command == "peer"
        assert peer.config.training.device == (f"cuda:{index}" if gpus else "auto")
        assert (peer.config.swarm.port, peer.config.metrics.port) == (31337 + index, 9100 + index)
        assert peer.config.swarm.announce_host == "203.0.113.50"
        assert peer.config.swarm.identity_path == state / f"identity-{index}.key"
        assert peer.config.swarm.initial_peers == [COORDINATOR]
        assert peer.config.preemption.source == "gcp"
    # every port a trainer listens on is one the task opens
    (resources, *_) = parsed["peers/skypilot/trainer.yaml"]["resources"]
    low, high = (int(port) for port in resources["ports"][0].split("-"))
    assert all(low <= peer.config.swarm.port <= high for peer in peers)


def test_a_preempted_trainer_ends_the_job_with_75_so_skypilot_relaunches_it(parsed, tmp_path):
    from geotrain.stopping.notices import EXIT_PREEMPTED

    record = tmp_path / "calls.jsonl"
    fake_geotrain(tmp_path / "home/geotrain-venv/bin/geotrain", record)
    result = run_trainer_task(parsed, tmp_path / "home", "2",
                              FAKE_GEOTRAIN=json.dumps({"cuda:0": "sleep:60", "cuda:1": f"exit:{EXIT_PREEMPTED}"}))
    assert result.returncode == EXIT_PREEMPTED, result.stderr
    assert EXIT_PREEMPTED in parsed["peers/skypilot/trainer.yaml"]["resources"][0]["job_recovery"][
        "recover_on_exit_codes"]
    # the other trainer was told to leave rather than left behind
    assert Path(f"{record}.stopped").read_text().split() == ["cuda:0"]
