"""``python -m bunkhouse.worker.engines.llamacpp_probe``: the disposable process that
measures what a request's constraint costs llama.cpp, so that a worker other clients share
never pays it first.

It loads the model as a worker does, but with one slot, a 256-token context and one thread,
then reads one JSON object a line on stdin: ``{"route": "chat" | "completion", "body":
{...}}``, runs the body through the engine in-process (xllamacpp's ``handle_chat_completions``
or ``handle_completions``: the same grammar building, parsing and sampling a worker's
scheduling loop does) and writes ``{"done": true}`` on stdout when the engine has answered,
whatever it answered (a refusal too: a schema it cannot convert is the worker's to refuse,
naming the field, as cheaply as here). It measures nothing itself: the front reads this
process's CPU time and memory while it runs a check and kills it past the bounds
(front/constraints.py).

Exit codes: 0 at the end of its stdin or at its parent's death, 3 when the model cannot load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bunkhouse.worker.lifeline import hold

EXIT_LOAD_FAILED = 3
PROBE_CONTEXT = 256  # tokens: a one-word prompt, its template, and two tokens generated
PROBE_BATCH = 64


def _server(model_path: str, chat_template: str | None, socket_dir: str) -> Any:
    import xllamacpp

    from bunkhouse.worker.engines.llamacpp import _set_template

    params = xllamacpp.CommonParams()
    params.model.path = model_path
    params.hostnames = [str(Path(socket_dir) / "probe.sock")]  # never connected to
    params.n_ctx = PROBE_CONTEXT
    params.n_parallel = 1
    params.n_batch = PROBE_BATCH
    params.n_ubatch = PROBE_BATCH
    params.kv_unified = False
    params.cache_ram_mib = 0
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    if chat_template:
        _set_template(params, chat_template)
    return xllamacpp.Server(params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bunkhouse.worker.engines.llamacpp_probe",
                                description="Measure requests' constraints on one model.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--parent-pid", type=int, default=os.getppid())
    args = p.parse_args(argv)
    hold(args.parent_pid, lambda: os._exit(0))
    # answers go to a copy of stdout; the engine's own prints land on stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    with tempfile.TemporaryDirectory(prefix="bunkhouse-probe-") as socket_dir:
        try:
            server = _server(args.model_path, args.chat_template, socket_dir)
        except Exception as e:  # the engine says why on stderr; this is its last line
            print(f"cannot load the model: {e}", file=sys.stderr)
            return EXIT_LOAD_FAILED
        out.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            request = json.loads(line)
            try:
                if request.get("route") == "chat":
                    server.handle_chat_completions(request["body"])
                else:
                    server.handle_completions(request["body"])
            except ValueError as e:  # a refusal (a schema it cannot convert): answered
                print(f"the engine refused it: {e}", file=sys.stderr)
            out.write(json.dumps({"done": True}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
