"""The llama.cpp adapter's parameters, as xllamacpp (the native engine) reads them."""

from __future__ import annotations

from pathlib import Path

import xllamacpp

from bunkhouse.engines import options as opts
from bunkhouse.engines.llamacpp import LlamaCppOptions
from bunkhouse.worker.engine import WorkerConfig
from bunkhouse.worker.engines.llamacpp import build_params


def test_an_embedders_pooling_reaches_llama_cpp(tmp_path: Path) -> None:
    """``--pooling model`` leaves the choice to the model file; ``mean`` is passed on."""
    pooling = xllamacpp.llama_pooling_type
    for kind, expected in (("model", pooling.LLAMA_POOLING_TYPE_UNSPECIFIED),
                           ("mean", pooling.LLAMA_POOLING_TYPE_MEAN)):
        config = WorkerConfig("e", Path("/m/e.gguf"), tmp_path / "w.sock", 512, 1,
                              embeddings=True, pooling=kind)
        assert build_params(config).pooling_type == expected


def test_the_llamacpp_worker_sets_its_options_on_the_engine(tmp_path: Path) -> None:
    own = LlamaCppOptions(cache_ram_mib=64, threads=3, swa_full=True)
    config = WorkerConfig("m", tmp_path / "m.gguf", tmp_path / "w.sock", 512, 1,
                          engine_options=opts.worker_args(own)[1])
    params = build_params(config)
    assert (params.cache_ram_mib, params.swa_full) == (64, True)
    assert params.cpuparams.n_threads == params.cpuparams_batch.n_threads == 3


# Fields the front bounds more tightly than the engine does (work or output multiplied, or a
# range the engine clamps rather than refuses): only the others are compared.
_FRONT_TIGHTER = frozenset({"n_probs", "n_cmpl", "mirostat", "top_k", "id_slot",
                            "t_max_predict_ms"})


def test_the_engines_ranges_are_the_fronts(qwen_worker: Path) -> None:
    """Each integer field's range in EXTENSION_BOUNDS is the one the engine holds it to: it
    takes both ends and refuses one past the low end (``repeat_last_n: -1`` was refused by
    the engine after the front let it through). ``n_predict: 0`` still generates a token,
    which is why the front refuses it."""
    import httpx

    from bunkhouse.engines.llamacpp import EXTENSION_BOUNDS

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(qwen_worker)),
                      base_url="http://worker", timeout=120) as client:
        def status(fields: dict[str, int]) -> int:
            body = {"prompt": "hi", "n_predict": 1, "grammar": 'root ::= "a"', **fields}
            return client.post("/completion", json=body).status_code

        for name, (lo, hi) in EXTENSION_BOUNDS.items():
            if name in _FRONT_TIGHTER:
                continue
            assert status({name: lo - 1}) != 200, name
            assert status({name: lo}) == status({name: hi}) == 200, name
        made = client.post("/completion", json={"prompt": "hi", "n_predict": 0}).json()
        assert made["tokens_predicted"] == 1
