"""Servers the e2e modules share: each start is a front, a spare worker and a model load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.server import Server, serve
from tests.models import QWEN


@pytest.fixture(scope="package")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`bunkhouse serve --preload` Qwen, every other setting its default: for the modules
    that ask nothing else of a server and restart, kill or reconfigure none (Anthropic's and
    Ollama's APIs, llama.cpp's routes, the OpenAI SDK's defaults). It lives until the last e2e
    module has run, and stops as `serve` stops any (no worker left behind)."""
    with serve(tmp_path_factory.mktemp("qwen"), "--preload", QWEN) as server:
        yield server
