"""The MLX worker's own rules, on a real worker process: a load without the extra installed
fails saying how to install it; the worker's answers are the tokenizer's exact decoding, stop
strings cut them, and a refused field is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bunkhouse.worker.main import EXIT_LOAD_FAILED
from tests.helpers import CHILD_PYTHONPATH, wait_for

ENGINE = "bunkhouse.worker.engines.mlx:MlxEngine"


def _argv(model: Path, sock: Path, model_id: str = "smollm-mlx") -> list[str]:
    return [sys.executable, "-m", "bunkhouse.worker", "--engine", ENGINE, "--model-id",
            model_id, "--model-path", str(model), "--socket", str(sock), "--context", "1024",
            "--parallel", "2"]


def test_mlx_without_the_extra_fails_saying_how_to_install_it(tmp_path: Path,
                                                              mlx_smollm: Path) -> None:
    shadow = tmp_path / "shadow" / "mlx"
    shadow.mkdir(parents=True)  # an `mlx` that cannot be imported, first on the path
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mlx'\", name='mlx')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), CHILD_PYTHONPATH])}
    done = subprocess.run(_argv(mlx_smollm, tmp_path / "w.sock"), env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_LOAD_FAILED, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "pip install 'bunkhouse[mlx]'" in last and "mlx" in last, last


@pytest.fixture(scope="module")
def mlx_socket(tmp_path_factory: pytest.TempPathFactory, mlx_smollm: Path) -> Iterator[Path]:
    sock = tmp_path_factory.mktemp("mlxw") / "w.sock"
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    proc = subprocess.Popen(_argv(mlx_smollm, sock), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: sock.exists() or None, 120, "the MLX worker's socket")
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)


def _post(sock: Path, path: str, body: dict[str, object]) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=300) as client:
        return client.post(f"http://worker{path}", json=body)


def test_mlx_answers_decode_exactly_and_stop_strings_cut_them(mlx_socket: Path) -> None:
    whole = _post(mlx_socket, "/v1/completions", {
        "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert whole.status_code == 200, whole.text
    text = whole.json()["choices"][0]["text"]
    assert text.startswith(" "), text  # the leading space stays (mlx-lm's detokenizer drops it)
    lines = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(mlx_socket)), timeout=300) as c, \
            c.stream("POST", "http://worker/v1/completions", json={
                "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                       if json.loads(line[6:])["choices"])
    assert streamed == text

    stop = text.strip().split(",")[0] + ","  # the answer's first number and its comma
    cut = _post(mlx_socket, "/v1/completions", {
        "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "stop": [stop]})
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"], choice


def test_mlx_refusals_name_the_field(mlx_socket: Path) -> None:
    for body, field in [
            ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
            ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
            ({"prompt": "hi", "n": 2}, "n"),
            ({"prompt": [99_999_999]}, "prompt"),
            ({"prompt": "hi", "stop": 5}, "stop"),
            ({"prompt": "hi", "min_p": 2}, "min_p"),
            ({"prompt": "hi", "min_p": -0.5, "temperature": 0}, "min_p"),
            ({"prompt": "hi", "repeat_penalty": -1}, "repeat_penalty"),
            ({"prompt": "hi " * 600}, "prompt")]:  # past the slot's 512 tokens
        resp = _post(mlx_socket, "/v1/completions", body)
        assert resp.status_code == 400, (body, resp.text)
        assert f"Field '{field}'" in resp.json()["error"]["message"], resp.text


def test_mlx_a_sampled_answer_survives_refusals_and_a_seed_repeats_it(
        mlx_socket: Path) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.5, "seed": 7,
            "ignore_eos": True}
    first = _post(mlx_socket, "/v1/completions", body)
    assert first.status_code == 200, first.text
    for bad in ({"min_p": 2}, {"top_k": 100_000, "min_p": 3}):  # once broke every draw after
        assert _post(mlx_socket, "/v1/completions", {**body, **bad}).status_code == 400
    huge_k = _post(mlx_socket, "/v1/completions", {**body, "top_k": 100_000})
    assert huge_k.status_code == 200, huge_k.text  # past the vocabulary: every token kept
    again = _post(mlx_socket, "/v1/completions", body)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
