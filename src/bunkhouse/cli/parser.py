"""``bunkhouse``'s command line: one function a subcommand, and one a group of ``serve``'s
flags, in the order ``--help`` lists them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from bunkhouse import __version__, defaults
from bunkhouse.cli import argtypes
from bunkhouse.config import SOURCES

if TYPE_CHECKING:  # what add_subparsers answers: where each subcommand's parser is added
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

DESCRIPTION = """\
bunkhouse serves every local model you have behind one OpenAI-compatible endpoint.
Each model runs in its own worker process, started when a request first names it.
"""

SERVE_EPILOG = """\
examples:
  bunkhouse serve                                 # the packaged models, Qwen2.5-Coder 0.5B default
  bunkhouse serve --models-dir ~/models           # also every *.gguf under ~/models
  bunkhouse serve --config bunkhouse.toml --preload qwen
  curl localhost:8080/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}]}'
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bunkhouse",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"bunkhouse {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve(sub)
    _catalog(sub.add_parser("models", help="list the model catalog"))
    _ps(sub)
    _events(sub)
    _model_controls(sub)
    _server_controls(sub)
    _transcribe(sub)
    _cache(sub)
    _pull(sub)
    return p


def _serve(sub: Commands) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the models over HTTP",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    serve.add_argument("--port", type=argtypes.port, default=8080,
                       help="port to listen on, 1-65535 (%(default)s)")
    _workers(serve)
    _memory(serve)
    _key_flags(serve)
    _site(serve)
    _limits(serve)
    _kv_cache(serve)
    _responses(serve)
    _requests(serve)
    _compute(serve)
    _catalog(serve)


def _workers(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="ID",
        help="start this model's worker before serving (repeatable)",
    )
    serve.add_argument("--ready-timeout", type=float, default=defaults.READY_TIMEOUT_S,
                       metavar="S", help="seconds a worker may take to load its model "
                                         "(%(default)s)")
    serve.add_argument("--stop-grace", type=float, default=defaults.STOP_GRACE_S, metavar="S",
                       help="seconds a worker gets to stop before SIGKILL (%(default)s)")


def _memory(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--budget", type=argtypes.size, metavar="SIZE",
                       help="memory all workers together may use, e.g. 8GiB or 512MiB "
                            "(default: half of this machine's RAM)")
    serve.add_argument("--ttl", type=float, metavar="S",
                       help="unload a model idle for S seconds (default 0: never)")
    serve.add_argument("--admission-wait", type=float, default=defaults.ADMISSION_WAIT_S,
                       metavar="S",
                       help="how long a load waits for models in use to make room before "
                            "503 insufficient_memory, and a request waits out an operator's "
                            "pause before 503 paused (%(default)s)")
    serve.add_argument("--probe-interval", type=float, default=defaults.PROBE_INTERVAL_S,
                       metavar="S",
                       help="liveness: a worker whose engine does not answer two probes in a "
                            "row, S seconds apart, is replaced (%(default)s)")


def _key_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require this client key on inference endpoints (repeatable; "
                            "also --api-key-file and $BUNKHOUSE_API_KEYS, comma-separated)")
    serve.add_argument("--api-key-file", action="append", default=[], type=Path,
                       metavar="FILE", help="client keys, one a line (repeatable)")
    serve.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                       help="an admin key: inference and control endpoints (repeatable; "
                            "also --admin-key-file and $BUNKHOUSE_ADMIN_KEYS)")
    serve.add_argument("--admin-key-file", action="append", default=[], type=Path,
                       metavar="FILE", help="admin keys, one a line (repeatable)")


def _site(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--allow-runtime-load", action="store_true",
                       help="let admin-key holders register models by path (POST /v1/models)")
    serve.add_argument("--allowed-root", action="append", default=[], type=Path,
                       metavar="DIR", help="where runtime-registered model files may live "
                                           "(repeatable; default: the --models-dir roots)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also serve requests whose Host is NAME (repeatable; .example.com "
                            "for every name under it, * for any). Bound to a loopback address, "
                            "only localhost and IP addresses are served: a web page cannot "
                            "reach this server through DNS rebinding")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let web pages from ORIGIN (e.g. https://app.example.com, or * "
                            "for any) call the API from a browser (repeatable); pages on "
                            "this machine (http://localhost:PORT) may by default. Admin routes "
                            "answer only origins named here, never *")


