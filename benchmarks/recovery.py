"""How a swarm copes with churn: a peer that vanishes, a newcomer that catches up, a peer that leaves cleanly.

Three measurements, each with real trainers (``python -m geotrain peer``) as OS processes on loopback,
all joined through one bootstrap-only coordinator (``geotrain coordinator --no-state``):

1. Kill recovery. A swarm of ``--peers`` trainers (CV tiny preset) trains until it is steady; then one
   trainer's whole process group gets SIGKILL (the VM vanishes: no goodbye, its DHT records stay behind).
   Measured on the swarm's epoch boundaries (for each epoch, the first peer's epoch event; after the kill,
   the first survivor's): the time from the kill until the survivors complete their next epoch, the
   duration of the epoch the kill fell into ("disrupted epoch"), and the median epoch of the same swarm
   before the kill. The kill lands at a different point of the epoch in each round (phases spread evenly
   over the epoch: 1/6, 1/2, 5/6 for three rounds), since a VM can vanish at any moment.
2. Graceful exit stall. The same swarm, but the trainer gets SIGTERM: the path a preemption notice takes
   (finish the micro-step, goodbye record, shut hivemind down, exit). Reported as for the kill, and
   compared with one matchmaking period of the loopback profile. Kill and graceful rounds alternate,
   side by side, with the same phases; every round starts a fresh swarm.
3. Newcomer sync. For each CV preset a donor trainer steps alone (target batch = micro-batch, so every
   step is an epoch); then newcomers join one after the other and download its state (parameters and
   AdamW's two moments, fp32, uncompressed). The newcomer's ``state_loaded`` event gives the seconds;
   the rate is compared with single-stream loopback TCP bandwidth measured in the same run. Newcomers
   run in client mode so that none of them becomes a donor for the next; a download hivemind gave up on
   (``state_loaded`` at epoch 0) is reported as failed, not as a rate.

    python benchmarks/recovery.py --output benchmarks/results/recovery.json    # about 11 min on 2 shared cores

Targets (from the project's issue; reported, never asserted): a newcomer loads state at no less than
half the link's bandwidth; a graceful exit costs the swarm less than one matchmaking period. The kill
has no number: it is reported next to the same swarm's epochs without a kill.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from geotrain.config import NETWORK_PROFILES  # noqa: E402  (the one place the profile's timing lives)

NETWORK_PROFILE = "loopback"
MATCHMAKING_TIME_S = NETWORK_PROFILES[NETWORK_PROFILE]["matchmaking_time_s"]
BYTES_PER_PARAMETER_STATE = 4 * 3  # fp32 parameters + AdamW's exp_avg and exp_avg_sq (geotrain's default: adamw)
STOP_GRACE_S = 25.0  # a trainer's own stop deadline is 20 s (geotrain.stopping.stopper.STOP_DEADLINE_S)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line still being written
    return events


def epoch_events(path: Path) -> list[dict]:
    return [e for e in read_jsonl(path) if e["event"] == "epoch"]


class Processes:
    """Every process this benchmark starts, each in its own process group, so that all can be ended.

    Peers are ended with SIGKILL to their whole group (trainer, hivemind's children, p2pd): by then their
    events are written, and a clean stop can take up to the trainer's 20 s deadline.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with open(self.directory / f"{name}.log", "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.started.append(process)
        return process

    def kill(self, processes: list[subprocess.Popen]) -> None:
        for process in processes:
            kill_group(process.pid)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def kill_all(self) -> None:
        self.kill(self.started)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group: the trainer, hivemind's children and p2pd."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_coordinator(processes: Processes, directory: Path) -> list[str]:
    peers_file = directory / "initial_peers.txt"
    coordinator = processes.start("coordinator", [
        sys.executable, "-m", "geotrain", "coordinator", "--no-state", "--port", "0", "--network-profile",
        NETWORK_PROFILE, "--state-dir", str(directory / "coordinator"), "--initial-peers-file", str(peers_file)])
    deadline = time.monotonic() + 90
    while not peers_file.exists():
        if coordinator.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"coordinator did not start; see {directory / 'coordinator.log'}")
        time.sleep(0.2)
    return peers_file.read_text().split()


