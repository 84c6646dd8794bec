"""The pure translations behind the drop-in routes: Ollama's keep_alive and embeddings, fill-
in-the-middle in OpenAI's and Ollama's terms, Ollama's params as request defaults."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bunkhouse.api import infill, ollama
from bunkhouse.catalog.sources import ollama_params
from bunkhouse.errors import InvalidRequest


@pytest.mark.parametrize(("given", "seconds"), [
    (None, None), (0, 0.0), ("0", 0.0), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3),
    (90, 90.0), (-1, math.inf), ("-1m", math.inf), ("2.5s", 2.5), ("10", 10.0),
    ("99999999999h", math.inf), (1e30, math.inf),
])
def test_keep_alive(given: Any, seconds: float | None) -> None:
    assert ollama.keep_alive({"keep_alive": given}) == seconds


@pytest.mark.parametrize("given", ["forever", "5 minutes", True, [1], "1e999", "m5", "x" * 100])
def test_bad_keep_alive_names_the_field(given: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        ollama.keep_alive({"keep_alive": given})
    assert e.value.param == "keep_alive"


def test_embed_requests_and_answers() -> None:
    assert ollama.embed_request({"model": "m", "input": "a"}, legacy=False)["input"] == ["a"]
    assert ollama.embed_request({"model": "m", "prompt": "a"}, legacy=True)["input"] == ["a"]
    for body, legacy, param in (({"model": "m", "input": []}, False, "input"),
                                ({"model": "m", "input": [1]}, False, "input"),
                                ({"model": "m", "prompt": ["a"]}, True, "prompt"),
                                ({"input": "a"}, False, "model"),
                                ({"model": "m", "input": "a", "truncate": "no"}, False,
                                 "truncate")):
        with pytest.raises(InvalidRequest) as e:
            ollama.embed_request(body, legacy)
        assert e.value.param == param
    result = {"data": [{"index": 1, "embedding": [0.0, 1.0]},
                       {"index": 0, "embedding": [1.0, 0.0]}], "usage": {"prompt_tokens": 4}}
    assert ollama.embed_answer(result, "m", legacy=False) == {
        "model": "m", "embeddings": [[1.0, 0.0], [0.0, 1.0]], "prompt_eval_count": 4}
    assert ollama.embed_answer(result, "m", legacy=True) == {"embedding": [1.0, 0.0]}


def test_suffix_becomes_infill_and_its_answer_a_completion() -> None:
    body = infill.from_completion({"model": "m", "prompt": "def f():\n    ", "suffix": "\n",
                                   "max_tokens": 5})
    assert body == {"model": "m", "max_tokens": 5, "input_prefix": "def f():\n    ",
                    "input_suffix": "\n"}
    for bad, param in (({"prompt": ["a", "b"], "suffix": "x"}, "prompt"),
                       ({"prompt": "a", "suffix": "x", "echo": True}, "echo")):
        with pytest.raises(InvalidRequest) as e:
            infill.from_completion(bad)
        assert e.value.param == param
    completions = infill.Completions("m")
    piece = completions.convert({"content": "return", "stop": False})
    assert piece["choices"][0] == {"index": 0, "text": "return", "logprobs": None,
                                   "finish_reason": None}
    last = completions.convert({"content": "", "stop": True, "stop_type": "limit",
                                "tokens_predicted": 5, "tokens_evaluated": 9})
    assert last["choices"][0]["finish_reason"] == "length" and last["id"] == piece["id"]
    assert last["usage"] == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    path, generate = ollama.generate_request({"model": "m", "prompt": "a", "suffix": "b"},
                                             templated=True)
    assert path == "/infill" and generate["input_prefix"] == "a"


def test_ollama_params_become_request_defaults() -> None:
    assert ollama_params({"stop": ["<end_of_turn>"], "temperature": 0.7, "num_ctx": 4096,
                          "num_predict": 64, "top_k": "40", "mirostat": 2}) == {
        "stop": ["<end_of_turn>"], "temperature": 0.7, "max_tokens": 64}
    assert ollama_params({"stop": "x"}) == {"stop": ["x"]}
    assert ollama_params({"temperature": "hot", "top_k": 1e400, "top_p": 7}) == {}


def test_embeddings_pool_as_the_model_file_says() -> None:
    """Only a model whose file says it pools is started with --pooling (what that becomes
    in llama.cpp's parameters: tests/integration/test_llamacpp_params.py)."""
    import dataclasses
    from pathlib import Path

    from bunkhouse.catalog.catalog import CatalogModel
    from bunkhouse.config import EngineOptions
    from bunkhouse.engines import engine_for
    from bunkhouse.gguf.meta import GGUFInfo

    info = GGUFInfo("bert", None, 512, 12, 384, 12, 12, 32, 32, None, None, None, 0,
                    pooling=True)
    embedder = CatalogModel("e", Path("/m/e.gguf"), "config", info, EngineOptions(), 1)
    generator = dataclasses.replace(embedder, info=dataclasses.replace(info, pooling=False))
    assert "--pooling" in engine_for(embedder).worker_args(embedder)
    assert "--pooling" not in engine_for(generator).worker_args(generator)

def test_several_infill_answers_are_one_completion_with_a_choice_each() -> None:
    answers = [{"content": "a", "stop": True, "tokens_predicted": 1, "tokens_evaluated": 3},
               {"content": "b", "stop": True, "stop_type": "limit", "tokens_predicted": 2,
                "tokens_evaluated": 3}]
    out = infill.Completions("m").convert(answers)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "a", "stop"), (1, "b", "length")]
    # one prompt: each answer counts it, the answer once (OpenAI's n)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
