"""The residency event ring and its live readers (residency/events.py), and the SSE route's
resume rules (front/watch.py)."""

from __future__ import annotations

import asyncio

import pytest

from bunkhouse.residency import events as ev
from bunkhouse.residency.events import EventLog, drain_cause


def test_a_reader_gets_the_backlog_after_its_number_then_live_events() -> None:
    async def run() -> list[int]:
        log = EventLog(capacity=10)
        for i in range(5):
            log.emit("m", "loading", str(i))
        subscription = log.subscribe(after=3)
        got = [e.seq for e in subscription.backlog]
        log.emit("m", "ready", "")
        log.emit("m", "draining", "making room for x")
        for _ in range(2):
            event = await subscription.next(5)
            assert event is not None
            got.append(event.seq)
        subscription.close()
        assert log.readers == 0
        return got

    assert asyncio.run(run()) == [4, 5, 6, 7]


def test_each_event_is_encoded_once_as_one_sse_message() -> None:
    import json

    event = EventLog().emit("m", "ready", "line one\nline two", measured_bytes=5)
    head, data, end = event.sse.decode().split("\n", 2)
    assert head == "id: 1" and end == "\n" and data.startswith("data: ")
    assert json.loads(data[6:]) == event.as_dict() and "sse" not in event.as_dict()


def test_an_events_detail_reaches_only_the_log_and_admins(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """Every client key reads events (/stats, /admin/events): a server path or a worker's
    output goes in the detail, which the public form leaves out. The log has it once, where
    its fault was logged (a failed load, a crash, a refused config), not again at the
    event's own line."""
    import json

    with caplog.at_level("INFO", "bunkhouse.residency"):
        event = EventLog().emit("*", "config refused", "SIGHUP: the configuration has an "
                                "error", "/srv/secret/bunkhouse.toml is not valid TOML")
    assert "config refused" in caplog.text and "/srv/secret" not in caplog.text
    assert "detail" not in event.as_dict() and b"/srv/secret" not in event.message()
    assert event.as_dict(detail=True)["detail"].startswith("/srv/secret")
    admin = json.loads(event.message(detail=True).decode().split("\n")[1][6:])
    assert admin == event.as_dict(detail=True)
    plain = EventLog().emit("m", "pinned", "operator")
    assert plain.message(detail=True) == plain.message() and "detail" not in \
        plain.as_dict(detail=True)


def test_a_slow_reader_is_dropped_and_never_slows_the_emitter(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr(ev, "SUBSCRIBER_QUEUE", 3)

    async def run() -> tuple[int, bool]:
        log = EventLog()
        subscription = log.subscribe()
        for i in range(10):  # nobody reads: the fourth overflows its queue
            log.emit("m", "pinned", str(i))
        seen = 0
        while (await subscription.next(1)) is not None:
            seen += 1
        return seen, subscription.dropped

    assert asyncio.run(run()) == (3, True)


def test_close_ends_every_reader_and_a_later_one_at_once() -> None:
    async def run() -> list[object]:
        log = EventLog()
        first = log.subscribe()
        log.close()
        later = log.subscribe()
        return [await first.next(1), await later.next(1)]

    assert asyncio.run(run()) == [None, None]


def test_a_quiet_subscription_times_out_for_a_heartbeat() -> None:
    async def run() -> None:
        subscription = EventLog().subscribe()
        with pytest.raises(TimeoutError):
            await subscription.next(0.01)

    asyncio.run(run())


def test_drains_are_counted_by_a_bounded_cause() -> None:
    log = EventLog()
    for reason in ("making room for gemma", "idle for 301 s (ttl 300 s)",
                   "keep_alive 0: unloaded once idle", "unloaded by an operator", "shutdown",
                   "removed", "crashed", "re-mounted: adapter b removed", "something new",
                   "its node n1 was lost (its raylet died)"):
        log.emit("m", "draining", reason)
    assert {cause for (_, cause) in log.drains} == set(ev.DRAIN_CAUSES)
    assert drain_cause("Making room for X") == "room"


def test_the_ring_keeps_its_capacity_and_knows_its_oldest() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.emit("m", "pinned", str(i))
    assert [e.seq for e in log.recent()] == [3, 4, 5]
    assert (log.oldest_seq, log.last_seq) == (3, 5)


def test_a_resume_past_the_ring_or_after_a_restart_is_told_of_its_gap() -> None:
    from bunkhouse.front.watch import EventStream

    log = EventLog(capacity=3)
    for i in range(5):
        log.emit("m", "pinned", str(i))
    stream = EventStream(log, lambda request: "")
    assert stream._gap(None) is None and stream._gap(2) is None and stream._gap(5) is None
    lost = stream._gap(0)
    assert lost is not None and (lost["missed_from"], lost["missed_to"]) == (1, 2)
    restarted = stream._gap(99)
    assert restarted is not None and "restarted" in restarted["reason"]
