"""The HTTP statuses and error codes the docs state are the ones the code renders: each
``STATUS `code``` pair the docs (and the code's own docstrings) write names an error class
with that status; every 4xx/5xx status the docs name is one some answer has; the exception
tree in errors.py's docstring lists every class as it is; and the statuses an endpoint
table gives a route are ones the OpenAPI description declares for it."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

from bunkhouse.errors import BunkhouseError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in (
    "architecture", "configuration", "operating", "protocols", "security"))]
"""The pages that state statuses (benchmarks.md and memory-estimate.md hold figures)."""
SOURCES = sorted((ROOT / "src" / "bunkhouse").rglob("*.py"))
ERROR_MODULES = ("bunkhouse.errors", "bunkhouse.engines.contract", "bunkhouse.front.responses",
                 "bunkhouse.front.response_store", "bunkhouse.front.ollama")
"""Every module that defines an error class (a test below holds this list complete)."""

_PAIR = re.compile(r"(?<![\w.,])([1-5]\d\d)\s+`?([a-z][a-z_]*)`?")
_CODE_FIRST = re.compile(r"`([a-z][a-z_]*)`\s*\(([1-5]\d\d)\)")
_STATUS = (r"(?<![\w.,:/\-#])({first}\d\d)(?![\w:/\-]|[.,]\d|\s*(?:MiB|MB|GiB|KiB|ms\b|s\b|"
           r"tokens|characters|digits|bytes|to\b|of\b|header|entries|properties|deep))")
_BARE = re.compile(_STATUS.format(first="[45]"))
"""A 4xx or 5xx status written out (not a size, a count or a time)."""
_ANY = re.compile(_STATUS.format(first="[1-5]"))
_HTTP = {s.value for s in HTTPStatus} | {499}


def _classes() -> list[type[BunkhouseError]]:
    for name in ERROR_MODULES:
        importlib.import_module(name)

    def walk(cls: type[BunkhouseError]) -> Iterator[type[BunkhouseError]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    return [BunkhouseError, *walk(BunkhouseError)]


def _codes() -> dict[str, int]:
    """Each error code and the one status it is rendered with."""
    codes: dict[str, set[int]] = {}
    for cls in _classes():
        codes.setdefault(cls.code, set()).add(cls.status)
    assert all(len(s) == 1 for s in codes.values()), codes  # one status a code
    return {code: next(iter(s)) for code, s in codes.items()}


@functools.cache
def _paths() -> dict[str, Any]:
    """The OpenAPI description's paths."""
    from bunkhouse.front.openapi import openapi

    paths: dict[str, Any] = openapi("docs")["paths"]
    return paths


def _rendered() -> set[int]:
    """Every status an answer can have: the error classes', the request-head guard's, the
    successes the OpenAPI description declares, and those written out in the code."""
    from bunkhouse.front import heads

    found = {cls.status for cls in _classes()} | set(heads._REASONS)
    for ops in _paths().values():
        for op in ops.values():
            found |= {int(s) for s in op["responses"]}
    for path in SOURCES:
        found |= {int(n) for n in re.findall(r"status_code=(\d{3})", path.read_text())}
    return found


def _where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}"


