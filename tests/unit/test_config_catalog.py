from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from bunkhouse.catalog import build_catalog
from bunkhouse.catalog.catalog import gguf_files
from bunkhouse.config import (
    EngineOptions,
    Settings,
    engine_options,
    load_config_file,
    parse_size,
)
from bunkhouse.engines import ENGINES
from bunkhouse.errors import ConfigError, ModelNotFound
from tests.helpers import write_tiny_gguf


def _settings(**kw: object) -> Settings:
    kw.setdefault("defaults", EngineOptions(engine_keys=(("threads", 1),)))
    return Settings(include_packaged=False, **kw)  # type: ignore[arg-type]


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bunkhouse.toml"
    path.write_text(text)
    return path


def test_models_dir_ids_are_relative_paths(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "sub" / "b.gguf")
    write_tiny_gguf(tmp_path / "big-00001-of-00002.gguf")
    write_tiny_gguf(tmp_path / "big-00002-of-00002.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    assert [i for i, _ in gguf_files(tmp_path)] == ["a", "big", "sub/b"]


def test_catalog_from_models_dir_skips_unreadable_files(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "good.gguf", context=1024)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    catalog = build_catalog(_settings(models_dirs=(tmp_path,)), engines=ENGINES)
    assert catalog.ids() == ["good"]
    assert catalog.default_id == "good"
    options = catalog.get(None).options  # each slot capped at the trained context
    assert (options.context, options.parallel) == (4 * 1024, 4)


def test_default_slots_hold_8192_tokens_within_the_trained_context(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "long.gguf", context=32768)
    write_tiny_gguf(tmp_path / "short.gguf", context=2048)
    catalog = build_catalog(_settings(models_dirs=(tmp_path,)), engines=ENGINES)
    long, short = catalog.get("long").options, catalog.get("short").options
    assert (long.context // long.parallel, short.context // short.parallel) == (8192, 2048)
    # a context someone set is kept, only a slot past the trained context is lowered
    given = engine_options(EngineOptions(), {"context": 65536, "context_auto": False,
                                                      "parallel": 2}, "test")
    catalog = build_catalog(_settings(models_dirs=(tmp_path,), defaults=given), engines=ENGINES)
    assert catalog.get("long").options.context == 65536
    assert catalog.get("short").options.context == 2 * 2048


def test_aliases_tags_and_suggestions(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "models" / "qwen-coder.gguf")
    write_tiny_gguf(tmp_path / "models" / "gemma3:latest.gguf")
    path = _config(tmp_path, """
        models_dirs = ["models"]
        [aliases]
        "gpt-4o-mini" = "qwen-coder"
        [[models]]
        id = "coder"
        path = "models/qwen-coder.gguf"
        aliases = ["qwen:0.5b", "autocomplete"]
    """)
    catalog = build_catalog(load_config_file(path, _settings()), engines=ENGINES)
    assert catalog.get("qwen:0.5b").id == catalog.get("autocomplete").id == "coder"
    assert catalog.get("gpt-4o-mini").id == "qwen-coder"
    assert catalog.get("qwen-coder").aliases == ("gpt-4o-mini",)
    assert catalog.get("gemma3").id == catalog.get("gemma3:latest").id == "gemma3:latest"
    assert catalog.get("coder:latest").id == "coder"
    with pytest.raises(ModelNotFound) as e:
        catalog.get("qwen-codr")
    assert "did you mean 'qwen-coder'" in e.value.message
    with pytest.raises(ModelNotFound):
        catalog.get("Coder")  # matched as typed


@pytest.mark.parametrize(("toml", "error"), [
    ('[[models]]\nid = "a"\npath = "m.gguf"\naliases = ["b"]\n'
     '[[models]]\nid = "b"\npath = "m.gguf"\n', "alias 'b' of model 'a' is already a model"),
    ('[[models]]\nid = "a"\npath = "m.gguf"\naliases = ["x"]\n[aliases]\nx = "a"\n',
     "alias 'x' of model 'a' is already an alias"),
    ('[aliases]\nx = "nobody"\n', "'x' names model 'nobody', which is not in the catalog"),
    ('[[models]]\nid = "m"\npath = "m.gguf"\n[[models]]\nid = "n"\npath = "m.gguf"\n'
     '[aliases]\n"m:latest" = "n"\n', "alias 'm:latest' of model 'n' is already a model's id"),
    ('[[models]]\nid = "a"\npath = "m.gguf"\naliases = ["q:latest"]\n[aliases]\nq = "a"\n',
     "is already an alias of 'a' ('q:latest')"),
    ('[[models]]\nid = "a"\npath = "m.gguf"\naliases = "b"\n', "aliases must be an array"),
    ('[aliases]\n"../x" = "a"\n', "must be 1-128 characters"),
    ('strict_context = "yes"\n', "'strict_context' must be true or false"),
    ('hf_cache = 3\n', "'hf_cache' must be true, false or a folder"),
])
def test_bad_names_are_refused(tmp_path: Path, toml: str, error: str) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    path = tmp_path / "bunkhouse.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        build_catalog(load_config_file(path, _settings()), engines=ENGINES)
    assert error in e.value.message


def test_config_entries_win_and_set_options(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "models" / "a.gguf", context=32768)
    path = _config(tmp_path, """
default_model = "mine"
[defaults]
parallel = 2
[[models]]
id = "mine"
path = "models/a.gguf"
context = 4096
[[models]]
id = "a"
path = "models/a.gguf"
""")
    settings = load_config_file(path, _settings(models_dirs=(tmp_path / "models",)))
    catalog = build_catalog(settings, engines=ENGINES)
    assert catalog.ids() == ["mine", "a"]
    mine = catalog.get("mine")
    assert (mine.options.context, mine.options.parallel, mine.source) == (4096, 2, "config")
    assert catalog.get("a").source == "config"
    assert catalog.get(None).id == "mine"


def test_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    catalog = build_catalog(_settings(models_dirs=(tmp_path,)), engines=ENGINES)
    with pytest.raises(ModelNotFound, match="known models: a") as info:
        catalog.get("b")
    assert info.value.status == 404 and info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("bogus = 1\n", "unknown key"),
        ("[[models]]\npath = 'x.gguf'\n", "needs a string key 'id'"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {mirostat = 2}\n",
         "params.mirostat: a model's params may set"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nfixed_params = {top_k = 0.5}\n",
         "fixed_params.top_k: must be an integer"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {temperature = nan}\n",
         "params.temperature: must be a number from 0.0 to 2.0"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nfixed_params = {repeat_last_n = -100}\n",
         "fixed_params.repeat_last_n: must be an integer from 0"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {repeat_last_n = -1}\n",
         "params.repeat_last_n: must be an integer from 0 to 2147483647"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {top_k = 2147483648}\n",
         "params.top_k: must be an integer from 0 to 2147483647"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {max_tokens = 0}\n",
         "params.max_tokens: must be an integer from 1"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {max_tokens = 3}\n"
         "strip_params = ['max_tokens']\n", "max_tokens both set and stripped"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nparams = {stop = [1]}\n",
         "params.stop: must be a text or an array"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nstrip_params = ['model']\n",
         "strip_params must be an array"),
        ("[[models]]\nid = 'bad id!'\npath = 'x.gguf'\n", "model id"),
        ('[[models]]\nid = "abc\\n"\npath = "x.gguf"\n', "model id"),
        ("[[models]]\nid = 'a/../b'\npath = 'x.gguf'\n", "no URL can reach"),
        ("[[models]]\nid = 'a//b'\npath = 'x.gguf'\n", "no URL can reach"),
        ("[[models]]\nid = 'a/./b'\npath = 'x.gguf'\n", "no URL can reach"),
        ("[defaults]\nparallel = 'four'\n", "must be an integer"),
        ("[defaults]\nparallel = 0\n", "parallel must be >= 1"),
        ("[defaults]\ncontext = 100\nparallel = 4\n", "fewer than 64 tokens"),
        ("[[models]]\nid='x'\npath='a'\n[[models]]\nid='x'\npath='b'\n", "configured twice"),
        ("this is = = not toml", "not valid TOML"),
        ("[defaults]\nembeddings = 'yes'\n", "embeddings must be true or false"),
        ("[[models]]\nid = 'x'\npath = 'x.gguf'\nembeddings = 1\n",
         "embeddings must be true or false"),
    ],
)
def test_config_errors_are_clear(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config_file(_config(tmp_path, text), _settings())


@pytest.mark.parametrize(("value", "shown"), [("'vllm'", "'vllm'"), ("3", "3"),
                                             ("['llama.cpp']", "['llama.cpp']")])
def test_an_unknown_engine_is_refused_when_the_catalog_is_built(
        tmp_path: Path, value: str, shown: str) -> None:
    """The config file keeps the name as written (config.py knows no engine); the catalog
    checks it against the engines it is given."""
    write_tiny_gguf(tmp_path / "x.gguf")
    text = ("[[models]]\nid = 'ok'\npath = 'x.gguf'\n"
            f"[[models]]\nid = 'x'\npath = 'x.gguf'\nengine = {value}\n")
    settings = load_config_file(_config(tmp_path, text), _settings())
    message = f"[[models]] #2: engine must be one of {sorted(ENGINES)}, not {shown}"
    with pytest.raises(ConfigError) as info:
        build_catalog(settings, engines=ENGINES)
    assert info.value.message == message


def test_the_engines_a_catalog_accepts_are_the_ones_it_is_given(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "x.gguf")
    path = _config(tmp_path, "[[models]]\nid = 'x'\npath = 'x.gguf'\nengine = 'llama.cpp'\n")
    settings = load_config_file(path, _settings())
    assert build_catalog(settings, engines=ENGINES).get("x").engine == "llama.cpp"
    with pytest.raises(ConfigError, match=r"engine must be one of \['other'\], not 'llama.cpp'"):
        build_catalog(settings, engines=frozenset({"other"}))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[defaults]\nctx = 3\n", r"^\[defaults\]: unknown key\(s\) \['ctx'\]$"),
        ("[defaults]\nthreads = 0\n", r"^\[defaults\]: threads must be >= 1$"),
        ("[defaults]\ncache_ram_mib = -1\n", r"^\[defaults\]: cache_ram_mib must be >= 0$"),
        ("[defaults]\ncache_type_k = 'q3_k'\n", r"^\[defaults\]: cache_type_k must be one"),
    ],
)
def test_engine_options_of_defaults_are_checked_when_the_catalog_is_built(
        tmp_path: Path, text: str, match: str) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    settings = load_config_file(_config(tmp_path, text), _settings())
    with pytest.raises(ConfigError) as e:
        build_catalog(settings, engines=ENGINES)
    assert re.search(match, e.value.message), e.value.message


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nctx = 3\n", r"^unknown key\(s\) \['ctx'\]$"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nthreads = 'two'\n",
         r"^threads must be an integer, not 'two'$"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nswa_full = 1\n",
         r"^swa_full must be true or false$"),
        ("models_dirs = ['.']\n[[models]]\nid = 'm'\nthreads = 0\n",
         r"^threads must be >= 1$"),  # an entry configuring a found model
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nspeculative = 'eagle'\n",
         r"^speculative must be \"ngram\" or \"none\""),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\ndraft_max = 8\n",
         r"^draft_max bounds speculative decoding, which is off"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nspeculative = 'ngram'\ndraft_min = 9\n"
         "draft_max = 8\n", r"^draft_min \(9\) must not be above draft_max \(8\)$"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nspeculative = 'ngram'\nmtp = true\n",
         r"^speculative = \"ngram\" and mtp = true are two kinds"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\ncache_type_v = 'q8_0'\nflash_attn = false\n",
         r"^cache_type_v = 'q8_0' needs flash attention .* flash_attn is false"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nflash_attn = 1\n",
         r"^flash_attn must be true, false or \"auto\""),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\nmtp = true\n",
         r"^mtp = true: the model's GGUF carries no multi-token-prediction heads"),
        ("[[models]]\nid = 'x'\npath = 'm.gguf'\ndraft = 'nothing-here'\n",
         r"^draft: 'nothing-here' is neither a model id nor a GGUF file"),
    ],
)
def test_a_model_whose_engine_options_are_refused_is_listed_with_the_reason(
        tmp_path: Path, text: str, match: str) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    write_tiny_gguf(tmp_path / "other.gguf")
    settings = load_config_file(_config(tmp_path, text + "[[models]]\nid = 'ok'\n"
                                        "path = 'other.gguf'\n"), _settings())
    catalog = build_catalog(settings, engines=ENGINES)
    refused = [m for m in catalog if m.refused]
    assert len(refused) == 1 and re.search(match, refused[0].refused or ""), refused
    assert catalog.get("ok").refused is None  # the others serve


