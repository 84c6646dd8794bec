"""The rules every protocol's request follows before its engine sees it (api/fields.py):
a null field is an omitted one, tools the model cannot run are skipped and named."""

from __future__ import annotations

from typing import Any

import pytest

from bunkhouse.api import anthropic, ollama, responses
from bunkhouse.api.fields import (
    CHAT_FREE_FORM,
    function_tool,
    omit_nulls,
    skipped_tools,
    without_tools,
)
from bunkhouse.api.schemas import ChatCompletionRequest, CompletionRequest, validate
from bunkhouse.errors import InvalidRequest

SCHEMA = {"type": "object", "properties": {"x": {"default": None, "enum": [None, 1]}}}


def test_nulls_are_omitted_at_any_depth_but_in_free_form_json() -> None:
    body = {"model": None, "messages": [{"role": "user", "content": "hi", "name": None},
                                        {"role": "assistant", "content": None,
                                         "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{}"}}]}],
            "tools": [{"type": "function", "function": {"name": "f", "description": None,
                                                        "parameters": SCHEMA}}],
            "stop": [None], "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "strict": None, "schema": SCHEMA}}}
    out = omit_nulls(body, CHAT_FREE_FORM)
    assert "model" not in out and out["messages"][0] == {"role": "user", "content": "hi"}
    assert "content" not in out["messages"][1]
    assert out["tools"][0]["function"] == {"name": "f", "parameters": SCHEMA}
    assert out["response_format"]["json_schema"] == {"name": "n", "schema": SCHEMA}
    assert out["stop"] == [None]  # a null in an array is a value: its type check refuses it
    untouched = {"messages": [{"role": "user", "content": "hi"}], "prompt": [1, 2]}
    assert omit_nulls(untouched, CHAT_FREE_FORM) is untouched  # nothing copied


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x", "name": None}], "stream": None,
     "max_tokens": None, "stream_options": None, "n": None, "seed": None, "user": None,
     "tools": [{"type": "function", "function": {"name": "f", "description": None,
                                                 "parameters": None, "strict": None}}]},
])
def test_a_chat_request_of_nulls_validates_as_if_they_were_omitted(body: dict[str, Any]
                                                                    ) -> None:
    parsed = validate(ChatCompletionRequest, omit_nulls(body, CHAT_FREE_FORM))
    assert parsed.stream is False and parsed.max_tokens is None
    assert validate(CompletionRequest, omit_nulls({"prompt": "x", "suffix": None,
                                                   "echo": None}, CHAT_FREE_FORM))


def test_anthropic_responses_and_ollama_nulls_are_omitted() -> None:
    chat = anthropic.to_chat({
        "max_tokens": 4, "system": None, "temperature": None, "top_k": None,
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {"a": None}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "content": "ok", "is_error": None}]}],
        "tools": [{"name": "f", "description": None, "input_schema": SCHEMA,
                   "cache_control": None}]})
    assert chat["tools"][0]["function"] == {"name": "f", "parameters": SCHEMA}
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"a": null}'
    given = omit_nulls({"input": "x", "instructions": None, "max_output_tokens": None,
                        "tools": [{"type": "function", "name": "f", "description": None,
                                   "parameters": None}]}, responses.FREE_FORM)
    out = responses.to_chat(given, responses.check_request(given), [])
    assert out["tools"][0]["function"]["name"] == "f" and "max_tokens" not in out
    asked = omit_nulls({"model": "m", "messages": [{"role": "user", "content": "x",
                                                    "images": None}],
                        "options": {"seed": None}, "format": None}, ollama.FREE_FORM)
    assert ollama.chat_request(asked)["messages"] == [{"role": "user", "content": "x"}]


CODEX: list[dict[str, Any]] = [
    {"type": "function", "name": "shell", "parameters": SCHEMA}, {"type": "web_search"},
    {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}]


def test_codex_tools_serve_the_function_and_skip_the_rest() -> None:
    body = {"input": "x", "tools": CODEX}
    out = responses.to_chat(body, responses.check_request(body), [])
    assert [t["function"]["name"] for t in out["tools"]] == ["shell"]
    assert skipped_tools(body, function_tool) == ["web_search", "custom:apply_patch"]
    only = {"input": "x", "tools": CODEX[1:]}
    assert "tools" not in responses.to_chat(only, responses.check_request(only), [])


def test_every_protocol_skips_the_tools_the_model_cannot_run() -> None:
    function = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    custom = {"type": "custom", "custom": {"name": "apply_patch"}}
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [custom, function]}
    assert without_tools(chat, function_tool)["tools"] == [function]
    assert skipped_tools(chat, function_tool) == ["custom:apply_patch"]
    assert "tools" not in without_tools({"tools": [custom]}, function_tool)
    server = {"type": "web_search_20250305", "name": "web_search"}
    message = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
               "tools": [server, {"name": "f", "input_schema": SCHEMA}]}
    assert [t["function"]["name"] for t in anthropic.to_chat(message)["tools"]] == ["f"]
    assert skipped_tools(message, anthropic.served) == ["web_search_20250305:web_search"]
    asked = {"model": "m", "messages": [], "tools": [{"type": "web_search"}, function]}
    assert ollama.chat_request(asked)["tools"] == [function]
    with pytest.raises(InvalidRequest) as info:  # a demand for a skipped tool: refused
        responses.to_chat({"input": "x", "tools": CODEX, "tool_choice": {"type": "web_search"}},
                          [], [])
    assert info.value.param == "tool_choice"


