"""The residency run loop and its door (ResidencyManager) with fake workers and a fake
clock: no processes, no sleeps (time moves only when a test advances the clock)."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from bunkhouse import defaults
from bunkhouse.catalog import Catalog, CatalogModel
from bunkhouse.cli.logs import TextLogFormatter
from bunkhouse.errors import (
    BunkhouseError,
    InsufficientMemory,
    ModelFailed,
    ModelTooLarge,
    Paused,
    ShuttingDown,
    WorkerLoadFailed,
    log_line,
)
from bunkhouse.supervisor.restart import RestartPolicy
from tests.fakes import GIB, FakeSpares, FakeWorker, Host, model, run, settle, until


def test_concurrent_acquires_of_a_cold_model_share_one_load() -> None:
    async def go() -> None:
        h = Host([model("a")])
        leases = await asyncio.gather(*(h.manager.acquire(h.models["a"]) for _ in range(10)))
        assert h.starts == ["a"]
        assert h.manager.status("a").leases == 10
        assert len({id(lease.worker) for lease in leases}) == 1
        for lease in leases:
            lease.release()
        await settle()
        assert h.manager.status("a").leases == 0

    run(go())


def test_cold_starts_are_serialized() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1), model("c", 1)])
        await asyncio.gather(h.use("a"), h.use("b"), h.use("c"))
        assert sorted(h.starts) == ["a", "b", "c"]
        assert h.max_concurrent_starts == 1

    run(go())


def test_release_is_idempotent_and_updates_last_used() -> None:
    async def go() -> None:
        h = Host([model("a")])
        lease = await h.manager.acquire(h.models["a"])
        h.advance(50)
        lease.release()
        lease.release()
        await settle()
        status = h.manager.status("a")
        assert status.leases == 0
        assert status.last_used is not None

    run(go())


def test_least_recently_used_is_evicted_and_its_worker_stopped() -> None:
    async def go() -> None:
        h = Host([model("a"), model("b"), model("c")], budget_gib=10)
        await h.use("a")
        h.advance(1)
        await h.use("b")
        h.advance(1)
        await h.use("a")  # now b is the least recently used
        h.advance(1)
        await h.use("c")
        assert (h.state("a"), h.state("b"), h.state("c")) == ("ready", "absent", "ready")
        assert [w.model.id for w in h.workers if w.stopped] == ["b"]
        assert h.manager.used_bytes() <= 10 * GIB
        kinds = [(e.model, e.kind) for e in h.manager.events.recent()]
        assert ("b", "draining") in kinds and ("b", "absent") in kinds

    run(go())


def test_pinned_model_is_never_evicted() -> None:
    async def go() -> None:
        h = Host([model("a", 6, pinned=True), model("b", 6)], budget_gib=10)
        await h.use("a")
        with pytest.raises(ModelTooLarge, match="pinned models hold"):
            await h.use("b")
        assert h.state("a") == "ready" and h.starts == ["a"]

    run(go())


def test_leased_model_is_never_evicted_and_the_load_waits_for_it() -> None:
    async def go() -> None:
        h = Host([model("a", 6), model("b", 6)], budget_gib=10)
        lease = await h.manager.acquire(h.models["a"])
        waiting = asyncio.create_task(h.use("b"))
        await settle()
        assert not waiting.done() and h.state("a") == "ready" and h.starts == ["a"]
        lease.release()  # the stream ends: now a may go
        await waiting
        assert (h.state("a"), h.state("b")) == ("absent", "ready")

    run(go())


def test_wait_is_bounded_then_insufficient_memory() -> None:
    async def go() -> None:
        h = Host([model("a", 6), model("b", 6)], budget_gib=10, admission_wait_s=30)
        lease = await h.manager.acquire(h.models["a"])
        waiting = asyncio.create_task(h.use("b"))
        await settle()
        h.advance(29)
        await settle()
        assert not waiting.done()
        h.advance(2)
        with pytest.raises(InsufficientMemory) as info:
            await waiting
        assert info.value.status == 503 and info.value.headers()["Retry-After"] == "5"
        assert "a" in info.value.message
        assert h.state("a") == "ready"
        more = await h.manager.acquire(h.models["a"])  # a takes leases again
        more.release()
        lease.release()

    run(go())


def test_a_model_that_fits_is_loaded_while_another_waits_and_the_refusal_names_the_busy_one(
        ) -> None:
    async def go() -> None:
        h = Host([model("g1", 4), model("g2", 4), model("q", 7)], budget_gib=10)
        stream = await h.manager.acquire(h.models["g1"])  # g1 streams
        waiting = asyncio.create_task(h.use("q"))  # q needs g1's room
        await settle()
        await h.use("g2")  # fits beside g1: loaded and answered meanwhile
        assert h.starts == ["g1", "g2"] and not waiting.done()
        h.advance(31)
        with pytest.raises(InsufficientMemory, match=r"models in use \(g1\)"):
            await waiting
        stream.release()

    run(go())


def test_model_bigger_than_the_budget_fails_at_once_naming_both_sizes() -> None:
    async def go() -> None:
        h = Host([model("huge", 12)], budget_gib=10)
        with pytest.raises(ModelTooLarge, match=r"needs \d+ MiB but the memory budget is 10240"):
            await h.use("huge")
        assert h.starts == []

    run(go())


def test_a_load_failing_with_a_foreign_error_tells_clients_no_path() -> None:
    """An error that is not ours (an OSError naming a file) fails the load with a message
    any client may read; the path goes only to the detail (the log and admins)."""
    class Broken(Host):
        async def start(self, m: CatalogModel, use_spare: bool = False) -> FakeWorker:
            raise FileNotFoundError(2, "No such file", "/srv/private/models/a.gguf")

    async def go() -> None:
        h = Broken([model("a")])
        with pytest.raises(BunkhouseError) as caught:
            await h.use("a")
        assert "/srv/private" not in caught.value.message
        assert "/srv/private" in (caught.value.detail or "")
        failed = [e for e in h.manager.events.recent() if e.kind == "failed"]
        assert failed and all("/srv/private" not in e.reason for e in failed)
        assert all(b"/srv/private" not in e.message() for e in h.manager.events.recent())
        assert "/srv/private" in (failed[0].as_dict(detail=True)["detail"] or "")

    run(go())


def test_ttl_unloads_idle_models_but_not_pinned_or_leased() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1, pinned=True), model("c", 1, ttl_s=1000)],
                 ttl_s=60)
        await h.use("a")
        await h.use("b")
        await h.use("c")
        held = await h.manager.acquire(h.models["c"])
        h.advance(61)
        await until(h, lambda: h.state("a") == "absent")
        assert (h.state("a"), h.state("b"), h.state("c")) == ("absent", "ready", "ready")
        held.release()
        await settle()
        h.advance(2000)
        await until(h, lambda: h.state("c") == "absent")

    run(go())


def test_failed_load_reaches_every_waiter_and_the_next_acquire_retries() -> None:
    async def go() -> None:
        h = Host([model("a")])
        h.fail.add("a")
        results = await asyncio.gather(*(h.use("a") for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, WorkerLoadFailed) for r in results)
        assert h.starts == ["a"] and h.state("a") == "failed"
        assert h.manager.status("a").last_error
        h.fail.clear()
        h.advance(1)  # past the backoff
        await h.use("a")
        assert h.starts == ["a", "a"] and h.state("a") == "ready"

    run(go())


def test_dead_worker_is_replaced_on_the_next_acquire() -> None:
    async def go() -> None:
        h = Host([model("a")])
        await h.use("a")
        h.advance(100)
        h.workers[0].stopped = True  # it died; its exit watcher has not said so
        await h.use("a")
        assert h.starts == ["a", "a"] and h.state("a") == "ready"

    run(go())


def test_pause_all_waits_for_leases_and_holds_new_ones() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1)])
        lease = await h.manager.acquire(h.models["a"])
        await h.use("b")
        order: list[str] = []
        resume = asyncio.Event()

        async def pauser() -> None:
            async with h.manager.pause_all():
                order.append("paused")
                await resume.wait()
                order.append("resuming")

        async def late() -> None:
            await h.use("b")
            order.append("late request served")

        pause = asyncio.create_task(pauser())
        await settle()
        other = asyncio.create_task(late())
        await settle()
        assert order == []  # the pause waits for a's lease
        lease.release()
        await until(h, lambda: order == ["paused"])
        await settle()
        assert not other.done()  # held while paused
        resume.set()
        await asyncio.gather(pause, other)
        assert order == ["paused", "resuming", "late request served"]

    run(go())


def test_close_stops_every_worker() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1)])
        await h.use("a")
        await h.use("b")
        await h.manager.close()
        assert all(w.stopped for w in h.workers)
        assert (h.state("a"), h.state("b")) == ("absent", "absent")

    run(go())


def test_a_crashed_worker_is_respawned_with_the_same_model() -> None:
    async def go() -> None:
        h = Host([model("a")])
        await h.use("a")
        h.advance(100)  # it ran a while: no backoff
        h.workers[0].die("exit code -9")
        await until(h, lambda: len(h.workers) == 2 and h.state("a") == "ready")
        assert h.starts == ["a", "a"]
        kinds = [e.kind for e in h.manager.events.recent() if e.model == "a"]
        assert kinds[-4:] == ["absent", "respawning", "loading", "ready"]
        assert "crashed" in kinds
        await h.use("a")

    run(go())


def test_a_crash_loop_ends_in_failed_after_the_budget_without_a_storm() -> None:
    async def go() -> None:
        h = Host([model("a")], restart=RestartPolicy(max_restarts=3, backoff_s=0.001,
                                                     cooldown_s=60))
        h.fail.add("a")
        outcomes = []
        for _ in range(8):
            try:
                await h.use("a")
            except (WorkerLoadFailed, ModelFailed) as e:
                outcomes.append(type(e).__name__)
            h.advance(1)
        assert h.starts == ["a"] * 4  # the first try and 3 restarts, then no more spawns
        assert outcomes == ["WorkerLoadFailed"] * 4 + ["ModelFailed"] * 4
        status = h.manager.status("a")
        assert status.state == "failed" and "failed to load" in (status.last_error or "")
        with pytest.raises(ModelFailed) as info:
            await h.use("a")
        assert info.value.status == 503 and int(info.value.headers()["Retry-After"]) > 0
        h.fail.clear()
        h.advance(61)  # the cool-down passes
        await h.use("a")
        assert h.state("a") == "ready" and len(h.starts) == 5

    run(go())


def test_a_failed_load_logs_its_output_once_and_each_refusal_a_short_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine's output of a failed load is logged once per failure, at ERROR; every
    request refused meanwhile or in the cool-down after logs one short WARNING at the edge
    (errors.log_line), naming the model, the cause and when the cool-down ends."""
    output = "llama_model_load: error loading model: tensor 'blk.0' is corrupt\n" * 20

    async def go() -> None:
        h = Host([model("a")], restart=RestartPolicy(max_restarts=1, backoff_s=0.001,
                                                     cooldown_s=60))
        h.fail.add("a")
        h.fail_detail = output
        errors: list[BunkhouseError] = []
        for _ in range(6):
            results = await asyncio.gather(*(h.use("a") for _ in range(3)),
                                           return_exceptions=True)
            errors += [r for r in results if isinstance(r, BunkhouseError)]
            h.advance(1)
        assert len(errors) == 18 and h.starts == ["a", "a"]  # a try, a restart, cooling
        lines = [log_line(e) for e in errors]
        assert all(line is not None and line[0] == logging.WARNING and output not in line[1]
                   for line in lines)
        cooling = [e for e in errors if isinstance(e, ModelFailed)]
        assert cooling and "tried again in" in cooling[-1].message
        assert cooling[-1].detail == output  # admins still read it
        for e in cooling:  # said once, one figure in the message and in Retry-After
            assert e.message.count("failed to load") == 1 and "is failed" not in e.message
            assert f"tried again in {e.headers()['Retry-After']} s" in e.message, e.message
            assert "bunkhouse load a" in e.message
        for e in errors:  # a load's own failures say when it is tried again too
            assert f"tried again in {e.headers()['Retry-After']} s" in e.message, e.message

    with caplog.at_level(logging.INFO):
        run(go())
    outputs = [getattr(r, "output", None) or "" for r in caplog.records]
    # logged at its first failure; the retry's same output is not repeated
    assert "".join(outputs).count("tensor 'blk.0' is corrupt") == 20
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(loud) == 2 and all("load failed" in r.getMessage() for r in loud)
    assert "load failed again" in loud[1].getMessage()
    text = TextLogFormatter("%(levelname)s %(message)s").format(loud[0])
    first, *rest = text.split("\n")  # the output indented under one ERROR line
    assert first.startswith("ERROR model a: load failed") and len(rest) >= 20
    assert all(line.startswith("    ") for line in rest) and "\\x0a" not in text
    assert rest[0] == "    llama_model_load: error loading model: tensor 'blk.0' is corrupt"


