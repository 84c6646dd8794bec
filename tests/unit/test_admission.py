"""Admission gates and the context check, without processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest

from bunkhouse.catalog import CatalogModel
from bunkhouse.config import EngineOptions
from bunkhouse.engines.llamacpp import LlamaCppClient
from bunkhouse.errors import ContextLengthExceeded, InvalidRequest, QueueFull
from bunkhouse.front.admission import (
    ComputeGate,
    ComputeGates,
    check_fits,
    refuse_before_load,
)
from bunkhouse.gguf.meta import GGUFInfo
from bunkhouse.residency.slots import SlotGate

INFO = GGUFInfo("qwen2", None, 32768, 24, 896, 14, 2, 64, 64, None, "{{x}}", 15, 0)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 5))


def test_slot_gate_runs_slots_queues_queue_refuses_the_rest() -> None:
    async def go() -> None:
        gate = SlotGate("m", slots=2, queue=3)
        first, second = await gate.enter(), await gate.enter()
        assert {first.id, second.id} == {0, 1}
        waiters = [asyncio.create_task(gate.enter()) for _ in range(3)]
        await asyncio.sleep(0)
        assert gate.waiting == 3
        with pytest.raises(QueueFull) as info:
            await gate.enter()
        assert info.value.status == 429 and info.value.type == "resource_admission"
        assert info.value.headers()["Retry-After"]
        gate.leave(first)
        assert (await asyncio.wait_for(waiters[0], 1)) is first  # FIFO; the slot let go
        assert gate.waiting == 2
        gate.leave(first)
        gate.leave(second)
        third = await asyncio.wait_for(waiters[1], 1)
        gate.leave(third)
        gate.leave(await asyncio.wait_for(waiters[2], 1))
        assert gate.running == 0

    run(go())


def test_a_full_line_is_refused_at_once_while_the_model_loads() -> None:
    """14 requests to a 1-slot, queue-8 model that is still loading: 9 take their places
    before any lease (none runs yet), the other 5 are refused at once, not after the load."""
    async def go() -> None:
        gate = SlotGate("m", slots=1, queue=8)
        places = [gate.join() for _ in range(9)]
        for _ in range(5):
            with pytest.raises(QueueFull) as info:
                gate.join()
            assert "queue of 8" in info.value.message
        assert gate.waiting == 9 and gate.running == 0
        places[-1].leave()
        places[-1].leave()  # again is harmless
        assert gate.waiting == 8
        first = await gate.enter(place=places[0])  # the model is ready: its places go in
        assert gate.running == 1 and gate.waiting == 7
        waiter = asyncio.create_task(gate.enter(place=places[1]))
        await asyncio.sleep(0)
        assert gate.waiting == 7  # still in line, counted once
        gate.join().leave()  # one more fits; the line is full again without it
        other = SlotGate("m", slots=1, queue=8)  # a place in an old gate is given back
        lone = await other.enter(place=places[2])
        assert gate.waiting == 6 and other.running == 1
        other.leave(lone)
        gate.leave(first)
        gate.leave(await asyncio.wait_for(waiter, 1))
        for place in places[3:]:
            place.leave()
        assert (gate.waiting, gate.running) == (0, 0)

    run(go())


def test_slot_gate_gives_a_conversation_its_slot_and_a_new_one_the_cheapest() -> None:
    async def go() -> None:
        gate = SlotGate("m", slots=3, queue=0)
        a = await gate.enter([1, 2, 3])
        a.held = (1, 2, 3)
        gate.leave(a)
        b = await gate.enter([7, 8])
        assert b is not a  # an empty slot before one holding a conversation
        b.held = (7, 8)
        gate.leave(b)
        assert await gate.enter([1, 2, 3, 4, 5]) is a  # it continues what a holds
        c = await gate.enter([9])
        assert c not in (a, b)
        gate.leave(c)
        c.held, c.dirty = (9,), False  # saved: cheaper to overwrite than b (unsaved)
        assert await gate.enter([5, 5]) is c
        gate.reset()
        assert all(s.held == () and not s.busy for s in gate.table)

    run(go())


def test_compute_gate_lets_one_model_batch_and_hands_over_in_turn() -> None:
    async def go() -> None:
        gate = ComputeGate(batch_window_s=0)
        order: list[str] = []
        await gate.enter("a")
        await gate.enter("a")  # the same model batches freely
        b1 = asyncio.create_task(gate.enter("b"))
        b2 = asyncio.create_task(gate.enter("b"))
        await asyncio.sleep(0)
        a3 = asyncio.create_task(gate.enter("a"))  # b is waiting: a's new request waits too
        await asyncio.sleep(0)
        assert not (b1.done() or b2.done() or a3.done())
        b1.add_done_callback(lambda _: order.append("b"))
        a3.add_done_callback(lambda _: order.append("a"))
        gate.leave("a")
        await asyncio.sleep(0)
        assert order == []  # one of a's requests still runs
        gate.leave("a")
        await asyncio.gather(b1, b2)
        assert gate.owner == "b" and gate.active == 2 and not a3.done()
        gate.leave("b")
        gate.leave("b")
        await a3
        assert order == ["b", "a"] and gate.owner == "a"
        gate.leave("a")
        assert gate.owner is None

    run(go())


def test_compute_gate_batches_the_owner_within_its_window() -> None:
    async def go() -> None:
        gate = ComputeGate(batch_window_s=60)
        await gate.enter("a")
        b = asyncio.create_task(gate.enter("b"))
        await asyncio.sleep(0)
        await asyncio.wait_for(gate.enter("a"), 0.1)  # a's turn is young: it still batches
        assert gate.active == 2 and not b.done()
        gate.leave("a")
        gate.leave("a")
        await b
        assert gate.owner == "b"

    run(go())


def test_compute_gate_off_admits_everyone() -> None:
    async def go() -> None:
        gate = ComputeGate(enabled=False)
        await gate.enter("a")
        await asyncio.wait_for(gate.enter("b"), 0.1)

    run(go())


def _model(context: int = 4096, parallel: int = 4) -> CatalogModel:
    return CatalogModel("m", Path("/m.gguf"), "config", INFO,
                        EngineOptions(context=context, parallel=parallel, embeddings=True), 1)


class Worker:
    """The llama.cpp client over a worker that answers /apply-template and /tokenize like
    llama.cpp (one token per word here); called as ``count_tokens``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.engine = LlamaCppClient(httpx.MockTransport(self._answer), "m")

    def _answer(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.path)
        payload = json.loads(request.content)
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={
                "prompt": " ".join(m["content"] for m in payload["messages"])})
        return httpx.Response(200, json={"tokens": list(range(len(payload["content"].split())))})

    async def __call__(self, prompt: str | list[dict[str, Any]]) -> int:
        return await self.engine.count_tokens(prompt)


