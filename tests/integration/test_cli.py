"""`bunkhouse serve`'s checks before serving that start a process (the worker engine is
imported in a child, as a worker would import it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunkhouse.cli import main
from tests.helpers import write_tiny_gguf


@pytest.mark.parametrize("engine", ["nonexistent_mod:Foo", "tests.fault_engine:Nope", "x"])
def test_a_worker_engine_that_cannot_load_is_refused_before_serving(
        engine: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    code = main(["serve", "--no-packaged", "--models-dir", str(tmp_path),
                 "--worker-engine", engine, "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--worker-engine" in err and "Traceback" not in err