def test_unload_and_pin_answer_whether_anything_changed() -> None:
    """``bunkhouse unload`` of an absent or failed model changes nothing and says so (None,
    at once); a second pin or unpin answers False; a failure stays failed."""
    async def go() -> None:
        h = Host([model("a"), model("b")])
        assert await h.manager.unload("a", "operator") is None  # absent: nothing held
        h.fail.add("b")
        with pytest.raises(WorkerLoadFailed):
            await h.use("b")
        for _ in range(2):
            assert await h.manager.unload("b", "operator") is None
            assert h.state("b") == "failed" and h.manager.status("b").last_error
        await h.use("a")
        assert await h.manager.unload("a", "operator") is True
        assert await h.manager.set_pinned("a", True) is True
        assert await h.manager.set_pinned("a", True) is False
        assert await h.manager.set_pinned("a", False) is True
        assert await h.manager.set_pinned("a", False) is False
        assert h.starts == ["b", "a"]

    run(go())


def test_a_model_too_large_is_refused_at_once_even_while_paused() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("huge", 12)], budget_gib=10, admission_wait_s=30)
        await h.manager.operator_pause(60)
        with pytest.raises(ModelTooLarge, match="needs"):
            await asyncio.wait_for(h.use("huge"), 1)  # not Paused after the wait
        assert h.starts == []

    run(go())


