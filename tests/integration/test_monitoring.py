"""Live monitoring: `geotrain local --prometheus` trains a real swarm while a real Prometheus scrapes every peer.

One swarm serves every check here (module fixture): Prometheus scrapes the trainers and the coordinator;
every PromQL expression of the Grafana dashboard, the console page and the alert rules evaluates on the
live server, and the dashboard's and the page's all return data; the coordinator's swarm samples/s is the
sum of the trainers' own; the console page, loaded in headless Chromium from Prometheus, draws its
throughput graph; stopping the swarm stops Prometheus and every peer.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.stopping.stopper import die_with_parent
from geotrain.telemetry.prometheus_server import (MONITORING_DIR, PrometheusError, api_get, console_expressions,
                                        dashboard_expressions, query, rule_expressions)
from swarm_helpers import FAST_SWARM, IDLE_SWARM, geotrain, processes_mentioning, wait_for

needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (apt-get install prometheus)")

DASHBOARD = MONITORING_DIR / "grafana" / "dashboards" / "geotrain.json"
CONSOLE = MONITORING_DIR / "consoles" / "geotrain.html"
RULES = MONITORING_DIR / "rules" / "geotrain.yml"
PEERS = 2
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]


class LiveSwarm:
    def __init__(self, directory: Path):
        self.directory = directory
        self.output_path = directory / "local.out"
        self.run_dir = directory / "run"
        # Epochs enough to outlast the checks; the last test stops the swarm (Ctrl-C, as a user would).
        # Scrapes every second; checkpoints every 2 epochs and a budget, so the checkpoint and budget
        # metrics exist; peers publish their records every second, so the swarm view follows quickly.
        command = [sys.executable, "-m", "geotrain", "local", "--prometheus", "--prometheus-port", "0",
                   "--prometheus-scrape-interval", "1", "--peers", str(PEERS), *IDLE_SWARM, "--epochs", "500",
                   "--run-dir", str(self.run_dir),
                   "--set", "coordinator.checkpoint_every_epochs=2", "--set", "metrics.publish_interval_s=1",
                   "--set", "cost.instance_usd_per_hour.local=0.5", "--set", "cost.egress_budget_usd_per_hour=5"]
        with open(self.output_path, "w") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=die_with_parent)
        self.url = None

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for_console_url(self) -> str:
        def printed():
            assert self.process.poll() is None, f"geotrain local exited early:\n{self.output()}"
            return re.search(r"swarm console: (http://\S+)", self.output())
        console = wait_for(printed, 90, "geotrain local to print the console page's URL").group(1)
        self.url = console.split("/consoles/")[0]
        return console

    def query(self, expression: str, at: float | None = None) -> list[dict]:
        return query(self.url, expression, at=at)

    def value(self, expression: str, at: float | None = None) -> float | None:
        result = self.query(expression, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill_leftovers(self) -> list[int]:
        leftovers = processes_mentioning(str(self.directory))
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leftovers


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    live = LiveSwarm(tmp_path_factory.mktemp("monitoring"))
    try:
        live.wait_for_console_url()
        # a few epochs of the swarm, seen by Prometheus through the coordinator, and one checkpoint
        wait_for(lambda: (live.value("max(geotrain_swarm_global_epoch)") or 0) >= 4
                 and live.query("geotrain_checkpoint_last_success_timestamp_seconds"),
                 150, "4 epochs and a checkpoint in Prometheus", interval_s=1)
        yield live
    finally:
        live.stop()
        assert not live.kill_leftovers(), "a process of the local swarm outlived it"


@needs_prometheus
def test_prometheus_scrapes_every_trainer_and_the_coordinator(swarm):
    targets = api_get(swarm.url, "/api/v1/targets", {"state": "active"})["activeTargets"]
    by_process = {target["labels"]["process"]: target["health"] for target in targets}
    assert by_process == {**{f"peer-{i}": "up" for i in range(PEERS)}, "coordinator": "up"}
    roles = {sample["metric"]["role"] for sample in swarm.query("geotrain_local_epoch or geotrain_swarm_global_epoch")}
    assert roles == {"trainer", "coordinator"}


@needs_prometheus
def test_every_dashboard_and_console_expression_returns_data(swarm):
    expressions = [f"dashboard panel {title!r}: {expression}" for title, expression in dashboard_expressions(DASHBOARD)]
    expressions += [f"console page: {expression}" for expression in console_expressions(CONSOLE)]
    assert len(expressions) > 30

    def empty_ones() -> list[str]:
        empty = []
        for entry in expressions:
            expression = entry.split(": ", 1)[1]
            try:
                if not swarm.query(expression):
                    empty.append(entry)
            except PrometheusError as error:
                pytest.fail(f"{entry} does not evaluate: {error}")
        return empty

    # rates need two scrapes in their window and the swarm view a publish round: a few seconds at most
    deadline = time.monotonic() + 30
    while (empty := empty_ones()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not empty, "no data for:\n" + "\n".join(empty)


@needs_prometheus
def test_every_alert_rule_evaluates_on_the_live_server(swarm):
    for name, expression in rule_expressions(RULES):
        try:
            swarm.query(expression)
        except PrometheusError as error:
            pytest.fail(f"alert {name} does not evaluate: {error}")
    # and Prometheus itself loaded the shipped rules and evaluates them without error
    groups = api_get(swarm.url, "/api/v1/rules", {"type": "alert"})["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(loaded) == {name for name, _ in rule_expressions(RULES)}
    wait_for(lambda: all(rule.get("lastEvaluation", "").startswith("2") for rule in
                         (r for g in api_get(swarm.url, "/api/v1/rules")["groups"] for r in g["rules"])),
             10, "every rule to be evaluated once")
    for group in api_get(swarm.url, "/api/v1/rules", {"type": "alert"})["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"


@needs_prometheus
def test_swarm_samples_per_second_is_the_sum_of_the_trainers(swarm):
    # The coordinator sums the samples/s each trainer publishes in its DHT record; each trainer's gauge is the
    # same number. Both change at every epoch end (every 2-3 s here) and the coordinator sees a new value up
    # to ~3 s later (record every 1 s, coordinator poll every 2 s), so at a random instant they may differ by
    # a whole epoch's fluctuation (tens of percent). Between an epoch's record reaching the coordinator and
    # the next epoch end they agree; 5% allows the trainers' epoch ends to be a scrape apart. Both sides are
    # read at one evaluation time, so they come from the same scrapes.
    seen = []
    for _attempt in range(40):
        at = time.time() - 1
        swarm_value = swarm.value("sum(geotrain_swarm_samples_per_second)", at)
        trainers = swarm.value('sum(geotrain_samples_per_second{role="trainer"})', at)
        count = swarm.value('count(geotrain_samples_per_second{role="trainer"})', at)
        seen.append((swarm_value, trainers))
        if count == PEERS and trainers and swarm_value is not None and abs(swarm_value - trainers) <= 0.05 * trainers:
            return
        time.sleep(0.7)
    pytest.fail(f"the swarm's samples/s never matched the sum of the trainers' within 5%: (swarm, trainers) = {seen}")


@needs_prometheus
def test_console_page_draws_the_throughput_graph_in_a_browser(swarm, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium not installed (apt-get install chromium): cannot render the console page")
    from PIL import Image

    screenshot = tmp_path / "console.png"
    result = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                             f"--screenshot={screenshot}", "--window-size=1200,900", "--virtual-time-budget=8000",
                             f"{swarm.url}/consoles/geotrain.html?range=10m"],
                            capture_output=True, text=True, timeout=120)
    assert screenshot.exists(), f"chromium wrote no screenshot:\n{result.stderr[-2000:]}"
    image = Image.open(screenshot).convert("RGB")
    # The throughput graph is the first graph, top left, below the row of values (see consoles/geotrain.html).
    graph = image.crop((0, 100, 590, 345))
    # its lines are saturated colours; text, grid and axes are grey, the background white
    pixels = graph.tobytes()
    coloured = sum(1 for i in range(0, len(pixels), 3) if max(pixels[i:i + 3]) - min(pixels[i:i + 3]) > 80)
    graph.save(tmp_path / "throughput-graph.png")
    assert coloured > 300, (f"the throughput graph has {coloured} coloured pixels: not drawn "
                            f"(see {tmp_path / 'throughput-graph.png'})")
    # the server-side values are there too: the page is not an error page
    page = subprocess.run(["curl", "-sf", f"{swarm.url}/consoles/geotrain.html"], capture_output=True, text=True)
    assert "Samples/s" in page.stdout and "error executing template" not in page.stdout


@needs_prometheus
def test_stopping_the_swarm_stops_prometheus(swarm):
    assert swarm.stop() == 0  # Ctrl-C: stopped on request
    assert "stopping the local swarm" in swarm.output()
    assert not processes_mentioning(str(swarm.directory)), "Prometheus or a peer outlived `geotrain local`"
    with pytest.raises(OSError):
        query(swarm.url, "up", timeout_s=2)
    assert (swarm.run_dir / "prometheus" / "data").is_dir()


def test_local_without_prometheus_installed_says_how_to_install_it(tmp_path):
    environment = {**os.environ, "PATH": str(tmp_path)}  # an empty PATH: no prometheus on it
    result = subprocess.run([sys.executable, "-m", "geotrain", "local", "--prometheus",
                             "--run-dir", str(tmp_path / "run"), *FAST_SWARM],
                            capture_output=True, text=True, timeout=120, env=environment, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "apt-get install prometheus" in result.stderr
    assert not (tmp_path / "run").exists(), "nothing should start without Prometheus"


def test_prometheus_flags_need_prometheus(tmp_path):
    result = geotrain("local", "--prometheus-port", "9999", "--run-dir", str(tmp_path / "run"), timeout_s=120)
    assert result.returncode == 2
    assert "--prometheus-port: only with --prometheus" in result.stderr


@needs_prometheus
def test_a_taken_prometheus_port_is_reported_before_the_swarm_starts(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = geotrain("local", "--prometheus", "--prometheus-port", str(port), "--run-dir", str(tmp_path / "run"),
                          *FAST_SWARM, timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"Prometheus port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--prometheus-port" in result.stderr
    assert not (tmp_path / "run" / "coordinator.log").exists(), "the swarm started although Prometheus could not"
    assert not processes_mentioning(str(tmp_path))
