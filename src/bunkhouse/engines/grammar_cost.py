"""A bound on the work a grammar or JSON schema costs llama.cpp before its first token.

llama.cpp expands a bounded repetition ``x{m,n}`` into ``n`` nested optional copies of ``x``;
when ``x`` can match nothing (``"a"?``, ``"a"{0,2}``, ``"a" | ""``, directly or through the
rules it names), every copy may or may not take part, the matcher's stacks multiply, and the
engine's scheduling loop stalls while it builds them: the worker misses its liveness probes
and is replaced, and three such requests failed the model for every client. Measured on
2 cores with Gemma 3 270M (the time of a 2-token answer)::

    ("a"{0,20}){0,20}           0.16 s      ("a"{0,4}){0,100}          2.7 s
    ("a"{0,10}){0,30}           0.20 s      ("a"{0,10}){0,100}         9.3 s
    (("a"{0,10}){0,10}){0,10}   2.8 s       ("a"{0,2}){0,200}          > 12 s (replaced)
    x{0,200} with x ::= "a"?    > 14 s      "a"{0,5000}                0.1 s
    ("a" | ""){0,100}           1.8 s       ("a" | ""){0,150}          18 s
    rules doubling 6 deep to "a" | "" (64 parts that can match nothing)        0.57 s
    the same 8 deep (256 parts)            > 14 s (replaced); to "a" | "b": 1.9 s (4,096)
    ("a" "b"?){0,100}           0.08 s      ("," [a-z]{1,20}){0,100}   0.06 s
    JSON schema: an array of strings, maxItems 300: 3.1 s
    JSON schema: an object of N optional string properties (Qwen2.5-Coder 0.5B, 2 tokens):
    128: 0.19 s, 400: 0.41 s, 800: 1.4 s, 1200: 3.3 s, or the worker crashed;
    8 objects of 128: 0.21 s (the cost is per object); N required properties: 800 in 0.10 s

So: a repetition of something that can match nothing may have an upper bound of at most
:data:`MAX_NESTED_BOUND`, the bounds along a chain of such repetitions may multiply to at
most :data:`MAX_NESTED_PRODUCT`, and a rule may expand to at most
:data:`MAX_NULLABLE_RUN` parts that can match nothing; a JSON schema's ``maxItems`` and
``minItems`` are at most :data:`MAX_SCHEMA_ITEMS`, an object has at most
:data:`MAX_OPTIONAL_PROPERTIES` properties it does not require, and its ``pattern`` regexes
follow the grammar rules. A flat repetition (``"a"{0,5000}``) costs little and is not bounded here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bunkhouse.errors import InvalidRequest

MAX_NESTED_BOUND = 32
MAX_NESTED_PRODUCT = 1000
MAX_NULLABLE_RUN = 64
MAX_SCHEMA_ITEMS = 100
MAX_OPTIONAL_PROPERTIES = 128

MAX_GRAMMAR_BYTES = 64 * 1024
"""Largest grammar text (llama.cpp's own JSON grammar is under 1 KiB)."""

_MAX_RULE_DEPTH = 200  # rules naming rules, deeper than this: refused, not recursed into
_MAX_GROUP_DEPTH = 64  # parentheses, likewise

_BOUND = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class TooCostly(ValueError):
    pass


class Unholdable(ValueError):
    """A JSON schema's number the engine cannot hold (it read ``minimum: -2**64`` as no
    bound and failed)."""


_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32_MAX = (1 << 31) - 1
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def check_numbers(schema: dict[str, Any]) -> None:
    """Raise Unholdable for a bound of ``schema`` past the engine's integers: a number's
    bound past 64 bits, a length or count past 32 (C ``int``)."""
    for keys, (lo, hi) in ((_NUMBER_BOUNDS, _INT64), (_COUNTS, (0, _INT32_MAX))):
        for key in keys:
            value = schema.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) \
                    and not lo <= value <= hi:
                raise Unholdable(f"{key} must be from {lo} to {hi}, not {value}")


@dataclass
class _Operand:
    """What a piece of a grammar can do, as far as the cost rule is concerned."""

    weight: int = 1  # the largest product of nested repetition bounds inside it (1: none)
    nullable: bool = False  # it can match nothing
    nulls: int = 0  # positions that can match nothing, once expanded


def _seq(items: list[_Operand]) -> _Operand:
    """A sequence: it matches nothing only if every part can."""
    if not items:
        return _Operand(nullable=True, nulls=1)  # "" or an empty group
    return _Operand(weight=max(i.weight for i in items),
                    nullable=all(i.nullable for i in items), nulls=sum(i.nulls for i in items))


def _alt(branches: list[_Operand]) -> _Operand:
    if len(branches) == 1:
        return branches[0]
    nullable = any(b.nullable for b in branches)
    return _Operand(weight=max(b.weight for b in branches),
                    nullable=nullable,
                    nulls=sum(b.nulls for b in branches) + int(nullable))


