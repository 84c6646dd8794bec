"""Which parts of a request are measured in the constraint probe, and how (pure)."""

from __future__ import annotations

from bunkhouse.engines.llamacpp import constraint_checks

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