def _limits(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--max-body", type=argtypes.size, default=defaults.MAX_BODY_BYTES,
                       metavar="SIZE",
                       help="largest request body; larger ones get 413 (16MiB)")
    serve.add_argument("--max-audio", type=argtypes.size, default=defaults.MAX_AUDIO_BYTES,
                       metavar="SIZE",
                       help="largest audio file for POST /v1/audio/transcriptions; larger "
                            "ones get 413 (25MB, as OpenAI's)")


def _kv_cache(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--kv-cache-dir", type=argtypes.dir_path, metavar="DIR",
                       help="where slots' saved KV state is kept, a private directory per "
                            "model (default: the cache directory's kv/)")
    serve.add_argument("--kv-cache-max", type=argtypes.size_or_zero, metavar="SIZE",
                       help="disk the KV snapshots may take, all models together, least "
                            "recently used removed first (default: 10%% of the free disk, at "
                            "most 32 GiB; 0 turns snapshots off)")
    serve.add_argument("--kv-min-tokens", type=argtypes.min_tokens, metavar="N",
                       default=defaults.KV_MIN_TOKENS,
                       help="fewest tokens a slot must hold for its KV state to be saved, "
                            "and a snapshot must share with a prompt to be restored "
                            "(default: %(default)s; lower it for a slow engine, where even "
                            "short prompts take seconds to prefill)")


def _responses(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--responses-db", type=argtypes.file_path, metavar="FILE",
                       help="the SQLite file that keeps Responses API answers for "
                            "previous_response_id and GET /v1/responses/{id}; it holds "
                            "conversations (default: responses.db in the data directory, "
                            "~/.local/share/bunkhouse)")
    serve.add_argument("--responses-keep", type=argtypes.count, default=defaults.RESPONSES_KEEP,
                       metavar="N", help="stored responses kept, oldest dropped first "
                                         "(%(default)s; 0 stores none)")
    serve.add_argument("--responses-max", type=argtypes.size,
                       default=defaults.RESPONSES_MAX_BYTES, metavar="SIZE",
                       help="bytes the stored responses may take together, oldest dropped "
                            "first (1GiB); a request that could not be stored within it "
                            "gets 400 naming store")
    serve.add_argument("--responses-days", type=argtypes.positive, metavar="DAYS",
                       default=defaults.RESPONSES_MAX_AGE_S / 86400,
                       help="stored responses older than this are dropped (%(default)g)")


def _requests(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--strict-context", action="store_true",
                       help="refuse (400) a request whose prompt plus max_tokens does not fit "
                            "a slot, as OpenAI does; by default it generates until the slot "
                            "is full (finish_reason length), as local servers do")
    serve.add_argument("--sse-ping-interval", type=argtypes.ping_interval, default=10.0,
                       metavar="S",
                       help="a streamed request still waiting for its model to load or for a "
                            "slot after 250 ms gets its headers, then a ping every S seconds "
                            "(%(default)g; at least 0.1), so that proxies and clients keep "
                            "the connection")
    serve.add_argument("--send-loading-state", action="store_true",
                       help="while a streamed chat request waits, also send what it waits "
                            "for (\"loading model X: 3 s\") as reasoning_content deltas")