def test_quick_deaths_back_off_exponentially() -> None:
    async def go() -> None:
        h = Host([model("a")], restart=RestartPolicy(max_restarts=10, backoff_s=1))
        await h.use("a")
        for n, backoff in enumerate((1, 2, 4)):
            h.workers[-1].die("crashed at once")
            await until(h, lambda: h.state("a") == "absent")
            await settle()
            assert len(h.workers) == n + 1  # not before its backoff
            h.advance(backoff - 0.01)
            await settle()
            assert len(h.workers) == n + 1
            h.advance(0.02)
            await until(h, lambda n=n: len(h.workers) == n + 2 and h.state("a") == "ready")

    run(go())


def test_a_worker_that_stops_answering_probes_is_replaced() -> None:
    async def go() -> None:
        h = Host([model("a")], probe_interval_s=5)
        await h.use("a")
        h.workers[0].answers = False
        for _ in range(2):
            h.advance(5)
            await settle()
            await until(h, lambda: h.manager.snapshot().health["a"].probing is None)
        await until(h, lambda: len(h.workers) == 2 and h.state("a") == "ready")
        assert h.workers[0].stopped and h.workers[0].exit_cause == "killed"

    run(go())


def test_a_stall_while_a_constrained_request_runs_is_that_requests_not_the_models(
        ) -> None:
    """Three workers in a row stall on requests whose constraints passed the probe: each is
    replaced, each request is blamed, and the model never counts a failure (with a restart
    budget of 2 it would be failed by the third)."""
    async def go() -> None:
        h = Host([model("a")], probe_interval_s=5,
                 restart=RestartPolicy(max_restarts=2, backoff_s=0.001, cooldown_s=60))
        for n in range(3):
            lease = await h.manager.acquire(h.models["a"])
            other = await h.manager.acquire(h.models["a"])  # another client's request
            lease.constrained(True)
            h.workers[-1].answers = False
            for _ in range(2):
                h.advance(5)
                await settle()
                await until(h, lambda: h.manager.snapshot().health["a"].probing is None)
            await until(h, lambda n=n: h.workers[n].stopped)
            assert lease.blamed() and not other.blamed()
            assert h.manager.snapshot().health["a"].failures == ()
            lease.release()
            other.release()
            await until(h, lambda: not h.manager.snapshot().models["a"].blamed)
        await h.use("a")
        assert h.state("a") == "ready" and len(h.workers) == 4

    run(go())


