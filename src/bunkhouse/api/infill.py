"""Fill-in-the-middle: llama.cpp's ``/infill`` in other protocols' terms. Pure functions.

llama.cpp's server builds the prompt from the model's FIM tokens (``<|fim_prefix|>``,
``<|fim_suffix|>``, ``<|fim_middle|>`` and the like, found in its vocabulary) around
``input_prefix`` and ``input_suffix``; ``prompt`` is text the middle starts with;
``input_extra`` are other files' chunks (``{"filename", "text"}``) for context. It answers in
its own completion objects (``content``, ``stop``, ``stop_type``, ``tokens_predicted``,
``tokens_evaluated``, ``timings``), streamed as SSE ``data:`` lines without ``[DONE]``
(tools/server/README.md, "POST /infill").

Here: OpenAI's ``suffix`` on ``/v1/completions`` (the prompt is the prefix) and Ollama's
``suffix`` on ``/api/generate`` are sent to ``/infill`` (:func:`from_completion`), and its
objects are turned into OpenAI completion objects (:func:`as_completion`).

Errors: InvalidRequest naming the field.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from bunkhouse.api.fields import need
from bunkhouse.api.usage import Tally

_NOT_WITH_SUFFIX = ("echo", "logprobs", "best_of")


def from_completion(body: dict[str, Any]) -> dict[str, Any]:
    """A completion request with a ``suffix`` as an ``/infill`` request: its ``prompt`` (one
    text) is the prefix."""
    prompt = body.get("prompt", "")
    need(isinstance(prompt, str), "prompt must be one text when a suffix is given (it is "
         "the text before the middle)", "prompt")
    for name in _NOT_WITH_SUFFIX:
        need(not body.get(name), f"{name} cannot be used with suffix", name)
    out = {k: v for k, v in body.items() if k not in ("prompt", "suffix", *_NOT_WITH_SUFFIX)}
    out["input_prefix"] = prompt
    out["input_suffix"] = body.get("suffix") or ""
    return out


def _finish(event: dict[str, Any]) -> str | None:
    if not event.get("stop"):
        return None
    return "length" if event.get("stop_type") == "limit" else "stop"


def as_completion(event: dict[str, Any], model: str, completion_id: str,
                  created: int) -> dict[str, Any]:
    """One of ``/infill``'s objects (a streamed piece or the whole answer) as an OpenAI
    completion object; the last one (``stop``) carries usage and timings."""
    out: dict[str, Any] = {
        "id": completion_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": event.get("index") or 0, "text": event.get("content") or "",
                     "logprobs": None, "finish_reason": _finish(event)}]}
    if event.get("stop"):
        prompt = int(event.get("tokens_evaluated") or 0)
        completion = int(event.get("tokens_predicted") or 0)
        timings = event.get("timings")
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion}
        if isinstance(timings, dict):
            out["timings"] = timings
    return out


class Completions:
    """``/infill``'s objects of one answer as OpenAI completion objects, one id for all."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def convert(self, event: dict[str, Any] | list[Any]) -> dict[str, Any]:
        """One object, or the list of whole answers the engine sends for several (``n``),
        as one completion object with a choice each."""
        if not isinstance(event, list):
            return as_completion(event, self.model, self.id, self.created)
        answers = [as_completion({**e, "index": i}, self.model, self.id, self.created)
                   for i, e in enumerate(event) if isinstance(e, dict)]
        out = answers[0] if answers else as_completion({}, self.model, self.id, self.created)
        out["choices"] = [a["choices"][0] for a in answers]
        tally = Tally(len(answers))  # one prompt, each answer counts it
        for answer in answers:
            tally.add(answer.get("usage"))
        usage = tally.total()
        if usage is not None:
            out["usage"] = usage
        return out
