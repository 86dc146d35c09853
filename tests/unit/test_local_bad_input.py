"""`geotrain local` given what it cannot do: a run directory of an earlier run or of something else, more
trainers than the machine holds, outputs that cannot be written, and Ctrl-C. Refusals are checked in this
process through the CLI's entry point; two real runs check a reused run directory and Ctrl-C end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from geotrain.capacity import PROCESS_MEMORY_BYTES, Machine
from geotrain.cli import main
from geotrain.config import load_config
from geotrain.errors import EXIT_BAD_INPUT
from geotrain.launcher import LaunchError, ProcessLauncher
from geotrain.local import LocalSwarm, format_summary, summarize
from geotrain.run_dir import clear_previous_run, lock_run_dir

ROOT = Path(__file__).resolve().parents[2]
OLD_PEER_ID = "12D3KooWOLDRUNoldRUNoldRUNoldRUNoldRUNoldRUNold0001"
OLD_SHA256 = "0123456789abcdef" * 4
TINY_RUN = ["--peers", "1", "--task", "cv", "--preset", "tiny", "--target-batch-size", "64"]


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """`geotrain local` makes SIGINT and SIGTERM raise KeyboardInterrupt once its checks pass: not in pytest."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def refusal(capsys, *argv: str) -> str:
    """`geotrain local ARGV` in this process: it must exit 2 with one message and no traceback."""
    code = main(["local", *argv], embedded=True)
    captured = capsys.readouterr()
    assert code == EXIT_BAD_INPUT, captured.out + captured.err
    assert "Traceback" not in captured.err
    assert captured.err.startswith("geotrain local: "), captured.err
    return captured.err


def earlier_run(run_dir: Path) -> dict[str, str]:
    """What a finished `geotrain local --peers 2 --prometheus --json RUN_DIR/summary.json` leaves behind."""
    files = {
        "config.resolved.yaml": "task:\n  name: cv\n",
        "coordinator.log": "old coordinator\n",
        "initial_peers.txt": f"/ip4/127.0.0.1/tcp/1/p2p/{OLD_PEER_ID}\n",
        "summary.json": json.dumps({"params_identical": True}),
        "local.lock": "",
        "coordinator/identity.key": "old key",
        "coordinator/checkpoints/checkpoint-000005.json": "{}",
        "prometheus/prometheus.yml": "",
    }
    for index in range(2):
        files[f"peer-{index}.log"] = "old trainer\n"
        files[f"peer-{index}.jsonl"] = "\n".join(json.dumps(event) for event in [
            {"event": "joined", "time": 1.0, "peer_id": OLD_PEER_ID, "parameters": 10},
            {"event": "training", "time": 2.0},
            {"event": "epoch", "time": 3.0, "epoch": 1, "samples": 64, "samples_per_second": 64.0, "loss": 2.0,
             "compute_s": 1.0, "comm_s": 0.1},
            {"event": "finished", "time": 4.0, "peer_id": OLD_PEER_ID, "epoch": 1, "samples": 64,
             "params_sha256": OLD_SHA256}]) + "\n"
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return files


# -- 1. a run directory holds one run ----------------------------------------------------------------------

def test_an_earlier_runs_files_are_removed_and_nothing_of_it_is_left(tmp_path):
    earlier_run(tmp_path)
    (tmp_path / "peer-7.log").write_text("a trainer of a bigger run\n")
    removed = clear_previous_run(tmp_path)
    assert set(removed) == {"config.resolved.yaml", "coordinator.log", "initial_peers.txt", "summary.json",
                            "coordinator/", "prometheus/", "peer-0.log", "peer-0.jsonl", "peer-1.log",
                            "peer-1.jsonl", "peer-7.log"}
    assert [p.name for p in tmp_path.iterdir()] == ["local.lock"]


def test_the_json_summary_of_an_earlier_run_is_its_own_whatever_its_name(tmp_path):
    earlier_run(tmp_path)
    (tmp_path / "result.json").write_text("{}")
    assert "result.json" in clear_previous_run(tmp_path, tmp_path / "result.json")


def test_a_run_dir_holding_anything_else_is_refused_and_kept(tmp_path, capsys):
    files = earlier_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    message = refusal(capsys, "--run-dir", str(tmp_path))
    assert f"--run-dir {tmp_path} holds files that no `geotrain local` run wrote (data/, notes.txt)" in message
    assert "give another --run-dir, or move those files out" in message
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert all((tmp_path / name).read_text() == text for name, text in files.items()), "a refusal removed files"


def test_a_run_dir_another_local_run_is_using_is_refused(tmp_path, capsys):
    files = earlier_run(tmp_path)
    lock = lock_run_dir(tmp_path)  # as a `geotrain local` still running there holds it
    try:
        message = refusal(capsys, "--run-dir", str(tmp_path), *TINY_RUN)
    finally:
        lock.close()
    assert f"--run-dir {tmp_path} is in use by another `geotrain local` that is still running" in message
    assert all((tmp_path / name).read_text() == text for name, text in files.items())


def test_the_launcher_never_takes_an_earlier_coordinators_address(tmp_path):
    peers_file = tmp_path / "initial_peers.txt"
    peers_file.write_text(f"/ip4/127.0.0.1/tcp/1/p2p/{OLD_PEER_ID}\n")
    launcher = ProcessLauncher(tmp_path)
    # a "coordinator" that exits without writing an address: the old file must not be taken for its address
    with pytest.raises(LaunchError, match="the coordinator exited"):
        launcher.start_coordinator(["identity", "--help"], peers_file, timeout_s=60)


