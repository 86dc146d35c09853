"""docker/: the image's Dockerfile, its entry point and health check, and the compose stack with monitoring.

No Docker engine runs here, so the Dockerfile is linted (hadolint) and read; the compose file is parsed and
held against what geotrain itself says: its commands go through geotrain's parser and config, its ports are
geotrain's defaults, and Prometheus and Grafana read the files in monitoring/. The entry point and health
check run for real against real endpoints.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import ipaddress
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath

import pytest
import yaml

from deploy_helpers import GeotrainCommandLine
from deploy_tools import REPO

DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
MONITORING = REPO / "monitoring"
TRAINERS = ("trainer-1", "trainer-2")
COORDINATOR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
GIB = 1024 ** 3


def dockerfiles() -> list[Path]:
    return sorted(path for path in DOCKER.rglob("Dockerfile*") if not path.name.endswith(".dockerignore"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current.strip():
                keyword, _, rest = current.strip().partition(" ")
                logical.append((keyword.upper(), rest.strip()))
            current = ""
    return logical


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def commands(compose) -> dict[str, GeotrainCommandLine]:
    """Each geotrain service's command, read by geotrain's own parser and config."""
    return {name: GeotrainCommandLine(service["command"])
            for name, service in compose["services"].items() if service.get("image", "").startswith("geotrain")}


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """container path -> (source, mode) of a service's short-syntax volumes."""
    result = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        result[target] = (source, mode[0] if mode else "rw")
    return result


# ---- Dockerfile --------------------------------------------------------------------------------------------