def trainer_command(run_id: str, preset: str, target_batch_size: int, batch_size: int, wait_for_peers: int,
                    data_seed: int, events: Path, initial_peers: list[str], client_mode: bool = False) -> list[str]:
    return [sys.executable, "-m", "geotrain", "peer", "--run-id", run_id, "--task", "cv", "--preset", preset,
            "--network-profile", NETWORK_PROFILE, "--preemption", "signal", "--threads", "1",
            "--target-batch-size", str(target_batch_size), "--batch-size", str(batch_size),
            "--wait-for-peers", str(wait_for_peers), "--data-seed", str(data_seed), "--events", str(events),
            *(["--client-mode"] if client_mode else []),
            *[x for address in initial_peers for x in ("--initial-peers", address)]]


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")


# --- 1 and 3: a peer leaves a steady swarm ---------------------------------------------------------------

def swarm_boundaries(event_files: list[Path], after_time: float = 0.0) -> dict[int, float]:
    """epoch -> when the swarm reached it: the first epoch event of any of these peers for that epoch.

    Under load the peers of one swarm do not finish an epoch together (they can average in two groups,
    and a peer that fell behind catches up later), so one peer's events are a noisy clock; the first
    peer to reach an epoch marks when the swarm's global epoch advanced.
    """
    boundaries: dict[int, float] = {}
    for path in event_files:
        for event in epoch_events(path):
            if event["time"] > after_time:
                boundaries[event["epoch"]] = min(boundaries.get(event["epoch"], event["time"]), event["time"])
    return dict(sorted(boundaries.items()))


def boundary_durations(boundaries: dict[int, float]) -> list[float]:
    epochs = list(boundaries)
    return [boundaries[b] - boundaries[a] for a, b in zip(epochs, epochs[1:]) if b == a + 1]


def departure_round(how: str, round_index: int, phase: float, args, processes: Processes,
                    initial_peers: list[str], directory: Path) -> dict:
    """Start a fresh swarm, let it settle, make its last peer leave (``how``: kill or graceful), measure."""
    run_id = f"{how}-{round_index}"
    event_files = [directory / f"{run_id}-peer{index}.jsonl" for index in range(args.peers)]
    trainers = [processes.start(f"{run_id}-peer{index}", trainer_command(
        run_id, "tiny", args.target_batch_size, args.batch_size, args.peers, index + 1, event_files[index],
        initial_peers)) for index in range(args.peers)]
    leaver, survivors = trainers[-1], event_files[:-1]
    try:
        warm_epoch = args.skip_epochs + args.epochs_before
        wait_for(lambda: max(swarm_boundaries(event_files), default=0) >= warm_epoch, args.swarm_timeout_s,
                 f"{run_id}: swarm epoch {warm_epoch}")
        steady = {e: t for e, t in swarm_boundaries(event_files).items() if e >= args.skip_epochs}
        median_before_s = statistics.median(boundary_durations(steady))
        # the signal lands `phase` of a (median) epoch after the swarm's next boundary
        last_epoch = max(steady)
        boundary = wait_for(lambda: [t for e, t in swarm_boundaries(event_files).items() if e > last_epoch], 60,
                            f"{run_id}: swarm epoch {last_epoch + 1}")[0]
        time.sleep(max(0.0, boundary + phase * median_before_s - time.time()))
        signal_time = time.time()
        if how == "kill":
            kill_group(leaver.pid)  # the VM vanishes: trainer, hivemind's children and p2pd at once
        else:
            leaver.send_signal(signal.SIGTERM)  # what the trainer does on a preemption notice, too

        def enough_after() -> bool:
            return all(sum(e["time"] > signal_time for e in epoch_events(path)) >= args.epochs_after
                       for path in survivors)

        try:
            wait_for(enough_after, args.swarm_timeout_s, f"{run_id}: {args.epochs_after} epochs after the {how}")
        except TimeoutError as error:
            print(f"  warning: {error}", flush=True)
        try:
            leaver_exit_code = leaver.wait(timeout=max(0.1, signal_time + STOP_GRACE_S - time.time()))
        except subprocess.TimeoutExpired:
            leaver_exit_code = None
    finally:
        processes.kill(trainers)
    return analyse_departure(how, round_index, phase, signal_time, event_files, leaver_exit_code, args)


