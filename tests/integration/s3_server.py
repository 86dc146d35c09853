"""A real S3-compatible server on loopback for tests: moto's server (``moto[server]``) as a subprocess.

It speaks the S3 REST API over HTTP, so s3fs/botocore run their real code paths (signing, multipart,
listing); only the storage behind it is in memory. It needs no credentials; any key and secret work.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class S3Server:
    """``moto.server`` on 127.0.0.1 at a free port; ``start`` raises RuntimeError saying why it could not."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict:
        # an explicit region: without one botocore asks the EC2 metadata service for it, which off AWS
        # costs seconds of time-outs per client; not us-east-1, which S3 refuses as a bucket's location
        return {"client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "eu-west-1"},
                "key": "test", "secret": "test"}

    def start(self, attempts: int = 3) -> "S3Server":
        try:
            import moto.server  # noqa: F401  (only to give a clear message when it is missing)
        except ImportError as error:
            raise RuntimeError(f"moto's S3 server is not installed ({error}); "
                               "install the test dependencies: pip install -e '.[dev]'") from None
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError as error:
                # the free port was taken between probing and binding; another one will do
                if "in use" not in str(error) or attempt == attempts - 1:
                    raise
                self.port = free_port()

    def _start_once(self) -> "S3Server":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto.server exited with code {self.process.returncode} before answering on "
                                   f"{self.endpoint_url}; its output:\n{self.log_path.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1.0):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto.server did not answer on {self.endpoint_url} within {START_TIMEOUT_S:.0f} s; "
                           f"its output:\n{self.log_path.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