def test_a_second_local_run_into_the_same_dir_reports_its_own_results(tmp_path):
    """The second `make demo`: runs/demo holds the first run; the second must train and report itself."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier_run(run_dir)
    result = subprocess.run([sys.executable, "-m", "geotrain", "local", *TINY_RUN, "--epochs", "1",
                             "--run-dir", str(run_dir), "--json", str(run_dir / "summary.json")],
                            capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{run_dir} held an earlier run; removed its files" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [peer["peer_id"] for peer in summary["peers"]] != [OLD_PEER_ID]
    assert summary["peers"][0]["params_sha256"] != OLD_SHA256 and OLD_SHA256[:16] not in result.stdout
    assert summary["epochs_completed"] == 1 and summary["params_identical"] is True
    assert not (run_dir / "peer-1.log").exists(), "a file of the earlier run's second trainer was left"


# -- 2. no more trainers than the machine holds ---------------------------------------------------------------

def test_the_trainer_limit_follows_cores_and_memory():
    assert Machine(cpus=2, available_memory_bytes=64 * 2**30).max_trainers() == 8
    assert Machine(cpus=64, available_memory_bytes=11 * PROCESS_MEMORY_BYTES).max_trainers() == 10
    assert Machine(cpus=2, available_memory_bytes=None).max_trainers() == 8
    assert Machine(cpus=2, available_memory_bytes=PROCESS_MEMORY_BYTES).max_trainers() == 0


def test_more_trainers_than_this_machine_holds_are_refused_before_anything_starts(tmp_path, capsys):
    limit = Machine.this_one().max_trainers()
    message = refusal(capsys, "--peers", str(limit + 1), "--run-dir", str(tmp_path / "run"))
    assert f"--peers {limit + 1}: this machine can run at most {limit} trainers" in message
    assert "CPU cores x 4" in message and "`geotrain peer`" in message
    assert not (tmp_path / "run").exists(), "nothing may start for a request that cannot work"


# -- 3. outputs are checked before anything starts --------------------------------------------------------------

def test_a_json_path_that_is_a_directory_is_refused_before_training(tmp_path, capsys):
    message = refusal(capsys, "--json", str(tmp_path), "--run-dir", str(tmp_path / "run"))
    assert f"--json {tmp_path} is a directory; expected the path of a file" in message
    assert str(tmp_path / "summary.json") in message
    assert not (tmp_path / "run").exists()


def test_a_run_dir_that_is_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    message = refusal(capsys, "--run-dir", str(blocker))
    assert f"--run-dir {blocker} is a file; expected a directory" in message
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize("flag", ["--run-dir", "--json"])
def test_an_output_below_a_file_is_refused(tmp_path, capsys, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    arguments = {"--run-dir": str(tmp_path / "run"), flag: str(blocker / "sub" / "out")}
    message = refusal(capsys, *[item for pair in arguments.items() for item in pair])
    assert f"{flag} {blocker / 'sub' / 'out'}: {blocker} is a file, not a directory" in message
    assert not (tmp_path / "run").exists()


def test_a_json_path_that_is_the_run_dir_is_refused(tmp_path, capsys):
    message = refusal(capsys, "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "run"))
    assert "is the run directory; expected a file" in message


def test_a_summary_that_cannot_be_written_at_the_end_goes_to_the_run_dir(tmp_path, capsys):
    swarm = LocalSwarm(load_config(), peers=1, epochs=1, run_dir=tmp_path / "run")
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # became a file while the swarm trained
    swarm._write_summary({"epochs_completed": 1}, blocker / "summary.json")
    captured = capsys.readouterr()
    assert f"cannot write the summary to {blocker / 'summary.json'}" in captured.err
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"epochs_completed": 1}


# -- 4. Ctrl-C ----------------------------------------------------------------------------------------------

def test_an_interrupted_summary_gives_no_parameters_verdict(tmp_path):
    (tmp_path / "peer-0.jsonl").write_text(json.dumps({"event": "epoch", "time": 1.0, "epoch": 1, "samples": 64,
                                                       "samples_per_second": 64.0, "loss": 2.0, "compute_s": 1.0,
                                                       "comm_s": 0.1}) + "\n")
    trainer = SimpleNamespace(name="peer-0", events_path=tmp_path / "peer-0.jsonl",
                              process=SimpleNamespace(returncode=0))
    summary = summarize(load_config(overrides={"training.max_epochs": 5}), [trainer], tmp_path, interrupted=True)
    assert summary["interrupted"] is True and summary["params_identical"] is None
    text = format_summary(summary)
    assert "interrupted at epoch 1 of 5: parameters not compared" in text
    assert "parameters identical" not in text


def test_ctrl_c_stops_a_local_run_with_exit_0_and_says_it_was_interrupted(tmp_path):
    output = tmp_path / "local.out"
    with open(output, "w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "geotrain", "local", *TINY_RUN, "--epochs", "500",
                                    "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "summary.json")],
                                   stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not re.search(r"^epoch \d+/500", output.read_text(), re.MULTILINE):
            assert process.poll() is None, f"geotrain local exited early:\n{output.read_text()}"
            assert time.monotonic() < deadline, f"no first epoch in 300 s:\n{output.read_text()}"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = output.read_text()
    assert code == 0, text
    assert "stopping the local swarm" in text and "Traceback" not in text
    assert re.search(r"interrupted at epoch \d+ of 500: parameters not compared", text), text
    assert "parameters identical on every peer" not in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["params_identical"] is None
