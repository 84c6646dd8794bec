"""Workers the integration modules share: each start is a process and a model load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bunkhouse.catalog import Catalog
from tests.helpers import worker_socket
from tests.models import QWEN


@pytest.fixture(scope="package")
def qwen_worker(packaged_catalog: Catalog) -> Iterator[Path]:
    """`python -m bunkhouse.worker` serving Qwen on its packaged options, on a socket in a
    private directory: for the modules that only send it requests (none stops, kills or
    reconfigures it); SIGTERMed after the last integration module, which must end it with 0."""
    with worker_socket(packaged_catalog.get(QWEN)) as sock:
        yield sock
