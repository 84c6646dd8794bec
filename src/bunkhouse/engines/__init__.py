"""Engine adapters, front side: what the front must know of each engine, and nothing more.

These modules never import an engine (the front loads no native ML code); the worker side of
each engine lives in ``bunkhouse.worker.engines``. The contract they implement is in
``engines/contract.py``; a model's ``engine`` key picks one.
"""

from __future__ import annotations

from bunkhouse.engines.contract import EngineAdapter, ServedModel
from bunkhouse.engines.llamacpp import LlamaCpp
from bunkhouse.engines.llamaserver import LlamaServer
from bunkhouse.engines.mlx import Mlx
from bunkhouse.engines.whisper import Whisper

LLAMA_SERVER = LlamaServer()
"""The llama-server engine; the composition root tells it where its binary is (``locate``)."""

ENGINES: dict[str, EngineAdapter] = {LlamaCpp.name: LlamaCpp(), LLAMA_SERVER.name: LLAMA_SERVER,
                                     Whisper.name: Whisper(), Mlx.name: Mlx()}


def engine_for(model: ServedModel) -> EngineAdapter:
    """The adapter of the engine serving ``model`` (its ``engine`` key)."""
    return ENGINES[model.engine]
