"""A model's memory need, as residency counts it, and the default budget.

Each engine estimates its own workers (its adapter's ``estimate``: the worst case under the
model's options; llama.cpp's is in engines/llamacpp.py, its table in docs/memory-estimate.md).
"""

from __future__ import annotations

import psutil

from bunkhouse.catalog import CatalogModel
from bunkhouse.engines import engine_for
from bunkhouse.engines.contract import MemoryEstimate

MIB = 1024 * 1024
DEFAULT_BUDGET_SHARE = 0.5

__all__ = ["MIB", "MemoryEstimate", "default_budget_bytes", "estimate"]


def default_budget_bytes() -> int:
    """Half of this machine's RAM: room for the OS, the front and everything else."""
    return int(psutil.virtual_memory().total * DEFAULT_BUDGET_SHARE)


def estimate(model: CatalogModel) -> MemoryEstimate:
    """The worst case of ``model``'s worker, by its engine's estimator."""
    return engine_for(model).estimate(model)
