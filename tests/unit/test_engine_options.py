"""What each engine adapter owns of a model's options: its own keys, checked and typed by it
and carried to its worker, and its slot sizes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bunkhouse.engines import options as opts
from bunkhouse.engines.llamacpp import LlamaCpp, LlamaCppOptions
from bunkhouse.engines.whisper import Whisper, WhisperOptions
from bunkhouse.errors import ConfigError
from bunkhouse.worker.main import parse_args


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"threads": 0}, "model 'x': threads must be >= 1"),
        ({"threads": "2"}, "model 'x': threads must be an integer, not '2'"),
        ({"threads": True}, "model 'x': threads must be an integer, not True"),
        ({"threads": 2.0}, "model 'x': threads must be an integer, not 2.0"),
        ({"cache_ram_mib": -1}, "model 'x': cache_ram_mib must be >= 0"),
        ({"swa_full": "yes"}, "model 'x': swa_full must be true or false"),
        ({"ctx": 3, "threads": 1}, "model 'x': unknown key(s) ['ctx']"),
    ],
)
def test_llamacpp_refuses_a_wrong_option_by_name(raw: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError) as e:
        LlamaCpp().options(raw, "model 'x'")
    assert e.value.message == error


def test_llamacpp_options_are_typed_with_their_defaults() -> None:
    adapter = LlamaCpp()
    assert adapter.known_options == {"cache_ram_mib", "threads", "swa_full", "speculative",
                                     "draft", "draft_max", "draft_min", "mtp", "cache_type_k",
                                     "cache_type_v", "flash_attn"}
    assert adapter.options({}, "w") == LlamaCppOptions(0, os.cpu_count() or 1, False)
    assert adapter.options({"threads": 2, "swa_full": True}, "w") == \
        LlamaCppOptions(cache_ram_mib=0, threads=2, swa_full=True)


def test_whisper_takes_threads_and_nothing_of_llamacpp() -> None:
    adapter = Whisper()
    assert adapter.options({"threads": 2}, "w") == WhisperOptions(threads=2)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['swa_full'\]"):
        adapter.options({"swa_full": True}, "model 'w'")
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        adapter.options({"threads": 0}, "model 'w'")


def test_options_reach_the_worker_engine_as_one_json_object(tmp_path: Path) -> None:
    own = LlamaCppOptions(cache_ram_mib=64, threads=3, swa_full=True)
    argv = ["--model-id", "m", "--model-path", str(tmp_path / "m.gguf"), "--socket",
            str(tmp_path / "w.sock"), "--engine", "x:Y", *opts.worker_args(own)]
    config, _, _ = parse_args(argv)  # the worker passes them on unread
    assert opts.decode(config.engine_options, LlamaCpp().options) == own
    for text, error in (("[1]", "must be a JSON object"), ("{", "not JSON"),
                        ('{"threads": 0}', "threads must be >= 1")):
        with pytest.raises(ConfigError, match=error):
            opts.decode(text, LlamaCpp().options)


def test_llamacpp_slots_are_whole_blocks_of_256_tokens_within_the_ask() -> None:
    slots = LlamaCpp()
    assert [slots.slot_tokens(t) for t in (1, 255, 256, 300, 511, 512, 8192)] == \
        [256, 256, 256, 256, 256, 512, 8192]


def test_whisper_slots_are_as_asked() -> None:
    assert Whisper().slot_tokens(300) == 300


def test_integers_past_the_engines_width_are_refused_by_name_and_seeds_fold() -> None:
    """llama.cpp holds its fields in C ints and its seed in 32 bits: a larger JSON integer
    would wrap (``n_predict: 4294967301`` read as 5); so each is refused naming the field,
    and a 64-bit seed is taken modulo 2**32 (-1: llama.cpp's random seed)."""
    from bunkhouse.engines.llamacpp import check_extensions, fold_seed
    from bunkhouse.errors import InvalidRequest

    for name, value in (("n_predict", 1 << 31), ("n_predict", -2), ("top_k", 1 << 32),
                        ("n_keep", -(1 << 40)), ("id_slot", 1 << 31), ("mirostat", 3),
                        ("repeat_last_n", 1 << 31), ("t_max_predict_ms", -2), ("n_cmpl", 0)):
        with pytest.raises(InvalidRequest) as info:
            check_extensions({name: value})
        assert info.value.param == name
    check_extensions({"n_predict": -1, "top_k": (1 << 31) - 1, "n_keep": -1, "id_slot": -1,
                      "t_max_predict_ms": -1})
    assert fold_seed({"seed": (1 << 40) + 7}) == {"seed": 7}
    assert fold_seed({"seed": -1}) == {"seed": (1 << 32) - 1}
    assert fold_seed({"seed": 42}) == {"seed": 42} and fold_seed({}) == {}


def test_extension_bounds_are_the_engines_own() -> None:
    """The ranges the engine's request schema holds (tried against a worker), one message
    per field: ``repeat_last_n`` and ``dry_penalty_last_n`` from 0 (the engine refuses -1),
    ``n_predict`` -1 or from 1 (its 0 generates a token); a ``lora`` field is refused, empty
    too (adapters are chosen by model id; the front sets every scale itself)."""
    from bunkhouse.engines.llamacpp import LlamaCpp, check_extensions
    from bunkhouse.errors import InvalidRequest

    message = {"repeat_last_n": "repeat_last_n must be an integer from 0 to 2147483647",
               "dry_penalty_last_n": "from 0 to", "dry_allowed_length": "from 0 to",
               "n_predict": "n_predict must be -1 (until the slot is full) or from 1 to",
               "top_k": "top_k must be an integer from 0 to 2147483647"}
    for name, value in (("repeat_last_n", -1), ("repeat_last_n", -2), ("repeat_last_n", 1 << 31),
                        ("dry_penalty_last_n", -2), ("dry_penalty_last_n", -1),
                        ("dry_allowed_length", -1), ("n_predict", 0), ("n_predict", -2),
                        ("top_k", -1), ("top_k", 1 << 64)):
        with pytest.raises(InvalidRequest, match=re.escape(message[name])) as info:
            check_extensions({name: value})
        assert info.value.param == name
    for wrong in (1.5, "5", True):  # the same message as for a value out of range
        with pytest.raises(InvalidRequest, match=re.escape(message["top_k"])):
            check_extensions({"top_k": wrong})
    check_extensions({"repeat_last_n": 0, "dry_penalty_last_n": 0, "n_predict": 1, "top_k": 0,
                      "min_p": 1 << 40})
    for lora in ([{"id": 1 << 64, "scale": 1}], [{"id": 0, "scale": 1}], "x", []):
        with pytest.raises(InvalidRequest) as info:
            LlamaCpp().check_request("/v1/chat/completions", {"lora": lora})
        assert info.value.param == "lora"
        assert "model id" in info.value.message or not isinstance(lora, list)
