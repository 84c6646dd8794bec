"""The unit layer runs on fakes: it starts no process, imports no native engine, and neither
looks up the packaged models nor opens their files. What needs one of those belongs in
tests/integration.

The guard below enforces it. While a unit test is collected, set up, run or torn down:

- a process start (``subprocess``, asyncio's subprocesses, ``os.system``/``fork``/``exec``/
  ``posix_spawn``, multiprocessing's spawn) fails in the test, through an audit hook
  (``sys.addaudithook``) and multiprocessing's one spawning function;
- an import of a native engine (``xllamacpp``, ``faster_whisper``, ``ctranslate2``, ``mlx``,
  ``mlx_lm``) or of the llama.cpp adapter that imports it fails, through a finder first on
  ``sys.meta_path``; those modules are hidden from ``sys.modules`` meanwhile, so the import
  is refused even where an integration test earlier in the session loaded them;
- a lookup of a packaged model's distribution (``importlib.metadata.distribution``, which the
  catalog's locator uses) or an ``open`` of a file of the installed parts, the Whisper
  directory or the assembled models in the cache fails.

Each refusal raises :class:`UnitLayerViolation` where it happens and is recorded; a refusal
the code under test caught and swallowed still fails the test when its phase ends.
tests/unit/test_unit_layer.py proves that each one trips.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import multiprocessing.util
import os
import re
import sys
import types
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import pytest

from bunkhouse.catalog import packaged
from bunkhouse.config import default_cache_dir
from bunkhouse.errors import PackagedModelError

NATIVE = ("xllamacpp", "faster_whisper", "ctranslate2", "mlx", "mlx_lm",
          "bunkhouse.worker.engines.llamacpp")
SPAWNS = frozenset({"subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec",
                    "os.fork", "os.forkpty"})


class UnitLayerViolation(AssertionError):
    """A unit test did what only an integration test may do."""


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _packaged_distributions() -> frozenset[str]:
    names = [part.distribution for model in packaged.KNOWN for part in model.parts]
    names += [directory.distribution for directory in packaged.DIRECTORIES]
    return frozenset(_canonical(name) for name in names)


def _model_file_places() -> tuple[str, ...]:
    """Where the packaged models' files are: each installed part's folder, the Whisper
    directory, the cache's assembled models (looked up once, before any test runs)."""
    places = {str(default_cache_dir() / "models")}
    for model in packaged.KNOWN:
        with contextlib.suppress(PackagedModelError):  # half installed: its own error, later
            places.update(str(path.parent) for path in packaged.part_paths(model) or ())
    for directory in packaged.DIRECTORIES:
        with contextlib.suppress(PackagedModelError):
            found = packaged.directory_path(directory)
            if found is not None:
                places.add(str(found))
    return tuple(sorted(places))


class Guard:
    """What a unit test may not do, refused while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []
        self.distributions = _packaged_distributions()
        self.places = _model_file_places()
        self._distribution = importlib.metadata.distribution
        self._spawnv_passfds = multiprocessing.util.spawnv_passfds

    def refuse(self, what: str) -> None:
        self.violations.append(what)
        raise UnitLayerViolation(f"a unit test {what}: that belongs in tests/integration")

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        if event in SPAWNS:
            self.refuse(f"started a process ({event} {args[:1]!r})")
        elif event == "open" and isinstance(args[0], str | os.PathLike):
            path = os.fspath(args[0])
            if isinstance(path, str) and path.startswith(self.places):
                self.refuse(f"opened a packaged model's file ({path})")

    def distribution(self, name: str) -> importlib.metadata.Distribution:
        if self.active and _canonical(name) in self.distributions:
            self.refuse(f"looked up the packaged model distribution {name!r}")
        return self._distribution(name)

    def spawnv_passfds(self, path: bytes, args: Sequence[str], passfds: Sequence[int]) -> int:
        if self.active:
            self.refuse(f"started a process (multiprocessing {path!r})")
        pid: int = self._spawnv_passfds(path, args, passfds)
        return pid

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Active for one phase; fails it with what was refused, even if it was caught."""
        was_active, outer = self.active, self.violations
        hidden = {name: sys.modules.pop(name) for name in _loaded()}
        self.active, self.violations = True, []
        try:
            yield
        finally:
            caught = self.violations
            self.active, self.violations = was_active, outer
            loaded = _loaded()
            for name in loaded:
                del sys.modules[name]
            sys.modules.update(hidden)
        caught += [f"imported {name}" for name in loaded]
        if caught:
            raise UnitLayerViolation(f"a unit test {caught[0]}: that belongs in "
                                     f"tests/integration (all refused: {caught})")


def _native(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in NATIVE)


def _loaded() -> list[str]:
    """The native modules in ``sys.modules`` (a module's parents are loaded before it)."""
    if not any(root in sys.modules for root in NATIVE):
        return []
    return [name for name in sys.modules if name.startswith(NATIVE) and _native(name)]


class NativeFinder(importlib.abc.MetaPathFinder):
    """Refuses the native engines' imports while the guard is active."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if self.guard.active and _native(fullname):
            self.guard.refuse(f"imported {fullname}")
        return None


GUARD = Guard()
sys.addaudithook(GUARD.audit)  # an audit hook cannot be removed: it is idle when inactive
sys.meta_path.insert(0, NativeFinder(GUARD))
importlib.metadata.distribution = GUARD.distribution  # type: ignore[assignment]
multiprocessing.util.spawnv_passfds = GUARD.spawnv_passfds  # type: ignore[assignment]


@contextlib.contextmanager
def refused(what: str) -> Iterator[None]:
    """For the guard's own tests: ``what`` (a regex) is refused inside, and forgiven."""
    with pytest.raises(UnitLayerViolation, match=what):
        yield
    GUARD.violations.clear()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def _guarded_phase(item: pytest.Item) -> Generator[None, object, object]:
    with GUARD.on():
        return (yield)


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = _guarded_phase


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    """A unit test module's import is guarded too (a native import at its top)."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    report = None
    try:
        with GUARD.on():
            report = yield
    except UnitLayerViolation as e:
        if report is None:
            raise
        if report.passed:  # a failed import already says where it was refused
            report.outcome, report.longrepr = "failed", str(e)
    return report
