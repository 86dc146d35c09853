"""A real Prometheus server for a swarm on this machine: config, start, readiness, queries, stop.

``geotrain local --prometheus`` uses it; so do the monitoring tests. The server is Prometheus itself
(Debian: ``apt-get install prometheus``), started as a child process on loopback with its own config
and data directory, loading geotrain's alert rules (``monitoring/rules``) and console page
(``monitoring/consoles``) from this checkout::

    server = PrometheusServer(run_dir / "prometheus", port=0)     # 0: any free port
    server.write_targets({"peer-0": 9101, "coordinator": 9100})
    server.write_config(scrape_interval_s=5)
    server.start()                                                 # returns once /-/ready answers
    print(server.console_url)                                      # .../consoles/geotrain.html
    server.query("sum(geotrain_swarm_samples_per_second)")         # the result list of /api/v1/query
    server.stop()

The targets file is file-based service discovery: Prometheus rereads it when it changes, so targets
can be rewritten while the server runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from geotrain.errors import UserError
from geotrain.stopping.stopper import die_with_parent
from geotrain.ports import free_ports

MONITORING_DIR = Path(__file__).resolve().parents[2] / "monitoring"
RULES_GLOB = "rules/*.yml"
CONSOLE_PAGE = "geotrain.html"
DEFAULT_PORT = 9090
DEFAULT_SCRAPE_INTERVAL_S = 5.0
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
INSTALL_HINT = "install it with `apt-get install prometheus` (Debian/Ubuntu) or put its binary on PATH"


class PrometheusError(RuntimeError):
    pass


class PrometheusNotInstalled(PrometheusError, UserError):
    """The user must install Prometheus (the message says how)."""


def find_prometheus() -> str:
    """Path of the ``prometheus`` binary, or :class:`PrometheusNotInstalled` saying how to get it."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusNotInstalled(f"the `prometheus` binary was not found on PATH; {INSTALL_HINT}")
    return binary


def monitoring_dir() -> Path:
    """geotrain's monitoring/ folder (rules, console page); it ships with the source checkout."""
    if not (MONITORING_DIR / "consoles" / CONSOLE_PAGE).is_file():
        raise PrometheusError(f"geotrain's monitoring files (alert rules, console page) are not at {MONITORING_DIR}; "
                              "run from a geotrain checkout (pip install -e .)")
    return MONITORING_DIR


class PrometheusServer:
    """One Prometheus process with its config, targets, data and log under ``directory``."""

    def __init__(self, directory: Path, port: int = DEFAULT_PORT, host: str = "127.0.0.1"):
        self.directory = Path(directory)
        self.host = host
        self.port = port if port else free_ports(1, host)[0]
        self.config_path = self.directory / "prometheus.yml"
        self.targets_path = self.directory / "targets.json"
        self.data_dir = self.directory / "data"
        self.log_path = self.directory / "prometheus.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def console_url(self) -> str:
        return f"{self.url}/consoles/{CONSOLE_PAGE}"

    # --- files -----------------------------------------------------------------------------
    def write_targets(self, targets: dict[str, int], host: str = "127.0.0.1") -> Path:
        """File-based discovery: one target per process name -> metrics port, labelled ``process``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        groups = [{"targets": [f"{host}:{port}"], "labels": {"process": name}} for name, port in targets.items()]
        temporary = self.targets_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(groups, indent=2) + "\n")
        os.replace(temporary, self.targets_path)  # Prometheus never reads a half-written file
        return self.targets_path

    def write_config(self, scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S) -> Path:
        """A config that scrapes the targets file and loads geotrain's alert rules."""
        self.directory.mkdir(parents=True, exist_ok=True)
        interval = _duration(scrape_interval_s)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(monitoring_dir() / RULES_GLOB)],
            "scrape_configs": [{
                "job_name": "geotrain",
                "scrape_timeout": interval,
                "file_sd_configs": [{"files": [str(self.targets_path)], "refresh_interval": interval}],
            }],
        }
        self.config_path.write_text("# written by geotrain (geotrain/telemetry/prometheus_server.py)\n" +
                                    yaml.safe_dump(config, sort_keys=False))
        return self.config_path

    # --- process ---------------------------------------------------------------------------
    def command(self) -> list[str]:
        monitoring = monitoring_dir()
        return [find_prometheus(), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address={self.host}:{self.port}",
                f"--web.console.templates={monitoring / 'consoles'}",
                f"--web.console.libraries={monitoring / 'console_libraries'}"]

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "PrometheusServer":
        command = self.command()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)
        try:
            self.wait_until_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_until_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise PrometheusError(self._exit_message())
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise PrometheusError(f"Prometheus did not become ready at {self.url} within {timeout_s:.0f} s; "
                              f"see {self.log_path}:\n{self.log_tail()}")

    def _exit_message(self) -> str:
        log = self.log_tail()
        if "address already in use" in log:
            return (f"Prometheus could not listen on {self.host}:{self.port}: the port is in use; choose another "
                    "with --prometheus-port (0 for any free port)")
        return f"Prometheus exited with code {self.process.returncode}; last lines of {self.log_path}:\n{log}"

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (Prometheus flushes its data), SIGKILL after ``grace_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    # --- queries ---------------------------------------------------------------------------
    def query(self, expression: str, timeout_s: float = 10.0) -> list[dict]:
        return query(self.url, expression, timeout_s=timeout_s)


