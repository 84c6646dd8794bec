"""Speculative decoding and KV cache types as llama.cpp options: the pure parts (the options'
checks, the refusals read from GGUF headers, the estimate's parts, the figures shown)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from bunkhouse.catalog.catalog import CatalogModel, resolve_draft, settle
from bunkhouse.cli.output import _options_line
from bunkhouse.config import EngineOptions
from bunkhouse.engines import llamacpp_spec as spec
from bunkhouse.engines.contract import Draft
from bunkhouse.engines.llamacpp import (
    DRAFT_CONTEXT_BYTES,
    NGRAM_TABLE_BYTES,
    LlamaCpp,
    estimate,
    parse_timings,
    speculation_output_bytes,
)
from bunkhouse.errors import ConfigError
from bunkhouse.front.metrics import DraftTally
from bunkhouse.gguf.meta import read_gguf_info
from tests.helpers import write_tiny_gguf

LLAMA = LlamaCpp()


def _model(path: Path, **own: object) -> CatalogModel:
    info = read_gguf_info(path)
    options = EngineOptions(context=4096, parallel=2, context_auto=False,
                            engine_keys=(("threads", 1), *own.items()))
    return CatalogModel("m", path, "config", info, options, path.stat().st_size)


def test_one_kind_with_its_bounds() -> None:
    assert spec.speculation("none", "", False, None, None, "w") == spec.Speculation(None)
    assert spec.speculation("ngram", "", False, None, None, "w") == spec.Speculation(
        "ngram", 64, 48)
    assert spec.speculation("ngram", "", False, 8, None, "w") == spec.Speculation("ngram", 8, 8)
    assert spec.speculation("none", "d.gguf", False, None, 2, "w") == spec.Speculation(
        "draft", 3, 2)
    assert spec.speculation("none", "", True, 5, 1, "w") == spec.Speculation("mtp", 5, 1)
    with pytest.raises(ConfigError, match=r"^w: draft and mtp = true are two kinds"):
        spec.speculation("none", "d", True, None, None, "w")
    with pytest.raises(ConfigError, match=r"^w: draft_min \(9\) must not be above"):
        spec.speculation("ngram", "", False, 8, 9, "w")


def test_a_quantized_v_cache_turns_flash_attention_on_or_is_refused() -> None:
    assert spec.flash_attention("f16", "auto", "w") == "auto"
    assert spec.flash_attention("f16", False, "w") is False
    assert spec.flash_attention("q8_0", "auto", "w") is True
    with pytest.raises(ConfigError, match=r"cache_type_v = 'q4_0' needs flash attention.*"
                                          r"flash_attn is false"):
        spec.flash_attention("q4_0", False, "w")
    assert LLAMA.options({"cache_type_k": "Q8_0"}, "w").cache_type_k == "q8_0"


def test_the_kv_estimate_follows_the_cache_types(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")  # 4 blocks, 2 KV heads of 8 dims
    f16 = estimate(_model(path))
    q8 = estimate(_model(path, cache_type_k="q8_0", cache_type_v="q8_0"))
    mixed = estimate(_model(path, cache_type_k="q8_0"))
    assert f16.kv_cache == 4 * 4096 * 2 * (8 + 8) * 2
    assert q8.kv_cache == f16.kv_cache * 34 // 64
    assert q8.kv_cache < mixed.kv_cache < f16.kv_cache
    assert q8.total - q8.kv_cache == f16.total - f16.kv_cache


def test_speculation_counts_its_verified_logits_and_the_draft(tmp_path: Path) -> None:
    target = write_tiny_gguf(tmp_path / "t.gguf", vocab=300)
    plain = estimate(_model(target))
    ngram = _model(target, speculative="ngram", draft_max=16)
    assert speculation_output_bytes(ngram) == 2 * 17 * 2 * 300 * 4  # computed, copied out
    assert estimate(ngram).outputs - plain.outputs == 2 * 17 * 2 * 300 * 4
    assert estimate(ngram).runtime - plain.runtime == NGRAM_TABLE_BYTES
    draft_file = write_tiny_gguf(tmp_path / "d.gguf", vocab=300)
    drafted = dataclasses.replace(_model(target, draft="d.gguf"), draft=Draft(
        "d.gguf", draft_file, draft_file.stat().st_size, read_gguf_info(draft_file)))
    with_draft = estimate(drafted)
    assert with_draft.weights == plain.weights + draft_file.stat().st_size
    assert with_draft.kv_cache == 2 * plain.kv_cache  # the same shapes, context and slots
    assert with_draft.runtime == plain.runtime + DRAFT_CONTEXT_BYTES
    assert with_draft.compute > plain.compute


def _gguf(path: Path, tokens: list[str], model: str = "gpt2", **extra: int) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(8)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    for key, value in extra.items():
        w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_draft_must_share_the_vocabulary_by_llamacpp_rule(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(200)]
    target = _gguf(tmp_path / "t.gguf", words)
    assert spec.vocab_mismatch(target, _gguf(tmp_path / "same.gguf", words)) is None
    # control tokens below id 5 may differ, and sizes within 128 (padding)
    assert spec.vocab_mismatch(target, _gguf(tmp_path / "pad.gguf", ["x"] * 5 + words[5:]
                                              + ["pad"] * 100)) is None
    assert "different kinds" in (spec.vocab_mismatch(
        target, _gguf(tmp_path / "spm.gguf", words, "llama")) or "")
    assert spec.vocab_mismatch(target, _gguf(tmp_path / "big.gguf", words * 2)) == \
        "200 and 400 tokens"
    respelled = [*words[:50], "other", *words[51:]]
    assert spec.vocab_mismatch(target, _gguf(tmp_path / "re.gguf", respelled)) == \
        "token 50 is 'w50' in one and 'other' in the other"


def test_refusals_name_the_option(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    assert LLAMA.refused(_model(path)) is None
    assert (LLAMA.refused(_model(path, mtp=True)) or "").startswith(
        "mtp = true: the model's GGUF carries no multi-token-prediction heads")
    mtp = _gguf(tmp_path / "mtp.gguf", ["a", "b"], **{"llama.nextn_predict_layers": 1})
    assert LLAMA.refused(_model(mtp, mtp=True)) is None
    assert (LLAMA.refused(_model(path, draft="missing")) or "").startswith(
        "draft: 'missing' is neither a model id nor a GGUF file")
    # head size 8 is not a multiple of q8_0's 32-element blocks
    assert (LLAMA.refused(_model(path, cache_type_k="q8_0")) or "").startswith(
        "cache_type_k = 'q8_0' stores blocks of 32 and this model's heads are 8 wide")


def test_a_draft_is_found_by_id_or_by_path(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    other = write_tiny_gguf(tmp_path / "sub" / "o.gguf")
    named = _model(other)
    found = resolve_draft("o", {"o": named}.get, tmp_path)
    assert (found.path, found.bytes) == (other, other.stat().st_size)
    assert resolve_draft("sub/o.gguf", {}.get, tmp_path).path == other.resolve()
    with pytest.raises(ConfigError, match=r"^draft: 'x' is neither"):
        resolve_draft("x", {}.get, tmp_path)
    settled = settle(_model(path, draft="sub/o.gguf"), {}.get, tmp_path)
    assert settled.refused is None and settled.draft is not None


def test_timings_carry_the_engines_draft_counts() -> None:
    t = parse_timings({"prompt_n": 3, "predicted_n": 40, "draft_n": 30,
                       "draft_n_accepted": 25})
    assert t is not None and (t.drafted_tokens, t.accepted_tokens) == (30, 25)
    plain = parse_timings({"prompt_n": 3, "predicted_n": 4})
    assert plain is not None and (plain.drafted_tokens, plain.accepted_tokens) == (0, 0)
    tally = DraftTally()
    assert tally.report("m")["draft_acceptance"] is None
    tally.add("m", 30, 25)
    tally.add("m", 10, 5)
    assert tally.report("m") == {"draft_tokens": 40, "draft_accepted_tokens": 30,
                                 "draft_acceptance": 0.75}


def test_models_shows_speculation_and_cache_types() -> None:
    assert _options_line({"speculative": "ngram", "draft": None, "draft_min": 48,
                          "draft_max": 64, "cache_type_k": "f16", "cache_type_v": "f16"}) == \
        "speculative ngram, 48-64 tokens drafted a step"
    assert _options_line({"speculative": None, "cache_type_k": "q8_0",
                          "cache_type_v": "q8_0"}) == "KV cache K q8_0, V q8_0"
    assert _options_line({"speculative": None, "cache_type_k": "f16",
                          "cache_type_v": "f16"}) == ""
    assert _options_line({"speculative": None, "n_gpu_layers": "all",  # llama-server's
                          "args": ["--jinja", "--temp", "0.2"]}) == \
        "all layers on the GPU; args --jinja --temp 0.2"


def test_log_probabilities_are_refused_where_drafted_tokens_have_none(tmp_path: Path) -> None:
    import asyncio

    from bunkhouse.errors import InvalidRequest
    from bunkhouse.front.admission import refuse_before_load

    path = write_tiny_gguf(tmp_path / "m.gguf")

    async def no_table() -> None:
        return None

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for asked in ({"logprobs": True}, {"top_logprobs": 2}, {"n_probs": 3}):
        with pytest.raises(InvalidRequest) as e:
            asyncio.run(refuse_before_load(_model(path, speculative="ngram"),
                                           "/v1/chat/completions", {**body, **asked},
                                           no_table))
        assert e.value.param == next(iter(asked)) and "speculative decoding" in e.value.message
        asyncio.run(refuse_before_load(_model(path), "/v1/chat/completions",
                                       {**body, **asked}, no_table))  # plain: served
    asyncio.run(refuse_before_load(_model(path, speculative="ngram"), "/v1/chat/completions",
                                   {**body, "logprobs": False}, no_table))


def test_a_draft_replaced_or_gone_since_it_was_checked_fails_the_load(tmp_path: Path) -> None:
    import os

    from bunkhouse.errors import WorkerLoadFailed
    from bunkhouse.supervisor.process import _check_draft

    path = write_tiny_gguf(tmp_path / "m.gguf")
    draft_file = write_tiny_gguf(tmp_path / "d.gguf")
    model = settle(_model(path, draft="d.gguf"), {}.get, tmp_path)
    _check_draft(model)  # as checked
    os.utime(draft_file, ns=(1, 1))
    with pytest.raises(WorkerLoadFailed, match=r"its draft model 'd\.gguf' was replaced"):
        _check_draft(model)
    draft_file.unlink()
    with pytest.raises(WorkerLoadFailed, match=r"its draft model 'd\.gguf' cannot be opened"):
        _check_draft(model)


def test_draft_bounds_are_bounded() -> None:
    for raw, error in (({"speculative": "ngram", "draft_max": 0}, "draft_max must be an "
                        "integer from 1 to 256"),
                       ({"speculative": "ngram", "draft_max": 100000}, "draft_max must be"),
                       ({"speculative": "ngram", "draft_min": -1}, "draft_min must be an "
                        "integer from 0 to 256")):
        with pytest.raises(ConfigError, match=error):
            LLAMA.options(raw, "w")
    assert LLAMA.options({"speculative": "NGRAM"}, "w").speculative == "ngram"


def test_a_draft_max_past_the_slot_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    model = _model(path, speculative="ngram", draft_max=256)
    model = dataclasses.replace(model, options=dataclasses.replace(
        model.options, context=256, parallel=2))
    assert (LLAMA.refused(model) or "").startswith("draft_max = 256 drafts more tokens")
