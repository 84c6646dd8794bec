"""The engine llama-server's pure parts: its binary's inspection (fake binaries: scripts that
print a help text), a model's ``args`` read or refused, its command line, and the catalog's
refusals of models on a binary it cannot use (the other models unaffected)."""

from __future__ import annotations

import dataclasses
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bunkhouse.catalog import Catalog, build_catalog
from bunkhouse.config import Settings, load_config_file
from bunkhouse.engines import ENGINES, LLAMA_SERVER
from bunkhouse.engines.contract import Draft, WorkerSpawn
from bunkhouse.engines.llamaserver import LlamaServer, parse_options
from bunkhouse.engines.llamaserver_binary import BinaryRefused, inspect
from bunkhouse.errors import ConfigError
from tests.helpers import wait_for
from tests.models import GEMMA, QWEN, WHISPER

HELP = """\
-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads
-c,    --ctx-size N                     size of the prompt context
-np,   --parallel N                     number of server slots
-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM
--spec-type none,draft-simple,ngram-mod
                                        comma-separated list of types
--spec-ngram-mod-n-max N                maximum number of ngram tokens
--spec-ngram-mod-n-min N                minimum number of ngram tokens
-kvu,  --kv-unified, -no-kvu, --no-kv-unified
                                        use single unified KV buffer
--host HOST                             IP addresses to listen on, or UNIX socket
                                        paths ending in .sock
--metrics                               enable prometheus compatible metrics endpoint
--slots, --no-slots                     expose slots monitoring endpoint
--slot-save-path PATH                   path to save slot kv cache
-a,    --alias STRING                   set model name aliases
--jinja, --no-jinja                     whether to use jinja template engine for chat
"""
OLD_HELP = """\
-c,    --ctx-size N                     size of the prompt context
--host HOST                             ip address to listen (default: 127.0.0.1)
--metrics                               enable prometheus compatible metrics endpoint
-a,    --alias STRING                   set alias for model name
"""


def fake_binary(path: Path, help_text: str, version: str = "version: 0 (unknown)") -> Path:
    path.write_text("#!/bin/sh\n"
                    f'if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
                    f"cat <<'EOF'\n{help_text}EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_binary_s_flags_come_from_its_help_and_its_build_from_its_files(
        tmp_path: Path) -> None:
    binary = inspect(fake_binary(tmp_path / "llama-server", HELP))
    assert binary.has("-a", "--alias", "-no-kvu", "--no-kv-unified", "-ngl", "--n-gpu-layers",
                      "--spec-type", "--slot-save-path")
    assert not binary.has("STRING") and not binary.has("--fit")
    rebuilt = inspect(fake_binary(tmp_path / "llama-server", HELP + "--fit [on|off]  fit\n"))
    assert rebuilt.has("--fit") and rebuilt.build != binary.build


def test_a_binary_too_old_or_missing_is_refused_saying_what_it_lacks(tmp_path: Path) -> None:
    with pytest.raises(BinaryRefused) as old:
        inspect(fake_binary(tmp_path / "old", OLD_HELP))
    for lacking in ("Unix socket", "--slot-save-path", "--slots"):
        assert lacking in str(old.value)
    assert "--metrics" not in str(old.value).split("lacks")[1]
    with pytest.raises(BinaryRefused, match="No such file"):
        inspect(tmp_path / "nowhere")
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'error while loading shared libraries' >&2\nexit 127\n")
    failing.chmod(0o755)
    with pytest.raises(BinaryRefused, match=r"--help failed with code 127 .error while loading"):
        inspect(failing)