@pytest.mark.parametrize("path", [*DOCS, *SOURCES], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_status_and_code_the_docs_pair_is_rendered_so(path: Path) -> None:
    codes, text, wrong = _codes(), path.read_text(), []
    pairs = [(m.start(), int(m.group(1)), m.group(2), m.group(0)) for m in _PAIR.finditer(text)]
    pairs += [(m.start(), int(m.group(2)), m.group(1), m.group(0))
              for m in _CODE_FIRST.finditer(text)]
    for at, status, word, said in pairs:
        if word in codes and codes[word] != status:
            wrong.append(f"{_where(path, text, at)}: {said!r}, but {word} is {codes[word]}")
        elif word not in codes and status >= 429 and "`" in said and "_" in word:
            wrong.append(f"{_where(path, text, at)}: {said!r}: no error has code {word}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_error_status_the_docs_name_is_one_an_answer_has(path: Path) -> None:
    rendered, text = _rendered(), path.read_text()
    wrong = [f"{_where(path, text, m.start())}: {text[m.start() - 40:m.end() + 20]!r}"
             for m in _BARE.finditer(text)
             if int(m.group(1)) in _HTTP and int(m.group(1)) not in rendered]
    assert not wrong, "statuses no answer has:\n" + "\n".join(wrong)


def test_the_docs_check_finds_a_status_no_answer_has() -> None:
    said = "A request refused at once keeps its 429 or 508; an error after that"
    assert [m.group(1) for m in _BARE.finditer(said)] == ["429", "508"]
    assert 508 not in _rendered() and _codes()["model_too_large"] == 503
    assert [m.groups() for m in _PAIR.finditer("fails with 508 `model_too_large`")] == [
        ("508", "model_too_large")]


def test_the_exception_tree_in_errors_docstring_lists_every_class_as_it_is() -> None:
    import bunkhouse.errors as errors

    tree = {}
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"\s+[│├└─ ]*(\w+)\s+(\d{3}) (\w+) / (\w+)", line)
        if m:
            tree[m.group(1)] = (int(m.group(2)), m.group(3), m.group(4))
    own = [c for c in _classes() if c.__module__ == "bunkhouse.errors"
           and c.__name__ not in ("ConfigError", "CatalogError", "GGUFError",
                                  "PackagedModelError")]  # startup only: never answered
    assert {c.__name__: (c.status, c.type, c.code) for c in own} == tree


def test_every_error_class_is_in_a_module_the_checks_import() -> None:
    seen = {cls.code for cls in _classes()}
    written = {code for path in SOURCES
               for code in re.findall(r'^    code = "(\w+)"', path.read_text(), re.M)}
    assert written <= seen, f"add their modules to ERROR_MODULES: {written - seen}"


_ROUTE = re.compile(r"`(?:(GET|POST|DELETE)(?:`, `(?:GET|POST|DELETE))* )?(/[^`\s]*)")


def _declared(cell: str) -> set[int] | None:
    """The statuses the OpenAPI description declares for any route a table's row names
    (``POST /a``, ``/b``; ``GET /c``: a method holds until the next); None if it describes
    none of them."""
    declared: set[int] | None = None
    method = "get"
    for m in _ROUTE.finditer(cell):
        method = (m.group(1) or method).lower()
        for path in re.sub(r"\[[^]]*\]", "", m.group(2)).split("\\|"):
            for template, ops in _paths().items():
                pattern = re.sub(r"\\\{\w+\\\}", r"[^/]+", re.escape(template)) + "$"
                if re.match(pattern, path) and method in ops:
                    declared = (declared or set()) | {int(s) for s in ops[method]["responses"]}
    return declared


def test_the_statuses_an_endpoint_table_gives_a_route_are_declared_for_it() -> None:
    wrong, rows = [], 0
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^\| (`[^|]*)\| ([^\n]*)\|$", text, re.M):
            declared = _declared(m.group(1) + m.group(2))  # routes the answer names too
            if declared is None:
                continue
            rows += 1
            for status in {int(s) for s in _ANY.findall(m.group(2))} & _HTTP:
                if status not in declared:
                    wrong.append(f"{_where(doc, text, m.start())}: {m.group(1).strip()} "
                                 f"{status}, not in its OpenAPI responses {sorted(declared)}")
    assert rows >= 20 and not wrong, "\n".join(wrong)


NOT_ANSWERED = {"client_closed_request"}
"""Codes no client reads: the client that would have had it is gone (the access log has it)."""


def _error_table(text: str) -> list[tuple[set[int], set[str], set[str]]]:
    """docs/protocols.md's error table: each row's statuses, the words of its OpenAI
    column (types and codes) and of its Anthropic column."""
    part = text.split("| cause | status |", 1)[1]
    rows = []
    for line in part.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append(({int(s) for s in re.findall(r"\b[1-5]\d\d\b", cells[1])},
                     set(re.findall(r"`(\w+)`", cells[2])),
                     set(re.findall(r"`(\w+)`", cells[3]))))
    return rows


def _untabled(rows: list[tuple[set[int], set[str], set[str]]]) -> list[str]:
    """Every error a client can be answered that no row of the table gives as it is
    rendered (status, OpenAI type and code, Anthropic type)."""
    from bunkhouse.api.anthropic import error_type

    missing = []
    for cls in _classes():
        if cls.code in NOT_ANSWERED:
            continue
        kind = error_type(cls.status, {"error": {"code": cls.code, "type": cls.type}})
        if not any(cls.status in st and {cls.type, cls.code} <= oa and kind in an
                   for st, oa, an in rows):
            missing.append(f"{cls.__name__}: {cls.status} {cls.type} / {cls.code} "
                           f"(Anthropic {kind})")
    return missing


def test_the_protocols_error_table_gives_every_error_a_client_can_be_answered() -> None:
    rows = _error_table((ROOT / "docs" / "protocols.md").read_text())
    assert rows and not _untabled(rows), "\n".join(_untabled(rows))


def test_the_error_table_check_finds_a_code_the_table_omits() -> None:
    table = ("| cause | status | OpenAI `type` / `code` | Anthropic `type` |\n| --- |\n"
             "| a conflict | 409 | `invalid_request_error` / `conflict` | "
             "`invalid_request_error` |\n")
    missing = _untabled(_error_table(table))
    assert "Conflict: 409 invalid_request_error / conflict (Anthropic invalid_request_error)" \
        not in missing
    assert any(m.startswith("MethodNotAllowed: 405") for m in missing)
    assert any(m.startswith("ResponseStoreError: 503") for m in missing)
