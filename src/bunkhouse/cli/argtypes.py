"""The ``type=`` of each flag that is more than a string: each turns one flag's text into its
value, or refuses it with the message argparse prints (exit status 2)."""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlsplit

from bunkhouse.config import parse_size
from bunkhouse.errors import ConfigError


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 1-65535")
    return value


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(e.message) from e


def size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else size(text)


def dir_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("needs a directory")
    return Path(text).expanduser()


def file_path(text: str) -> Path:
    if not text.strip() or text.endswith("/"):
        raise argparse.ArgumentTypeError("needs a file name")
    return Path(text).expanduser()


def count(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 10**9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 10^9")
    return int(text)


def ping_interval(text: str) -> float:
    value = positive(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text!r} is below 0.1 s: pings that often only "
                                         "flood the client")
    return value


def non_negative(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, 0 or more")
    return value


def positive(text: str) -> float:
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def tokens(text: str) -> int:
    if not text.strip().isdigit() or not 64 <= int(text) <= 1 << 24:
        raise argparse.ArgumentTypeError(f"{text!r} is not a context size from 64 to 16777216 "
                                         "tokens")
    return int(text)


def min_tokens(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 1 << 24:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens from 1 to "
                                         "16777216")
    return int(text)


def slots(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of slots from 1 to 256")
    return int(text)


def server_url(text: str) -> str:
    """A running server's address as the client commands call it: ``http://HOST:PORT``
    (``--url`` or ``$BUNKHOUSE_URL``). ``HOST:PORT`` alone means http, as ``OLLAMA_HOST``
    does; an OpenAI client's base URL (``.../v1``) names the same server."""
    base = text.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    if base and "://" not in base:
        base = f"http://{base}"
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a server address; use http://HOST:PORT or HOST:PORT "
            "(--url, else $BUNKHOUSE_URL)")
    return base


def _number(text: str) -> float:
    """``text`` as a number; -1 for text that is none, which every caller refuses."""
    try:
        return float(text)
    except ValueError:
        return -1.0


def ray_address(text: str) -> str:
    """``--ray``: a Ray cluster's ``host:port``, or ``auto``; Ray Client's ``ray://`` is not
    a driver's address."""
    text = text.strip()
    if text.startswith("ray://"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a Ray Client address; give the head's GCS address, host:port "
            "(ray start --head prints it), or 'auto' for $RAY_ADDRESS")
    host, _, port = text.rpartition(":")
    if text != "auto" and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not host:port (the head's address: ray start --head prints it) "
            "or 'auto'")
    return text