def analyse_departure(how: str, round_index: int, phase: float, signal_time: float, event_files: list[Path],
                      leaver_exit_code: int | None, args) -> dict:
    survivors = event_files[:-1]
    before = {e: t for e, t in swarm_boundaries(event_files).items() if t < signal_time}
    last_epoch_before = max(before)
    after = {e: t for e, t in swarm_boundaries(survivors, signal_time).items() if e > last_epoch_before}
    steady_before = boundary_durations({e: t for e, t in before.items() if e >= args.skip_epochs})
    median_before_s = statistics.median(steady_before)
    next_boundary = next(iter(after.values()), None)
    time_to_next_epoch_s = next_boundary - signal_time if next_boundary is not None else None
    disrupted_epoch_s = next_boundary - before[last_epoch_before] if next_boundary is not None else None
    # the swarm without the leaver, once settled: epochs after the disrupted one and the one after it
    later = boundary_durations(dict(list(after.items())[1:]))
    median_after_s = statistics.median(later[1:] or later) if later else None
    by_survivor = []
    for path in survivors:
        first = [e["time"] for e in epoch_events(path) if e["time"] > signal_time]
        by_survivor.append(first[0] - signal_time if first else None)
    finished = [e for e in read_jsonl(event_files[-1]) if e["event"] == "finished"]
    sample = {
        "round": round_index,
        "phase_of_epoch": phase,
        "epoch_at_signal": last_epoch_before,
        "median_epoch_before_s": median_before_s,
        "time_to_next_epoch_s": time_to_next_epoch_s,
        "disrupted_epoch_s": disrupted_epoch_s,
        "extra_s": disrupted_epoch_s - median_before_s if disrupted_epoch_s is not None else None,
        "ratio_time_to_next_over_median_before": (time_to_next_epoch_s / median_before_s
                                                  if time_to_next_epoch_s is not None else None),
        "ratio_disrupted_over_median_before": (disrupted_epoch_s / median_before_s
                                               if disrupted_epoch_s is not None else None),
        "median_epoch_after_s": median_after_s,
        "time_to_next_epoch_by_survivor_s": by_survivor,
        "time_to_next_epoch_all_survivors_s": (max(by_survivor) if by_survivor and None not in by_survivor
                                               else None),
        "swarm_epochs_before_s": steady_before,  # after the warm-up epochs
        "swarm_epochs_after_s": boundary_durations({last_epoch_before: before[last_epoch_before], **after}),
        "peers_seen_by_peer0_after": [e["peers"] for e in epoch_events(event_files[0])
                                      if e["time"] > signal_time][:args.epochs_after],
        "leaver_exit_code": leaver_exit_code,
        "leaver_finished_event": bool(finished),
    }
    if finished:
        sample["leaver_seconds_since_stop_request"] = finished[-1].get("seconds_since_stop_request")
    return sample


def summarise_departures(samples: list[dict]) -> dict:
    def median_of(key: str) -> float | None:
        values = [s[key] for s in samples if s.get(key) is not None]
        return statistics.median(values) if values else None

    keys = ("median_epoch_before_s", "time_to_next_epoch_s", "time_to_next_epoch_all_survivors_s",
            "disrupted_epoch_s", "extra_s", "median_epoch_after_s", "ratio_time_to_next_over_median_before",
            "ratio_disrupted_over_median_before")
    summary = {key: median_of(key) for key in keys}
    # how much undisturbed epochs vary on this machine: a disrupted epoch inside this spread is not a stall
    undisturbed = sorted(d for s in samples for d in s["swarm_epochs_before_s"])
    if undisturbed:
        summary["undisturbed_epochs"] = {"count": len(undisturbed), "median_s": statistics.median(undisturbed),
                                         "p90_s": undisturbed[int(0.9 * (len(undisturbed) - 1))],
                                         "max_s": undisturbed[-1]}
    return summary


# --- 2: a newcomer loads the swarm's state -------------------------------------------------------------------

