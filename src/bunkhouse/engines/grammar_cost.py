"""A bound on the work a grammar or JSON schema costs llama.cpp before its first token.

llama.cpp expands a bounded repetition ``x{m,n}`` into ``n`` nested optional copies of ``x``;
when ``x`` can itself repeat (``?``, ``*``, ``+``, ``{..}``, directly or through the rules it
names), the matcher's stacks multiply, and the engine's scheduling loop stalls while it
builds them: the worker misses its liveness probes and is replaced, and three such requests
failed the model for every client. Measured on 2 cores with Gemma 3 270M (the time of a
2-token answer)::

    ("a"{0,20}){0,20}           0.16 s      ("a"{0,4}){0,100}          2.7 s
    ("a"{0,10}){0,30}           0.20 s      ("a"{0,10}){0,100}         9.3 s
    (("a"{0,10}){0,10}){0,10}   2.8 s       ("a"{0,2}){0,200}          > 12 s (replaced)
    x{0,200} with x ::= "a"?    > 14 s      "a"{0,5000}                0.1 s
    JSON schema: an array of strings, maxItems 300: 3.1 s

So: a repetition whose operand can repeat may have an upper bound of at most
:data:`MAX_NESTED_BOUND`, and the bounds along a chain of nested repetitions may multiply to
at most :data:`MAX_NESTED_PRODUCT`; a JSON schema's ``maxItems``/``minItems`` are at most
:data:`MAX_SCHEMA_ITEMS`, and its ``pattern`` regexes follow the grammar rule. A flat
repetition (``"a"{0,5000}``) costs little and is not bounded here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from bunkhouse.errors import InvalidRequest

MAX_NESTED_BOUND = 32
MAX_NESTED_PRODUCT = 1000
MAX_SCHEMA_ITEMS = 100

_BOUND = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class TooCostly(ValueError):
    pass


@dataclass
class _Operand:
    weight: int = 1  # the largest product of repetition bounds inside it (1: none)
    repeats: bool = False  # it can repeat: a quantifier inside it, or in a rule it names
    refs: set[str] = field(default_factory=set)


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index after the literal or class that starts at ``i`` (escapes honoured)."""
    i += 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _scan(text: str, rules: dict[str, _Operand] | None, regex: bool) -> _Operand:
    """The operand a whole rule body (or regex) makes, checking every repetition in it.
    ``rules``: what each named rule is known to be (GBNF), None for a regex."""
    stack: list[_Operand] = [_Operand()]
    last: _Operand | None = None
    i = 0
    while i < len(text):
        c = text[i]
        if c == "#" and not regex:
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        if c == '"' and not regex:
            last, i = _Operand(), _skip_quoted(text, i, '"')
        elif c == "[":
            last, i = _Operand(), _skip_quoted(text, i, "]")
        elif c == "\\" and regex:
            last, i = _Operand(), i + 2
        elif c == "(":
            stack.append(_Operand())
            last, i = None, i + 1
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            _merge(stack[-1], last)
            i += 1
        elif c in "?*+" and last is not None:  # not expanded: it only makes last repeat
            last.repeats = True
            _merge(stack[-1], last)
            i += 1
        elif c == "{" and last is not None and (m := _BOUND.match(text, i)):
            low, comma, high = m.group(1), m.group(2), m.group(3)
            bound = int(high) if high else (int(low or 0) if not comma else None)
            _repeat(stack[-1], last, bound)
            i = m.end()
        elif not regex and (m := _NAME.match(text, i)):
            ref = m.group(0)
            known = (rules or {}).get(ref)
            last = _Operand(known.weight, known.repeats, {ref}) if known else \
                _Operand(refs={ref})
            _merge(stack[-1], last)
            i = m.end()
            continue
        else:
            last, i = (_Operand() if regex and c not in "|^$" else None), i + 1
        if last is not None and c not in "?*+{)" and not (c == "\\" and not regex):
            _merge(stack[-1], last)
    while len(stack) > 1:
        _merge(stack[-2], stack.pop())
    return stack[0]