def test_hadolint_passes_on_every_dockerfile(tools):
    files = dockerfiles()
    assert files, "no Dockerfile in docker/"
    for dockerfile in files:
        result = subprocess.run([str(tools.bin("hadolint")), "--no-color", str(dockerfile)],
                                capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, f"hadolint on {dockerfile.relative_to(REPO)}:\n{result.stdout}{result.stderr}"


def test_image_is_multi_stage_with_cpu_and_cuda_variants():
    steps = instructions(DOCKER / "Dockerfile")
    stages = [arguments for keyword, arguments in steps if keyword == "FROM"]
    assert len(stages) >= 2 and any(" AS build" in s for s in stages) and any(" AS runtime" in s for s in stages)
    build_steps = " ".join(arguments for keyword, arguments in steps if keyword == "RUN")
    assert "ARG VARIANT=cpu" in (DOCKER / "Dockerfile").read_text()
    assert re.search(r"cpu\)\s*torch_index=\(--extra-index-url https://download.pytorch.org/whl/cpu\)", build_steps)
    assert re.search(r"cuda\)\s*torch_index=\(\)", build_steps)
    # the runtime stage takes the built environment, not the build tools
    runtime = steps[[i for i, (k, a) in enumerate(steps) if k == "FROM"][-1]:]
    assert ("COPY", "--from=build /opt/geotrain /opt/geotrain") in runtime


def test_image_runs_as_a_non_root_user_with_state_on_a_volume():
    steps = instructions(DOCKER / "Dockerfile")
    text = (DOCKER / "Dockerfile").read_text()
    user = [arguments for keyword, arguments in steps if keyword == "USER"][-1]
    uid = re.search(r"useradd .*--uid (\d+)", text).group(1)
    assert user == f"{uid}:{uid}" and uid != "0"
    volumes = [json.loads(arguments) for keyword, arguments in steps if keyword == "VOLUME"]
    assert volumes == [["/var/lib/geotrain"]]
    assert re.search(r"install -d -o geotrain -g geotrain -m 0700 /var/lib/geotrain\b", text)


def test_image_exposes_geotrain_ports_and_checks_health():
    from geotrain.config import COORDINATOR_PORT as DEFAULT_PORT

    steps = dict((keyword, arguments) for keyword, arguments in instructions(DOCKER / "Dockerfile"))
    assert set(steps["EXPOSE"].split()) == {str(DEFAULT_PORT), "9100"}
    assert steps["HEALTHCHECK"].endswith('CMD ["geotrain-healthcheck"]')
    assert steps["ENTRYPOINT"] == '["tini", "--", "geotrain-entrypoint"]'
    assert steps["STOPSIGNAL"] == "SIGTERM"


def dockerignore_includes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches a path (or a folder above it) decides."""
    included = True
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        exclude = not pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        matches = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if pattern.startswith("**/"):
            matches = matches or any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        if matches:
            included = not exclude
    return included


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_heavy():
    patterns = [line.strip() for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = []
    for keyword, arguments in instructions(DOCKER / "Dockerfile"):
        words = [word for word in arguments.split() if not word.startswith("--")]
        if keyword == "COPY" and "--from=" not in arguments:
            sources += words[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
        files = [source] if (REPO / source).is_file() else [
            str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py")]
        for file in files:
            assert dockerignore_includes(file, patterns), f"{file} is COPYed but left out of the build context"
    for heavy in (".venv/bin/python", ".venv-sky/bin/python", "runs/demo/summary.json", "tests/unit/test_config.py",
                  "geotrain/__pycache__/cli.cpython-311.pyc"):
        assert not dockerignore_includes(heavy, patterns), f"{heavy} would be sent to the Docker daemon"


# ---- entry point --------------------------------------------------------------------------------------------

@pytest.fixture
def fake_geotrain(tmp_path) -> Path:
    """A stand-in for the geotrain executable that prints the arguments it got, as JSON."""
    path = tmp_path / "geotrain"
    path.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    path.chmod(0o755)
    return path


def entrypoint(fake_geotrain: Path, *arguments: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), *arguments], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GEOTRAIN_BIN": str(fake_geotrain), **env}, timeout=30)


def test_entrypoint_passes_the_coordinators_addresses_from_the_shared_file(tmp_path, fake_geotrain):
    addresses = ["/ip4/172.30.57.10/tcp/31337/p2p/12D3KooWA", "/ip4/172.30.57.10/tcp/31338/p2p/12D3KooWA"]
    peers_file = tmp_path / "swarm/initial-peers.txt"

    def coordinator_writes_late():
        time.sleep(1.5)
        peers_file.parent.mkdir()
        peers_file.write_text("\n".join(addresses) + "\n\n")

    writer = threading.Thread(target=coordinator_writes_late)
    writer.start()
    result = entrypoint(fake_geotrain, "peer", "--task", "cv", GEOTRAIN_INITIAL_PEERS_FILE=str(peers_file))
    writer.join()
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["peer", "--task", "cv", "--initial-peers", addresses[0],
                                         "--initial-peers", addresses[1]]


def test_entrypoint_gives_up_on_a_missing_file_with_geotrains_join_failure_code(tmp_path, fake_geotrain):
    result = entrypoint(fake_geotrain, "peer", GEOTRAIN_INITIAL_PEERS_FILE=str(tmp_path / "absent.txt"),
                        GEOTRAIN_INITIAL_PEERS_WAIT_S="1")
    assert result.returncode == 3
    assert "did not appear within 1 s" in result.stderr


def test_entrypoint_leaves_other_commands_alone(tmp_path, fake_geotrain):
    result = entrypoint(fake_geotrain, "coordinator", "--port", "31337",
                        GEOTRAIN_INITIAL_PEERS_FILE=str(tmp_path / "absent.txt"))
    assert json.loads(result.stdout) == ["coordinator", "--port", "31337"]


def fake_df(folder: Path, shm_kb: int) -> str:
    """PATH with a df that reports /dev/shm as ``shm_kb`` KB, the way `df -Pk` does."""
    folder.mkdir()
    df = folder / "df"
    df.write_text("#!/bin/sh\n"
                  "echo 'Filesystem     1024-blocks  Used Available Capacity Mounted on'\n"
                  f"echo 'shm {shm_kb} 0 {shm_kb} 0% /dev/shm'\n")
    df.chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


@pytest.mark.parametrize("shm_kb, warned", [(64 * 1024, True), (10 * 1024 * 1024, False)])
def test_entrypoint_warns_when_dev_shm_is_dockers_default(tmp_path, fake_geotrain, shm_kb, warned):
    for command in ("peer", "coordinator"):
        result = entrypoint(fake_geotrain, command, PATH=fake_df(tmp_path / command, shm_kb))
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [command]   # a warning, not a refusal
        assert ("/dev/shm holds only 64 MB" in result.stderr and "--shm-size" in result.stderr
                and "--ipc=host" in result.stderr) == warned
    assert "/dev/shm" not in entrypoint(fake_geotrain, "--help", PATH=fake_df(tmp_path / "help", 1024)).stderr


# ---- health check --------------------------------------------------------------------------------------------

def healthcheck(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), *arguments], capture_output=True,
                          text=True, timeout=30)


@pytest.fixture
def geotrain_process(tmp_path):
    """Start processes whose command line is geotrain's (``python .../bin/geotrain ARGS``) but that only sleep."""
    script = tmp_path / "bin" / "geotrain"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(120)\n")
    started = []

    def start(*arguments: str) -> int:
        process = subprocess.Popen([sys.executable, str(script), *arguments])
        started.append(process)
        return process.pid

    yield start
    for process in started:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_healthcheck_of_a_trainer_reads_its_real_metrics_endpoint(geotrain_process, tmp_path):
    from geotrain.config import MetricsConfig
    from geotrain.telemetry.metrics import PeerMetrics

    port = PeerMetrics("compose-demo", "trainer").serve(MetricsConfig(port=0, host="0.0.0.0"))
    trainer = geotrain_process("peer", "--metrics-port", str(port), "--metrics-host", "0.0.0.0")
    healthy = healthcheck("--pid", str(trainer))
    assert healthy.returncode == 0, healthy.stdout
    assert f"127.0.0.1:{port}/metrics answers" in healthy.stdout

    # the port from the YAML config when no flag gives it, as geotrain reads it
    config = tmp_path / "trainer.yaml"
    config.write_text(f"metrics:\n  port: {port}\n")
    assert healthcheck("--pid", str(geotrain_process("peer", f"--config={config}"))).returncode == 0

    silent = healthcheck("--pid", str(geotrain_process("peer", "--metrics-port", str(free_port()))))
    assert silent.returncode == 1 and "did not answer" in silent.stdout


def test_healthcheck_of_a_trainer_without_metrics_says_what_to_add(geotrain_process):
    result = healthcheck("--pid", str(geotrain_process("peer", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/Q")))
    assert result.returncode == 1 and "--metrics-port" in result.stdout


def test_healthcheck_of_the_coordinator_dials_its_dht_port(geotrain_process):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert healthcheck("--pid", str(geotrain_process("coordinator", "--port", str(port)))).returncode == 0
    closed = healthcheck("--pid", str(geotrain_process("coordinator", "--set", f"swarm.port={free_port()}")))
    assert closed.returncode == 1 and "does not accept connections" in closed.stdout


def load_healthcheck_module():
    spec = importlib.util.spec_from_file_location("geotrain_healthcheck", DOCKER / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in docker/
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return module


def test_healthcheck_defaults_are_geotrains():
    module = load_healthcheck_module()
    from geotrain.config import MetricsConfig
    from geotrain.config import COORDINATOR_PORT as DEFAULT_PORT

    assert module.DEFAULT_COORDINATOR_PORT == DEFAULT_PORT
    assert module.DEFAULT_METRICS_HOST == MetricsConfig().host
    assert module.resolve(["--config", "/nonexistent.yaml", "--set", "metrics.port=1", "--metrics-port", "2"]) == {
        "metrics.port": "2"}


# ---- compose stack ------------------------------------------------------------------------------------------

def test_compose_has_the_local_run(compose):
    assert set(compose["services"]) == {"coordinator", *TRAINERS, "prometheus", "grafana"}
    build = compose["services"]["coordinator"]["build"]
    assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert build["args"]["VARIANT"] in ("cpu", "cuda")


def test_compose_commands_are_valid_geotrain_commands(commands):
    from geotrain.config import COORDINATOR_PORT as DEFAULT_PORT

    assert commands["coordinator"].command == "coordinator"
    assert {name for name, command in commands.items() if command.command == "peer"} == set(TRAINERS)
    # one run, one DHT port: geotrain's default
    assert {command.config.swarm.run_id for command in commands.values()} == {"compose-demo"}
    assert {command.config.coordinator_port() if command.command == "coordinator" else command.config.swarm.port
            for command in commands.values()} == {DEFAULT_PORT}
    assert all(command.config.swarm.host == "0.0.0.0" for command in commands.values())


def test_compose_coordinator_builds_the_trainers_model(commands):
    # it keeps and checkpoints the swarm's state: a different model or optimizer could not hold it
    coordinator = commands["coordinator"].config
    for trainer in TRAINERS:
        assert commands[trainer].config.task == coordinator.task
        assert commands[trainer].config.optimizer == coordinator.optimizer
    assert coordinator.coordinator.hold_state


def test_every_peer_announces_its_own_fixed_address(compose, commands):
    subnet = ipaddress.ip_network(compose["networks"]["swarm"]["ipam"]["config"][0]["subnet"])
    addresses = {}
    for name, command in commands.items():
        fixed = compose["services"][name]["networks"]["swarm"]["ipv4_address"]
        assert command.config.swarm.announce_host == fixed, f"{name} announces an address that is not its own"
        assert ipaddress.ip_address(fixed) in subnet
        addresses[name] = fixed
    every_fixed = [service["networks"]["swarm"]["ipv4_address"] for service in compose["services"].values()]
    assert len(set(every_fixed)) == len(every_fixed)


def test_identities_live_on_volumes_and_trainers_find_the_coordinator(compose, commands):
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for source, _mode in mounts(service).values():
            if not source.startswith("."):
                assert source in declared, f"{name} mounts undeclared volume {source}"
    coordinator = compose["services"]["coordinator"]
    state_dir = str(commands["coordinator"].state_dir)
    assert state_dir == "/var/lib/geotrain" and state_dir in mounts(coordinator)
    peers_file = PurePosixPath(str(commands["coordinator"].initial_peers_file))
    shared_volume, mode = mounts(coordinator)[str(peers_file.parent)]
    assert mode == "rw"
    state_volumes = {mounts(coordinator)[state_dir][0]}
    for trainer in TRAINERS:
        service = compose["services"][trainer]
        identity = PurePosixPath(str(commands[trainer].config.swarm.identity_path))
        assert str(identity.parent) == "/var/lib/geotrain"          # the image's VOLUME
        state_volumes.add(mounts(service)[str(identity.parent)][0])
        assert service["environment"]["GEOTRAIN_INITIAL_PEERS_FILE"] == str(peers_file)
        assert mounts(service)[str(peers_file.parent)] == (shared_volume, "ro")
    assert len(state_volumes) == 1 + len(TRAINERS), "every peer needs a volume of its own for its identity"


def test_prometheus_scrapes_every_peers_metrics_port(compose, commands):
    service = compose["services"]["prometheus"]
    config_path = next(arg.split("=", 1)[1] for arg in service["command"] if arg.startswith("--config.file="))
    assert mounts(service)[config_path] == ("../monitoring/prometheus.yml", "ro")
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    static = {target for config in jobs["geotrain-compose"]["static_configs"] for target in config["targets"]}
    peers = ["coordinator", *TRAINERS]
    assert static == {f"{name}:{commands[name].config.metrics.port}" for name in peers}
    assert all(commands[name].config.metrics.host == "0.0.0.0" for name in peers)
    # file-based discovery: targets/*.json relative to the config file, mounted where Prometheus resolves it
    file_sd = [pattern for config in jobs["geotrain"]["file_sd_configs"] for pattern in config["files"]]
    assert file_sd == ["targets/*.json"]
    targets_dir = str(PurePosixPath(config_path).parent / "targets")
    assert mounts(service)[targets_dir] == ("../monitoring/targets", "ro")
    # rule_files and the console flags resolve to the mounted monitoring/ folders
    for pattern in prometheus["rule_files"]:
        folder = str(PurePosixPath(config_path).parent / PurePosixPath(pattern).parent)
        assert mounts(service)[folder] == (f"../monitoring/{PurePosixPath(pattern).parent}", "ro")
    flags = dict(arg.split("=", 1) for arg in service["command"] if "=" in arg)
    assert mounts(service)[flags["--web.console.templates"]] == ("../monitoring/consoles", "ro")
    assert mounts(service)[flags["--web.console.libraries"]] == ("../monitoring/console_libraries", "ro")


def test_grafana_is_provisioned_with_the_datasource_and_dashboard(compose):
    grafana = compose["services"]["grafana"]
    grafana_mounts = mounts(grafana)
    provisioning = grafana_mounts["/etc/grafana/provisioning"][0]
    assert (COMPOSE_FILE.parent / provisioning).resolve() == MONITORING / "grafana/provisioning"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/geotrain.yaml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert (COMPOSE_FILE.parent / grafana_mounts[dashboards_path][0]).resolve() == MONITORING / "grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(dashboards_path)
    assert (MONITORING / "grafana/dashboards" / PurePosixPath(home).name).is_file()

    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    assert compose["services"]["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    dashboard = json.loads((MONITORING / "grafana/dashboards/geotrain.json").read_text())
    used = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    used |= {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert used == {source["uid"]}


def exposed_metrics() -> tuple[set[str], set[str]]:
    """Names and label names geotrain's trainers and coordinator really export (every optional series set)."""
    from prometheus_client import generate_latest

    from geotrain.telemetry.metrics import PeerMetrics, SwarmMetrics

    peer = PeerMetrics("run", "trainer")
    peer.labelled(peer.sent_bytes, destination_region="region").inc()
    swarm = SwarmMetrics("run")
    for gauge in (swarm.eta_seconds, swarm.cost_per_million_samples, swarm.egress_budget,
                  swarm.checkpoint_last_success):
        swarm.set_optional(gauge, 1.0)
    swarm.labelled(swarm.peers, peer_region="region", peer_cloud="cloud").set(1)
    swarm.labelled(swarm.egress_bytes_per_second, peer_region="region", destination_region="region").set(1)
    text = generate_latest(peer.registry).decode() + generate_latest(swarm.registry).decode()
    names, labels = set(), set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            names.add(name)
            labels |= set(re.findall(r'(\w+)="', rest))
    return names, labels


def test_dashboard_queries_only_metrics_and_labels_geotrain_exports():
    names, labels = exposed_metrics()
    dashboard = json.loads((MONITORING / "grafana/dashboards/geotrain.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions.append(dashboard["templating"]["list"][0]["query"]["query"])
    for expression in expressions:
        for metric in re.findall(r"\bgeotrain_\w+", expression):
            assert metric in names, f"{metric} in {expression!r} is not a metric geotrain exports"
        for label in re.findall(r"\b(\w+)=~", expression) + re.findall(r"by \(([\w, ]+)\)", expression):
            for name in label.split(","):
                assert name.strip() in labels, f"label {name.strip()} in {expression!r} is not geotrain's"
        assert expression.count("(") == expression.count(")")
    legends = " ".join(target["legendFormat"] for panel in dashboard["panels"] for target in panel["targets"])
    assert set(re.findall(r"\{\{(\w+)\}\}", legends)) <= labels | {"instance"}


def test_dashboard_shows_what_an_operator_watches():
    dashboard = json.loads((MONITORING / "grafana/dashboards/geotrain.json").read_text())
    expressions = {target["expr"] for panel in dashboard["panels"] for target in panel["targets"]}
    required = [
        r"^sum\(geotrain_samples_per_second\{",                          # swarm throughput
        r"geotrain_peers\{", r"geotrain_global_epoch\{", r"geotrain_local_epoch\{", r"geotrain_loss\{",
        r"geotrain_granularity\{",
        r"rate\(geotrain_compute_seconds_total\{", r"rate\(geotrain_communication_seconds_total\{",
    ]
    for pattern in required:
        assert any(re.search(pattern, expression) for expression in expressions), f"no panel queries {pattern}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "geotrain"


# ---- GPUs and shared memory ---------------------------------------------------------------------------------

def size_in_bytes(text: str | int) -> int:
    """A Docker/compose size (10gb, 10g, 512m, bytes), in bytes; Docker's units are binary."""
    if isinstance(text, int):
        return text
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", str(text).strip().lower()).groups()
    return int(float(number) * 1024 ** "bkmg".index(unit or "b"))


def shared_memory_needed() -> int:
    """/dev/shm a trainer of the study's largest model needs: hivemind's averaged gradients and offloaded fp32
    parameters, Adam's two moments (shared when hivemind averages them), and 1 GB of DataLoader batches."""
    from geotrain.tasks.presets import EMJ24_PARAMETER_COUNTS

    largest = max(count for counts in EMJ24_PARAMETER_COUNTS.values() for count in counts.values())
    assert largest == 560_100_000  # xlm-roberta-large; the sizing in compose.yaml's comment names it
    fp32 = 4 * largest
    return 2 * fp32 + 2 * fp32 + 10 ** 9


def documented_docker_runs(text: str) -> list[list[str]]:
    """The `docker run ...` examples in a text (comment markers and line continuations removed), as words."""
    lines = [re.sub(r"^#\s?", "", line).strip() for line in text.splitlines()]
    runs, current = [], None
    for line in lines:
        if current is None and line.startswith("docker run "):
            current = ""
        if current is not None:
            current += " " + line.rstrip("\\").strip()
            if not line.endswith("\\"):
                runs.append(shlex.split(current))
                current = None
    return runs


def test_compose_gives_hivemind_enough_shared_memory_for_the_largest_model(compose, commands):
    for name in commands:
        service = compose["services"][name]
        if service.get("ipc") != "host":
            assert size_in_bytes(service["shm_size"]) >= shared_memory_needed(), f"{name}: shm_size too small"
    assert size_in_bytes("10gb") == 10 * GIB and size_in_bytes("64m") == 64 * 1024 ** 2


def test_gpu_trainers_run_one_container_per_gpu_with_enough_shared_memory():
    """The Dockerfile's and docs/deployment.md's `docker run` of a GPU trainer: the CUDA image, one GPU per
    container (which --device auto then picks), /dev/shm as large as compose's, and a valid geotrain command."""
    compose_shm = size_in_bytes(yaml.safe_load(COMPOSE_FILE.read_text())["x-geotrain"]["shm_size"])
    sources = {"docker/Dockerfile": (DOCKER / "Dockerfile").read_text(),
               "docs/deployment.md": (REPO / "docs/deployment.md").read_text()}
    for source, text in sources.items():
        gpu_runs = [run for run in documented_docker_runs(text) if any(word.startswith("--gpus") for word in run)]
        assert gpu_runs, f"{source} shows no docker run of a GPU trainer"
        assert "--ipc=host" in text, f"{source} does not mention --ipc=host"
        for run in gpu_runs:
            image = next(word for word in run if word.startswith("geotrain:"))
            options, arguments = run[2:run.index(image)], run[run.index(image) + 1:]
            assert image == "geotrain:cuda"
            assert options[options.index("--gpus") + 1] == "device=0", f"{source}: one GPU per container"
            assert size_in_bytes(options[options.index("--shm-size") + 1]) == compose_shm
            arguments = [COORDINATOR if word.startswith("/ip4/") else "198.51.100.4" if word == "PUBLIC_IP" else word
                         for word in arguments]
            if "--config" in arguments:  # a file mounted into the container; not here
                del arguments[arguments.index("--config"):arguments.index("--config") + 2]
            trainer = GeotrainCommandLine(arguments)
            assert trainer.command == "peer" and trainer.config.training.device == "auto"
            # the container's port is the host's (-p P:P), so the announced address is dialable
            port = str(trainer.config.swarm.port)
            assert f"{port}:{port}" in options
    assert "ARG VARIANT=cpu" in sources["docker/Dockerfile"]


def test_compose_trainers_take_whichever_device_the_image_has(commands):
    # the CPU image trains on the CPU; the same command on the CUDA image with a GPU reserved uses the GPU
    for trainer in TRAINERS:
        assert commands[trainer].value("--device") == "auto"
        assert commands[trainer].config.training.device == "auto"
