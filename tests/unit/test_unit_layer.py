"""The unit layer's guard (tests/unit/conftest.py) trips on each thing a unit test may not do:
start a process, import a native engine, look up the packaged models or open their files."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import multiprocessing
import os
import subprocess
from typing import Any

import pytest

from bunkhouse.catalog import build_catalog, packaged
from bunkhouse.config import Settings, default_cache_dir
from bunkhouse.engines import ENGINES
from tests.unit.conftest import GUARD, UnitLayerViolation, refused


def test_a_process_is_refused() -> None:
    with refused("started a process"):
        subprocess.run(["true"], check=False)
    with refused("started a process"):
        os.system("true")
    with refused("started a process"):
        os.posix_spawn("/bin/true", ["true"], {})


def test_an_asyncio_subprocess_is_refused() -> None:
    async def go() -> None:
        with refused("started a process"):
            await asyncio.create_subprocess_exec("true")

    asyncio.run(go())


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_multiprocessing_process_is_refused(method: str) -> None:
    context: Any = multiprocessing.get_context(method)  # typeshed's BaseContext has no Process
    with refused("started a process"):
        context.Process(target=print).start()


@pytest.mark.parametrize("name", ["xllamacpp", "faster_whisper", "ctranslate2",
                                  "bunkhouse.worker.engines.llamacpp"])
def test_a_native_engine_is_not_imported(name: str) -> None:
    with refused(f"imported {name}"):
        importlib.import_module(name)


def test_the_packaged_models_are_not_looked_up() -> None:
    with refused("looked up the packaged model distribution"):
        build_catalog(Settings(), engines=ENGINES)  # include_packaged by default
    with refused("looked up the packaged model distribution"):
        packaged.directory_path(packaged.WHISPER_TINY_EN)
    assert importlib.metadata.distribution("pytest").metadata["Name"] == "pytest"  # others are


def test_a_packaged_models_file_is_not_opened() -> None:
    with refused("opened a packaged model's file"), \
            open(default_cache_dir() / "models" / packaged.GEMMA3_270M.filename, "rb"):
        pass


def test_a_refusal_the_code_swallows_still_fails_its_phase() -> None:
    with pytest.raises(UnitLayerViolation, match="started a process"), GUARD.on(), \
            contextlib.suppress(Exception):
        subprocess.run(["true"], check=False)
    assert GUARD.active and not GUARD.violations  # the test's own phase goes on, guarded
