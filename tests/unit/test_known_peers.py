"""A peer's known peers file (geotrain.hive.dht.known_peers): what a restart joins through besides its initial
peers. The restart itself, with the coordinator down, is in tests/integration/test_durable_state.py."""

from __future__ import annotations

import logging

from geotrain.hive.dht.known_peers import joining_through, read_known_peers

A = "/ip4/127.0.0.1/tcp/31337/p2p/QmbwQLybpb6T3zZhNuqy146pPqZUV3UksSSavHtEEFPLRU"
B = "/ip4/10.0.0.2/tcp/31338/p2p/Qma4mxFTPGejMDAftRZ1dcHpBjCcvRps3jrY623Bve5z5i"


def test_a_restart_joins_through_its_initial_peers_then_the_known_ones_once_each(tmp_path):
    known = tmp_path / "known.txt"
    known.write_text(f"{A}\n{B}\n")
    assert joining_through([A], known) == [A, B]
    assert joining_through([], tmp_path / "not-yet-written.txt") == []
    assert joining_through([A], None) == [A]


def test_a_damaged_known_peers_file_is_logged_and_what_is_usable_in_it_is_kept(tmp_path, caplog):
    known = tmp_path / "known.txt"
    known.write_bytes(f"{B}\n/ip4/300.1.1.1/tcp/1/p2p/x\ngarbage\n".encode())
    with caplog.at_level(logging.WARNING):
        assert read_known_peers(known) == [B]
    assert "2 entries of" in caplog.text and "not peer addresses" in caplog.text
    known.write_bytes(b"\xff\xfe\x00garbage")
    with caplog.at_level(logging.WARNING):
        assert read_known_peers(known) == []
    assert "joining through the initial peers only" in caplog.text
    directory = tmp_path / "a-directory"
    directory.mkdir()
    assert read_known_peers(directory) == []
