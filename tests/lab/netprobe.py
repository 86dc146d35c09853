"""Plain-Python network probes that the lab tests run inside regions with `geotrain lab run`.

    python netprobe.py udp-echo --host 10.77.2.2 --port 9000             # answers every datagram
    python netprobe.py rtt --host 10.77.2.2 --port 9000 --count 40       # prints {"rtt_ms": [...]}
    python netprobe.py tcp-sink --host 10.77.2.2 --port 9001 --seconds 8 --warmup 2   # prints {"mbit_s": ..}
    python netprobe.py tcp-source --host 10.77.2.2 --port 9001 --seconds 9
    python netprobe.py tcp-whoami --host 10.77.1.2 --port 9002           # tells each client where it sees it
    python netprobe.py tcp-ask --host 10.77.1.2 --port 9002              # prints {"answer": "HOST:PORT"} or {"error": ..}

The sink counts the bytes that arrive after the warm-up (TCP's slow start) until the end of the
measurement window: the goodput a user's transfer would see.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

CHUNK = 256 * 1024


def udp_echo(host: str, port: int) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((host, port))
    print("ready", flush=True)
    while True:
        data, sender = server.recvfrom(2048)
        server.sendto(data, sender)


def rtt(host: str, port: int, count: int, interval_s: float) -> None:
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(2.0)
    samples = []
    for sequence in range(count):
        payload = sequence.to_bytes(4, "big")
        started = time.perf_counter()
        client.sendto(payload, (host, port))
        try:
            while client.recv(2048) != payload:
                pass
        except socket.timeout:
            continue
        samples.append((time.perf_counter() - started) * 1000)
        time.sleep(interval_s)
    print(json.dumps({"rtt_ms": samples}), flush=True)


def tcp_sink(host: str, port: int, seconds: float, warmup_s: float) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(1)
    print("ready", flush=True)
    connection, _ = server.accept()
    started = time.perf_counter()
    counted, window_start, window_end = 0, started + warmup_s, started + warmup_s + seconds
    while True:
        data = connection.recv(CHUNK)
        now = time.perf_counter()
        if not data or now >= window_end:
            break
        if now >= window_start:
            counted += len(data)
    connection.close()
    measured_s = min(time.perf_counter(), window_end) - window_start
    print(json.dumps({"bytes": counted, "seconds": measured_s, "mbit_s": counted * 8 / measured_s / 1e6}),
          flush=True)


def tcp_source(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            client = socket.create_connection((host, port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    payload = b"\0" * CHUNK
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            client.sendall(payload)
    except OSError:
        pass  # the sink closes when its window is over
    client.close()


def tcp_whoami(host: str, port: int) -> None:
    server = socket.create_server((host, port))
    print("ready", flush=True)
    while True:
        connection, (peer_host, peer_port) = server.accept()
        connection.sendall(f"{peer_host}:{peer_port}\n".encode())
        connection.close()


def tcp_ask(host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as client:
            answer = client.makefile().readline().strip()
        print(json.dumps({"answer": answer}), flush=True)
    except OSError as error:
        print(json.dumps({"error": type(error).__name__}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("udp-echo", "rtt", "tcp-sink", "tcp-source", "tcp-whoami", "tcp-ask"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    args = parser.parse_args()
    if args.mode == "udp-echo":
        udp_echo(args.host, args.port)
    elif args.mode == "rtt":
        rtt(args.host, args.port, args.count, args.interval)
    elif args.mode == "tcp-sink":
        tcp_sink(args.host, args.port, args.seconds, args.warmup)
    elif args.mode == "tcp-source":
        tcp_source(args.host, args.port, args.seconds)
    elif args.mode == "tcp-whoami":
        tcp_whoami(args.host, args.port)
    else:
        tcp_ask(args.host, args.port, args.seconds)


if __name__ == "__main__":
    main()
