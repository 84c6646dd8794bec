"""What typical and hostile constraints cost llama.cpp to prepare, as the front measures it.

    python -m benchmarks.constraint_costs [--model ID]

Runs each constraint below through the front's constraint probe (front/constraints.py: a
disposable process with the model, one slot, one thread) on the chat route, with no CPU
limit, and prints the CPU seconds and memory it adds to a two-token answer: the figures the
bound ``MAX_CONSTRAINT_CPU_S`` was chosen from. Uses the packaged Qwen2.5-Coder 0.5B unless
``--model`` names another catalogued model.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from bunkhouse.catalog import CatalogModel, build_catalog
from bunkhouse.config import Settings
from bunkhouse.engines import ENGINES
from bunkhouse.engines.llamacpp import constraint_checks
from bunkhouse.front.constraints import ConstraintGate


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}


def _enum(n: int) -> dict[str, Any]:
    return _schema({"enum": [f"value-{i}-abcdefgh" for i in range(n)]})


_PERSON = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
    "address": {"type": "object", "required": ["city"], "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}

_TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "a tool", "parameters": {
        "type": "object", "required": ["p0"], "properties": {
            **{f"p{j}": {"type": "string"} for j in range(8)},
            "mode": {"enum": ["a", "b", "c"]},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "k": {"type": "string"}, "v": {"type": "number"}}}}}}}} for i in range(20)]

CASES: dict[str, dict[str, Any]] = {
    "JSON mode": {"response_format": {"type": "json_object"}},
    "a nested object schema": _schema(_PERSON),
    "20 tools, 10 parameters each": {"tools": _TOOLS},
    "128 optional properties": _schema({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(128)}}),
    "a two-word grammar": {"grammar": 'root ::= "yes" | "no"'},
    "an enum of 100 strings": _enum(100),
    "an enum of 500 strings": _enum(500),
    "an enum of 3,000 strings": _enum(3000),
}


async def measure(model: CatalogModel) -> None:
    gate = ConstraintGate(cpu_limit_s=float("inf"))
    try:
        for name, extra in CASES.items():
            body = {"messages": [{"role": "user", "content": "hi"}], **extra}
            for check in constraint_checks("/v1/chat/completions", body):
                cpu, memory = await gate.cost(model, check)
                print(f"{name:32} {check.param:16} {cpu:7.2f} s CPU {memory >> 20:6d} MiB",
                      flush=True)
    finally:
        gate.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = p.parse_args()
    asyncio.run(measure(build_catalog(Settings(), engines=ENGINES).get(args.model)))


if __name__ == "__main__":
    main()
