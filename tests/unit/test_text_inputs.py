"""Text files a user hands to a command (a config, an allow-list, a planner profile, a run summary) that are
not UTF-8: each is refused in one line naming the file, the line and the byte, with exit code 2, never a
traceback; the allow-list before the peer builds its model or joins the swarm. They share one reader,
geotrain.text_files.read_user_text, with the planner's price tables."""

from __future__ import annotations

import json
import sys
import types

import pytest

from geotrain import cli
from geotrain.config import SwarmConfig, load_config
from geotrain.hive.dht.admission_files import AdmissionConfigError, load_swarm_token

PEER_ID = "QmRP5NLCmcd7p1XiyEeK5fH9Qf49jek37bWqo7rG6B7p12"  # a libp2p peer id (as in test_guard.py)


def windows_1252(tmp_path, name: str, text: str) -> tuple[str, int]:
    """``text`` saved as Windows-1252 (é is the byte 0xe9): the path and the offset of its first é."""
    path = tmp_path / name
    data = text.encode("cp1252")
    path.write_bytes(data)
    return str(path), data.index(b"\xe9")


def refusal(capsys, argv: list[str]) -> str:
    """What ``geotrain ARGV`` printed when it refused its input (exit code 2, no traceback)."""
    code = cli.main(argv, embedded=True)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "UnicodeDecodeError" not in err, err
    return err.strip()


def test_a_config_that_is_not_utf8_names_the_file_line_and_byte(tmp_path, capsys):
    path, offset = windows_1252(tmp_path, "run.yaml", "swarm:\n  run_id: caf\u00e9\n")
    err = refusal(capsys, ["local", "--config", path])
    assert err.startswith(f"geotrain local: {path}:2: byte 0xe9 (at byte offset {offset}) is not UTF-8; ")
    assert "save it as UTF-8" in err and err.count("\n") == 0


def test_a_config_saved_as_utf16_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("optimizer:\n  learning_rate: 0.25\n".encode("utf-16"))  # Notepad's "Unicode"
    assert load_config(path).optimizer.learning_rate == 0.25


def test_an_allow_file_that_is_not_utf8_stops_the_peer_before_it_starts(tmp_path, capsys, monkeypatch):
    path, offset = windows_1252(tmp_path, "allowed.txt", f"{PEER_ID}  # caf\u00e9 team\n")
    started = []
    trainer = types.ModuleType("geotrain.trainer")  # building the model and joining the DHT took ~15 s
    trainer.Trainer = lambda config: started.append(config)
    monkeypatch.setitem(sys.modules, "geotrain.trainer", trainer)
    monkeypatch.setattr(cli.os, "_exit", lambda code: None)  # `geotrain peer` leaves with os._exit
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")  # setup_logging sets them; restore them after the test
    monkeypatch.setenv("GOLOG_LOG_LEVEL", "error")
    err = refusal(capsys, ["peer", "--allow-file", path])
    assert err.startswith(f"geotrain peer: {path}:1: byte 0xe9 (at byte offset {offset}) is not UTF-8; ")
    assert not started


def test_a_token_file_that_is_not_utf8_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("GEOTRAIN_SWARM_TOKEN", raising=False)
    path, _ = windows_1252(tmp_path, "swarm.token", "caf\u00e9" * 8)
    with pytest.raises(AdmissionConfigError, match=r"swarm.token:1: byte 0xe9 \(at byte offset 3\) is not UTF-8"):
        load_swarm_token(SwarmConfig(token_file=path))


def test_a_profile_that_is_not_utf8_names_the_file_line_and_byte(tmp_path, capsys):
    path, offset = windows_1252(tmp_path, "mine.yaml", "name: mine\ntask: cv # caf\u00e9\nparameters: 10\n")
    err = refusal(capsys, ["plan", "--profile", path])
    assert err.startswith(f"geotrain plan: {path}:2: byte 0xe9 (at byte offset {offset}) is not UTF-8; ")


def test_a_run_summary_that_is_not_utf8_names_the_file_line_and_byte(tmp_path, capsys):
    text = json.dumps({"task": "cv", "preset": "caf\u00e9"}, ensure_ascii=False, indent=1)
    path, offset = windows_1252(tmp_path, "run.json", text)
    err = refusal(capsys, ["profile", "--from-run", path, "--name", "m", "--profiles-dir", str(tmp_path)])
    assert err.startswith(f"geotrain profile: {path}:3: byte 0xe9 (at byte offset {offset}) is not UTF-8; ")
    assert not (tmp_path / "m.yaml").exists()


def test_a_lab_topology_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    from geotrain.lab.topology import TopologyError, load_topology

    path, offset = windows_1252(tmp_path, "mine.yaml", "# caf\u00e9\nregions: {}\n")
    with pytest.raises(TopologyError, match=rf"mine.yaml:1: byte 0xe9 \(at byte offset {offset}\) is not UTF-8"):
        load_topology(path)
