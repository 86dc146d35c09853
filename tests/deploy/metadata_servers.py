"""Cloud metadata services on loopback, speaking each cloud's documented protocol, for the startup scripts.

Each server answers the paths the real one answers and enforces the same request headers, so a script
that forgets a header (or the IMDSv2 token) fails here as it would on a VM:

- AWS IMDSv2: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` returns a token;
  ``GET /latest/meta-data/...`` needs ``X-aws-ec2-metadata-token`` (401 without a valid one); a VM
  without a public address answers 404 for ``public-ipv4``.
- GCE: ``GET /computeMetadata/v1/instance/...`` needs ``Metadata-Flavor: Google`` (403 without);
  ``zone`` is ``projects/NUM/zones/ZONE``, ``machine-type`` ``projects/NUM/machineTypes/TYPE``.
- Azure IMDS: ``GET /metadata/instance?api-version=...`` needs ``Metadata: true`` and an
  ``api-version`` (400 without), and returns the instance document as JSON.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    status: int


@dataclass
class MetadataServer:
    """One fake metadata service; ``answer(method, path, query, headers) -> (status, body, headers)``."""

    cloud: str
    answer: object
    requests: list[Request] = field(default_factory=list)

    def __enter__(self) -> "MetadataServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                split = urlsplit(self.path)
                headers = {key.lower(): value for key, value in self.headers.items()}
                status, body, extra_headers = server.answer(self.command, split.path, parse_qs(split.query), headers)
                server.requests.append(Request(self.command, self.path, headers, status))
                payload = body.encode()
                self.send_response(status)
                for key, value in extra_headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = _handle

            def log_message(self, *args):  # the test output is no place for an access log
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"


def aws_imds(region: str, instance_type: str, public_ip: str | None) -> MetadataServer:
    tokens: set[str] = set()
    meta_data = {"placement/region": region, "instance-type": instance_type,
                 "placement/availability-zone": f"{region}a", "local-ipv4": "10.0.0.12"}
    if public_ip is not None:
        meta_data["public-ipv4"] = public_ip

    def answer(method, path, query, headers):
        if path == "/latest/api/token":
            if method != "PUT":
                return 405, "", {}
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, "", {}
            token = secrets.token_urlsafe(24)
            tokens.add(token)
            return 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
        if not path.startswith("/latest/meta-data/"):
            return 404, "", {}
        if method != "GET":
            return 405, "", {}
        if headers.get("x-aws-ec2-metadata-token") not in tokens:
            return 401, "", {}  # IMDSv2 required: no token, no answer
        value = meta_data.get(path.removeprefix("/latest/meta-data/"))
        return (404, "", {}) if value is None else (200, value, {})

    return MetadataServer("aws", answer)


def gce_metadata(zone: str, machine_type: str, external_ip: str | None,
                 project_number: str = "123456789012") -> MetadataServer:
    prefix = "/computeMetadata/v1/instance/"
    values = {"zone": f"projects/{project_number}/zones/{zone}",
              "machine-type": f"projects/{project_number}/machineTypes/{machine_type}",
              "network-interfaces/0/ip": "10.128.0.7"}
    if external_ip is not None:
        values["network-interfaces/0/access-configs/0/external-ip"] = external_ip

    def answer(method, path, query, headers):
        if not path.startswith("/computeMetadata/"):
            return 404, "", {}
        if headers.get("metadata-flavor") != "Google":
            return 403, "Missing required header: Metadata-Flavor", {}
        value = values.get(path.removeprefix(prefix)) if path.startswith(prefix) else None
        if value is None:
            return 404, "", {"Metadata-Flavor": "Google"}
        return 200, value, {"Metadata-Flavor": "Google", "Content-Type": "application/text"}

    return MetadataServer("gcp", answer)


def azure_imds(location: str, vm_size: str, public_ip: str) -> MetadataServer:
    document = {
        "compute": {"location": location, "vmSize": vm_size, "name": "geotrain-trainer-1",
                    "priority": "Spot", "zone": "1", "osType": "Linux"},
        "network": {"interface": [{
            "ipv4": {"ipAddress": [{"privateIpAddress": "10.1.0.4", "publicIpAddress": public_ip}],
                     "subnet": [{"address": "10.1.0.0", "prefix": "24"}]},
            "ipv6": {"ipAddress": []},
            "macAddress": "000D3A000000",
        }]},
    }

    def answer(method, path, query, headers):
        if not path.startswith("/metadata/"):
            return 404, "", {}
        if headers.get("metadata") != "true":
            return 400, json.dumps({"error": "Bad request. Required metadata header not specified"}), {}
        if "api-version" not in query:
            return 400, json.dumps({"error": "Bad request. api-version was not specified in the request"}), {}
        if path != "/metadata/instance" or method != "GET":
            return 404, "", {}
        return 200, json.dumps(document), {"Content-Type": "application/json; charset=utf-8"}

    return MetadataServer("azure", answer)