def _compute(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--compute-gate", choices=["on", "off"], default="on",
                       help="on: one model computes at a time, so that workers never "
                            "oversubscribe the CPU; off: for GPU hosts (%(default)s)")
    serve.add_argument("--compute-turn", type=argtypes.non_negative,
                       default=defaults.COMPUTE_TURN_S, metavar="S",
                       help="with the gate on, a model that has computed for S seconds while "
                            "another model waits is suspended (SIGSTOP) and the other goes; "
                            "it continues where it stopped on its next turn, so a short "
                            "request never waits out another model's long generation "
                            "(%(default)g; 0: a turn lasts until its requests end)")
    serve.add_argument("--spare-worker", choices=["on", "off"], default="on",
                       help="on: while the host is idle, keep a worker process with the "
                            "engine imported and no model (64 MiB of the budget), so that "
                            "the next load pays only for its model (%(default)s)")
    serve.add_argument("--ray", metavar="ADDRESS", default=None, type=argtypes.ray_address,
                       help="place models on the nodes of a running Ray cluster (host:port of "
                            "its head, or 'auto': $RAY_ADDRESS); each node's budget is its "
                            "bunkhouse_memory_mib resource, else half its memory. Needs "
                            "pip install 'bunkhouse[ray]' (docs/scaling.md)")
    serve.add_argument("--worker-engine", default=None, metavar="MODULE:CLASS",
                       help="load this worker engine class for every model instead of each "
                            "model's own (for tests and experiments; models pick their engine "
                            "with the 'engine' key of the config file)")


def _catalog(p: argparse.ArgumentParser) -> None:
    """The flags that say which models there are and how they are served (``serve`` and
    ``models``)."""
    p.add_argument(
        "--models-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="serve every *.gguf under DIR (repeatable)",
    )
    p.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML config file (see docs/configuration.md)"
    )
    p.add_argument(
        "--no-packaged",
        action="store_true",
        help="do not serve the models shipped in Python packages",
    )
    p.add_argument("--llama-server", type=argtypes.file_path, metavar="PATH",
                   help="the llama-server binary of the engine \"llama-server\" (a model's "
                        "engine key); default: the config's llama_server, else llama-server "
                        "on PATH")
    p.add_argument("--no-source", action="append", default=[], choices=SOURCES,
                   metavar="NAME",
                   help="do not serve the models of this other tool's folder (repeatable): "
                        "hf_cache (the Hugging Face hub cache), ollama (Ollama's store), "
                        "lmstudio (LM Studio's models folder)")
    p.add_argument("--context", type=argtypes.tokens, metavar="TOKENS",
                   help="every model's context, shared by its slots (default: 8192 tokens "
                        "a slot, within the model's trained context)")
    p.add_argument("--parallel", type=argtypes.slots, metavar="N",
                   help="every model's slots: requests decoded at once (default 4)")
    p.add_argument("--default-model", metavar="ID", help="model for requests that name none")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines (default), or one JSON object a line for log collectors")


DEFAULT_URL = "http://127.0.0.1:8080"


def _url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=argtypes.server_url,
                   default=os.environ.get("BUNKHOUSE_URL", "").strip() or DEFAULT_URL,
                   help=f"the server's address, http://HOST:PORT or HOST:PORT (default: "
                        f"$BUNKHOUSE_URL, else {DEFAULT_URL})")


def _client_key(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--api-key", default=os.environ.get("BUNKHOUSE_API_KEY"),
                   help=f"{who}, if the server needs one (default: $BUNKHOUSE_API_KEY)")


def _admin_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-key", default=os.environ.get("BUNKHOUSE_ADMIN_KEY"),
                   help="default: $BUNKHOUSE_ADMIN_KEY")


def _ps(sub: Commands) -> None:
    ps = sub.add_parser("ps", help="show a running server's models, memory and budget")
    _url(ps)
    _client_key(ps, "a client or admin key")
    ps.add_argument("--watch", type=argtypes.positive, nargs="?", const=2.0, metavar="S",
                    help="redraw every S seconds (2 if not given) until Ctrl-C")


def _events(sub: Commands) -> None:
    events = sub.add_parser("events", help="follow a running server's residency events "
                                           "(loads, evictions, crashes) until Ctrl-C")
    _url(events)
    _client_key(events, "a client or admin key")
    events.add_argument("--since", type=int, metavar="SEQ",
                        help="begin after this event's sequence number (what the server still "
                             "holds of them), not with the next one")
    events.add_argument("--json", action="store_true", help="print each event's JSON")


