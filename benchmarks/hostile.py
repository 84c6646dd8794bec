"""The front's memory under hostile request heads and bodies, and /health while it lasts.

    python -m benchmarks.hostile [--json PATH]

Against `bunkhouse serve --no-packaged` (no model: the front alone), at once: four 128 MB
headers, one head of 200,000 header fields, a chunked body with 32 MB of trailers, and 200
connections each declaring a 16 MB body and sending 1 MB of it. The front's resident memory
is sampled every 100 ms (benchmarks.common.RssSampler); /health is asked throughout, and each
answer's time is kept. Prints the front's RSS before, at its peak and after, what each probe
was answered, and /health's slowest answer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import RssSampler, bunkhouse

MIB = 1 << 20


def _send(address: tuple[str, int], payload: bytes, read: bool = True) -> bytes:
    with socket.create_connection(address, timeout=120) as sock:
        with contextlib.suppress(OSError):  # the front may close before it has it all
            sock.sendall(payload)
        answer = b""
        with contextlib.suppress(OSError):
            while read and (chunk := sock.recv(65536)):
                answer += chunk
        return answer


def _probes(address: tuple[str, int]) -> dict[str, bytes]:
    head = b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
    probes = {f"128 MB header {i}": head + b"X-Big: " + b"b" * (128 * MIB) for i in range(4)}
    probes["200,000 headers"] = head + b"X: y\r\n" * 200_000 + b"\r\n"
    probes["32 MB of trailers"] = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: "
                                   + b"a" * (32 * MIB))
    answers: dict[str, bytes] = {}
    threads = [threading.Thread(target=lambda k=k, p=p: answers.__setitem__(
        k, _send(address, p)[:40])) for k, p in probes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def _slow_bodies(address: tuple[str, int], n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(address, timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 16000000\r\n\r\n"
                     + b" " * MIB)
        socks.append(sock)
    return socks


def run() -> dict[str, object]:
    with bunkhouse("hostile", "--no-packaged") as (url, proc):
        host, port = url.removeprefix("http://").split(":")
        address = (host, int(port))
        health: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client() as client:
                while not done.is_set():
                    t0 = time.monotonic()
                    client.get(f"{url}/health", timeout=60).raise_for_status()
                    health.append(time.monotonic() - t0)
                    done.wait(0.05)

        with RssSampler(lambda: [proc.pid]) as rss:
            time.sleep(1)
            before = rss.samples[-1][1]
            poller = threading.Thread(target=poll)
            poller.start()
            answers = _probes(address)
            socks = _slow_bodies(address, 200)
            time.sleep(2)
            for sock in socks:
                sock.close()
            time.sleep(2)
            done.set()
            poller.join()
            after = rss.samples[-1][1]
        return {
            "rss_before_mib": before / MIB, "rss_peak_mib": rss.peak / MIB,
            "rss_after_mib": after / MIB,
            "answers": {k: v.decode(errors="replace").split("\r\n")[0]
                        for k, v in answers.items()},
            "health_answers": len(health), "health_slowest_ms": 1000 * max(health),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    result = run()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
