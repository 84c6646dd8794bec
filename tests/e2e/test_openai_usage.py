"""OpenAI's usage and ids through `bunkhouse serve` with the real `openai` SDK: several
choices (``n``) and several prompts are each counted, a stream's usage comes once, last and
only when asked, and completions are ``cmpl-`` ``text_completion`` objects."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.server import Server
from tests.models import QWEN

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(qwen_server: Server) -> Server:
    return qwen_server  # tests/e2e/conftest.py: one server for the modules that share it


@pytest.fixture(scope="module")
def sdk(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client


def test_every_choice_and_every_prompt_is_counted(sdk: openai.OpenAI) -> None:
    one = sdk.chat.completions.create(model=QWEN, messages=HI, max_tokens=1, temperature=0)
    two = sdk.chat.completions.create(model=QWEN, messages=HI, max_tokens=3, n=2)
    assert one.usage is not None and two.usage is not None and len(two.choices) == 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # one prompt, counted once
    assert two.usage.completion_tokens == 6  # 3 each: no EOS within 3 tokens of "hi"
    prompts = ["The capital of France is", "def add(a, b):"]
    alone = [sdk.completions.create(model=QWEN, prompt=p, max_tokens=2, temperature=0)
             for p in prompts]
    both = sdk.completions.create(model=QWEN, prompt=prompts, max_tokens=2, temperature=0)
    assert both.usage is not None and all(a.usage is not None for a in alone)
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert both.usage.completion_tokens == sum(
        a.usage.completion_tokens for a in alone if a.usage)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens
    for answer in (*alone, both):
        assert answer.id.startswith("cmpl-") and answer.object == "text_completion"


def test_a_stream_sends_usage_once_last_and_only_when_asked(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(
        model=QWEN, messages=HI, max_tokens=2, n=2, stream=True,
        stream_options={"include_usage": True}))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    for asked in (False, True):  # a list of prompts; not asked, asked
        pieces = list(sdk.completions.create(model=QWEN, prompt=["x", "y"], max_tokens=2,
                                             stream=True,
                                             stream_options={"include_usage": asked}))
        assert None not in pieces and all(p.id.startswith("cmpl-") for p in pieces)
        assert all(p.object == "text_completion" for p in pieces)
        assert all(p.usage is None for p in pieces[:-1])
        assert (pieces[-1].usage is not None) is asked
        if asked:
            assert pieces[-1].choices == [] and pieces[-1].usage is not None
            assert pieces[-1].usage.completion_tokens == 4
    for options in ({}, {"stream_options": {"include_usage": True}}):  # fill in the middle
        filled = list(sdk.completions.create(model=QWEN, prompt="def f(", suffix=")\n",
                                             max_tokens=2, stream=True, **options))  # type: ignore[call-overload]
        assert all(p.usage is None for p in filled[:-1])
        assert (filled[-1].usage is not None and filled[-1].choices == []) is bool(options)