def sync_preset(preset: str, args, processes: Processes, initial_peers: list[str], directory: Path) -> dict:
    """One donor trains alone; newcomers join one at a time and download its state."""
    run_id = f"sync-{preset}"
    donor_events = directory / f"{run_id}-donor.jsonl"
    donor = processes.start(f"{run_id}-donor", trainer_command(
        run_id, preset, args.sync_batch_size, args.sync_batch_size, 1, 1, donor_events, initial_peers))
    loads, failed = [], []
    try:
        wait_for(lambda: epoch_events(donor_events), args.swarm_timeout_s, f"{run_id}: donor's first epoch")
        parameters = [e for e in read_jsonl(donor_events) if e["event"] == "joined"][0]["parameters"]
        attempt = 0
        while len(loads) < args.sync_repeats and attempt < args.sync_repeats + 2:
            name = f"{run_id}-newcomer{attempt}"
            events = directory / f"{name}.jsonl"
            # client mode: a newcomer never offers state itself, so the next one loads from the donor too
            newcomer = processes.start(name, trainer_command(
                run_id, preset, args.sync_batch_size, args.sync_batch_size, 1, 100 + attempt, events, initial_peers,
                client_mode=True))
            attempt += 1
            try:
                loaded = wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "state_loaded"],
                                  args.swarm_timeout_s, f"{name} state_loaded")[0]
            except TimeoutError as error:
                print(f"  warning: {error}", flush=True)
                continue
            finally:
                processes.kill([newcomer])
            # hivemind gives up on a download quietly (a chunk later than next_chunk_timeout) and geotrain
            # still reports state_loaded, at the newcomer's own epoch 0: not a load
            log = (directory / f"{name}.log").read_text()
            sample = {"seconds": loaded["seconds"], "epoch": loaded["epoch"],
                      "download_failed_in_log": "Failed to download state" in log}
            if loaded["epoch"] == 0 or sample["download_failed_in_log"]:
                failed.append(sample)
                print(f"  {name}: state download failed after {loaded['seconds']:.1f} s (epoch {loaded['epoch']})",
                      flush=True)
            else:
                loads.append(sample)
    finally:
        processes.kill([donor])
    state_bytes = parameters * BYTES_PER_PARAMETER_STATE
    seconds = [load["seconds"] for load in loads]
    median_s = statistics.median(seconds) if seconds else None
    return {
        "preset": preset,
        "parameters": parameters,
        "state_bytes": state_bytes,
        "loads": loads,
        "failed_loads": failed,
        "mb_per_s": [state_bytes / 1e6 / s for s in seconds],
        "median_seconds": median_s,
        "median_mb_per_s": state_bytes / 1e6 / median_s if median_s else None,
        # hivemind.Optimizer also downloads the gradient averager's buffers (one more fp32 copy, uncompressed)
        "median_wire_mb_per_s": parameters * 4 * 4 / 1e6 / median_s if median_s else None,
    }