def test_a_stall_after_a_constrained_request_ended_is_the_models() -> None:
    async def go() -> None:
        h = Host([model("a")], probe_interval_s=5)
        lease = await h.manager.acquire(h.models["a"])
        lease.constrained(True)
        lease.constrained(False)  # its answer ended
        h.workers[0].answers = False
        for _ in range(2):
            h.advance(5)
            await settle()
            await until(h, lambda: h.manager.snapshot().health["a"].probing is None)
        await until(h, lambda: h.workers[0].stopped)
        assert not lease.blamed()
        assert len(h.manager.snapshot().health["a"].failures) == 1
        lease.release()

    run(go())


def test_a_suspended_worker_is_not_probed_and_a_probe_across_a_suspension_counts_nothing(
        ) -> None:
    async def go() -> None:
        h = Host([model("a")], probe_interval_s=5)
        await h.use("a")
        h.workers[0].answers = False
        h.manager.suspend("a")
        await settle()
        assert h.workers[0].suspended
        h.advance(50)
        await settle()
        assert h.manager.snapshot().health["a"].probe_failures == 0
        h.manager.resume("a")
        await settle()
        assert not h.workers[0].suspended and len(h.workers) == 1

    run(go())


def test_a_worker_that_fails_every_request_is_replaced() -> None:
    async def go() -> None:
        h = Host([model("a")])
        for ok in (False, True, False, False):  # a success resets the count
            lease = await h.manager.acquire(h.models["a"])
            lease.report(ok)
            lease.release()
        await settle()
        assert len(h.workers) == 1
        lease = await h.manager.acquire(h.models["a"])
        lease.report(False)  # the third failure in a row
        lease.release()
        await until(h, lambda: h.state("a") == "absent")
        h.advance(1)  # its crash-loop backoff
        await until(h, lambda: len(h.workers) == 2 and h.state("a") == "ready")

    run(go())


