"""The commands that talk to a running server: ``ps``, ``events``, ``load``/``unload``/
``pin``/``unpin``, ``reload``/``default``/``pause``/``resume`` and ``transcribe``.

Each prints what it got and answers an exit status: 0 done, 1 refused or unreachable,
2 a bad argument."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bunkhouse.cli.output import (
    control_line,
    event_line,
    format_ps,
    printable,
    server_line,
)

_UNREACHABLE = 3  # bunkhouse ps: no server answered (--watch tries again)


def ps(url: str, key: str | None = None, watch_s: float | None = None) -> int:
    """``bunkhouse ps``: once, or redrawn every ``watch_s`` seconds until interrupted."""
    if watch_s is None:
        return min(_ps_once(url, key), 1)
    try:
        while True:
            print("\033[H\033[2J", end="")  # clear the terminal, as watch(1) does
            code = _ps_once(url, key)
            if code and code != _UNREACHABLE:  # a refused key: no retry helps
                return code
            print(f"\nevery {watch_s:g} s; Ctrl-C to stop")
            time.sleep(watch_s)
    except KeyboardInterrupt:
        return 0


def _ps_once(url: str, key: str | None) -> int:
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/stats", timeout=10, headers=headers)
        if resp.status_code in (401, 403):
            print(f"bunkhouse: error: {resp.json()['error']['message']} (--api-key)",
                  file=sys.stderr)
            return 1
        stats = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"bunkhouse: error: cannot read {url}/stats: {e}; is `bunkhouse serve` running "
              "there? (--url or $BUNKHOUSE_URL sets the address)", file=sys.stderr)
        return _UNREACHABLE
    print(format_ps(stats))
    return 0


def follow_events(url: str, key: str | None, since: int | None, as_json: bool) -> int:
    """``bunkhouse events``: print the server's residency events as they come, resuming by
    sequence number after a lost connection, until interrupted."""
    import httpx

    # Ctrl-C (SIGINT) stops it even when it was started with SIGINT ignored or blocked (as a
    # child of a process that ignores it): it has nothing to finish
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    base = url.rstrip("/")
    last = since
    warned = False
    try:
        while True:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            if last is not None:
                headers["last-event-id"] = str(last)
            try:
                with httpx.stream("GET", f"{base}/admin/events", headers=headers,
                                  timeout=httpx.Timeout(10, read=120)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}"
                              f"{' (--api-key)' if resp.status_code in (401, 403) else ''}",
                              file=sys.stderr)
                        return 1
                    warned = False
                    for line in resp.iter_lines():
                        if line.startswith("id:"):
                            last = int(line[3:].strip())
                        elif line.startswith("data:"):
                            print(event_line(line[5:].strip(), as_json), flush=True)
            except httpx.HTTPError as e:
                if not warned:
                    print(f"bunkhouse: {base}/admin/events: {e}; retrying every 2 s "
                          "(Ctrl-C to stop)", file=sys.stderr)
                    warned = True
            time.sleep(2)
    except KeyboardInterrupt:
        return 0


def _message(resp: Any) -> str:
    """An error answer's message: the envelope's, else its text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(resp.text)


def _admin_post(base: str, path: str, key: str | None, body: dict[str, Any] | None
                ) -> Any:
    """POST to a running server's admin route: the answer, or None once the failure is
    printed (unreachable, or an error status with its message)."""
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=600)
    except httpx.HTTPError as e:
        print(f"bunkhouse: error: cannot reach {base}: {e}; is `bunkhouse serve` running "
              "there? (--url or $BUNKHOUSE_URL sets the address)", file=sys.stderr)
        return None
    if resp.status_code >= 400:
        print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}", file=sys.stderr)
        return None
    return resp


def control(verb: str, model: str, url: str, key: str | None, path: str | None) -> int:
    """``bunkhouse load|unload|pin|unpin ID`` against a running server."""
    base = url.rstrip("/")
    if verb == "load" and path:
        resp = _admin_post(base, "/v1/models", key, {"id": model, "path": path})
    else:
        resp = _admin_post(base, f"/v1/models/{model}/{verb}", key, None)
    if resp is None:
        return 1
    body = resp.json() if resp.status_code not in (202, 204) else None
    print(control_line(verb, model, resp.status_code, body))
    return 0


def server_call(verb: str, model: str | None, url: str, key: str | None,
                max_s: float | None = None) -> int:
    """``bunkhouse reload``, ``default ID``, ``pause`` and ``resume`` against a running
    server: each prints what changed, from the server's answer (or that nothing did)."""
    body: dict[str, Any] = {"model": model} if verb == "default" else {}
    if verb == "pause" and max_s is not None:
        body["max_s"] = max_s
    resp = _admin_post(url.rstrip("/"), f"/admin/{verb}", key, body)
    if resp is None:
        return 1
    data = resp.json()
    print(server_line(verb, data))
    return 1 if verb == "pause" and not data["paused"] else 0


def transcribe(path: Path, url: str, key: str | None, model: str, language: str | None,
               fmt: str) -> int:
    """``bunkhouse transcribe FILE``: the text streamed as it is transcribed, or the answer
    in another format printed whole."""
    import httpx

    try:
        audio = path.expanduser().open("rb")
    except OSError as e:
        print(f"bunkhouse: error: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    fields = {"model": model, "response_format": "json" if fmt == "text" else fmt,
              **({"language": language} if language else {}),
              **({"stream": "true"} if fmt == "text" else {})}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    base = url.rstrip("/")  # --url / $BUNKHOUSE_URL, as cli/argtypes.py server_url made it
    try:
        with audio, httpx.stream("POST", f"{base}/v1/audio/transcriptions", data=fields,
                                 files={"file": (path.name, audio)}, headers=headers,
                                 timeout=httpx.Timeout(600, connect=10)) as resp:
            if resp.status_code >= 400:
                resp.read()
                print(f"bunkhouse: error: {resp.status_code}: {_message(resp)}",
                      file=sys.stderr)
                return 1
            if fmt != "text":
                print(resp.read().decode("utf-8", errors="replace").rstrip("\n"))
                return 0
            try:
                return _print_deltas(resp.iter_lines())
            except httpx.HTTPError:
                print("\nbunkhouse: error: the server closed the stream before the "
                      "transcription ended", file=sys.stderr)
                return 1
    except httpx.HTTPError as e:
        print(f"bunkhouse: error: cannot reach {base}: {e}; is `bunkhouse serve` running "
              "there? (--url or $BUNKHOUSE_URL sets the address)", file=sys.stderr)
        return 1


def _print_deltas(lines: Iterator[str]) -> int:
    """Print a transcription stream's deltas as they come; 1 on its error event."""
    started = False
    for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if event.get("type") == "transcript.text.delta":
            delta = printable(str(event.get("delta", "")))
            print(delta if started else delta.lstrip(), end="", flush=True)
            started = True
        elif event.get("type") == "transcript.text.done":
            print()
            return 0
        elif event.get("type") == "error":
            print(f"\nbunkhouse: error: {event.get('error', {}).get('message')}",
                  file=sys.stderr)
            return 1
    print()
    return 1
