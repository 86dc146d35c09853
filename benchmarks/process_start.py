"""How long geotrain processes take to come up: forked by the fork server against a fresh Python each.

Each round starts N coordinators (``geotrain coordinator --no-state --port 0``: torch and hivemind imported, a DHT
and its p2pd up, the join address written) at once on this machine, both ways, alternating which goes first:
as ``python -m geotrain`` (what `geotrain local` did before the fork server) and forked by one
``geotrain.fork_server`` (what `geotrain local` and the integration tests do now; the server's own start is
counted in the forked side's wall time). It reports the wall time until every address is written, and the CPU
seconds each coordinator process used until then (its own, not its p2pd's).

    python benchmarks/process_start.py --output benchmarks/results/process_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from geotrain.fork_server import ForkServer

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
UP_TIMEOUT_S = 120.0


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` itself (``/proc/PID/stat`` fields 14 and 15)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def coordinator_arguments(directory: Path, index: int) -> list[str]:
    return ["coordinator", "--no-state", "--port", "0", "--state-dir", str(directory / f"state-{index}"),
            "--initial-peers-file", str(directory / f"peers-{index}.txt")]


def one_side(forked: bool, processes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="process-start-") as name:
        directory = Path(name)
        started = time.monotonic()
        server = ForkServer.start(label=str(directory)) if forked else None
        children = []
        for index in range(processes):
            log_path = directory / f"coordinator-{index}.log"
            if server is not None:
                children.append(server.spawn(coordinator_arguments(directory, index), log_path))
            else:
                with open(log_path, "w") as log:
                    children.append(subprocess.Popen([sys.executable, "-m", "geotrain",
                                                      *coordinator_arguments(directory, index)],
                                                     stdout=log, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = started + UP_TIMEOUT_S
        while not all((directory / f"peers-{i}.txt").exists() for i in range(processes)):
            if time.monotonic() > deadline or any(child.poll() is not None for child in children):
                raise SystemExit(f"a coordinator did not come up; see {directory}")
            time.sleep(0.02)
        wall_s = time.monotonic() - started
        cpu = [cpu_seconds(child.pid) for child in children]
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(timeout=60)
        if server is not None:
            server.close()
    return {"wall_s": round(wall_s, 3), "cpu_s_per_process": [round(c, 3) for c in cpu]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4, help="coordinators started at once (default 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each side once per round (default 4)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        result = {("forked" if forked else "fresh"): one_side(forked, args.processes) for forked in order}
        rounds.append(result)
        print(f"round {index + 1}: fresh {result['fresh']['wall_s']:.2f} s, forked {result['forked']['wall_s']:.2f} s",
              flush=True)
    summary = {side: {"median_wall_s": statistics.median(r[side]["wall_s"] for r in rounds),
                      "median_cpu_s_per_process": statistics.median(c for r in rounds for c in r[side]["cpu_s_per_process"])}
               for side in ("fresh", "forked")}
    summary["wall_ratio_forked_to_fresh"] = round(summary["forked"]["median_wall_s"] / summary["fresh"]["median_wall_s"], 3)
    report = {"benchmark": "process_start", "processes": args.processes, "rounds": rounds, "summary": summary,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