def test_engine_options_of_defaults_and_entries_reach_the_engine(tmp_path: Path) -> None:
    from bunkhouse.engines.llamacpp import LlamaCpp, LlamaCppOptions, model_options

    write_tiny_gguf(tmp_path / "m.gguf")
    path = _config(tmp_path, """
        [defaults]
        threads = 3
        cache_ram_mib = 16
        [[models]]
        id = "x"
        path = "m.gguf"
        cache_ram_mib = 64
        swa_full = true
        [[models]]
        id = "y"
        path = "m.gguf"
    """)
    catalog = build_catalog(load_config_file(path, _settings()), engines=ENGINES)
    x, y = catalog.get("x"), catalog.get("y")
    assert model_options(x) == LlamaCppOptions(cache_ram_mib=64, threads=3, swa_full=True)
    assert model_options(y) == LlamaCppOptions(cache_ram_mib=16, threads=3, swa_full=False)
    args = LlamaCpp().worker_args(x)
    sent = json.loads(args[args.index("--engine-options") + 1])
    assert {k: sent[k] for k in ("cache_ram_mib", "swa_full", "threads")} == \
        {"cache_ram_mib": 64, "swa_full": True, "threads": 3}
    assert "draft_max" not in sent  # None: the default, left out
    assert LlamaCpp().estimate(x).prompt_cache == 64 * 2**20