def _repeat(operand: _Operand, low: int, high: int | None) -> _Operand:
    """``operand`` repeated ``low`` to ``high`` times (None: unbounded); raises TooCostly.
    What costs is repeating something that can match nothing: every copy may or may not
    take part, and the matcher follows each way (``("a" "b"?){0,200}`` is cheap,
    ``("a"?){0,200}`` is not)."""
    if operand.nullable and high is not None:
        if high > MAX_NESTED_BOUND:
            raise TooCostly(f"a repetition of up to {high} of something that can match "
                            f"nothing (at most {MAX_NESTED_BOUND})")
        if operand.weight * high > MAX_NESTED_PRODUCT:
            raise TooCostly(f"nested repetitions multiply to {operand.weight * high} "
                            f"(at most {MAX_NESTED_PRODUCT})")
    if operand.nullable and high is None and low > 0:
        raise TooCostly("an unbounded repetition of something that can match nothing")
    bound = high if high is not None else max(low, 1)
    weight = operand.weight * bound if operand.nullable else max(operand.weight, bound)
    nullable = low == 0 or operand.nullable
    nulls = max(operand.nulls, 1) * bound if operand.nullable else int(nullable)
    return _Operand(weight=weight, nullable=nullable, nulls=nulls)


class _Parser:
    """A recursive-descent reading of GBNF (or, with ``regex``, of a regex), computing the
    :class:`_Operand` of each rule; a rule's references are read first, once each."""

    def __init__(self, rules: dict[str, str], regex: bool) -> None:
        self.rules = rules
        self.regex = regex
        self.done: dict[str, _Operand] = {}
        self.active: list[str] = []
        self.text, self.i = "", 0  # what is being read, and where
        self.depth = 0  # groups open

    def rule(self, name: str) -> _Operand:
        if name in self.done:
            return self.done[name]
        if name in self.active:  # recursion: assume it can match nothing (the worse case)
            return _Operand(nullable=True)
        if name not in self.rules:
            return _Operand()  # an unknown name: the engine refuses the grammar
        if len(self.active) >= _MAX_RULE_DEPTH:
            raise TooCostly(f"its rules name each other more than {_MAX_RULE_DEPTH} deep")
        self.active.append(name)
        saved = self.text, self.i
        found = self.read(self.rules[name])
        self.text, self.i = saved  # back to the rule that named this one
        self.active.pop()
        self._check(found)
        self.done[name] = found
        return found

    @staticmethod
    def _check(found: _Operand) -> None:
        if found.nulls > MAX_NULLABLE_RUN:
            raise TooCostly(f"{found.nulls} parts in a row can match nothing (at most "
                            f"{MAX_NULLABLE_RUN})")

    def read(self, text: str) -> _Operand:
        self.text, self.i = text, 0
        parts = [self._alternation(top=True)]
        while self.i < len(text):  # past a stray ')': read on, so that nothing goes unread
            self.i += 1
            parts.append(self._alternation(top=True))
        result = _seq(parts)
        self._check(result)
        return result

    def _alternation(self, top: bool = False) -> _Operand:
        branches = [self._sequence()]
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            branches.append(self._sequence())
        if not top and self.i < len(self.text) and self.text[self.i] == ")":
            self.i += 1
        return _alt(branches)

    def _sequence(self) -> _Operand:
        items: list[_Operand] = []
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c in "|)":
                break
            atom = self._atom(c)
            if atom is None:
                continue
            items.append(self._quantified(atom))
        return _seq(items)

    def _atom(self, c: str) -> _Operand | None:
        text, i = self.text, self.i
        if c.isspace() or (self.regex and c in "^$"):
            self.i += 1
            return None
        if c == "#" and not self.regex:
            while self.i < len(text) and text[self.i] != "\n":
                self.i += 1
            return None
        if c == '"' and not self.regex:
            self.i = _skip_quoted(text, i, '"')
            empty = self.i - i <= 2
            return _Operand(nullable=empty, nulls=int(empty))
        if c == "[":
            self.i = _skip_quoted(text, i, "]")
            return _Operand()
        if c == "(":
            self.i += 1
            if self.regex and text.startswith("?:", self.i):
                self.i += 2
            self.depth += 1
            if self.depth > _MAX_GROUP_DEPTH:
                raise TooCostly(f"groups nested deeper than {_MAX_GROUP_DEPTH}")
            group = self._alternation()
            self.depth -= 1
            return group
        if c == "\\" and self.regex:
            self.i += 2
            return _Operand()
        if not self.regex and (m := _NAME.match(text, i)):
            self.i = m.end()
            return self.rule(m.group(0))
        self.i += 1
        return _Operand() if self.regex else None

    def _quantified(self, atom: _Operand) -> _Operand:
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c == "?":
                atom, self.i = _repeat(atom, 0, 1), self.i + 1
            elif c == "*":
                atom, self.i = _repeat(atom, 0, None), self.i + 1
            elif c == "+":
                atom, self.i = _repeat(atom, 1, None), self.i + 1
            elif c == "{" and (m := _BOUND.match(text, self.i)):
                low = int(m.group(1) or 0)
                high = int(m.group(3)) if m.group(3) else (None if m.group(2) else low)
                atom, self.i = _repeat(atom, low, high), m.end()
            else:
                break
        return atom


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index after the literal or class that starts at ``i`` (escapes honoured)."""
    i += 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


_HEAD = re.compile(r"[ \t]*([A-Za-z0-9_-]+)[ \t]*::=")


def rules(grammar: str) -> dict[str, str]:
    """Each rule's body, read as llama.cpp reads GBNF: a rule starts with ``name ::=`` at the
    start of a line; literals and classes may hold newlines, ``#`` and ``::=`` (skipped
    whole); comments end at the line's end (dropped, also inside ``{m,n}``)."""
    found: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []
    i, line_start = 0, True
    while i < len(grammar):
        head = _HEAD.match(grammar, i) if line_start else None
        if head is not None:
            if name is not None:
                found[name] = found.get(name, "") + "\n" + "".join(body)
            name, body, i, line_start = head.group(1), [], head.end(), False
            continue
        c = grammar[i]
        if c in '"[':
            end = _skip_quoted(grammar, i, '"' if c == '"' else "]")
            body.append(grammar[i:end])
            i, line_start = end, False
        elif c == "#":
            while i < len(grammar) and grammar[i] != "\n":
                i += 1
        else:
            body.append(c)
            i, line_start = i + 1, c == "\n"
    if name is not None:
        found[name] = found.get(name, "") + "\n" + "".join(body)
    return found