def test_a_reload_adds_removes_without_cutting_and_changes_at_the_next_load() -> None:
    import dataclasses

    async def go() -> None:
        h = Host([model("a", 1), model("b", 1), model("c", 1)])
        lease = await h.manager.acquire(h.models["a"])  # a is in use through the reload
        await h.use("c")
        bigger = dataclasses.replace(h.models["c"], size_bytes=2 * GIB)
        h.models["d"] = model("d", 1)
        change = await h.manager.apply_catalog(
            Catalog([model("b", 1), bigger, h.models["d"]], "d"))
        assert change == {"added": ["d"], "removed": ["a"], "changed": ["c"]}
        assert h.manager.catalog.default_id == "d"
        # a drains only once its request ends; new requests for it are refused
        await settle()
        assert h.state("a") == "draining" and not h.workers[0].stopped
        lease.release()
        await until(h, lambda: "a" not in h.manager.catalog.ids())
        assert h.workers[0].stopped
        # c keeps its running settings until it is loaded again
        assert h.manager.status("c").estimated_bytes < 2 * GIB
        await h.manager.unload("c", "test")
        assert h.manager.catalog.get("c").size_bytes == 2 * GIB
        await h.use("d")
        # keep_alive: 0 unloads as soon as nobody holds the model; inf never for idleness
        h.manager.keep_alive("d", 0)
        await until(h, lambda: h.state("d") == "absent")
        await h.use("b")
        h.manager.keep_alive("b", math.inf)
        await settle()
        h.advance(10**6)
        await settle()
        assert h.state("b") == "ready" and h.manager.expires_at("b") is None
        h.manager.keep_alive("b", 60)
        await settle()
        assert h.manager.expires_at("b") is not None
        h.advance(61)
        await until(h, lambda: h.state("b") == "absent")

    run(go())


def test_a_model_removed_and_added_back_while_it_drains_stays() -> None:
    import dataclasses

    from bunkhouse.config import RequestParams

    async def go() -> None:
        h = Host([model("a", 1), model("b", 1)])
        lease = await h.manager.acquire(h.models["a"])
        await h.manager.apply_catalog(Catalog([model("b", 1)], None))
        await settle()
        assert h.state("a") == "draining"
        back = await h.manager.apply_catalog(Catalog([model("a", 1), model("b", 1)], None))
        assert back["added"] == ["a"]
        lease.release()
        await until(h, lambda: h.state("a") == "absent")
        assert "a" in h.manager.catalog.ids()
        await h.use("a")
        # names and request params change at once, even while the model runs
        await h.use("b")
        renamed = dataclasses.replace(model("b", 1), aliases=("bee",),
                                      request=RequestParams((("temperature", 0.1),)))
        change = await h.manager.apply_catalog(Catalog([model("a", 1), renamed], None))
        assert change["changed"] == ["b"] and h.state("b") == "ready"
        assert h.manager.catalog.get("bee").request.defaults == (("temperature", 0.1),)
        again = await h.manager.apply_catalog(Catalog([model("a", 1), renamed], None))
        assert again == {"added": [], "removed": [], "changed": []}

    run(go())