def test_entries_without_a_path_configure_found_models_and_params_apply(
        tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "models" / "found.gguf", context=32768)
    path = _config(tmp_path, """
        models_dirs = ["models"]
        [[models]]
        id = "found"
        aliases = ["f"]
        parallel = 2
        pinned = true
        params = { temperature = 0.2, stop = ["END"] }
        fixed_params = { top_k = 40 }
        strip_params = ["logit_bias"]
    """)
    model = build_catalog(load_config_file(path, _settings()), engines=ENGINES).get("f")
    assert (model.id, model.pinned, model.options.parallel) == ("found", True, 2)
    assert model.options.context == 2 * 8192
    body = model.request.apply({"temperature": 1.0, "top_k": 5, "logit_bias": {"1": 2},
                                "max_tokens": 3})
    assert body == {"temperature": 1.0, "top_k": 40, "max_tokens": 3, "stop": ["END"]}
    assert model.request.apply({"stop": None})["stop"] == ["END"]
    nobody = _config(tmp_path, '[[models]]\nid = "ghost"\npinned = true\n')
    with pytest.raises(ConfigError, match="no such model found to configure"):
        build_catalog(load_config_file(nobody, _settings()), engines=ENGINES)


def test_missing_model_file_is_a_startup_error(tmp_path: Path) -> None:
    path = _config(tmp_path, "[[models]]\nid = 'x'\npath = 'nowhere.gguf'\n")
    with pytest.raises(ConfigError, match="no file at"):
        build_catalog(load_config_file(path, _settings()), engines=ENGINES)