def check_grammar(grammar: str) -> None:
    """Raise TooCostly for a GBNF grammar that would stall the engine (module doc)."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise TooCostly(f"it is over {MAX_GRAMMAR_BYTES // 1024} KiB")
    bodies = rules(grammar)
    parser = _Parser(bodies, regex=False)
    for rule in bodies:
        parser.rule(rule)


def check_pattern(pattern: str) -> None:
    """Raise TooCostly for a JSON schema ``pattern`` regex the same rule refuses."""
    _Parser({}, regex=True).read(pattern[:MAX_GRAMMAR_BYTES])


def check_schema(schema: Any, depth: int = 0) -> None:
    """Raise TooCostly for a JSON schema that would stall llama.cpp's grammar from it,
    Unholdable for a bound the engine cannot hold."""
    if depth > 64:
        raise TooCostly("a JSON schema nested deeper than 64 levels")
    if isinstance(schema, list):
        for item in schema:
            check_schema(item, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    check_numbers(schema)
    for key in ("maxItems", "minItems"):
        value = schema.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SCHEMA_ITEMS:
            raise TooCostly(f"{key} is {value} (at most {MAX_SCHEMA_ITEMS})")
    props = schema.get("properties")
    if isinstance(props, dict):
        required = schema.get("required")
        needed = set(required) & set(props) if isinstance(required, list) \
            and all(isinstance(r, str) for r in required) else set()
        optional = len(props) - len(needed)
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise TooCostly(f"an object has {optional} properties it does not require (at "
                            f"most {MAX_OPTIONAL_PROPERTIES}; list the others in "
                            "\"required\")")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        check_pattern(pattern)
    for value in schema.values():
        if isinstance(value, dict | list):
            check_schema(value, depth + 1)


def check_request(body: dict[str, Any]) -> None:
    """InvalidRequest naming the field whose grammar or JSON schema is too costly."""
    schemas: list[tuple[str, Any]] = [("json_schema", body.get("json_schema"))]
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        schemas.append(("response_format", schema or response_format.get("schema")))
    for i, tool in enumerate(body.get("tools") or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            schemas.append((f"tools.{i}.function.parameters", fn.get("parameters")))
    grammar = body.get("grammar")
    checks: list[tuple[str, Callable[[Any], None], Any]] = [
        (param, check_schema, value) for param, value in schemas if value is not None]
    if isinstance(grammar, str):
        checks.insert(0, ("grammar", check_grammar, grammar))
    for param, check, value in checks:
        try:
            check(value)
        except TooCostly as e:
            raise InvalidRequest(f"{param} would take the engine too long to prepare: {e}; "
                                 "bound it more tightly", param=param) from e
        except Unholdable as e:
            raise InvalidRequest(f"{param}: a JSON schema's {e} (the engine's integers)",
                                 param=param) from e
