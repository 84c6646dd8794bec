"""The bound on grammar and JSON-schema cost (engines/grammar_cost.py), on the cases measured
against llama.cpp (its module doc) and on grammars people use."""

from __future__ import annotations

from typing import Any

import pytest

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
