"""Real HTTP servers on loopback that speak the clouds' documented metadata formats for spot notices.

- AWS IMDSv2: PUT /latest/api/token (header X-aws-ec2-metadata-token-ttl-seconds) gives a token; GETs
  without a valid X-aws-ec2-metadata-token get 401. /latest/meta-data/spot/instance-action is 404 until a
  notice, then {"action": "terminate", "time": "<UTC ISO>"}; .../events/recommendations/rebalance likewise.
- GCE: GET /computeMetadata/v1/instance/preempted needs Metadata-Flavor: Google (else 403); with
  wait_for_change=true it blocks until the value changes (or timeout_sec), then answers TRUE/FALSE.
- Azure: GET /metadata/scheduledevents?api-version=... needs Metadata: true (else 400) and answers
  {"DocumentIncarnation": n, "Events": [...]}; POST {"StartRequests": [{"EventId": ...}]} acknowledges.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class MetadataServer:
    def __init__(self):
        self.noticed = threading.Event()
        self.requests: list[tuple[str, str]] = []
        self.acknowledged: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes = b"", content_type: str = "text/plain"):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                server.requests.append(("GET", self.path))
                server.handle(self, "GET")

            def do_PUT(self):
                server.requests.append(("PUT", self.path))
                server.handle(self, "PUT")

            def do_POST(self):
                server.requests.append(("POST", self.path))
                server.handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def notify(self, seconds_ahead: float = 30.0) -> None:
        self.not_before = datetime.now(timezone.utc) + timedelta(seconds=seconds_ahead)
        self.noticed.set()

    def close(self) -> None:
        self.noticed.set()  # release long polls
        self.httpd.shutdown()
        self.httpd.server_close()


class AwsMetadata(MetadataServer):
    TOKEN = "AQAEAtoken-for-tests"

    def handle(self, request, method):
        path = urlparse(request.path).path
        if method == "PUT" and path == "/latest/api/token":
            if not request.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return request._answer(400)
            return request._answer(200, self.TOKEN.encode())
        if request.headers.get("X-aws-ec2-metadata-token") != self.TOKEN:
            return request._answer(401)
        if path == "/latest/meta-data/spot/instance-action":
            if not self.noticed.is_set():
                return request._answer(404)
            body = {"action": "terminate", "time": self.not_before.strftime("%Y-%m-%dT%H:%M:%SZ")}
            return request._answer(200, json.dumps(body).encode(), "application/json")
        if path == "/latest/meta-data/events/recommendations/rebalance":
            return request._answer(404)
        return request._answer(404)


class GcpMetadata(MetadataServer):
    def handle(self, request, method):
        url = urlparse(request.path)
        if request.headers.get("Metadata-Flavor") != "Google":
            return request._answer(403)
        if url.path == "/computeMetadata/v1/instance/id":
            return request._answer(200, b"4567891234567891234", "application/text")
        if url.path == "/computeMetadata/v1/instance/preempted":
            query = parse_qs(url.query)
            if query.get("wait_for_change") == ["true"]:
                self.noticed.wait(float(query.get("timeout_sec", ["60"])[0]))
            return request._answer(200, b"TRUE" if self.noticed.is_set() else b"FALSE", "application/text")
        return request._answer(404)


class AzureMetadata(MetadataServer):
    VM_NAME = "geotrain-spot-1"

    def handle(self, request, method):
        url = urlparse(request.path)
        if request.headers.get("Metadata") != "true":
            return request._answer(400, b'{"error": "Bad request. Required metadata header not specified"}')
        if url.path == "/metadata/instance/compute/name":
            return request._answer(200, self.VM_NAME.encode())
        if url.path == "/metadata/instance":
            return request._answer(200, json.dumps({"compute": {"name": self.VM_NAME}}).encode(), "application/json")
        if url.path != "/metadata/scheduledevents":
            return request._answer(404)
        if method == "POST":
            length = int(request.headers.get("Content-Length", 0))
            body = json.loads(request.rfile.read(length))
            self.acknowledged.extend(item["EventId"] for item in body.get("StartRequests", []))
            return request._answer(200)
        events = []
        if self.noticed.is_set():
            events = [{"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
                       "ResourceType": "VirtualMachine", "Resources": [self.VM_NAME], "EventStatus": "Scheduled",
                       "NotBefore": format_datetime(self.not_before, usegmt=True), "Description": "",
                       "EventSource": "Platform", "DurationInSeconds": -1}]
        body = {"DocumentIncarnation": 2 if events else 1, "Events": events}
        return request._answer(200, json.dumps(body).encode(), "application/json")


CLOUDS = {"aws": AwsMetadata, "gcp": GcpMetadata, "azure": AzureMetadata}


def metadata_flags(cloud: str, server: MetadataServer) -> list[str]:
    return ["--preemption", cloud, "--set", f"preemption.{cloud}_metadata_url={server.url}",
            "--set", "preemption.poll_interval_s=0.5"]


__all__ = ["AwsMetadata", "AzureMetadata", "CLOUDS", "GcpMetadata", "metadata_flags", "time"]