def _merge(into: _Operand, part: _Operand) -> None:
    into.weight = max(into.weight, part.weight)
    into.repeats |= part.repeats
    into.refs |= part.refs


def _repeat(into: _Operand, operand: _Operand, bound: int | None) -> None:
    """``operand`` repeated up to ``bound`` times (None: unbounded ``{m,}``)."""
    if operand.repeats:
        if bound is None or bound > MAX_NESTED_BOUND:
            raise TooCostly(f"a repetition of up to {bound or 'unbounded'} of something that "
                            f"itself repeats (at most {MAX_NESTED_BOUND})")
        if operand.weight * bound > MAX_NESTED_PRODUCT:
            raise TooCostly(f"nested repetitions multiply to {operand.weight * bound} "
                            f"(at most {MAX_NESTED_PRODUCT})")
    operand.weight = operand.weight * (bound or 1) if operand.repeats else max(
        operand.weight, bound or 1)
    operand.repeats = True
    _merge(into, operand)


MAX_GRAMMAR_BYTES = 64 * 1024
"""Largest grammar text (llama.cpp's own JSON grammar is under 1 KiB)."""

_ROUNDS = 32  # rounds to learn what each rule can do through the rules it names


def check_grammar(grammar: str) -> None:
    """Raise TooCostly for a GBNF grammar that would stall the engine (module doc)."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise TooCostly(f"it is over {MAX_GRAMMAR_BYTES // 1024} KiB")
    bodies: dict[str, str] = {}
    name = None
    for line in grammar.splitlines():
        head, sep, body = line.partition("::=")
        if sep and _NAME.fullmatch(head.strip()):
            name = head.strip()
            bodies[name] = bodies.get(name, "") + "\n" + body
        elif name is not None:
            bodies[name] += "\n" + line
    rules: dict[str, _Operand] = {}
    for _ in range(_ROUNDS):  # what each rule can do, through the rules it names
        changed = False
        for rule, body in bodies.items():
            found = _scan(body, rules, regex=False)
            for ref in found.refs:
                if ref in rules:
                    _merge(found, _Operand(rules[ref].weight, rules[ref].repeats))
            new = _Operand(min(found.weight, MAX_NESTED_PRODUCT + 1), found.repeats)
            old = rules.get(rule)
            if old is None or (old.weight, old.repeats) != (new.weight, new.repeats):
                rules[rule] = new
                changed = True
        if not changed:
            return
    raise TooCostly(f"its rules name each other more than {_ROUNDS} deep")


def check_schema(schema: Any, depth: int = 0) -> None:
    """Raise TooCostly for a JSON schema that would stall llama.cpp's grammar from it."""
    if depth > 64:
        raise TooCostly("a JSON schema nested deeper than 64 levels")
    if isinstance(schema, list):
        for item in schema:
            check_schema(item, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    for key in ("maxItems", "minItems"):
        value = schema.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SCHEMA_ITEMS:
            raise TooCostly(f"{key} is {value} (at most {MAX_SCHEMA_ITEMS})")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        _scan(pattern, None, regex=True)
    for value in schema.values():
        if isinstance(value, dict | list):
            check_schema(value, depth + 1)


def check_request(body: dict[str, Any]) -> None:
    """InvalidRequest naming the field whose grammar or JSON schema is too costly."""
    checks: list[tuple[str, Any, bool]] = [
        ("grammar", body.get("grammar"), True),
        ("json_schema", body.get("json_schema"), False),
    ]
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        checks.append(("response_format", schema or response_format.get("schema"), False))
    for i, tool in enumerate(body.get("tools") or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            checks.append((f"tools.{i}.function.parameters", fn.get("parameters"), False))
    for param, value, is_grammar in checks:
        try:
            if is_grammar and isinstance(value, str):
                check_grammar(value)
            elif not is_grammar and value is not None:
                check_schema(value)
        except TooCostly as e:
            raise InvalidRequest(f"{param} would take the engine too long to prepare: {e}; "
                                 "bound it more tightly", param=param) from e