def test_keep_alive_never_unloads_a_pinned_model() -> None:
    async def go() -> None:
        h = Host([model("p", 1, pinned=True)])
        await h.use("p")
        h.manager.keep_alive("p", 0)
        await h.use("p")
        h.advance(10**6)
        await settle()
        assert h.state("p") == "ready"

    run(go())


def test_a_model_held_for_another_takes_no_new_lease_but_counts_as_loaded() -> None:
    async def go() -> None:
        h = Host([model("a", 6), model("b", 6)], budget_gib=10)
        lease = await h.manager.acquire(h.models["a"])
        waiting = asyncio.create_task(h.use("b"))  # a is held for b: no new lease
        await settle()
        late = asyncio.create_task(h.use("a"))
        await settle()
        assert not late.done() and h.manager.status("a").waiting == 1
        await h.manager.load("a")  # an operator's load: it is loaded, answered at once
        lease.release()
        await waiting  # b is served first, then a again
        await late
        assert h.starts == ["a", "b", "a"]

    run(go())


def test_a_load_whose_requests_all_left_evicts_nothing() -> None:
    async def go() -> None:
        h = Host([model("a", 6), model("b", 6)], budget_gib=10)
        lease = await h.manager.acquire(h.models["a"])
        waiting = [asyncio.create_task(h.use("b")) for _ in range(2)]
        await settle()
        assert h.manager.status("b").waiting == 2  # shown while they wait
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        lease.release()  # a may go now, but nobody wants b any more
        await settle()
        assert (h.state("a"), h.state("b")) == ("ready", "absent") and h.starts == ["a"]
        assert h.manager.status("b").waiting == 0
        await h.use("b")  # a new request loads it as usual
        assert (h.state("a"), h.state("b")) == ("absent", "ready")

    run(go())


def test_once_stopping_no_model_is_loaded_and_ready_ones_still_serve() -> None:
    async def go() -> None:
        h = Host([model("a", 6), model("b", 6)], budget_gib=10)
        lease = await h.manager.acquire(h.models["a"])
        waiting = asyncio.create_task(h.use("b"))  # waits for a's memory
        await settle()
        h.manager.stop_loads()
        with pytest.raises(ShuttingDown):
            await waiting
        with pytest.raises(ShuttingDown):
            await h.use("b")
        lease.release()
        await h.use("a")  # a ready model serves through the stop's grace
        assert (h.state("a"), h.state("b")) == ("ready", "absent") and h.starts == ["a"]

    run(go())


def test_an_operators_pause_holds_new_leases_loads_nothing_and_resumes_together() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1)], admission_wait_s=5)
        await h.use("a")
        held = await h.manager.acquire(h.models["a"])
        await h.manager.operator_pause(60)
        assert h.manager.paused
        quiet = asyncio.create_task(h.manager.paused_quiet())
        waiting = [asyncio.create_task(h.use("a")), asyncio.create_task(h.use("b"))]
        await settle()
        assert not quiet.done()  # a's lease is still in flight
        held.release()
        assert await quiet is True
        assert not any(t.done() for t in waiting)
        assert h.starts == ["a"]  # b is not loaded while paused
        assert h.manager.status("b").waiting == 1
        assert await h.manager.operator_resume() is True
        await asyncio.gather(*waiting)
        assert h.starts == ["a", "b"]
        assert await h.manager.operator_resume() is False  # none held any more
        kinds = [e.kind for e in h.manager.events.recent(50) if e.model == "*"]
        assert kinds == ["paused", "resumed"]

    run(go())


def test_a_paused_request_gives_up_after_the_admission_wait_and_a_pause_ends_by_itself(
        ) -> None:
    async def go() -> None:
        h = Host([model("a", 1)], admission_wait_s=5)
        await h.use("a")
        await h.manager.operator_pause(30)
        waiting = asyncio.create_task(h.use("a"))
        await settle()
        h.advance(5)
        with pytest.raises(Paused) as refused:
            await waiting
        assert refused.value.headers()["Retry-After"] == "25"
        assert h.manager.status("a").waiting == 0  # its place was given up
        h.advance(25)  # the pause's 30 s passed: nobody resumed it
        await until(h, lambda: not h.manager.paused)
        await h.use("a")
        reasons = [e.reason for e in h.manager.events.recent(50) if e.kind == "resumed"]
        assert reasons == ["not resumed within 30 s"]

    run(go())