def test_unknown_default_model_is_a_startup_error(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    with pytest.raises(ConfigError, match="not in the catalog"):
        build_catalog(_settings(models_dirs=(tmp_path,), default_model="zzz"), engines=ENGINES)


def test_pins_ttls_and_budget_from_the_config(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    path = _config(tmp_path, """
budget = "1.5GiB"
[defaults]
ttl = 300
[[models]]
id = "pinned"
path = "a.gguf"
pinned = true
[[models]]
id = "quick"
path = "a.gguf"
ttl = 5
""")
    settings = load_config_file(path, _settings())
    assert settings.budget_bytes == int(1.5 * 2**30) and settings.ttl_s == 300
    catalog = build_catalog(settings, engines=ENGINES)
    assert (catalog.get("pinned").pinned, catalog.get("pinned").ttl_s) == (True, None)
    assert (catalog.get("quick").pinned, catalog.get("quick").ttl_s) == (False, 5.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[[models]]\nid='x'\npath='a'\npinned='yes'\n", "pinned must be true or false"),
        ("[[models]]\nid='x'\npath='a'\nttl=-1\n", "ttl must be a number"),
        ("[defaults]\nttl='long'\n", "ttl must be a number"),
        ("budget = 'lots'\n", "not a size"),
    ],
)
def test_residency_config_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config_file(_config(tmp_path, text), _settings())


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
     ("1000", 1000), ("2kib", 2048), ("8G", 8 * 2**30), ("8g", 8 * 2**30),
     ("512M", 512 * 2**20), ("8gb", 8 * 10**9), ("4Gi", 4 * 2**30)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["0", "0GiB", "0.0", "lots", "8 X", "-1G"])