def _chat(words: int, max_tokens: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "w " * words}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def test_small_requests_fit_without_asking_the_worker() -> None:
    worker = Worker()
    run(check_fits(_model(context=16384), "/v1/chat/completions", _chat(10, 100), worker))
    run(check_fits(_model(), "/v1/completions", {"prompt": "hi", "max_tokens": 9}, worker))
    assert worker.calls == []


def test_large_prompts_are_templated_and_tokenized_exactly() -> None:
    worker = Worker()
    # 1200 bytes prove nothing; 600 tokens + 100 fit the 1024-token slot
    run(check_fits(_model(), "/v1/chat/completions", _chat(600, 100), worker))
    assert worker.calls == ["/apply-template", "/tokenize"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", _chat(1000, 100), "max_tokens"),  # 1100 > 1024
        ("/v1/chat/completions", _chat(1100, None), "messages"),  # the prompt alone
        ("/v1/completions", {"prompt": "w " * 1000, "max_tokens": 500}, "max_tokens"),
        ("/v1/completions", {"prompt": list(range(1030))}, "prompt"),
    ],
)
def test_oversize_requests_are_400_naming_the_numbers(path: str, body: dict[str, Any],
                                                      param: str) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        run(check_fits(_model(), path, body, Worker()))
    err = info.value
    assert err.status == 400 and err.code == "context_length_exceeded" and err.param == param
    assert "slot of 1024 tokens" in err.message and "context 4096 shared by 4 slots" in err.message


