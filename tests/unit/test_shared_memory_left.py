"""A peer that stops its children (geotrain.stopping.processes.kill_descendants) leaves no shared memory in /dev/shm.

hivemind shares tensors with its averager processes through files in /dev/shm (torch's file_system strategy);
torch's ``torch_shm_manager``, a child of the process, removes them once every process that used them is gone.
Stopped together with the peer's other children (or by ``lab down`` from outside), it left them behind: in RAM
until the next reboot. It also aborts, removing nothing, when a client hangs up before reading its answer to a
new file's name; the peer then removes what it and its children shared on its way out."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from geotrain.stopping.processes import descendants, is_alive, is_shared_memory_manager, terminate_tree

PEER = """
import multiprocessing, time
import torch
import hivemind  # (sets torch's file_system sharing strategy, as in every peer)
from geotrain.stopping.processes import kill_descendants

shared = torch.zeros(4096).share_memory_()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.2,))
child.start()
child.join()
print("ready", flush=True)
kill_descendants(grace_s=1.0)  # what a peer does on its way out
"""


def files_of(pid: int) -> list[str]:
    return sorted(path.name for path in Path("/dev/shm").glob(f"torch_{pid}_*"))


def test_a_peer_that_stops_its_children_leaves_no_shared_memory():
    process = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    assert files_of(process.pid), "the peer shared no tensor through /dev/shm: the test checks nothing"
    assert process.wait(timeout=60) == 0
    deadline = time.monotonic() + 10  # the manager notices that its clients are gone, then removes the files
    while files_of(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not files_of(process.pid), f"left in /dev/shm: {files_of(process.pid)}"


SHARING_PEER = """
import time
import torch
import hivemind  # (sets torch's file_system sharing strategy, as in every peer)

shared = torch.zeros(4096).share_memory_()
print("ready", flush=True)
time.sleep(600)
"""


def test_stopping_every_process_of_a_peer_from_outside_leaves_no_shared_memory():
    """What ``geotrain lab down`` does to the processes in a lab's namespaces: terminate_tree on all of them."""
    process = subprocess.Popen([sys.executable, "-c", SHARING_PEER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        everything = [process.pid, *descendants(process.pid)]
        assert any(is_shared_memory_manager(pid) for pid in everything), "no torch_shm_manager: checks nothing"
        assert files_of(process.pid)
        terminate_tree(everything, grace_s=5.0)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while files_of(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not files_of(process.pid), f"left in /dev/shm: {files_of(process.pid)}"
    finally:
        if process.poll() is None:
            process.kill()


PEER_WITH_A_TENSOR_IN_FLIGHT = """
import multiprocessing, sys, time
import torch
import hivemind  # (sets torch's file_system sharing strategy, as in every peer)
from geotrain.stopping.processes import kill_descendants

kept = torch.zeros(4096).share_memory_()  # this process's own, mapped until it exits
manager_handle = kept.untyped_storage()._share_filename_cpu_()[0].decode()
context = multiprocessing.get_context("fork")
queue = context.Queue()
reader = context.Process(target=time.sleep, args=(600,))  # never reads what it is sent
reader.start()
queue.put(torch.ones(4096))  # shared through /dev/shm; its reference is held until it is read: never
time.sleep(0.5)
print(manager_handle, reader.pid, flush=True)
sys.stdin.readline()
kill_descendants(grace_s=1.0, final=True)  # what a peer does on its way out
if sys.argv[1] == "close":
    del kept  # a storage that closes after that: torch finds nothing to remove, and does not fail
"""


def abort_the_manager(handle: str) -> None:
    """What a process that dies between sending torch's manager a new file's name and reading its answer does
    to it: the answer fails with EPIPE and the manager terminates (torch 2.x), removing nothing."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(handle)
    client.shutdown(socket.SHUT_RD)  # (as if gone: the manager's answer cannot be delivered)
    client.send(struct.pack("=ib60s3x", os.getpid(), 0, b"/torch_never_made"))
    time.sleep(0.5)
    client.close()


def test_a_peer_whose_shared_memory_manager_died_still_leaves_no_shared_memory():
    # (a storage closed after the manager died would abort the process: torch tells the manager, EPIPE)
    process = subprocess.Popen([sys.executable, "-c", PEER_WITH_A_TENSOR_IN_FLIGHT, "keep"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        handle, reader = process.stdout.readline().split()
        managers = [pid for pid in descendants(process.pid) if is_shared_memory_manager(pid)]
        assert managers and len(files_of(process.pid)) >= 2, "nothing shared and in flight: checks nothing"
        abort_the_manager(handle)
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in managers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_alive(pid) for pid in managers), "the manager survived: the test checks nothing"
        process.stdin.write("stop\n")
        process.stdin.flush()
        assert process.wait(timeout=60) == 0
        left = files_of(process.pid) + files_of(int(reader))
        assert not left, f"left in /dev/shm: {left}"
    finally:
        if process.poll() is None:
            process.kill()


def test_a_storage_closed_after_the_cleanup_on_the_way_out_is_no_error():
    process = subprocess.Popen([sys.executable, "-c", PEER_WITH_A_TENSOR_IN_FLIGHT, "close"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, reader = process.stdout.readline().split()
        assert len(files_of(process.pid)) >= 2
        process.stdin.write("stop\n")
        process.stdin.flush()
        assert process.wait(timeout=60) == 0, process.stderr.read()[-2000:]
        left = files_of(process.pid) + files_of(int(reader))
        assert not left, f"left in /dev/shm: {left}"
    finally:
        if process.poll() is None:
            process.kill()
