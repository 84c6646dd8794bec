"""The llama-server binary of the engine ``llama-server``: where it is, what it can do, what
build it is.

A build from source says ``build 0`` to ``--version``, so its version is no guide to its
features: they are read from its ``--help`` instead (every flag it lists, and whether
``--host`` takes a Unix socket's path). Its build, which keys the KV snapshots it saves, is
the digest of its file and of the llama.cpp libraries beside it (a shared build loads them
from there), so a rebuilt binary never restores another build's slot files.

Inspecting runs the binary twice (``--help``, ``--version``; about 50 ms) and reads its
files once per file version; the answer is kept until the file changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HELP_TIMEOUT_S = 20.0
"""The longest ``--help`` or ``--version`` may take (a binary that hangs is refused)."""

EXECUTABLE = "llama-server"

# What bunkhouse needs of the binary: (what, how its --help shows it).
_NEEDS: tuple[tuple[str, str], ...] = (
    ("listening on a Unix socket (--host PATH.sock)", "unix"),
    ("saving and restoring slots (/slots, --slot-save-path)", "--slot-save-path"),
    ("the /slots endpoint (--slots)", "--slots"),
    ("the /metrics endpoint (--metrics)", "--metrics"),
    ("model aliases (--alias)", "--alias"),
)

_FLAG = re.compile(r"(--?[A-Za-z][\w.-]*)")
_DIGEST_BYTES = 1 << 20


class BinaryRefused(Exception):
    """The binary is missing, does not run, or lacks a feature bunkhouse needs: the message
    says which and what to do."""


@dataclass(frozen=True, slots=True)
class Binary:
    """An inspected llama-server: its path, ``--version``'s first line, every flag its
    ``--help`` lists, and its build (a digest of its files)."""

    path: Path
    version: str
    flags: frozenset[str]
    build: str

    def has(self, *flags: str) -> bool:
        """Whether every one of ``flags`` is one this binary takes."""
        return all(f in self.flags for f in flags)


def find(configured: Path | None) -> Path:
    """The binary to use: the configured one (config ``llama_server`` or ``--llama-server``),
    else ``llama-server`` on PATH. BinaryRefused saying how to name one."""
    if configured is not None:
        return configured
    found = shutil.which(EXECUTABLE)
    if found is None:
        raise BinaryRefused(
            "no llama-server binary: set llama_server = \"PATH\" in the config file, pass "
            "--llama-server PATH to bunkhouse serve, or put llama-server on PATH "
            "(benchmarks/build-llama-server.sh builds one)")
    return Path(found)


_inspected: dict[tuple[str, int, int], Binary] = {}


def inspect(path: Path) -> Binary:
    """``path`` as a llama-server bunkhouse can run (cached per file version); BinaryRefused
    naming what is missing or why it does not run."""
    try:
        st = path.stat()
    except OSError as e:
        raise BinaryRefused(f"llama-server binary {path}: {e.strerror}") from e
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BinaryRefused(f"llama-server binary {path}: not an executable file")
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    known = _inspected.get(key)
    if known is None:
        known = _inspect(path)
        _inspected[key] = known
    return known


def _inspect(path: Path) -> Binary:
    text = _run(path, "--help")
    flags = _flags(text)
    if not {"-c", "--ctx-size"} & flags or "--host" not in flags:
        raise BinaryRefused(f"{path} does not look like llama-server: its --help lists no "
                            "--ctx-size or --host flag; name llama.cpp's llama-server binary "
                            "itself (a wrapper script should `exec` it)")
    missing = [what for what, sign in _NEEDS
               if (sign not in flags if sign.startswith("-") else not _takes_socket(text))]
    if missing:
        raise BinaryRefused(
            f"llama-server binary {path} is too old for bunkhouse: it lacks "
            f"{'; '.join(missing)}; use a llama.cpp build from 2025 or later "
            "(benchmarks/build-llama-server.sh builds one)")
    version = (_run(path, "--version").strip().splitlines() or ["unknown"])[0]
    binary = Binary(path, version, flags, _build(path, version))
    log.info("llama-server binary %s: %s, build %s, %d flags", path, version, binary.build,
             len(flags))
    return binary


def _run(path: Path, flag: str) -> str:
    try:  # its own process group: a wrapper script's children go with it
        child = subprocess.Popen([str(path), flag], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError as e:
        raise BinaryRefused(f"llama-server binary {path} does not run: {e.strerror}") from e
    try:
        out, _ = child.communicate(timeout=HELP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BinaryRefused(f"llama-server binary {path}: {flag} did not answer within "
                            f"{HELP_TIMEOUT_S:.0f} s") from e
    finally:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
    text = out.decode("utf-8", errors="replace")
    if child.returncode != 0:
        last = text.strip().splitlines()[-1:] or ["no output"]
        raise BinaryRefused(f"llama-server binary {path}: {flag} failed with code "
                            f"{child.returncode} ({last[0][:200]})")
    return text


def _flags(help_text: str) -> frozenset[str]:
    """Every flag a ``--help`` lists: the names at the start of its option lines (``-c,
    --ctx-size N``; ``--spec-draft-ngl, -ngld, --gpu-layers-draft N``)."""
    flags: set[str] = set()
    for line in help_text.splitlines():
        if not line.startswith("-"):
            continue
        for word in line.split():  # names end at the first without a comma after it
            name = _FLAG.fullmatch(word.rstrip(","))
            if name is None:
                break
            flags.add(name.group(1))
            if not word.endswith(","):
                break
    return frozenset(flags)


def _takes_socket(help_text: str) -> bool:
    """Whether ``--host`` takes a Unix socket's path (llama.cpp: "UNIX socket paths ending
    in .sock", since 2025)."""
    at = help_text.find("--host")
    return at >= 0 and ".sock" in help_text[at:at + 400]


def _build(path: Path, version: str) -> str:
    """A digest of the binary, the llama.cpp libraries beside it, and its version line."""
    digest = hashlib.sha256(version.encode())
    real = path.resolve()
    libraries = sorted(p for p in real.parent.glob("lib*.so*")
                       if p.is_file() and not p.is_symlink())
    for file in (real, *libraries):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(_DIGEST_BYTES):
                digest.update(chunk)
    return digest.hexdigest()[:16]
