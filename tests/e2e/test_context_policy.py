"""What happens when a prompt fits a slot but prompt + max_tokens does not: by default the
answer is generated until the slot is full (finish_reason "length"), as local servers do;
with --strict-context it is OpenAI's 400. A prompt that cannot fit at all is a 400 either way.
And on defaults, the OpenAI SDK's max_tokens=4096 after a 1,000-token prompt is served."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import Server, serve
from tests.models import GEMMA, QWEN


def _count(url: str, model: str, text: str) -> int:
    chat = httpx.post(f"{url}/v1/completions", timeout=300,
                      json={"model": model, "prompt": text, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    tokens: int = chat.json()["usage"]["prompt_tokens"]
    return tokens


@pytest.mark.parametrize("strict", [False, True])
def test_max_tokens_past_the_slot(tmp_path: Path, strict: bool) -> None:
    flags = ("--strict-context",) if strict else ()
    with serve(tmp_path, "--no-source", "hf_cache", "--context", "512", "--parallel", "2",
               "--preload", GEMMA, *flags) as server:
        assert server.model(GEMMA)["slot_context"] == 256
        prompt = "Once upon a time, " * 20
        tokens = _count(server.url, GEMMA, prompt)
        body = {"model": GEMMA, "prompt": prompt, "max_tokens": 4096, "ignore_eos": True}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        if strict:
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
        else:
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 256 - tokens
        # a prompt that cannot fit at all is a 400 either way
        too_long = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": GEMMA, "prompt": "Once upon a time, " * 200, "max_tokens": 8})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "prompt"


def test_the_openai_sdks_max_tokens_4096_on_defaults(qwen_server: Server) -> None:
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa " * 100).strip()
    server = qwen_server  # tests/e2e/conftest.py: Qwen on every default
    model = server.model(QWEN)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        answer = client.chat.completions.create(
            model=QWEN, max_tokens=4096, temperature=0, messages=[
                {"role": "user", "content": f"{words}\n\nHow many different Greek letter "
                                            "names are in the text above? One number."}])
    assert answer.usage is not None and answer.usage.prompt_tokens >= 1000
    assert answer.choices[0].message.content
    assert model["slot_context"] >= answer.usage.prompt_tokens + 4096