def test_args_are_read_into_options_refused_or_passed() -> None:
    own = parse_options({"args": ["-t", "3", "-ctk", "q8_0", "--flash-attn", "on", "--jinja",
                                  "--swa-full", "-ngl=all", "--temp", "0.2"]}, "m")
    assert (own.llama.threads, own.llama.cache_type_k, own.llama.flash_attn) == (3, "q8_0", True)
    assert own.llama.swa_full and own.n_gpu_layers == "all"
    assert own.args == ("--jinja", "--temp", "0.2")
    for flag, says in (("-c", "set context = N"), ("--port", "private Unix socket"),
                       ("--ctx-size=4096", "set context"), ("-np", "set parallel"),
                       ("--lora", "adapter_of"), ("-ub", "batches of 512"),
                       ("--models-dir", "router mode"), ("-md", "draft = ID-OR-PATH")):
        with pytest.raises(ConfigError, match=f"args: {flag.split('=')[0]} is not passed.*"
                                              f"{says}"):
            parse_options({"args": [flag, "1"]}, "m")
    with pytest.raises(ConfigError, match="threads is set twice"):
        parse_options({"args": ["-t", "3"], "threads": 2}, "m")
    with pytest.raises(ConfigError, match="-t needs a whole number"):
        parse_options({"args": ["-t", "many"]}, "m")
    with pytest.raises(ConfigError, match="args must be an array of strings"):
        parse_options({"args": "--jinja"}, "m")
    with pytest.raises(ConfigError, match="n_gpu_layers must be"):
        parse_options({"n_gpu_layers": -1}, "m")


