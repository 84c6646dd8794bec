"""Which parts of a request are measured in the constraint probe, and how (pure)."""

from __future__ import annotations

import pytest

from bunkhouse.engines.llamacpp import constraint_checks
from bunkhouse.errors import InvalidRequest, StalledTooOften
from bunkhouse.front.constraints import MAX_STALLS, ConstraintGate
from tests.fakes import model

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = "/v1/chat/completions"


def test_a_request_without_a_constraint_is_not_measured() -> None:
    assert constraint_checks(CHAT, {"messages": [], "max_tokens": 5}) == []
    assert constraint_checks(CHAT, {"response_format": {"type": "text"}}) == []
    assert constraint_checks(CHAT, {"tools": TOOLS, "tool_choice": "none"}) == []


def test_each_constraint_is_measured_alone_with_a_one_word_prompt() -> None:
    body = {"messages": [{"role": "user", "content": "a long conversation " * 1000}],
            "max_tokens": 900, "grammar": 'root ::= "a"', "json_schema": {"type": "string"},
            "response_format": {"type": "json_object"}, "tools": TOOLS,
            "logit_bias": {"15": 1}, "samplers": ["top_k"], "temperature": 0.2}
    checks = constraint_checks(CHAT, body)
    assert [c.param for c in checks] == ["samplers", "grammar", "json_schema",
                                         "response_format", "tools"]
    for check in checks:
        assert check.route == "chat"
        assert check.body["messages"] == [{"role": "user", "content": "hi"}]
        assert check.body["max_tokens"] == 2 and check.body["stream"] is False
        assert "tools" not in check.body  # their text would be a long prefill
    assert checks[1].body["grammar"] == 'root ::= "a"' and "json_schema" not in checks[1].body
    tools = checks[4].body["response_format"]["json_schema"]["schema"]
    assert tools["properties"]["name"] == {"const": "get_weather"}
    for check in checks:  # each with the request's sampler lists, not its temperature
        assert check.body["logit_bias"] == {"15": 1} and check.body["samplers"] == ["top_k"]
        assert "temperature" not in check.body


def test_sampler_lists_are_measured_with_what_turns_them_on() -> None:
    """300 DRY sequence breakers cost nothing without ``dry_multiplier`` and stalled a worker
    with it: the check must carry it."""
    breakers = [f"zq{i}xw abcdefghijklmnopqrstuvwxyz0123456789" for i in range(300)]
    [check] = constraint_checks(CHAT, {"dry_multiplier": 0.8, "dry_base": 1.75,
                                       "dry_sequence_breakers": breakers})
    assert check.param == "dry_sequence_breakers"
    assert check.body["dry_multiplier"] == 0.8 and check.body["dry_base"] == 1.75
    assert check.body["dry_sequence_breakers"] == breakers


def test_a_completion_is_measured_on_the_completion_route() -> None:
    [check] = constraint_checks("/v1/completions", {"prompt": "x" * 10_000, "grammar": "g"})
    assert check.route == "completion" and check.body["prompt"] == "hi"
    assert check.body["n_predict"] == 2 and "messages" not in check.body


def test_parts_of_many_alternatives_are_measured_on_their_own() -> None:
    """A costly part behind a fixed prefix costs only when generation reaches it, after the
    probe's two tokens: the largest such parts are measured as the whole constraint."""
    alternatives = " | ".join(f'"w{i:05d}"' for i in range(5000))
    grammar = f'root ::= "The answer is: " alt\nalt ::= {alternatives}\nsmall ::= "a" | "b"\n'
    whole, part = constraint_checks("/v1/completions", {"grammar": grammar})
    assert whole.body["grammar"] == grammar and part.param == "grammar"
    assert part.body["grammar"].endswith("root ::= alt\n")
    assert "bunkhouse-root ::= \"The answer is: \" alt" in part.body["grammar"]

    enum = {"enum": [f"v{i}" for i in range(3000)]}
    schema = {"type": "object", "properties": {"intro": {"const": "x"}, "v": enum,
                                               "w": {"$ref": "#/$defs/w"}},
              "$defs": {"w": {"anyOf": [{"const": i} for i in range(40)]}}}
    checks = constraint_checks(CHAT, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert [c.param for c in checks] == ["response_format"] * 3
    parts = [c.body["response_format"]["json_schema"]["schema"] for c in checks[1:]]
    assert parts[0]["enum"] == enum["enum"] and "anyOf" in parts[1]
    assert all(p["$defs"] == schema["$defs"] for p in parts)  # a $ref still resolves

    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": enum}}}}]
    whole, part = constraint_checks(CHAT, {"tools": tools})
    assert whole.param == part.param == "tools"
    assert part.body["response_format"]["json_schema"]["schema"]["enum"] == enum["enum"]
    # a schema of few alternatives has no parts of its own
    assert len(constraint_checks(CHAT, {"response_format": {"type": "json_schema",
                                       "json_schema": {"schema": {"enum": [1, 2]}}}})) == 1


def test_what_is_known_refused_is_refused_before_any_load_or_probe() -> None:
    """A constraint that stalled a worker, and a client whose constraints stalled workers
    too often, are refused from what the gate knows: no probe, no lease, no load waited for."""
    gate, m = ConstraintGate(), model("a")
    body = {"messages": [], "grammar": 'root ::= "a"'}
    gate.refuse_known(m, CHAT, body, "alice")  # nothing known yet: it goes on
    assert gate.blame(m, CHAT, body, "bob") == "grammar"
    with pytest.raises(InvalidRequest) as info:
        gate.refuse_known(m, CHAT, body, "alice")
    assert info.value.param == "grammar"
    other = {"messages": [], "grammar": 'root ::= "b"'}
    for _ in range(MAX_STALLS - 1):
        gate.blame(m, CHAT, other, "bob")
    with pytest.raises(StalledTooOften):
        gate.refuse_known(m, CHAT, {"messages": [], "grammar": 'root ::= "c"'}, "bob")
    gate.refuse_known(m, CHAT, {"messages": []}, "bob")  # no constraint: never refused