def test_openai_integers_past_what_engines_hold_are_refused_by_name() -> None:
    for schema, body, param in (
            (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                     "seed": 1 << 64}, "seed"),
            (CompletionRequest, {"prompt": [4294967296]}, "prompt")):
        with pytest.raises(InvalidRequest) as info:
            validate(schema, body)
        assert info.value.param == param
    assert validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                            "seed": -(1 << 63)})


def test_every_token_limit_is_at_least_one() -> None:
    """``max_tokens: 0`` made the engine generate one token: every protocol's token limit
    is refused below 1, naming its field (OpenAI's and Anthropic's own minimum); Ollama's
    ``num_predict`` keeps its meanings (0, -1 and -2: until the context is full)."""
    user = [{"role": "user", "content": "x"}]
    for schema, body, param in (
            (ChatCompletionRequest, {"messages": user, "max_tokens": 0}, "max_tokens"),
            (ChatCompletionRequest, {"messages": user, "max_completion_tokens": 0},
             "max_completion_tokens"),
            (CompletionRequest, {"prompt": "hi", "max_tokens": 0}, "max_tokens")):
        with pytest.raises(InvalidRequest) as info:
            validate(schema, body)
        assert info.value.param == param
    for convert, body, param in (
            (anthropic.to_chat, {"messages": user, "max_tokens": 0}, "max_tokens"),
            (lambda b: responses.to_chat(b, [], []), {"input": "x", "max_output_tokens": 0},
             "max_output_tokens")):
        with pytest.raises(InvalidRequest) as info:
            convert(body)
        assert info.value.param == param
    for predict in (0, -1, -2):
        out = ollama.chat_request({"model": "m", "messages": user,
                                   "options": {"num_predict": predict}})
        assert "max_tokens" not in out


def test_responses_integers_are_bounded_as_on_chat_completions() -> None:
    """``top_logprobs`` (0 to 20), ``max_tool_calls`` (not negative) and ``seed`` (64 bits,
    passed on) are checked, not dropped unread."""
    for name, value in (("top_logprobs", 1 << 64), ("top_logprobs", 21),
                        ("max_tool_calls", -1), ("seed", 1 << 64), ("seed", 1.5)):
        with pytest.raises(InvalidRequest, match=f"{name} must be an integer from") as info:
            responses.check_request({"input": "x", name: value})
            responses.to_chat({"input": "x", name: value}, [], [])
        assert info.value.param == name
    body = {"input": "x", "top_logprobs": 20, "max_tool_calls": 0, "seed": -1}
    assert responses.to_chat(body, responses.check_request(body), [])["seed"] == -1


def test_one_message_per_field_and_integers_printed_whole() -> None:
    """Anthropic's ``top_k`` says the same whatever is wrong with it; Ollama's bounds print
    as integers, not ``-9.22337e+18``."""
    user = [{"role": "user", "content": "x"}]
    messages = set()
    for top_k in (-1, 1 << 64, 1.5):
        with pytest.raises(InvalidRequest) as info:
            anthropic.to_chat({"messages": user, "max_tokens": 1, "top_k": top_k})
        messages.add(info.value.message)
    assert messages == {"top_k must be an integer from 0 to 2147483647"}
    for name, value, says in (("seed", 1 << 64, "from -9223372036854775808 to "
                                                "9223372036854775807"),
                              ("top_k", 1 << 40, "from 0 to 2147483647"),
                              ("temperature", 9, "from 0 to 2")):
        with pytest.raises(InvalidRequest, match=says) as info:
            ollama.chat_request({"model": "m", "messages": user, "options": {name: value}})
        assert info.value.param == f"options.{name}"


def test_a_refusal_names_the_field_as_the_callers_protocol_does() -> None:
    """A chat completion field a refusal names (its param and its message) is renamed as
    Anthropic's and the Responses API call it."""
    from bunkhouse.api.fields import rename_error

    for rules, renamed in ((anthropic.CHAT_FIELDS, "tools.0.input_schema"),
                           (responses.CHAT_FIELDS, "tools.0.parameters")):
        err = InvalidRequest("tools.0.function.parameters would take the engine too long",
                             param="tools.0.function.parameters")
        rename_error(err, rules)
        assert (err.param, err.message) == (renamed, f"{renamed} would take the engine too long")
    for param, renamed in (("response_format", "format"), ("top_k", "options.top_k"),
                           ("max_tokens", "options.num_predict")):
        err = InvalidRequest(f"{param}: wrong", param=param)
        rename_error(err, ollama.CHAT_FIELDS)
        assert (err.param, err.message) == (renamed, f"{renamed}: wrong")


def test_an_openai_integer_field_has_one_message_whatever_is_wrong() -> None:
    """``max_tokens: 0`` and ``max_tokens: 1.5`` (and ``n``, ``seed``, ...) are told the same
    thing: the field's range, not pydantic's words for each way to miss it."""
    user = [{"role": "user", "content": "x"}]
    for field, values, says in (("max_tokens", (0, 1.5, "9"), "from 1"),
                                ("n", (0, 129, True), "from 1 to 128"),
                                ("top_logprobs", (-1, 21, 2.0), "from 0 to 20")):
        messages = set()
        for value in values:
            with pytest.raises(InvalidRequest) as info:
                validate(ChatCompletionRequest, {"messages": user, field: value})
            assert info.value.param == field
            messages.add(info.value.message)
        assert messages == {f"{field}: must be an integer {says}"}