def test_the_command_line_sets_what_sizes_memory_and_passes_args_last(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    adapter = LlamaServer()
    adapter.locate(fake_binary(tmp_path / "llama-server", HELP))
    base = packaged_catalog.get(QWEN)
    model = dataclasses.replace(base, engine="llama-server", options=dataclasses.replace(
        base.options, context=4096, parallel=2, engine_keys=(
            ("speculative", "ngram"), ("args", ["--jinja"]), ("n_gpu_layers", 99))))
    argv = adapter.command(model, WorkerSpawn(QWEN, "/proc/self/fd/7", tmp_path / "w.sock",
                                              tmp_path / "kv"))
    assert argv is not None and argv[0] == str(tmp_path / "llama-server")
    line = " ".join(argv)
    for part in ("-m /proc/self/fd/7", f"--host {tmp_path}/w.sock", f"--alias {QWEN}",
                 "-c 4096 -np 2", "-b 512 -ub 512", "--cache-ram 0", "--no-kv-unified",
                 f"--slot-save-path {tmp_path}/kv/", "-ngl 99",
                 "--spec-type ngram-mod --spec-ngram-mod-n-max 64 --spec-ngram-mod-n-min 48"):
        assert part in line, part
    assert argv[-1] == "--jinja" and "--no-webui" not in argv  # this binary has no such flag


def _catalog(tmp_path: Path, binary: Path) -> Catalog:
    config = tmp_path / "bunkhouse.toml"
    config.write_text(f'llama_server = "{binary}"\nhf_cache = false\nollama = false\n'
                      'lmstudio = false\n[defaults]\nengine = "llama-server"\n'
                      f'[[models]]\nid = "{GEMMA}"\nengine = "llama.cpp"\n')
    settings = load_config_file(config, Settings())
    LLAMA_SERVER.locate(settings.llama_server)
    return build_catalog(settings, engines=ENGINES)


@pytest.mark.parametrize("binary, says", [
    ("missing", "llama-server binary {path}: No such file"),
    ("old", "is too old for bunkhouse: it lacks listening on a Unix socket"),
])
def test_models_on_an_unusable_binary_are_refused_and_the_rest_serve(
        tmp_path: Path, binary: str, says: str) -> None:
    path = fake_binary(tmp_path / "old", OLD_HELP) if binary == "old" else tmp_path / "missing"
    catalog = _catalog(tmp_path, path)
    qwen = catalog.get(QWEN)
    assert qwen.engine == "llama-server"
    assert qwen.refused and says.format(path=path) in qwen.refused
    assert catalog.get(GEMMA).refused is None and catalog.get(WHISPER).refused is None


def test_no_binary_anywhere_says_how_to_name_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    adapter = LlamaServer()
    with pytest.raises(BinaryRefused, match=r'llama_server = "PATH".*--llama-server PATH'):
        adapter.binary()
    assert adapter.build == "llama-server (no binary)"


def test_a_default_engine_must_serve_gguf_files(tmp_path: Path) -> None:
    config = tmp_path / "bunkhouse.toml"
    config.write_text('[defaults]\nengine = "whisper"\n')
    with pytest.raises(ConfigError, match=r"\[defaults\]: engine must be one of"):
        build_catalog(load_config_file(config, Settings()), engines=ENGINES)


PARENT = """
import asyncio, sys
from bunkhouse.supervisor.process import spawn_local
async def main():
    child = await spawn_local(["sleep", "300"])
    print(child.pid, flush=True)
    await asyncio.sleep(300)
asyncio.run(main())
"""


def test_a_worker_that_is_a_program_of_its_own_dies_with_a_killed_front() -> None:
    """The parent-death signal armed at spawn: no lifeline of ours runs in the binary."""
    front = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        assert front.stdout is not None
        with front.stdout:
            child = psutil.Process(int(front.stdout.readline()))
        assert child.name() == "sleep"
        front.kill()
        front.wait(30)
        psutil.wait_procs([child], timeout=30)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        front.kill()
        front.wait(30)


def test_an_older_build_s_flags_are_used_where_it_has_no_newer_ones(
        tmp_path: Path, packaged_catalog: Catalog) -> None:
    older = HELP.replace("--spec-type none,draft-simple,ngram-mod\n", "") + (
        "--draft-max N                           tokens to draft\n"
        "--draft-min N                           at least\n"
        "-md,   --model-draft FNAME              draft model\n"
        "-ctkd, --cache-type-k-draft TYPE        draft K cache\n")
    adapter = LlamaServer()
    adapter.locate(fake_binary(tmp_path / "llama-server", older))
    base = packaged_catalog.get(QWEN)
    draft = Draft(QWEN, base.path, base.size_bytes, base.info)
    model = dataclasses.replace(base, engine="llama-server", draft=draft, options=dataclasses
                                .replace(base.options, engine_keys=(("draft", QWEN),)))
    argv = adapter.command(model, WorkerSpawn(QWEN, "/proc/self/fd/7", tmp_path / "w.sock"))
    line = " ".join(argv or [])
    assert f"--draft-max 3 --draft-min 0 -md {base.path}" in line and "--spec-type" not in line
    ngram = dataclasses.replace(model, draft=None, options=dataclasses.replace(
        base.options, engine_keys=(("speculative", "ngram"),)))
    refused = adapter.refused(ngram)
    assert refused and "has no --spec-type flag" in refused, refused


def test_presets_values_without_flags_and_a_key_read_twice_are_refused() -> None:
    for args, says in ((["--embd-gemma-default"], "a preset sets the model"),
                       (["--fim-qwen-1.5b-default"], "a preset sets the model"),
                       (["foo"], "'foo' is not a flag"), ([""], "'' is not a flag"),
                       (["-t", "1", "--threads", "2"], "--threads sets threads, which an"),
                       (["--log-prompts-dir", "/tmp"], "a file of its own"),
                       (["--rerank"], "no rerank route")):
        with pytest.raises(ConfigError, match=says):
            parse_options({"args": args}, "m")


def test_a_flag_with_a_dot_is_read_from_the_help(tmp_path: Path) -> None:
    binary = inspect(fake_binary(tmp_path / "llama-server",
                                 HELP + "--fim-qwen-1.5b-default          a preset\n"))
    assert binary.has("--fim-qwen-1.5b-default")
    with pytest.raises(BinaryRefused, match="does not look like llama-server"):
        inspect(fake_binary(tmp_path / "true", "usage: true\n"))


def test_a_wrapper_script_s_child_is_stopped_with_it_and_a_hanging_help_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from bunkhouse.engines import llamaserver_binary
    from bunkhouse.supervisor.process import _terminate, spawn_local

    async def wrapper() -> psutil.Process:
        proc = await spawn_local(["sh", "-c", "sleep 300; true"])  # no exec: a child
        shell = psutil.Process(proc.pid)
        child = wait_for(lambda: (shell.children() or [None])[0], 30, "the wrapper's child")
        await _terminate(proc, 10, "wrapped")
        return child

    child = asyncio.run(wrapper())
    psutil.wait_procs([child], timeout=30)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE

    marker = tmp_path / "hang.pid"
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {marker}\nwait\n")
    hang.chmod(0o755)
    monkeypatch.setattr(llamaserver_binary, "HELP_TIMEOUT_S", 2.0)
    with pytest.raises(BinaryRefused, match="did not answer within 2 s"):
        inspect(hang)
    try:
        left = psutil.Process(int(marker.read_text()))
    except psutil.NoSuchProcess:
        return  # gone already
    psutil.wait_procs([left], timeout=30)
    assert not left.is_running() or left.status() == psutil.STATUS_ZOMBIE