@pytest.mark.parametrize("body,which", [
    ({"input": "w " * 600}, "the input"),
    ({"input": ["short", "w " * 600]}, "input 1"),
    ({"input": list(range(513))}, "the input"),
    ({"input": [[1, 2], list(range(600))]}, "input 1"),
])
def test_embeddings_inputs_longer_than_the_engine_takes_are_400_naming_the_limit(
        body: dict[str, Any], which: str) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        run(check_fits(_model(), "/v1/embeddings", body, Worker()))
    assert info.value.param == "input" and "at most 512 tokens per input" in info.value.message
    assert which in info.value.message


def test_embeddings_inputs_within_the_limit_pass() -> None:
    worker = Worker()
    run(check_fits(_model(), "/v1/embeddings", {"input": ["w " * 500, "x"]}, worker))
    assert worker.calls == ["/tokenize"]  # only the input whose bytes left it open


def test_more_prompts_than_slots_is_400_before_the_model_loads() -> None:
    async def no_table() -> None:
        raise AssertionError("a prompt count needs no vocabulary, nor a worker")

    body = {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 4}
    with pytest.raises(InvalidRequest, match="5 prompts in one request; send at most 4"):
        run(refuse_before_load(_model(), "/v1/completions", body, no_table))
    run(refuse_before_load(_model(), "/v1/completions", {"prompt": ["a", "b"]}, no_table))


def _tiny_table(tmp_path: Path) -> Any:
    from bunkhouse.catalog.vocab import pair_table
    from tests.helpers import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")  # tokens tok0 ... tok299, no spaces
    return pair_table(path, path.stat().st_mtime_ns)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tok " * 3000}]}),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "tok " * 3000}]}]}),
    ("/v1/completions", {"prompt": "tok " * 3000}),
    ("/v1/completions", {"prompt": ["tok", "tok " * 3000]}),
    ("/v1/completions", {"prompt": list(range(2100))}),
])
def test_a_prompt_certainly_too_long_is_refused_before_its_model_loads(
        tmp_path: Path, path: str, body: dict[str, Any]) -> None:
    table = _tiny_table(tmp_path)

    async def pairs() -> Any:
        return table

    async def go() -> None:
        with pytest.raises(ContextLengthExceeded) as info:
            await refuse_before_load(_model(context=8192, parallel=4), path, body, pairs)
        assert info.value.param == ("messages" if "messages" in body else "prompt")
        assert "2048 tokens" in info.value.message

    run(go())


def test_the_vocabulary_is_read_only_for_prompts_that_might_not_fit(tmp_path: Path) -> None:
    asked: list[bool] = []
    table = _tiny_table(tmp_path)

    async def pairs() -> Any:
        asked.append(True)
        return table

    async def go() -> None:
        model = _model(context=8192, parallel=4)
        await refuse_before_load(model, "/v1/completions", {"prompt": "tok " * 100}, pairs)
        assert not asked  # 400 bytes can never be more than 2,048 tokens
        await refuse_before_load(model, "/v1/completions", {"prompt": "tok" * 1000}, pairs)
        assert asked  # 3,000 bytes might be: the bound (1,000 tokens) lets it through
        with pytest.raises(ContextLengthExceeded):
            await refuse_before_load(model, "/v1/embeddings", {"input": "tok " * 3000}, pairs)

    run(go())


def _sliced(turn_s: float) -> tuple[ComputeGate, list[str]]:
    """A gate with a time slice whose suspensions (-model) and resumptions (+model) are
    recorded in order."""
    calls: list[str] = []
    gate = ComputeGate(batch_window_s=0, turn_s=turn_s, suspend=lambda m: calls.append(f"-{m}"),
                       resume=lambda m: calls.append(f"+{m}"))
    return gate, calls


async def _b_after_a_slice(turn_s: float) -> tuple[ComputeGate, list[str]]:
    """A sliced gate where a computes and b got in once a's slice ended."""
    gate, calls = _sliced(turn_s)
    await gate.enter("a")
    await asyncio.wait_for(gate.enter("b"), 5)
    return gate, calls