def _model_controls(sub: Commands) -> None:
    """``load``, ``unload``, ``pin``, ``unpin``: one model on a running server."""
    for verb, what in (("load", "load a model (with --path: register it first)"),
                       ("unload", "drain and unload a model"),
                       ("pin", "never evict a model"), ("unpin", "let a model be evicted")):
        cmd = sub.add_parser(verb, help=f"{what} on a running server (admin key)")
        cmd.add_argument("model", metavar="ID")
        _url(cmd)
        _admin_key(cmd)
        if verb == "load":
            cmd.add_argument("--path", help="a GGUF file inside the server's allowed roots")


def _server_controls(sub: Commands) -> None:
    """``reload``, ``default``, ``pause``, ``resume``: the whole running server."""
    for verb, what in (("reload", "re-read the config file and model folders"),
                       ("default", "make a model the default one"),
                       ("pause", "hold every model paused once its requests in flight "
                                 "finish (new ones wait)"),
                       ("resume", "end a pause: waiting requests go on")):
        cmd = sub.add_parser(verb, help=f"{what} on a running server (admin key)")
        if verb == "default":
            cmd.add_argument("model", metavar="ID")
        if verb == "pause":
            cmd.add_argument("--max", type=argtypes.positive, default=300.0, metavar="S",
                             help="resume by itself after S seconds (%(default)s; at most "
                                  "3600)")
        _url(cmd)
        _admin_key(cmd)


def _transcribe(sub: Commands) -> None:
    transcribe = sub.add_parser(
        "transcribe", help="transcribe an audio file with a running server's Whisper model",
        description="Send FILE (wav, mp3, m4a, flac, ogg, webm, ...) to POST "
                    "/v1/audio/transcriptions and print the text as it comes.")
    transcribe.add_argument("file", type=Path, metavar="FILE")
    _url(transcribe)
    _client_key(transcribe, "a client key")
    transcribe.add_argument("--model", default="whisper-1",
                            help="the transcription model (%(default)s: the first one)")
    transcribe.add_argument("--language", help="the spoken language, ISO-639-1 (en, de, ...)")
    transcribe.add_argument("--format", default="text",
                            choices=["text", "json", "srt", "vtt", "verbose_json"],
                            help="what to print (%(default)s: the text, streamed)")


def _cache(sub: Commands) -> None:
    cache = sub.add_parser(
        "cache", help="list or remove saved KV snapshots (conversations' KV state on disk)",
        description="Work on the KV snapshot directory itself. Stop the server first, or use "
                    "its admin API (DELETE /admin/cache[/MODEL]) while it runs.")
    cache.add_argument("action", choices=["list", "purge"])
    cache.add_argument("model", nargs="?", metavar="ID", help="only this model's snapshots")
    cache.add_argument("--kv-cache-dir", type=argtypes.dir_path, metavar="DIR",
                       help="the snapshot directory (default: the cache directory's kv/)")


def _pull(sub: Commands) -> None:
    pull = sub.add_parser(
        "pull", help="download a GGUF model from the Hugging Face hub",
        description="Download a model's GGUF file(s) (every part of a split model, and a\n"
                    "vision projector if the repo has one) into the Hugging Face cache, check\n"
                    "each file's sha256, and print the id it is served under. A dropped\n"
                    "connection is resumed; files already there are not fetched again.\n"
                    "HF_TOKEN for gated repos; HF_ENDPOINT and HF_HUB_OFFLINE as the hub\n"
                    "client reads them. A running server serves the model after\n"
                    "`bunkhouse reload` (or pulls itself: POST /admin/pull).",
        epilog="examples:\n"
               "  bunkhouse pull Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF          # Q4_K_M\n"
               "  bunkhouse pull bartowski/gemma-2-2b-it-GGUF:Q8_0\n"
               "  bunkhouse pull hf.co/ORG/REPO:path/in/repo/model-q4_0.gguf",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pull.add_argument("model", metavar="ORG/REPO[:QUANT|:FILE]",
                      help="the repo, and a quantization (Q4_K_M if none) or a .gguf file")
    pull.add_argument("--json", action="store_true",
                      help="print each step as a JSON line (Ollama's pull statuses), not a bar")
