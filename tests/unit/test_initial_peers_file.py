"""A trainer started next to its coordinator waits for the coordinator's addresses in a file
(geotrain.initial_peers_file; `geotrain peer --initial-peers-file`)."""

from __future__ import annotations

import threading

import pytest

from geotrain.errors import StopRequested, SwarmUnreachableError, UserError
from geotrain.initial_peers_file import wait_for_initial_peers

ADDRESS = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx"


def test_the_addresses_are_read_once_the_coordinator_has_written_them(tmp_path):
    path = tmp_path / "initial_peers.txt"
    threading.Timer(0.5, lambda: path.write_text(f"{ADDRESS}\n{ADDRESS.replace('31337', '31338')}\n")).start()
    assert wait_for_initial_peers(path, timeout_s=10) == [ADDRESS, ADDRESS.replace("31337", "31338")]


def test_an_empty_file_is_waited_on_like_a_missing_one(tmp_path):
    path = tmp_path / "initial_peers.txt"
    path.write_text("\n")
    threading.Timer(0.5, lambda: path.write_text(ADDRESS)).start()
    assert wait_for_initial_peers(path, timeout_s=10) == [ADDRESS]


def test_a_file_of_something_else_is_refused_naming_it(tmp_path):
    path = tmp_path / "initial_peers.txt"
    path.write_text("127.0.0.1:31337\n")
    with pytest.raises(UserError, match=r"--initial-peers-file .*initial_peers.txt: '127.0.0.1:31337' is not a peer's"):
        wait_for_initial_peers(path, timeout_s=10)


def test_no_coordinator_gives_up_after_the_timeout_saying_what_to_start(tmp_path):
    path = tmp_path / "initial_peers.txt"
    with pytest.raises(SwarmUnreachableError, match="no address there after 1 s; start the coordinator with "
                                                    "--initial-peers-file"):
        wait_for_initial_peers(path, timeout_s=1)


def test_a_stop_ends_the_wait_at_once(tmp_path):
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(StopRequested):
        wait_for_initial_peers(tmp_path / "initial_peers.txt", timeout_s=60, stop=stop)


def test_a_peer_whose_coordinator_never_writes_its_file_exits_3_before_joining(run_cli, tmp_path):
    result = run_cli("peer", "--task", "cv", "--preset", "tiny", "--preemption", "none", "--bootstrap-timeout", "1",
                     "--initial-peers-file", str(tmp_path / "initial_peers.txt"))
    assert result.returncode == 3, result.stderr
    assert "no address there after 1 s" in result.stderr and "Traceback" not in result.stderr
