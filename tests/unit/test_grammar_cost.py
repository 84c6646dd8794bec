"""The bound on grammar and JSON-schema cost (engines/grammar_cost.py), on the cases measured
against llama.cpp (its module doc) and on grammars people use."""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from bunkhouse.engines.grammar_cost import TooCostly, check_grammar, check_request, check_schema
from bunkhouse.errors import InvalidRequest

JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
# a comment with ( and { in it
ws ::= | " " | "\n" [ \t]{0,20}
'''


@pytest.mark.parametrize("grammar", [
    JSON_GBNF,
    'root ::= "a"{0,5000}',
    'root ::= ("a"{0,20}){0,20}',
    'root ::= ("a"{0,10} " "){0,30}',
    'root ::= (("a"{0,8}){0,7}){0,7}',
    'root ::= ([a-z]+ " ")*',
    'root ::= date\ndate ::= [0-9]{4} "-" [0-9]{2} "-" [0-9]{2}',
    'root ::= "{" "}" # {0,1000} in a comment',
    'root ::= "(a{0,500}){0,500}"',  # inside a literal
])
def test_grammars_people_use_pass(grammar: str) -> None:
    check_grammar(grammar)


@pytest.mark.parametrize("grammar", [
    'root ::= ((\"a\"{0,30}){0,30}){0,30}',  # the hardening report's request
    'root ::= ("a"{0,10}){0,100}',
    'root ::= ("a"{0,2}){0,200}',
    'root ::= ("a"{0,1}){0,400}',
    'root ::= (("a"{0,10}){0,10}){0,30}',
    'root ::= x{0,200}\nx ::= "a"?',
    'root ::= y{0,50}\ny ::= z\nz ::= "b"*',
    'root ::= ("a"*){0,100}',
    'root ::= ("a"?){5,}',
    "root ::= " + "x" * (65 * 1024),
])
def test_repetitions_of_repetitions_that_stall_the_engine_are_refused(grammar: str) -> None:
    with pytest.raises(TooCostly):
        check_grammar(grammar)


def test_schemas() -> None:
    check_schema({"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 100})
    check_schema({"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"})
    check_schema({"type": "string", "pattern": r"^(\d{1,3}\.){3}\d{1,3}$"})
    with pytest.raises(TooCostly):
        check_schema({"type": "array", "items": {"type": "string"}, "maxItems": 300})
    with pytest.raises(TooCostly):
        check_schema({"type": "string", "pattern": "^((a{0,45}){0,45}){0,45}$"})
    with pytest.raises(TooCostly):
        check_schema({"type": "object", "properties": {"x": {"anyOf": [
            {"type": "string", "pattern": "(a?){0,300}"}]}}})


@pytest.mark.parametrize(("body", "param"), [
    ({"grammar": 'root ::= ("a"{0,10}){0,100}'}, "grammar"),
    ({"json_schema": {"type": "array", "maxItems": 1000}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^((a{0,45}){0,45}){0,45}$"}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "minItems": 500}}}]}, "tools.0.function.parameters"),
])
def test_the_request_check_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_request(body)
    assert info.value.param == param


DOUBLING = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(12)) + \
    'r12 ::= "a" | ""\n'


@pytest.mark.parametrize("grammar", [
    'root ::= ("a" | ""){0,250}',  # found by a second newcomer round: 502, worker replaced
    'root ::= ("a" | ""){0,150}',  # 18 s
    'root ::= x{0,250}\nx ::= "a" | ""',
    DOUBLING,  # no quantifier at all: 4,096 parts that can match nothing, 11.5 s, replaced
    DOUBLING.replace("r12", "r8").split("r8 ::= r9")[0] + 'r8 ::= "a" | ""\n',  # 256: 14 s
])
def test_things_that_can_match_nothing_count_as_repeating(grammar: str) -> None:
    with pytest.raises(TooCostly):
        check_grammar(grammar)


def test_alternations_of_non_empty_things_pass() -> None:
    check_grammar('root ::= ("a" | "b"){0,100}')
    check_grammar('root ::= ("a" | ""){0,30}')
    check_grammar("root ::= " + " ".join(['"a"?'] * 64))  # 0.5 s
    check_grammar("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(12))
                  + 'r12 ::= "a" | "b"\n')


@pytest.mark.parametrize("text", ["(" * 5000 + '"a"' + ")" * 5000, ")" * 100 + "(((", '"\\',
                                  "[", "a{", "{3,1}", "x ::= y\ny ::= x", "root ::= |||"])
def test_odd_text_is_checked_or_refused_never_a_crash(text: str) -> None:
    for check in (check_grammar, lambda t: check_schema({"pattern": t})):
        with contextlib.suppress(TooCostly):
            check(text)


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(st.text(alphabet='()[]{}|?*+"\\ax:=,0123456789\n ', max_size=200))
def test_random_grammar_text_is_checked_or_refused(text: str) -> None:
    test_odd_text_is_checked_or_refused_never_a_crash(text)
    test_odd_text_is_checked_or_refused_never_a_crash("root ::= " + text)


def test_a_stray_parenthesis_hides_nothing() -> None:
    with pytest.raises(TooCostly):
        check_grammar('root ::= ) ("a" | ""){0,250}')


@pytest.mark.parametrize("grammar", [
    'root ::= "[" (tag (ws "," ws tag){0,200})? "]"\ntag ::= "\\"" [a-z]{1,20} "\\""\n'
    'ws ::= [ \\t\\n]{0,4}',  # 0.08 s: each copy must take a ","
    'root ::= ("a" "b"?){0,100}',  # 0.08 s
    'root ::= ("," [a-z]{1,20}){0,100}',  # 0.06 s
])
def test_repeating_what_cannot_match_nothing_passes(grammar: str) -> None:
    check_grammar(grammar)


@pytest.mark.parametrize("grammar", [
    # found by a third newcomer round, each accepted, then the worker replaced:
    'n ::= "" | "a" m\nm ::= n{0,200}\nroot ::= "a" m\n',  # recursion hid that n is nullable
    'root ::= "b" (("a"?){0,#c\n200})\n',  # a comment inside the bound
    'root ::= [x\ny ::= "] ("a"?){0,200}\n',  # a newline inside a class is no new rule
    "root ::= " + " | ".join(f"r{i}" for i in range(8)) + "\n"
    + "".join(f'r{i} ::= "a"{{0,{i + 1}}} ("a"{{0,31}}){{0,32}}\n' for i in range(8)),  # 18 s
])
def test_grammars_read_as_the_engine_reads_them(grammar: str) -> None:
    with pytest.raises(TooCostly):
        check_grammar(grammar)


def _object(optional: int, required: int = 0) -> dict[str, object]:
    props = {f"k{i}": {"type": "string"} for i in range(optional + required)}
    return {"type": "object", "properties": props,
            "required": [f"k{i}" for i in range(optional, optional + required)]}


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_an_object_with_too_many_optional_properties_is_refused(where: str) -> None:
    from bunkhouse.engines.grammar_cost import MAX_OPTIONAL_PROPERTIES, check_request
    from bunkhouse.errors import InvalidRequest
    big = _object(MAX_OPTIONAL_PROPERTIES + 1)
    body: dict[str, object] = (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": big}}}
        if where == "response_format"
        else {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"inner": big}}}}]})
    with pytest.raises(InvalidRequest) as info:
        check_request(body)
    assert info.value.param == ("response_format" if where == "response_format"
                                else "tools.0.function.parameters")
    assert "required" in info.value.message
    # as many optional ones as allowed, in many objects, and any number of required ones pass
    check_request({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"o{j}": _object(MAX_OPTIONAL_PROPERTIES, 2000)
                                         for j in range(8)}}}}})


def test_a_schema_bound_past_the_engines_integers_is_refused_naming_the_field() -> None:
    """``minimum: -2**64`` made the engine fail with no field named: a number's bound past
    64 bits, or a length or count past 32, is refused naming the field that holds it."""
    huge = {"type": "integer", "minimum": -(1 << 64), "maximum": 1 << 64}
    for body, param in (
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": huge}}},
             "response_format"),
            ({"json_schema": {"type": "string", "maxLength": 1 << 40}}, "json_schema"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"n": huge}}}}]},
             "tools.0.function.parameters")):
        with pytest.raises(InvalidRequest, match="the engine's integers") as info:
            check_request(body)
        assert info.value.param == param
    check_request({"json_schema": {"type": "integer", "minimum": -(1 << 63),
                                   "maximum": (1 << 63) - 1, "maxLength": (1 << 31) - 1}})
