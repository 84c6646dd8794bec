"""``python -m bunkhouse.worker.engines.llamacpp_trial MODEL SOCKET [ADAPTER ...]``: whether
llama.cpp loads the model with those LoRA adapters (exit 0) or not (exit 3, its reason on
stderr). The worker runs it in a child process to find which adapter files the engine
refuses (worker/engines/llamacpp.py): the child's memory is not the worker's, and it exits
without freeing the engine, whose shutdown right after a load could hang."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import xllamacpp

EXIT_REFUSED = 3
TRIAL_CONTEXT = 256  # the adapters are checked when the model loads, whatever its context


def main(argv: list[str]) -> int:
    model, socket, adapters = argv[0], Path(argv[1]), argv[2:]
    params = xllamacpp.CommonParams()
    params.model.path = model
    params.hostnames = [str(socket)]
    params.n_ctx = TRIAL_CONTEXT
    params.n_parallel = 1
    params.cache_ram_mib = 0
    params.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(a, 0.0) for a in adapters]
    params.lora_init_without_apply = True
    socket.unlink(missing_ok=True)
    try:
        server = xllamacpp.Server(params)
    except Exception as e:  # the engine's refusal: its own lines above say why
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    finally:
        socket.unlink(missing_ok=True)
    sys.stderr.flush()
    os._exit(0)  # while ``server`` is alive: freeing it waits on its loop, which can hang
    return id(server)  # never reached


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # no engine shutdown: the process ends here
