#!/usr/bin/env python3
"""Health check of a geotrain container (the image's HEALTHCHECK): is its peer doing its job?

- A trainer (``geotrain peer``) is healthy when its metrics endpoint answers with geotrain's metrics,
  so it needs ``--metrics-port`` (a trainer without one is reported unhealthy, saying so).
- The coordinator is healthy when its DHT port accepts TCP connections and, when it serves metrics
  (``--metrics-port``), its metrics endpoint answers with geotrain's swarm metrics (``geotrain_swarm_*``).

The ports come from the command line of the geotrain process in the container, read the way geotrain
reads them (``--config`` file, then ``--set``, then flags), so the check follows whatever the container
was started with and needs no settings of its own. Standard library (and PyYAML, a geotrain dependency,
for ``--config``) only: it runs every 30 s and must not import torch.

    geotrain-healthcheck             # the oldest geotrain process in this container
    geotrain-healthcheck --pid 42    # that one

Exit 0 healthy, 1 unhealthy, as Docker expects; the reason goes to stdout (``docker inspect`` shows it).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.request
from pathlib import Path

# geotrain's defaults (geotrain/config.py COORDINATOR_PORT, the default of coordinator.port, and
# MetricsConfig.host); tests/deploy checks that they agree.
DEFAULT_COORDINATOR_PORT = 31337
DEFAULT_METRICS_HOST = "127.0.0.1"
TIMEOUT_S = 5.0
# Exported from the first second (a trainer's counter, the coordinator's swarm gauge), so their absence
# means "not geotrain's endpoint".
PROOF_METRIC = "geotrain_samples_total"
COORDINATOR_PROOF_METRIC = "geotrain_swarm_global_epoch"


def geotrain_arguments(pid: int) -> list[str] | None:
    """The arguments after ``geotrain`` in process ``pid``'s command line, or None if it is not geotrain."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return None
    words = [word.decode(errors="replace") for word in argv]
    for index, word in enumerate(words):
        # the console script (.../bin/geotrain, run directly or by its python), or python -m geotrain
        if os.path.basename(word) == "geotrain" and (index == 0 or index == 1):
            return words[index + 1:]
        if word == "-m" and index + 1 < len(words) and words[index + 1] == "geotrain":
            return words[index + 2:]
    return None


def find_geotrain() -> tuple[int, list[str]] | None:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            arguments = geotrain_arguments(int(entry.name))
            if arguments:
                found.append((int(entry.name), arguments))
    # hivemind's forked helpers carry the same command line; the oldest process is the peer itself
    return min(found) if found else None


def flag_values(arguments: list[str], flag: str) -> list[str]:
    """Every value given to ``flag``, as ``--flag VALUE`` or ``--flag=VALUE``, in order."""
    values = []
    for index, word in enumerate(arguments):
        if word == flag and index + 1 < len(arguments):
            values.append(arguments[index + 1])
        elif word.startswith(flag + "="):
            values.append(word[len(flag) + 1:])
    return values


def resolve(arguments: list[str]) -> dict[str, str]:
    """swarm.port, coordinator.port, metrics.port and metrics.host as geotrain resolves them: config, --set, flags."""
    settings: dict[str, str] = {}
    for config_path in flag_values(arguments, "--config")[-1:]:
        import yaml

        try:
            document = yaml.safe_load(Path(config_path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            document = {}  # geotrain itself reports a bad config; here it only means "no ports from it"
        for key in ("swarm.port", "coordinator.port", "metrics.port", "metrics.host"):
            section, name = key.split(".")
            value = (document.get(section) or {}).get(name) if isinstance(document, dict) else None
            if value is not None:
                settings[key] = str(value)
    for assignment in flag_values(arguments, "--set"):
        key, _, value = assignment.partition("=")
        settings[key.strip()] = value.strip()
    for flag, key in (("--port", "swarm.port"), ("--metrics-port", "metrics.port"), ("--metrics-host", "metrics.host")):
        values = flag_values(arguments, flag)
        if values:
            settings[key] = values[-1]
    return settings


def dialable(host: str) -> str:
    # a wildcard listen address is reached through loopback from inside the container
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def serves_metrics(settings: dict[str, str]) -> bool:
    return settings.get("metrics.port") not in (None, "", "null", "None", "0")


def check_metrics(settings: dict[str, str], proof_metric: str) -> tuple[bool, str]:
    """Does the peer's metrics endpoint answer, with ``proof_metric`` among its series?"""
    port = settings["metrics.port"]
    host = dialable(settings.get("metrics.host", DEFAULT_METRICS_HOST))
    url = f"http://{host}:{port}/metrics" if ":" not in host else f"http://[{host}]:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            body = response.read().decode(errors="replace")
    except OSError as error:
        return False, f"metrics endpoint {url} did not answer: {error}"
    if proof_metric not in body:
        return False, f"{url} answered, but without {proof_metric}; is it geotrain's endpoint?"
    return True, f"metrics endpoint {url} answers"


def check_trainer(settings: dict[str, str]) -> tuple[bool, str]:
    if not serves_metrics(settings):
        return False, ("the trainer runs without a metrics endpoint; start it with --metrics-port 9100 "
                       "so that it can be checked")
    return check_metrics(settings, PROOF_METRIC)


def check_coordinator(settings: dict[str, str]) -> tuple[bool, str]:
    # swarm.port when given, else coordinator.port (geotrain/config.py GeotrainConfig.coordinator_port)
    port = int(settings.get("swarm.port") or settings.get("coordinator.port") or DEFAULT_COORDINATOR_PORT)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S):
            pass
    except OSError as error:
        return False, f"DHT port {port} does not accept connections: {error}"
    if not serves_metrics(settings):
        return True, f"DHT port {port} accepts connections"
    healthy, reason = check_metrics(settings, COORDINATOR_PROOF_METRIC)
    return healthy, f"DHT port {port} accepts connections; {reason}"


def check(arguments: list[str]) -> tuple[bool, str]:
    command = arguments[0] if arguments else ""
    settings = resolve(arguments[1:])
    if command == "peer":
        return check_trainer(settings)
    if command == "coordinator":
        return check_coordinator(settings)
    return True, f"nothing to check for `geotrain {command}`"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, help="the geotrain process to check (default: the oldest one)")
    options = parser.parse_args()
    if options.pid is not None:
        arguments = geotrain_arguments(options.pid)
        found = (options.pid, arguments) if arguments else None
    else:
        found = find_geotrain()
    if found is None:
        print("no geotrain process is running in this container")
        return 1
    healthy, reason = check(found[1])
    print(reason)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
