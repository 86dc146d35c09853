"""A peer that stops its children (geotrain.processes.kill_descendants) leaves no shared memory in /dev/shm.

hivemind shares tensors with its averager processes through files in /dev/shm (torch's file_system strategy);
torch's ``torch_shm_manager``, a child of the process, removes them once every process that used them is gone.
Stopped together with the peer's other children, it left them behind: in RAM until the next reboot."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from geotrain.processes import descendants, is_shared_memory_manager, terminate_tree

PEER = """
import multiprocessing, time
import torch
import hivemind  # (sets torch's file_system sharing strategy, as in every peer)
from geotrain.processes import kill_descendants

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
