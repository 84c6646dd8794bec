"""The vocabulary's lower bound on tokens, against each packaged model's real tokenizer."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from bunkhouse.catalog import Catalog
from bunkhouse.catalog.vocab import PairTable, pair_table
from tests.helpers import REPO, worker_socket
from tests.models import GEMMA, QWEN


def _texts() -> list[str]:
    rng = random.Random(7)
    alphabet = "abc XYZ 012 ,.;!? \n\t é ü ß 中文 日本語 🙂 ∑ ▁ <|im_start|> <start_of_turn>"
    noise = ["".join(rng.choice(alphabet) for _ in range(400)) for _ in range(5)]
    return [
        (REPO / "README.md").read_text(),
        (REPO / "src/bunkhouse/residency/manager.py").read_text(),
        "The capital of France is Paris. " * 40,
        "a" * 3000, " " * 500, "\n\n\n" * 100, "-=" * 300, "1234567890" * 50,
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<start_of_turn>user\nHello<end_of_turn>\n",
        "人工智能正在改变世界。" * 30, "🙂🙃" * 100, "naïve café déjà vu " * 30,
        *noise,
    ]


@contextmanager
def _worker(request: pytest.FixtureRequest, catalog: Catalog,
            model_id: str) -> Iterator[httpx.Client]:
    """A client of ``model_id``'s worker: the shared Qwen worker (conftest.py), or its own."""
    with contextlib.ExitStack() as stack:
        sock = request.getfixturevalue("qwen_worker") if model_id == QWEN else \
            stack.enter_context(worker_socket(catalog.get(model_id)))
        yield stack.enter_context(httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                                               base_url="http://w", timeout=60))


@pytest.mark.slow
@pytest.mark.parametrize("model_id", [QWEN, GEMMA])
def test_the_bound_never_exceeds_the_real_count(packaged_catalog: Catalog, model_id: str,
                                                request: pytest.FixtureRequest) -> None:
    path = packaged_catalog.get(model_id).path
    table = pair_table(path, path.stat().st_mtime_ns)
    assert isinstance(table, PairTable)
    with _worker(request, packaged_catalog, model_id) as client:
        for add_special in (False, True):
            for text in _texts():
                real = len(client.post("/tokenize", json={
                    "content": text, "add_special": add_special,
                    "parse_special": True}).json()["tokens"])
                bound = table.min_tokens(text)
                assert bound <= real, f"{model_id}: bound {bound} > {real} for {text[:60]!r}"
        prose = (REPO / "README.md").read_text()
        real = len(client.post("/tokenize", json={"content": prose}).json()["tokens"])
        ratio = table.min_tokens(prose) / real
        print(f"{model_id}: the bound is {ratio:.2f} of the real count on the README")
        assert ratio > 0.4  # strong enough to refuse a prompt far over the slot