def loopback_bandwidth_bytes_per_s(duration_s: float, chunk_bytes: int = 4 << 20) -> float:
    """One TCP stream over 127.0.0.1, sender and receiver in two threads (socket calls release the GIL)."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = {"bytes": 0, "first": None, "last": None}

    def receive() -> None:
        connection, _ = listener.accept()
        buffer = memoryview(bytearray(chunk_bytes))
        with connection:
            while True:
                count = connection.recv_into(buffer)
                if count == 0:
                    break
                now = time.perf_counter()
                received["first"] = received["first"] or now
                received["bytes"] += count
                received["last"] = now

    receiver = threading.Thread(target=receive)
    receiver.start()
    payload = os.urandom(chunk_bytes)
    with socket.create_connection(listener.getsockname()) as sender:
        deadline = time.perf_counter() + duration_s
        while time.perf_counter() < deadline:
            sender.sendall(payload)
    receiver.join()
    listener.close()
    return received["bytes"] / (received["last"] - received["first"])


def measure_bandwidth(duration_s: float) -> float:
    bandwidth = loopback_bandwidth_bytes_per_s(duration_s)
    print(f"loopback TCP, one stream: {bandwidth / 1e6:.0f} MB/s", flush=True)
    return bandwidth


# --- the run ---------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="trainers in the kill and graceful swarms")
    parser.add_argument("--target-batch-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--skip-epochs", type=int, default=2, help="epochs left out as warm-up")
    parser.add_argument("--epochs-before", type=int, default=5, help="steady epochs measured before a departure")
    parser.add_argument("--epochs-after", type=int, default=4, help="epochs each survivor completes after it")
    parser.add_argument("--swarm-repeats", type=int, default=3, help="rounds of kill and of graceful exit")
    parser.add_argument("--presets", default="tiny,resnet18,resnet50", help="CV presets for newcomer sync")
    parser.add_argument("--sync-repeats", type=int, default=2, help="newcomers per preset, one after the other")
    parser.add_argument("--sync-batch-size", type=int, default=8, help="donor's micro-batch = target batch")
    parser.add_argument("--bandwidth-seconds", type=float, default=2.0, help="per bandwidth measurement")
    parser.add_argument("--swarm-timeout-s", type=float, default=180.0)
    parser.add_argument("--parts", default="kill,graceful,sync", help="which measurements to run")
    parser.add_argument("--keep-logs", type=Path, default=None, help="write logs and events here (default: a temp dir)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    presets = args.presets.split(",")

    # a SIGTERM to the benchmark itself still ends every process it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    departures: dict[str, list[dict]] = {"kill": [], "graceful": []}
    sync: list[dict] = []
    bandwidths: list[float] = []  # measured between the sync runs: the machine is shared, so more than once
    with tempfile.TemporaryDirectory() as temporary:
        directory = args.keep_logs or Path(temporary)
        directory.mkdir(parents=True, exist_ok=True)
        processes = Processes(directory)
        try:
            initial_peers = start_coordinator(processes, directory)
            phases = [(index + 0.5) / args.swarm_repeats for index in range(args.swarm_repeats)]
            for round_index, phase in enumerate(phases):
                order = ("kill", "graceful") if round_index % 2 == 0 else ("graceful", "kill")
                for how in order:
                    if how not in parts:
                        continue
                    sample = departure_round(how, round_index, phase, args, processes, initial_peers, directory)
                    departures[how].append(sample)
                    print(f"round {round_index + 1} {how:<8} phase {phase:.2f}: median epoch before "
                          f"{sample['median_epoch_before_s']:.2f} s, next epoch {_s(sample['time_to_next_epoch_s'])} "
                          f"after the signal, disrupted epoch {_s(sample['disrupted_epoch_s'])}", flush=True)
            if "sync" in parts:
                for preset in presets:
                    bandwidths.append(measure_bandwidth(args.bandwidth_seconds))
                    result = sync_preset(preset, args, processes, initial_peers, directory)
                    sync.append(result)
                    print(f"sync {preset:<9} {result['parameters'] / 1e6:6.2f} M params, "
                          f"{result['state_bytes'] / 1e6:7.1f} MB state: {_s(result['median_seconds'])}, "
                          f"{_f(result['median_mb_per_s'])} MB/s", flush=True)
                bandwidths.append(measure_bandwidth(args.bandwidth_seconds))
        finally:
            processes.kill_all()
    bandwidth = statistics.median(bandwidths) if bandwidths else None
    for result in sync:
        rate = result["median_mb_per_s"]
        result["fraction_of_loopback_bandwidth"] = rate * 1e6 / bandwidth if rate and bandwidth else None
        wire = result["median_wire_mb_per_s"]
        result["wire_fraction_of_loopback_bandwidth"] = wire * 1e6 / bandwidth if wire and bandwidth else None
    kill_medians = summarise_departures(departures["kill"])
    graceful_medians = summarise_departures(departures["graceful"])
    graceful_medians["meets_target"] = (graceful_medians["extra_s"] < MATCHMAKING_TIME_S
                                        if graceful_medians["extra_s"] is not None else None)
    graceful_medians["leaver_exit_codes"] = [s["leaver_exit_code"] for s in departures["graceful"]]

    report = {
        "benchmark": "recovery",
        "what": "churn in a swarm: recovery after a SIGKILLed peer, stall after a graceful exit (SIGTERM), "
                "newcomer state download rate vs loopback TCP bandwidth",
        "setup": {
            "swarm": {"peers": args.peers, "task": "cv", "preset": "tiny", "target_batch_size": args.target_batch_size,
                      "batch_size_per_step": args.batch_size, "skip_epochs": args.skip_epochs,
                      "epochs_before": args.epochs_before, "epochs_after": args.epochs_after,
                      "repeats": args.swarm_repeats, "leaver": f"peer {args.peers - 1}",
                      "clock": "swarm epoch boundaries: for each epoch, the first epoch event of any peer (after "
                               "the signal: of any survivor)",
                      "signal_phases_of_epoch": phases, "fresh_swarm_per_round": True,
                      "order": "kill and graceful rounds alternate (kill first in even rounds)"},
            "sync": {"presets": presets, "donor_target_batch_size": args.sync_batch_size,
                     "donor_batch_size_per_step": args.sync_batch_size, "newcomers_per_preset": args.sync_repeats,
                     "newcomers": "--client-mode, one at a time, so each downloads from the donor",
                     "state_bytes": "parameters x 4 B x 3 (fp32 parameters + AdamW exp_avg, exp_avg_sq; "
                                    "buffers such as BatchNorm statistics not counted)",
                     "wire_bytes": "state_bytes + parameters x 4 B: hivemind.Optimizer.load_state_from_peers also "
                                   "downloads the gradient averager's fp32 buffers; both lie inside the measured "
                                   "seconds",
                     "load_state_compression": "none (hivemind's default)",
                     "loopback_tcp": f"one stream, sender and receiver threads, {args.bandwidth_seconds} s, "
                                     "measured before each preset and after the last"},
            "network_profile": NETWORK_PROFILE, "matchmaking_time_s": MATCHMAKING_TIME_S, "threads_per_peer": 1,
            "coordinator": "--no-state (bootstrap only)", "machine": platform.machine(), "cpus": os.cpu_count(),
            "device": "cpu", "python": platform.python_version(),
        },
        "kill": {"samples": departures["kill"], "medians": kill_medians},
        "graceful": {"samples": departures["graceful"], "medians": graceful_medians},
        "sync": {"loopback_tcp_bytes_per_s": bandwidths, "median_loopback_tcp_bytes_per_s": bandwidth,
                 "presets": sync},
        "targets": {
            "kill": "none in numbers: reported next to the same swarm's median epoch without a kill",
            "sync": "state transfer at >= 0.5 of the link's bandwidth",
            "graceful": f"extra time of the disrupted epoch < one matchmaking period ({MATCHMAKING_TIME_S} s)",
        },
        "wall_s": time.monotonic() - started,
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"written to {args.output} ({report['wall_s']:.0f} s)")


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(report: dict) -> None:
    rows = []
    for how in ("kill", "graceful"):
        m = report[how]["medians"]
        if m["median_epoch_before_s"] is None:
            continue
        target = ("no number; vs epoch before" if how == "kill"
                  else f"extra < {MATCHMAKING_TIME_S} s: {_s(m['extra_s'])}")
        spread = m.get("undisturbed_epochs")
        rows.append((f"{how}: epoch before", _s(m["median_epoch_before_s"]),
                     f"undisturbed p90 {_s(spread['p90_s'])}, max {_s(spread['max_s'])}" if spread else ""))
        rows.append((f"{how}: signal -> next epoch",
                     f"{_s(m['time_to_next_epoch_s'])} ({_f(m['ratio_time_to_next_over_median_before'], 2)}x)", ""))
        rows.append((f"{how}: disrupted epoch",
                     f"{_s(m['disrupted_epoch_s'])} ({_f(m['ratio_disrupted_over_median_before'], 2)}x)", target))
    bandwidth = report["sync"]["median_loopback_tcp_bytes_per_s"]
    if bandwidth:
        rows.append(("loopback TCP, one stream", f"{bandwidth / 1e6:.0f} MB/s", ""))
    for r in report["sync"]["presets"]:
        rows.append((f"sync {r['preset']} ({r['state_bytes'] / 1e6:.0f} MB)",
                     f"{_s(r['median_seconds'])}, {_f(r['median_mb_per_s'])} MB/s",
                     f">= 0.5 of link: {_f(r['fraction_of_loopback_bandwidth'], 3)}"
                     + (f" ({len(r['failed_loads'])} failed)" if r["failed_loads"] else "")))
    print()
    print(f"{'measurement (medians)':<30} {'result':<26} target")
    for row in rows:
        print(f"{row[0]:<30} {row[1]:<26} {row[2]}")


if __name__ == "__main__":
    main()