def test_sizes_that_mean_nothing_are_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_embeddings_are_on_for_embedding_models_and_where_configured(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "models" / "gen.gguf")
    write_tiny_gguf(tmp_path / "models" / "on.gguf")
    path = _config(tmp_path, f"""
[[models]]
id = "on"
path = "{tmp_path / 'models' / 'on.gguf'}"
embeddings = true
engine = "llama.cpp"
""")
    catalog = build_catalog(load_config_file(path, _settings(models_dirs=(tmp_path / "models",))),
                            engines=ENGINES)
    assert catalog.get("on").embeddings and catalog.get("on").engine == "llama.cpp"
    assert not catalog.get("gen").embeddings  # a generation model: off unless configured
    pooled = dataclasses.replace(catalog.get("gen").info, pooling=True)
    assert dataclasses.replace(catalog.get("gen"), info=pooled).embeddings


def test_a_config_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "bunkhouse.toml"
    os.mkfifo(fifo)  # a read would block until a writer came: never waited for
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config_file(fifo, _settings())


def test_slots_are_whole_blocks_of_256_tokens(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", context=32768)
    given = engine_options(EngineOptions(), {"context": 600, "context_auto": False,
                                                      "parallel": 2}, "test")
    options = build_catalog(_settings(models_dirs=(tmp_path,), defaults=given),
                            engines=ENGINES).get("m").options
    assert (options.context, options.parallel) == (512, 2)
    small = engine_options(EngineOptions(), {"context": 600, "context_auto": False,
                                                      "parallel": 3}, "test")
    options = build_catalog(_settings(models_dirs=(tmp_path,), defaults=small),
                            engines=ENGINES).get("m").options
    assert (options.context, options.parallel) == (768, 3)  # llama.cpp's least: 256 a slot


def test_names_that_are_one_by_their_latest_spelling_keep_the_first(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    write_tiny_gguf(tmp_path / "m:latest.gguf")
    catalog = build_catalog(_settings(models_dirs=(tmp_path,)), engines=ENGINES)
    assert catalog.ids() == ["m"] and catalog.get("m:latest").id == "m"


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    path = _config(tmp_path, "x = " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config_file(path, _settings())


def test_config_params_are_bounded_as_the_same_request_fields() -> None:
    """A model's ``params`` value that no request could send is refused when the config is
    read: each integer field's range is the engine's (or the protocol's) for that field."""
    from bunkhouse.config import REQUEST_PARAMS
    from bunkhouse.engines.llamacpp import EXTENSION_BOUNDS

    for name, (_, lo, hi) in REQUEST_PARAMS.items():
        if name in EXTENSION_BOUNDS:
            assert (lo, hi) == EXTENSION_BOUNDS[name], name
    assert REQUEST_PARAMS["seed"][1:] == (-(1 << 63), (1 << 63) - 1)


def test_the_default_is_the_first_models_entry_even_one_without_a_path(tmp_path: Path
                                                                     ) -> None:
    """The first [[models]] entry is the default whether it has a path or configures a model
    of another source (a models folder's here, as the packaged Qwen's in a user's file)."""
    write_tiny_gguf(tmp_path / "models" / "found.gguf")
    write_tiny_gguf(tmp_path / "own.gguf")
    path = _config(tmp_path, """
[[models]]
id = "found"
context = 1024
[[models]]
id = "own"
path = "own.gguf"
""")
    settings = load_config_file(path, _settings(models_dirs=(tmp_path / "models",)))
    catalog = build_catalog(settings, engines=ENGINES)
    assert catalog.default_id == "found"
    assert catalog.get(None).id == "found"
