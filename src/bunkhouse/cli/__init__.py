"""``bunkhouse``, the command line (``main``; also ``python -m bunkhouse``).

- ``parser.py``: the flags of every subcommand, and ``argtypes.py``, what each flag's text
  must be;
- ``settings.py``: Settings from the flags, the config file and the key variables;
- ``compose.py``: the composition root of ``serve``, which builds the object graph and
  starts the server; ``prestart.py``, what it checks first; ``server.py``, uvicorn's server
  with bunkhouse's stop; ``logs.py``, the server's log;
- ``remote.py``: the commands that talk to a running server (``ps``, ``events``, ``load``,
  ``pause``, ``transcribe``...); ``reader.py``, their end when the reader of their output
  leaves while they wait; ``cache.py``, the KV snapshot directory; ``output.py``, the
  tables and lines they print.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from bunkhouse.cli import remote
from bunkhouse.cli.cache import cache
from bunkhouse.cli.compose import catalog_of, reread, serve
from bunkhouse.cli.logs import setup_logging
from bunkhouse.cli.output import print_catalog
from bunkhouse.cli.parser import parser
from bunkhouse.cli.reader import ends_with_its_reader
from bunkhouse.cli.settings import settings_from
from bunkhouse.config import default_data_dir
from bunkhouse.errors import BunkhouseError
from bunkhouse.pull.run import main as pull_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Whatever a command prints may go to a reader that
    stops early (``bunkhouse events | head -3``): its output ends there, quietly."""
    try:
        code = _command(argv)
        sys.stdout.flush()  # a closed pipe is found here, not at the interpreter's exit
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """The reader of stdout left: the way Python's documentation gives ("Note on SIGPIPE"):
    stdout goes to /dev/null, so that the interpreter's last flush raises nothing, and the
    status is 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def _command(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    code = _client_command(args)
    if code is not None:
        return code
    setup_logging(args.log_level, args.log_format)
    try:
        return _serve_or_list(args)
    except BunkhouseError as e:
        print(f"bunkhouse: error: {e.message}", file=sys.stderr)
        return 2


def _client_command(args: argparse.Namespace) -> int | None:
    """Run a command that serves nothing (a running server's client, ``cache``); None for
    ``serve`` and ``models``."""
    if args.command in ("ps", "events", "transcribe"):
        with ends_with_its_reader():  # each may wait long with nothing to print
            return _following(args)
    if args.command in ("reload", "default", "pause", "resume"):
        return remote.server_call(args.command, getattr(args, "model", None), args.url,
                                  args.admin_key, getattr(args, "max", None))
    if args.command in ("load", "unload", "pin", "unpin"):
        return remote.control(args.command, args.model, args.url, args.admin_key,
                              getattr(args, "path", None))
    if args.command == "pull":
        return pull_main(args.model, default_data_dir(), args.json)
    if args.command == "cache":
        if args.model is not None and not args.model.strip():
            print("bunkhouse: error: give a model id, or none for every model", file=sys.stderr)
            return 2
        return cache(args.action, args.model, args.kv_cache_dir)
    return None


def _following(args: argparse.Namespace) -> int:
    """``ps``, ``events`` and ``transcribe``: the commands that wait on a server between
    lines."""
    if args.command == "ps":
        return remote.ps(args.url, args.api_key, args.watch)
    if args.command == "events":
        return remote.follow_events(args.url, args.api_key, args.since, args.json)
    return remote.transcribe(args.file, args.url, args.api_key, args.model, args.language,
                             args.format)


def _serve_or_list(args: argparse.Namespace) -> int:
    """``bunkhouse models`` prints the catalog; ``bunkhouse serve`` serves it."""
    settings = settings_from(args)
    catalog = catalog_of(settings)
    if args.command == "models":
        print_catalog(catalog)
        return 0
    return serve(settings, catalog, functools.partial(reread, args))