def test_compute_gate_time_slice_suspends_the_owner_and_resumes_it_in_turn() -> None:
    async def go() -> None:
        gate, calls = _sliced(0.05)
        await gate.enter("a")  # a long generation
        b = asyncio.create_task(gate.enter("b"))  # a short request to another model
        await asyncio.wait_for(b, 5)  # a's slice ended: b runs while a is stopped
        assert calls == ["-a"] and gate.owner == "b" and gate.suspended == {"a"}
        assert gate.preemptions == 1
        late_a = asyncio.create_task(gate.enter("a"))  # a's new request joins a's turn
        await asyncio.sleep(0)
        gate.leave("b")  # b is done: a continues, with its new request
        await asyncio.wait_for(late_a, 5)
        assert calls == ["-a", "+a"] and gate.owner == "a" and not gate.suspended
        assert gate.active == 2
        gate.leave("a")
        gate.leave("a")
        assert gate.owner is None

    run(go())


def test_compute_gate_time_slices_two_busy_models_in_turn() -> None:
    async def go() -> None:
        gate, calls = await _b_after_a_slice(0.02)
        for _ in range(100):  # both keep computing: the slices alternate
            await asyncio.sleep(0.01)
            if len(calls) >= 4:
                break
        assert calls[:5] == ["-a", "-b", "+a", "-a", "+b"][:len(calls[:5])]
        assert len(gate.suspended) == 1 and gate.owner not in gate.suspended
        gate.leave("a")
        gate.leave("b")
        assert not gate.suspended and gate.owner is None and gate.active == 0
        assert calls.count("-a") == calls.count("+a") and calls.count("-b") == calls.count("+b")

    run(go())


def test_compute_gate_resumes_a_suspended_model_whose_requests_all_left() -> None:
    async def go() -> None:
        gate, calls = await _b_after_a_slice(0.02)
        assert gate.suspended == {"a"}
        gate.leave("a")  # a's client went away while a was stopped
        assert calls == ["-a", "+a"] and not gate.suspended
        await asyncio.sleep(0.1)  # nobody waits: b's slice never ends
        assert gate.owner == "b" and calls == ["-a", "+a"]
        gate.leave("b")
        assert gate.owner is None

    run(go())


def test_compute_gate_without_hooks_never_slices() -> None:
    async def go() -> None:
        gate = ComputeGate(batch_window_s=0, turn_s=0.01)
        await gate.enter("a")
        b = asyncio.create_task(gate.enter("b"))
        await asyncio.sleep(0.1)
        assert not b.done()
        gate.leave("a")
        await asyncio.wait_for(b, 5)

    run(go())


@pytest.mark.parametrize("ceiling", [2147483648, 4294967296, 4294967301])
def test_a_ceiling_past_the_slot_is_the_slot_however_short_the_prompt(ceiling: int) -> None:
    """A short raw prompt is never counted: its ceiling is still lowered to the slot (1024
    tokens), never sent as a number the engine would wrap (4294967301 read as 5)."""
    async def fit() -> None:
        worker = Worker()
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": ceiling}),
                           ("/infill", {"input_prefix": "a", "max_tokens": ceiling})):
            assert await check_fits(_model(), path, body, worker, cap=True) == 1024
        assert worker.calls == []

    run(fit())


def test_models_on_different_nodes_compute_at_once_and_on_one_node_take_turns() -> None:
    async def go() -> None:
        gates = ComputeGates(batch_window_s=0)
        await gates.of("node-a").enter("a")
        await asyncio.wait_for(gates.of("node-b").enter("b"), 5)  # its own node's cores
        waiting = asyncio.ensure_future(gates.of("node-a").enter("c"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and gates.waits == 1  # behind a, on the same node
        gates.of("node-a").leave("a")
        await asyncio.wait_for(waiting, 5)
        gates.of("node-a").leave("c")
        gates.of("node-b").leave("b")
        assert gates.of("node-a").owner is None and gates.of("node-b").owner is None

    asyncio.run(go())
