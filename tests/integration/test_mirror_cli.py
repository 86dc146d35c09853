"""The checkpoint mirror through the command line, as a user runs it: ``geotrain coordinator --mirror-url``
as an OS process against a real S3-compatible server on loopback, with the endpoint and credentials given
in the environment (AWS_ENDPOINT_URL, which botocore honours) or in the config key
``coordinator.mirror_options``; and the clear errors for a mirror that cannot be opened."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from geotrain.events import read_events
from swarm_helpers import FAST_SWARM, geotrain, spawn, wait_for

try:
    import s3fs
except ImportError as missing:
    pytest.fail(f"s3fs is not installed ({missing}); install the test dependencies: pip install -e '.[dev]'",
                pytrace=False)

pytestmark = pytest.mark.integration

BUCKET = "geotrain-cli"
MIRROR_URL = f"s3://{BUCKET}/run"
REGION = "eu-west-1"  # see S3Server.storage_options: an explicit region spares botocore a metadata look-up


@pytest.fixture
def bucket(s3_server):
    filesystem = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    filesystem.mkdir(BUCKET)
    yield filesystem
    filesystem.rm(BUCKET, recursive=True)


def environment_without_aws(directory: Path, **variables: str) -> dict[str, str]:
    """This process's environment less every AWS setting of the machine running the tests, plus ``variables``.

    No ~/.aws files and no instance metadata service: botocore looks there for what it was not given, and
    the tests must reach nothing but loopback.
    """
    environment = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    environment.update(AWS_CONFIG_FILE=str(directory / "no-aws-config"),
                       AWS_SHARED_CREDENTIALS_FILE=str(directory / "no-aws-credentials"),
                       AWS_EC2_METADATA_DISABLED="true", **variables)
    return environment


def start_coordinator(swarm, name: str, state_dir: Path, environment: dict[str, str], *arguments: str):
    peers_file = swarm.directory / f"{name}-peers.txt"
    process = spawn("coordinator", "--state-dir", str(state_dir), "--port", "0", "--initial-peers-file",
                    str(peers_file), "--mirror-url", MIRROR_URL, *FAST_SWARM, "--network-profile", "loopback",
                    *arguments, log_path=swarm.directory / f"{name}.log", whole_env=environment)
    swarm.processes.append(process)
    wait_for(lambda: peers_file.exists() or process.poll() is not None, 90, f"{name} to come up")
    assert process.poll() is None, f"{name} exited with {process.returncode}:\n{swarm.log(name)[-3000:]}"
    swarm.initial_peers = peers_file.read_text().split()
    return process


def mirrored_manifests(filesystem: s3fs.S3FileSystem) -> list[dict]:
    """The manifests in the bucket, newest first (a manifest is uploaded last: its checkpoint is whole)."""
    filesystem.invalidate_cache()
    try:
        names = filesystem.ls(f"{BUCKET}/run", detail=False)
    except FileNotFoundError:
        return []
    manifests = []
    for name in names:
        if name.endswith(".json"):
            try:
                manifests.append(json.loads(filesystem.cat_file(name)))
            except FileNotFoundError:
                continue  # removed by retention since the listing
    return sorted(manifests, key=lambda manifest: manifest["version"], reverse=True)


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=40)


def test_a_coordinator_on_a_new_vm_restores_from_the_bucket(swarm, s3_server, bucket):
    state_dir = swarm.directory / "coordinator-state"

    # (a) endpoint and credentials from the environment, as on a VM configured for S3-compatible storage
    with_environment = environment_without_aws(
        swarm.directory, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
        AWS_ENDPOINT_URL=s3_server.endpoint_url, AWS_DEFAULT_REGION=REGION)
    first = start_coordinator(swarm, "coordinator-1", state_dir, with_environment, "--checkpoint-every-epochs", "1")
    trainer, events = swarm.start_trainer("trainer", *FAST_SWARM)
    wait_for(lambda: any(manifest["epoch"] >= 2 for manifest in mirrored_manifests(bucket)), 180,
             "a mirrored checkpoint of epoch 2")
    assert stop(first) == 0, swarm.log("coordinator-1")[-3000:]
    stop(trainer)  # its exit code is that of a preemption (--preemption signal): not what is tested here
    newest = mirrored_manifests(bucket)[0]
    assert f"checkpoint {newest['version']} mirrored to {MIRROR_URL}/{newest['data_file']}" in swarm.log(
        "coordinator-1")
    trainer_epochs = [event["epoch"] for event in read_events(events) if event["event"] == "epoch"]
    assert newest["epoch"] >= 2 and newest["epoch"] in trainer_epochs, (newest["epoch"], trainer_epochs)
    assert bucket.info(f"{BUCKET}/run/{newest['data_file']}")["size"] == newest["size_bytes"]

    # The VM is gone with its disk. (b) the new one has no AWS settings: the config file gives them.
    shutil.rmtree(state_dir)
    config_path = swarm.directory / "mirror.yaml"
    config_path.write_text(yaml.safe_dump({"coordinator": {"mirror_options": {
        "client_kwargs": {"endpoint_url": s3_server.endpoint_url, "region_name": REGION},
        "key": "test", "secret": "test"}}}))
    second = start_coordinator(swarm, "coordinator-2", state_dir, environment_without_aws(swarm.directory),
                               "--config", str(config_path))
    log = swarm.log("coordinator-2")
    assert f"restored checkpoint {newest['version']} from the mirror {MIRROR_URL}" in log, log[-3000:]
    assert f"restored checkpoint version {newest['version']}: epoch {newest['epoch']}" in log, log[-3000:]
    restored = json.loads((state_dir / "checkpoints" / f"checkpoint-{newest['version']:06d}.json").read_text())
    assert restored["sha256"] == newest["sha256"]
    assert stop(second) == 0, swarm.log("coordinator-2")[-3000:]


def assert_refused_before_joining(result: subprocess.CompletedProcess, state_dir: Path, message: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert f"geotrain coordinator: {message}" in result.stderr, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not (state_dir / "identity.key").exists(), "it joined the swarm before refusing the mirror"
    assert not list(state_dir.rglob("*checkpoint*")), sorted(state_dir.rglob("*"))


def test_a_mirror_whose_driver_is_not_installed_names_the_extra(tmp_path):
    # the test needs a store whose driver is missing here; the test dependencies install only s3fs
    assert importlib.util.find_spec("gcsfs") is None, "gcsfs is installed: this test needs it absent"
    state_dir = tmp_path / "state"
    result = geotrain("coordinator", "--mirror-url", "gs://bucket/run", "--state-dir", str(state_dir), timeout_s=120)
    assert_refused_before_joining(result, state_dir, "checkpoint mirror gs://bucket/run needs the gcsfs package: "
                                                     "pip install 'geotrain[gcs]'")


def test_an_unknown_protocol_and_malformed_storage_options_are_refused(tmp_path):
    state_dir = tmp_path / "state"
    result = geotrain("coordinator", "--mirror-url", "foo://x", "--state-dir", str(state_dir), timeout_s=120)
    assert_refused_before_joining(result, state_dir, "checkpoint mirror foo://x: unknown storage protocol foo://; "
                                                     "expected s3://bucket/run (pip install 'geotrain[s3]')")

    result = geotrain("coordinator", "--mirror-url", MIRROR_URL, "--state-dir", str(state_dir),
                      "--set", "coordinator.mirror_options={client_kwargs: http://127.0.0.1:9000}", timeout_s=120)
    assert_refused_before_joining(result, state_dir, f"checkpoint mirror {MIRROR_URL}: storage option client_kwargs "
                                                     "must be a mapping, e.g. {endpoint_url: https://...}; "
                                                     "got str 'http://127.0.0.1:9000'")


def test_a_mirror_that_cannot_be_read_on_a_fresh_disk_is_reported_not_a_fresh_run(tmp_path):
    """An unreachable mirror must not look like a run without checkpoints: exit 1 (a restart may help), no traceback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free: nothing answers there
    options = f"coordinator.mirror_options={{client_kwargs: {{endpoint_url: 'http://127.0.0.1:{port}'}}, " \
              "key: k, secret: s, config_kwargs: {retries: {max_attempts: 1}}}"
    result = subprocess.run([sys.executable, "-m", "geotrain", "coordinator", "--state-dir", str(tmp_path / "state"),
                             "--mirror-url", MIRROR_URL, "--set", options, "--port", "0"],
                            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                            env=environment_without_aws(tmp_path, AWS_DEFAULT_REGION=REGION))
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"the mirror {MIRROR_URL} cannot be listed" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "state" / "identity.key").exists(), "it joined the swarm"