def test_a_pause_holds_a_load_that_waits_for_memory_and_a_stop_ends_paused_waits() -> None:
    async def go() -> None:
        h = Host([model("a", 1), model("b", 1)], budget_gib=1.5, admission_wait_s=5)
        held = await h.manager.acquire(h.models["a"])
        waiting = asyncio.create_task(h.use("b"))  # b waits for a's memory
        await settle()
        await h.manager.operator_pause(60)
        held.release()  # a is idle now: without the pause, b's load would evict it
        await settle()
        assert h.state("a") == "ready" and h.starts == ["a"]  # nothing evicted or loaded
        await h.manager.operator_resume()
        await waiting
        assert h.starts == ["a", "b"] and h.state("a") == "absent"

        await h.manager.operator_pause(60)
        paused = asyncio.create_task(h.use("b"))  # b is ready: it waits for the resume
        await settle()
        assert not paused.done()
        h.manager.stop_loads()  # the front begins to stop: the pause is never resumed
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(paused, 1)

    run(go())


def _spare_host(room: int) -> tuple[Host, FakeSpares, int]:
    """A host with spares whose budget is one model's estimate plus ``room`` bytes."""
    spares = FakeSpares()
    models = [model("a", 4), model("b", 4), model("whisper", 4)]
    probe = Host(models)
    budget = probe.manager.status("a").estimated_bytes + room
    return Host(models, spares=spares, budget_bytes=budget), spares, budget


def test_a_spare_is_kept_while_idle_counted_in_the_budget_and_taken_by_the_next_load() -> None:
    async def go() -> None:
        h, spares, budget = _spare_host(defaults.SPARE_BYTES + 1)
        lease = await h.manager.acquire(h.models["a"])
        await settle()
        assert spares.log == []  # a request in flight: no spare yet
        lease.release()
        await until(h, lambda: h.manager.spare_status() is not None)
        assert spares.log == ["+llama"]  # idle: one spare for a's engine
        assert h.manager.used_bytes() == budget - 1
        await h.use("b")  # b's worker is the spare: a is evicted, the spare is not dropped
        assert (h.state("a"), h.state("b")) == ("absent", "ready")
        assert "-llama" not in spares.log
        assert h.manager.used_bytes() <= budget
        h.advance(1)
        await h.use("whisper")  # another engine: room is needed, the spare goes first
        assert "-llama" in spares.log
        assert h.state("whisper") == "ready" and h.manager.used_bytes() <= budget
        assert h.manager.peak_bytes <= budget

    run(go())


def test_no_spare_without_room_for_it_besides_the_models() -> None:
    async def go() -> None:
        h, spares, _ = _spare_host(defaults.SPARE_BYTES - 1)
        await h.use("a")
        await settle()
        assert spares.log == []

    run(go())


def test_a_spare_still_being_made_is_waited_for_without_spinning() -> None:
    """A load that needs the room of a spare whose start has not returned yet waits for
    that start (and the drop) as events: the loop takes no step meanwhile."""
    class SlowSpares(FakeSpares):
        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()

        async def fill_spare(self, engine: str, node: str = "local") -> int | None:
            await self.release.wait()
            return await super().fill_spare(engine, node)

    async def go() -> None:
        spares = SlowSpares()
        models = [model("a", 4), model("b", 4)]
        budget = Host(models).manager.status("a").estimated_bytes * 2 + 1
        h = Host(models, spares=spares, budget_bytes=budget)
        await h.use("a")  # idle afterwards: a spare starts, and does not return
        await until(h, lambda: h.manager.snapshot().nodes["local"].spare is not None)
        waiting = asyncio.create_task(h.use("b"))  # needs the spare's room
        await settle()
        steps = h.manager.steps
        await settle(500)
        assert h.manager.steps == steps and not waiting.done()  # no spinning
        spares.release.set()
        await waiting
        assert (h.state("a"), h.state("b")) == ("ready", "ready")
        assert h.manager.used_bytes() <= budget

    run(go())
