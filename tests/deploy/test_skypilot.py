"""peers/skypilot/: every task file parses with SkyPilot's own ``sky.Task.from_yaml``, in SkyPilot's venv.

SkyPilot runs in .venv-sky (its dependencies pin versions geotrain's would clash with), so a small script
runs there and reports what SkyPilot made of each file as JSON. Validating resources against clouds needs
SkyPilot's online catalog and credentials, so it stops at what SkyPilot checks offline: the schema, the
envs, the resources it would request and the workdir. The task's `run` step then runs here, in dry-run
mode, against a metadata service on loopback.
"""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from deploy_helpers import GeotrainCommandLine, parse_key_values
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
    from geotrain.preemption import EXIT_PREEMPTED

    task = parsed["peers/skypilot/trainer.yaml"]
    assert task["envs"]["GEOTRAIN_INITIAL_PEERS"] == COORDINATOR
    assert {r["cloud"] for r in task["resources"]} == {"AWS", "GCP", "Azure"}
    for resources in task["resources"]:
        assert resources["use_spot"] is True
        assert resources["ports"] == ["31337"]
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
        env = {**task["envs"], "HOME": "/home/sky", "GEOTRAIN_DRY_RUN": "1", "GEOTRAIN_METADATA_URL": server.url}
        result = subprocess.run(["bash", "-c", task["run"]], cwd=task["workdir"], env={"PATH": "/usr/bin:/bin", **env},
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    facts = parse_key_values(result.stdout)
    assert (facts["cloud"], facts["region"], facts["announce_host"]) == ("gcp", "europe-west4", "203.0.113.50")
    command = GeotrainCommandLine.from_shell(facts["command"])
    assert shlex.split(facts["command"])[0] == "/home/sky/geotrain-venv/bin/geotrain"
    assert command.config.swarm.announce_host == "203.0.113.50"
    if name == "trainer.yaml":
        assert command.config.swarm.initial_peers == [COORDINATOR]
        assert str(command.config.swarm.identity_path) == "/home/sky/geotrain-state/identity.key"
        assert command.config.preemption.source == "gcp"
    else:
        assert str(command.state_dir) == "/home/sky/geotrain-state"

