from __future__ import annotations

from pathlib import Path

import pytest

from bunkhouse.cli import main
from tests.helpers import write_tiny_gguf


def test_models_prints_the_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_tiny_gguf(tmp_path / "chatty.gguf", context=4096)
    write_tiny_gguf(tmp_path / "base.gguf", chat_template=None)
    assert main(["models", "--no-packaged", "--models-dir", str(tmp_path),
                 "--default-model", "chatty"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["ID", "SIZE", "ARCH", "CONTEXT", "KIND", "SOURCE"]
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert rows["chatty"][1] == "*"
    assert "4x4096/4096" in rows["chatty"] and "chat" in rows["chatty"]
    assert "completion" in rows["base"] and str(tmp_path / "base.gguf") in rows["base"]


def test_bad_config_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bunkhouse.toml"
    config.write_text("[defaults]\nparalel = 2\n")
    assert main(["models", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bunkhouse: error:") and "paralel" in err


def test_an_unknown_engine_is_refused_at_start_and_on_reload(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bunkhouse.cli.compose import reread
    from bunkhouse.cli.parser import parser
    from bunkhouse.errors import ConfigError

    write_tiny_gguf(tmp_path / "a.gguf")
    config = tmp_path / "bunkhouse.toml"
    config.write_text("[[models]]\nid = 'a'\npath = 'a.gguf'\nengine = 'nope'\n")
    flags = ["--no-packaged", "--config", str(config)]
    message = ("[[models]] #1: engine must be one of ['llama-server', 'llama.cpp', 'mlx', "
               "'whisper'], not 'nope'")
    assert main(["serve", *flags, "--port", "1"]) == 2
    assert f"bunkhouse: error: {message}" in capsys.readouterr().err
    with pytest.raises(ConfigError) as info:  # what POST /admin/reload and SIGHUP read
        reread(parser().parse_args(["serve", *flags]))
    assert info.value.message == message


def test_unknown_preload_is_refused_before_serving(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    code = main(["serve", "--no-packaged", "--models-dir", str(tmp_path), "--preload", "zzz",
                 "--port", "1"])
    assert code == 2
    assert "model 'zzz' not found; known models: a" in capsys.readouterr().err


def test_a_preload_the_budget_cannot_hold_is_refused_before_serving(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf")
    code = main(["serve", "--no-packaged", "--models-dir", str(tmp_path), "--preload", "a",
                 "--budget", "1MiB", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--preload a: it needs" in err and "raise --budget" in err
    assert "Traceback" not in err


def test_help_explains_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--models-dir", "--config", "--preload"):
        assert flag in out


def test_bad_budget_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--budget", "lots"])
    assert info.value.code == 2
    assert "not a size" in capsys.readouterr().err


def test_ps_without_a_server_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import free_port

    assert main(["ps", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "is `bunkhouse serve` running" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_out_of_range_is_refused(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", port])
    assert info.value.code == 2
    assert "is not a port; use 1-65535" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["0", "0MiB"])
def test_a_zero_budget_is_refused(budget: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--budget", budget])
    assert info.value.code == 2
    assert "more than 0 bytes" in capsys.readouterr().err


def test_a_budget_smaller_than_a_model_is_warned_about(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from bunkhouse.catalog import build_catalog
    from bunkhouse.cli.prestart import warn_never_fit
    from bunkhouse.config import Settings
    from bunkhouse.engines import ENGINES

    write_tiny_gguf(tmp_path / "a.gguf")
    catalog = build_catalog(Settings(models_dirs=(tmp_path,), include_packaged=False),
                            engines=ENGINES)
    warn_never_fit(catalog, 10 * 2**20)
    assert "model a needs about" in caplog.text and "raise --budget" in caplog.text


def test_socket_dirs_of_fronts_that_are_gone_are_removed(tmp_path: Path) -> None:
    import psutil

    from bunkhouse.supervisor.launcher import LocalLauncher
    from bunkhouse.supervisor.process import LaunchOptions

    dead = tmp_path / "bunkhouse-dead"
    dead.mkdir()
    (dead / "owner").write_text("999999999 1.0")
    (dead / "w1.sock").write_text("")
    me = psutil.Process()
    alive = tmp_path / "bunkhouse-alive"
    alive.mkdir()
    (alive / "owner").write_text(f"{me.pid} {me.create_time()}")
    reused = tmp_path / "bunkhouse-reused"  # a live pid, but started at another time
    reused.mkdir()
    (reused / "owner").write_text(f"{me.pid} 12.0")
    other = tmp_path / "bunkhouse-other"  # no owner file: not ours to judge
    other.mkdir()
    launcher = LocalLauncher(LaunchOptions(), tmp_dir=tmp_path)
    try:
        assert not dead.exists() and not reused.exists()
        assert alive.exists() and other.exists() and launcher.socket_dir.exists()
    finally:
        launcher.close()


def test_ps_shows_idle_time_only_for_loaded_models_serving_nothing() -> None:
    import time

    from bunkhouse.cli.output import format_ps

    now = time.time()
    base = {"pinned": False, "estimated_bytes": 1, "measured_bytes": None, "pid": None}
    stats = {"budget_bytes": 1, "used_bytes": 0, "free_bytes": 1, "peak_used_bytes": 0,
             "models": [{**base, "id": "idle", "state": "ready", "leases": 0,
                         "last_used": now - 30},
                        {**base, "id": "busy", "state": "ready", "leases": 1,
                         "last_used": now - 30},
                        {**base, "id": "gone", "state": "absent", "leases": 0,
                         "last_used": now - 30}]}
    rows = {line.split()[0]: line.split() for line in format_ps(stats).splitlines()[1:4]}
    # ID STATE PINNED LEASES RUN/QUEUE/WAIT ESTIMATED(2) MEASURED IDLE PID
    assert rows["idle"][8:10] == ["30", "s"] and rows["idle"][4] == "0/0/0"
    assert rows["busy"][8] == "-" and rows["gone"][8] == "-"


def test_ps_shows_adapters_under_their_base() -> None:
    from bunkhouse.cli.output import format_ps

    base = {"pinned": False, "estimated_bytes": 1, "measured_bytes": None, "pid": None,
            "leases": 0, "last_used": None}
    stats = {"budget_bytes": 1, "used_bytes": 0, "free_bytes": 1, "peak_used_bytes": 0,
             "models": [{**base, "id": "q", "state": "ready"},
                        {**base, "id": "g", "state": "absent"},
                        {**base, "id": "qa", "state": "ready", "parent": "q"}]}
    lines = format_ps(stats).splitlines()
    assert [line.split()[:2] for line in lines[1:4]] == [["q", "ready"], ["+", "qa"],
                                                        ["g", "absent"]]


def test_ps_shows_each_models_node_and_each_nodes_budget_on_a_cluster() -> None:
    from bunkhouse.cli.output import format_ps

    base = {"pinned": False, "estimated_bytes": 2**20, "measured_bytes": None, "pid": 7,
            "leases": 0, "last_used": None}
    stats = {"budget_bytes": 2**31, "used_bytes": 2**20, "free_bytes": 2**31 - 2**20,
             "peak_used_bytes": 2**20,
             "nodes": [{"id": "c3d5f2a89ea40cbc741b", "budget_bytes": 2**30,
                        "used_bytes": 2**20, "models": ["q"]},
                       {"id": "d32c7aaeaaf6e99014e6", "budget_bytes": 2**30,
                        "used_bytes": 0, "models": []}],
             "models": [{**base, "id": "q", "state": "ready", "node": "c3d5f2a89ea40cbc741b"},
                        {**base, "id": "g", "state": "absent", "pid": None}]}
    lines = format_ps(stats).splitlines()
    assert lines[0].split()[-2:] == ["NODE", "ACCEPTED"]
    assert lines[1].split()[-2:] == ["c3d5f2a89ea4", "-"]
    assert lines[2].split()[-2:] == ["-", "-"]
    assert "node c3d5f2a89ea4: budget 1024 MiB, used 1 MiB: q" in lines
    assert "node d32c7aaeaaf6: budget 1024 MiB, used 0 MiB: no model" in lines


def test_ps_watch_waits_for_an_unreachable_server_until_interrupted(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import bunkhouse.cli.remote

    naps: list[float] = []

    def nap(seconds: float) -> None:  # the user's Ctrl-C at the third wait
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(bunkhouse.cli.remote.time, "sleep", nap)
    assert main(["ps", "--url", "http://127.0.0.1:1", "--watch", "0.1"]) == 0
    assert capsys.readouterr().err.count("cannot read http://127.0.0.1:1/stats") == 3
    assert naps == [0.1, 0.1, 0.1]


def test_ps_watch_stops_on_a_refused_key(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    import bunkhouse.cli.remote

    def refused(*args: object, **kwargs: object) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "the API key is not valid"}})

    monkeypatch.setattr(httpx, "get", refused)
    monkeypatch.setattr(bunkhouse.cli.remote.time, "sleep", lambda s: None)
    assert main(["ps", "--watch", "0.1"]) == 1
    assert "the API key is not valid (--api-key)" in capsys.readouterr().err


def test_json_log_lines_carry_an_access_line_field_by_field() -> None:
    import json
    import logging

    from bunkhouse.cli.logs import JsonLogFormatter

    record = logging.LogRecord("bunkhouse.access", logging.INFO, __file__, 1,
                               "GET %s status=%s", ("/v1/models", 200), None)
    record.fields = {"method": "GET", "path": "/v1/models", "status": 200}
    line = json.loads(JsonLogFormatter().format(record))
    assert line["message"] == "GET /v1/models status=200" and line["level"] == "info"
    assert (line["method"], line["status"], line["logger"]) == ("GET", 200, "bunkhouse.access")
    assert line["time"].endswith("Z")


def test_events_prints_one_line_an_event() -> None:
    from bunkhouse.cli.output import event_line

    data = ('{"seq": 7, "time": 0, "model": "m", "kind": "ready", "reason": "measured 1 MiB", '
            '"data": {}}')
    assert event_line(data, as_json=False).endswith("#7 m: ready (measured 1 MiB)")
    assert event_line(data, as_json=True) == data
    assert "gap" in event_line('{"kind": "gap", "time": 0, "reason": "restarted"}', False)


def test_control_characters_never_reach_a_log_line_or_a_terminal() -> None:
    import logging

    from bunkhouse.cli.logs import TextLogFormatter
    from bunkhouse.cli.output import event_line, format_ps

    evil = "esc\x1b]0;PWNED\x07\x1b[31mred\nline2"
    record = logging.LogRecord("bunkhouse", logging.INFO, __file__, 1, "model %s: ready",
                               (evil,), None)
    line = TextLogFormatter("%(message)s").format(record)
    assert "\n" not in line and "\x1b" not in line and "\\x1b]0;PWNED\\x07" in line
    data = ('{"seq": 1, "time": 0, "model": "' + evil.encode("unicode_escape").decode()
            + '", "kind": "ready", "reason": "r"}')
    assert "\x1b" not in event_line(data, as_json=False)
    table = format_ps({"models": [{"id": evil, "state": "ready", "pinned": False, "leases": 0,
                                   "estimated_bytes": 1, "measured_bytes": None, "pid": None,
                                   "last_used": None}],
                       "budget_bytes": 1, "used_bytes": 0, "free_bytes": 1,
                       "peak_used_bytes": 0})
    assert "\x1b" not in table and "\x07" not in table and len(table.splitlines()) == 4


def test_a_folder_model_whose_name_has_control_characters_is_skipped(tmp_path: Path) -> None:
    from bunkhouse.catalog.catalog import gguf_files

    (tmp_path / "good.gguf").write_bytes(b"GGUF")
    (tmp_path / "bad\x1b[31m\nname.gguf").write_bytes(b"GGUF")
    assert [model_id for model_id, _ in gguf_files(tmp_path)] == ["good"]


@pytest.mark.parametrize("flag", ["--api-key", "--admin-key"])
def test_a_key_source_that_yields_no_key_fails_closed_at_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        flag: str) -> None:
    """A key file, variable or flag given without a key is an error naming it: the server
    never starts open to anyone because a key file was left empty."""
    empty = tmp_path / "empty.keys"
    empty.write_text("\n   \n# the key goes here\n  # indented comment\n")
    serve = ["serve", "--no-packaged", "--port", "1"]
    assert main([*serve, f"{flag}-file", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"key file {empty}" in err and "holds no key" in err
    assert main([*serve, flag, " "]) == 2
    assert f"{flag} was given an empty key" in capsys.readouterr().err
    env = "BUNKHOUSE_API_KEYS" if flag == "--api-key" else "BUNKHOUSE_ADMIN_KEYS"
    for value in ("", " , "):
        monkeypatch.setenv(env, value)
        assert main(serve) == 2
        assert f"${env} is set but holds no key" in capsys.readouterr().err


class _ClosedPipe:
    """A stdout whose reader has left (``bunkhouse ... | head -3``): every write and flush
    raises BrokenPipeError; its fd is a pipe's write end, which the CLI may redirect."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


@pytest.mark.parametrize("argv", [["cache", "list"], ["models", "--no-packaged"]])
def test_a_reader_that_leaves_ends_the_output_quietly(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import sys

    write_tiny_gguf(tmp_path / "m.gguf")
    extra = ["--kv-cache-dir", str(tmp_path / "kv")] if argv[0] == "cache" else \
        ["--models-dir", str(tmp_path)]
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(write_end))
        assert main([*argv, *extra]) == 1  # no traceback: Python's "Note on SIGPIPE"
    finally:
        os.close(read_end)
        os.close(write_end)
    assert capsys.readouterr().err == ""


def test_the_server_address_comes_from_url_then_bunkhouse_url(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bunkhouse.cli.parser import parser

    monkeypatch.delenv("BUNKHOUSE_URL", raising=False)
    assert parser().parse_args(["ps"]).url == "http://127.0.0.1:8080"
    monkeypatch.setenv("BUNKHOUSE_URL", "10.0.0.5:9000")  # OLLAMA_HOST's form: http
    for command in (["ps"], ["events"], ["pin", "m"], ["reload"], ["transcribe", "a.wav"]):
        assert parser().parse_args(command).url == "http://10.0.0.5:9000", command
    assert parser().parse_args(["ps", "--url", "https://h:1/v1/"]).url == "https://h:1"
    monkeypatch.setenv("BUNKHOUSE_URL", "ftp://h")
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["ps"])
    assert info.value.code == 2 and "$BUNKHOUSE_URL" in capsys.readouterr().err
    assert parser().parse_args(["ps", "--url", "h:2"]).url == "http://h:2"  # --url wins


def test_model_controls_say_what_changed_and_the_model_now() -> None:
    from bunkhouse.cli.output import control_line

    ready = {"state": "ready", "pid": 42, "measured_bytes": 400 * 2**20,
             "estimated_bytes": 450 * 2**20, "pinned": True}
    pinned = control_line("pin", "q", 200, ready)
    assert pinned == "q: pinned: never evicted; ready (pid 42, 400 MiB measured, " \
                     "450 MiB estimated)"
    assert "not loaded" in control_line("pin", "q", 200, {"state": "absent"})
    assert control_line("unpin", "q", 200, ready).startswith("q: unpinned: evicted when")
    assert control_line("load", "q", 200, ready).startswith("q: loaded: ready (pid 42, 400")
    assert "memory is free" in control_line("unload", "q", 204, None)
    assert "draining" in control_line("unload", "q", 202, None)
    assert control_line("pin", "\x1b[2J", 200, ready).startswith("\\x1b[2J: pinned")



def test_a_reader_that_leaves_ends_a_command_waiting_on_the_server() -> None:
    """``bunkhouse events --since 0 | head -2``: head left while the command waited for the
    server's next line, not while it wrote: the watch on stdout ends it at once (``ps
    --watch`` and ``transcribe`` run under the same watch; e2e: test_operator.py)."""
    import os
    import sys
    import threading

    from bunkhouse.cli.reader import ends_with_its_reader

    read_end, write_end = os.pipe()
    ended = threading.Event()
    out = open(write_end, "w", closefd=False)  # noqa: SIM115
    saved, sys.stdout = sys.stdout, out
    try:
        with ends_with_its_reader(ended.set):
            assert not ended.is_set()  # a reader that stays: nothing
            os.close(read_end)  # head has had its lines
            assert ended.wait(60)
        with ends_with_its_reader(ended.clear):
            pass  # a body that ends first: the watch ends with it
    finally:
        sys.stdout = saved
        out.close()
        os.close(write_end)


def test_model_controls_say_when_nothing_changed() -> None:
    """``bunkhouse unload`` of an absent or failed model, ``pin`` twice, ``load`` of a ready
    one: the server's ``changed`` false is said as such, never as a change."""
    from bunkhouse.cli.output import control_line

    ready = {"state": "ready", "pid": 42, "measured_bytes": 1, "estimated_bytes": 1,
             "changed": False}
    absent = {"state": "absent", "changed": False}
    failed = {"state": "failed", "last_error": "model 'broken' failed to load: bad magic",
              "changed": False}
    assert control_line("unload", "coder", 200, absent) == (
        "coder: nothing to unload: it holds no worker and no memory; not loaded (it loads "
        "on its next request, or with bunkhouse load)")
    line = control_line("unload", "broken", 200, failed)
    assert line.startswith("broken: nothing to unload") and "bad magic" in line
    assert "unloaded" not in line and "memory is free" not in line
    assert control_line("pin", "q", 200, ready).startswith("q: already pinned: nothing changed;")
    assert control_line("unpin", "q", 200, ready).startswith("q: already unpinned: nothing")
    assert control_line("load", "q", 200, ready).startswith("q: already loaded: nothing")


def test_server_controls_say_what_changed() -> None:
    from bunkhouse.cli.output import server_line

    assert server_line("default", {"id": "q", "changed": True}) == "default model: q"
    assert "already: nothing changed" in server_line("default", {"id": "q", "changed": False})
    assert server_line("resume", {"resumed": False}) == "no pause was held: nothing changed"
    pause = {"paused": True, "resumes_at": 0, "in_flight": 0}
    assert server_line("pause", {**pause, "extended": False}).startswith("paused: ")
    assert server_line("pause", {**pause, "extended": True}).startswith("still paused")
    assert "nothing changed" in server_line("reload", {"added": [], "removed": [],
                                                       "changed": []})
    assert server_line("reload", {"added": ["a"], "removed": [], "changed": []}) == (
        "added: a\nremoved: none\nchanged: none")