def api_get(url: str, path: str, parameters: dict | None = None, timeout_s: float = 10.0):
    """The ``data`` of a Prometheus HTTP API answer; an error answer raises PrometheusError."""
    address = f"{url}{path}" + ("?" + urllib.parse.urlencode(parameters) if parameters else "")
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        try:
            body = json.loads(error.read() or b"{}")
        except ValueError:
            body = {"errorType": error.code, "error": error.reason}
    if body.get("status") != "success":
        raise PrometheusError(f"{path} {parameters or ''}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query(url: str, expression: str, at: float | None = None, timeout_s: float = 10.0) -> list[dict]:
    """Evaluate PromQL on the server at ``url`` (now, or at unix time ``at``): the result list.

    Bad PromQL raises PrometheusError with Prometheus' own message."""
    parameters = {"query": expression} if at is None else {"query": expression, "time": f"{at:.3f}"}
    return api_get(url, "/api/v1/query", parameters, timeout_s)["result"]


def _duration(seconds: float) -> str:
    """Prometheus duration syntax: 5s, 1500ms."""
    return f"{seconds:g}s" if float(seconds).is_integer() else f"{round(seconds * 1000)}ms"


# --- the PromQL in geotrain's monitoring files (for tests and tools) ---------------------------
# Grafana's variables, replaced by values any Prometheus accepts: every run, rates over a minute.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$run_id": ".*"}


def dashboard_expressions(path: Path, variables: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in a Grafana dashboard, its variables substituted."""
    variables = variables or GRAFANA_VARIABLES
    dashboard = json.loads(Path(path).read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expression = target["expr"]
            for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $__range
                expression = expression.replace(name, variables[name])
            found.append((panel["title"], expression))
    return found


def console_expressions(path: Path) -> list[str]:
    """Every PromQL expression of a console page: by its convention, the Go raw strings (`...`)."""
    text = re.sub(r"\{\{/\*.*?\*/\}\}", "", Path(path).read_text(), flags=re.DOTALL)  # template comments
    return re.findall(r"`([^`]*)`", text)


def rule_expressions(path: Path) -> list[tuple[str, str]]:
    """(alert or record name, PromQL) of every rule in a rules file."""
    rules = yaml.safe_load(Path(path).read_text())
    return [(rule.get("alert") or rule.get("record"), rule["expr"])
            for group in rules["groups"] for rule in group["rules"]]
