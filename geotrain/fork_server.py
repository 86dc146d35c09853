"""Start geotrain processes by forking one that has already imported torch and hivemind.

A peer started as ``python -m geotrain peer ...`` spends about 2.4 CPU-seconds importing torch, hivemind and scipy
before it parses its first flag. A fork server pays that once: it is started with those modules imported and
nothing else running (no asyncio loop, no torch thread pool, no hivemind object), and forks one child per
command, which then runs ``geotrain``'s command line exactly as ``python -m geotrain`` would::

    server = ForkServer.start(label=str(run_dir))
    peer = server.spawn(["peer", "--initial-peers", address], log_path=run_dir / "peer-0.log")
    peer.poll(); peer.wait(timeout=60); peer.send_signal(signal.SIGTERM)   # as subprocess.Popen
    server.close()

Each child starts a session of its own (``os.killpg(peer.pid, ...)`` reaches its whole tree), has stdin from
/dev/null and stdout and stderr in its log, gets SIGTERM when the server dies, makes its own multiprocessing locks
where modules made them at import (hivemind's MPFuture locks: shared, one killed sibling would block all others),
and shows its own command line in
``ps`` and ``/proc/PID/cmdline`` (``python -m geotrain peer ...``), so tools that find a run's processes by their
command line find these. The server ends when the process that started it closes it or dies.

The parent talks to the server over a socket pair, one JSON object per line each way, each with the number of
the request it answers: ``{"spawn": {...}}`` answered with ``{"pid": N}``, ``{"poll": N}`` with ``{"returncode":
CODE or null}`` (a negative code: the signal that ended the child, as ``subprocess`` gives it).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from geotrain.stopping.stopper import die_with_parent

# What every geotrain peer and coordinator imports before it starts; imported by the server once.
PRELOADED_MODULES = ("geotrain.cli", "geotrain.trainer", "geotrain.coordinator")
START_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.05
# The server's command line is padded to this many bytes, so that each child can write its own in its place.
COMMAND_LINE_ROOM_BYTES = 8192
SERVER_FD_VARIABLE = "GEOTRAIN_FORK_SERVER_FD"  # the server's end of the socket pair


class ForkServerError(RuntimeError):
    """The fork server did not start or stopped answering; the message says what it printed."""


class ForkedProcess:
    """A child of the fork server, used as a :class:`subprocess.Popen`: ``pid``, ``returncode``, ``poll()``,
    ``wait(timeout)``, ``send_signal()``, ``terminate()``, ``kill()``."""

    def __init__(self, server: "ForkServer", pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_INTERVAL_S)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The parent's end of a fork server (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen, connection: socket.socket):
        self.process = process
        self._connection = connection
        self._replies = connection.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()
        self._asked = 0

    @classmethod
    def start(cls, label: str = "", timeout_s: float = START_TIMEOUT_S) -> "ForkServer":
        """A server whose command line ends with ``label`` (a run directory, so its children are found by it)."""
        parent_end, server_end = socket.socketpair()
        padding = " " * COMMAND_LINE_ROOM_BYTES
        with server_end:
            process = subprocess.Popen(
                [sys.executable, "-m", "geotrain.fork_server", label, padding], stdin=subprocess.DEVNULL,
                pass_fds=(server_end.fileno(),), start_new_session=True,
                env={**os.environ, SERVER_FD_VARIABLE: str(server_end.fileno())})
        server = cls(process, parent_end)
        parent_end.settimeout(timeout_s)
        try:
            reply = server._replies.readline()
        except socket.timeout:
            reply = ""
        parent_end.settimeout(None)
        if not reply:
            server.close()
            raise ForkServerError(f"the fork server did not start within {timeout_s:.0f} s "
                                  f"(exit code {process.poll()})")
        return server

    def spawn(self, arguments: list[str], log_path: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, append: bool = False, stderr_path: Path | None = None,
              script: Path | None = None) -> ForkedProcess:
        """``geotrain ARGUMENTS`` in a child writing stdout and stderr to ``log_path``; ``env``: its whole
        environment (default: this process's); ``append``: to the log, not over it; ``stderr_path``: stderr
        there instead (a file of its own, written over); ``script``: ``python SCRIPT ARGUMENTS`` instead (a
        program that imports torch or hivemind too, such as a test's helper peer)."""
        request = {"arguments": list(arguments), "log_path": str(log_path), "append": append,
                   "env": dict(os.environ if env is None else env), "cwd": str(cwd) if cwd else None,
                   "stderr_path": str(stderr_path) if stderr_path else None,
                   "script": str(Path(script).resolve()) if script else None}
        pid = self._ask({"spawn": request})["pid"]
        return ForkedProcess(self, pid, [str(script)] if script else ["geotrain", *arguments])

    def returncode_of(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["returncode"]

    def close(self) -> None:
        """Stop the server; children of it that still run get SIGTERM (they die with it) and leave."""
        self._replies.close()  # the socket's file descriptor closes with the last of its users
        self._connection.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _ask(self, request: dict) -> dict:
        """The server's answer to ``request``. Each carries a number, so that an answer left unread by a call that
        was interrupted (Ctrl-C while it waited) is skipped, not taken for the next call's."""
        with self._lock:
            self._asked += 1
            request = {**request, "id": self._asked}
            try:
                self._connection.sendall((json.dumps(request) + "\n").encode())
                while True:
                    line = self._replies.readline()
                    if not line or json.loads(line).get("id") == request["id"]:
                        break
            except OSError as error:
                raise ForkServerError(f"the fork server is gone ({error})") from error
        if not line:
            raise ForkServerError(f"the fork server is gone (exit code {self.process.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise ForkServerError(reply["error"])
        return reply


# --- the server process -------------------------------------------------------------------------------------------


def _command_line_area() -> tuple[int, int]:
    """Where this process's command line lies in its memory (``/proc/PID/stat`` fields 48 and 49)."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[45]), int(fields[46])


def _set_command_line(words: list[str]) -> None:
    """Write ``words`` where the kernel reads ``/proc/self/cmdline``, cut to fit; the rest of the area is zeros."""
    start, end = _command_line_area()
    room = end - start - 1  # the last byte stays 0: the kernel then reads the area as it is
    text = b"\0".join(word.encode(errors="replace") for word in words)[:room]
    ctypes.memmove(start, text + b"\0" * (room - len(text)), room)


def _reap(codes: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = os.waitstatus_to_exitcode(status)


def _import_what_an_optimizer_imports() -> None:
    """Every peer and coordinator builds a torch optimizer, and torch imports its compiler (torch._dynamo, with
    sympy) the first time one is built: about 2 CPU-seconds a process, measured with torch 2.14 on this suite's
    machine, that a child of this server would otherwise pay while its swarm waits for it. A throwaway
    optimizer imports it here, once (it starts no thread)."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def find_import_time_locks() -> list[tuple[object, str]]:
    """(module or class, attribute) of every multiprocessing Lock and RLock that loaded modules made at import
    (hivemind's MPFuture update and initialization locks, its SharedBytes and executor locks, ...)."""
    found = []
    for module in list(sys.modules.values()):
        try:
            contents = dict(vars(module))
        except TypeError:
            continue
        with warnings.catch_warnings():  # deprecated module attributes warn when read (torch.distributed's)
            warnings.simplefilter("ignore")
            namespaces = [module] + [value for value in contents.values()
                                     if isinstance(value, type) and value.__module__ == module.__name__]
        for namespace in namespaces:
            for name, value in list(vars(namespace).items()):
                if type(value) in (multiprocessing.synchronize.Lock, multiprocessing.synchronize.RLock):
                    found.append((namespace, name))
    return found


def renew_import_time_locks(locations: list[tuple[object, str]]) -> None:
    """A new lock in each place: these are semaphores in shared memory, so every child of one server would share
    its siblings' (a fresh Python makes its own), and one killed while holding one (a SIGKILLed peer sending a
    result) would block the others for good: seen in CI, a coordinator's DHT stuck in MPFuture's update lock."""
    for namespace, name in locations:
        setattr(namespace, name, type(getattr(namespace, name))(ctx=multiprocessing.get_context()))


def _become_child(request: dict, closing: list[int], import_time_locks: list[tuple[object, str]]) -> dict:
    """In the forked child: the session, files, environment and signals ``python -m geotrain`` (or ``python
    SCRIPT``) would have. Returns the request."""
    for fd in closing:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    die_with_parent()
    renew_import_time_locks(import_time_locks)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    log = os.open(request["log_path"], mode, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if request.get("stderr_path"):
        errors = os.open(request["stderr_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(errors, 2)
        os.close(errors)
    os.environ.clear()
    os.environ.update(request["env"])
    if request["cwd"]:
        os.chdir(request["cwd"])
    arguments, script = request["arguments"], request.get("script")
    if script:
        _set_command_line([sys.executable, script, *arguments])
        sys.argv = [script, *arguments]
        sys.path[0] = os.path.dirname(script)  # as for `python SCRIPT`: its folder first
    else:
        _set_command_line([sys.executable, "-m", "geotrain", *arguments])
        sys.argv = [sys.argv[0], *arguments]  # argv[0] is set by runpy, as by `python -m geotrain`
    # as a fresh interpreter would: torch sizes its thread pool from OMP_NUM_THREADS, numpy seeds from the OS
    # (Python's own random module reseeds itself after a fork)
    import numpy
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    numpy.random.seed()
    return request


def serve(connection_fd: int) -> dict | None:
    """Answer requests until the parent closes the connection (None); in each forked child, its request."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # as geotrain's CLI sets it; --log-level DEBUG resets it
    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    _import_what_an_optimizer_imports()
    import_time_locks = find_import_time_locks()
    _set_command_line([sys.executable, "-m", "geotrain.fork_server", *sys.argv[1:2]])
    connection = socket.socket(fileno=connection_fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    codes: dict[int, int] = {}
    requests = connection.makefile("r", encoding="utf-8")
    connection.sendall(b'{"ready": true}\n')
    while True:
        readable, _, _ = select.select([connection, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(codes)
        if connection not in readable:
            continue
        line = requests.readline()
        if not line:
            return None
        request = json.loads(line)
        if "poll" in request:
            _reap(codes)
            reply = {"returncode": codes.get(request["poll"])}
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as error:
                reply = {"error": f"cannot fork a geotrain process: {error}"}
            else:
                if pid == 0:
                    requests.close()
                    connection.close()
                    return _become_child(request["spawn"], [wake_read, wake_write], import_time_locks)
                reply = {"pid": pid}
        connection.sendall((json.dumps({**reply, "id": request.get("id")}) + "\n").encode())


if __name__ == "__main__":
    _request = serve(int(os.environ.pop(SERVER_FD_VARIABLE)))
    if _request is None:
        os._exit(0)  # nothing to flush; torch's and hivemind's teardown would take most of a second
    if _request.get("script"):
        runpy.run_path(_request["script"], run_name="__main__")  # what `python SCRIPT` runs
    else:
        runpy.run_module("geotrain", run_name="__main__", alter_sys=True)  # what `python -m geotrain` runs
