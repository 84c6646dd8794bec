"""`bunkhouse serve --api-key`: the openai SDK with the key gets answers, without it 401."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import serve
from tests.models import QWEN

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_api_key_guards_inference(tmp_path: Path) -> None:
    keyfile = tmp_path / "admin.keys"
    keyfile.write_text("# admin keys\nadmin-one\n")
    with serve(tmp_path, "--api-key", "sk-local-1", "--admin-key-file", str(keyfile),
               env={"BUNKHOUSE_API_KEYS": "sk-local-2"}) as server:
        for key in ("sk-local-1", "sk-local-2", "admin-one"):
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key=key) as client:
                reply = client.chat.completions.create(
                    model=QWEN, messages=FRANCE, max_tokens=16, temperature=0)  # type: ignore[arg-type]
                assert "Paris" in (reply.choices[0].message.content or "")
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                           max_retries=0) as client, pytest.raises(openai.AuthenticationError):
            client.models.list()
        resp = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": FRANCE, "max_tokens": 4})
        assert resp.status_code == 401
        assert "sk-local" not in server.log.read_text()  # keys are never logged
