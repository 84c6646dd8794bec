"""The bunkhouse exception tree and its mapping to OpenAI-style error envelopes.

Every error that can cross a boundary is a ``BunkhouseError``. Each subclass fixes the HTTP
status, the envelope ``type`` and ``code`` it becomes at the HTTP edge::

    BunkhouseError                      500 server_error / internal_error
    ├── ConfigError                     (startup only: bad flags or TOML; never an HTTP answer)
    ├── CatalogError                    (startup only: unreadable model roots or packages)
    │   ├── GGUFError                   a file is not a readable GGUF
    │   └── PackagedModelError          a packaged model is missing parts or fails its checksum
    ├── InvalidRequest                  400 invalid_request_error / invalid_request
    │   └── ContextLengthExceeded       400 invalid_request_error / context_length_exceeded
    ├── Unauthorized                    401 invalid_request_error / invalid_api_key
    ├── Forbidden                       403 invalid_request_error / permission_denied
    ├── RequestTooLarge                 413 invalid_request_error / request_too_large
    ├── NotFound                        404 invalid_request_error / not_found
    │   └── ModelNotFound               404 invalid_request_error / model_not_found
    ├── Conflict                        409 invalid_request_error / conflict
    ├── MethodNotAllowed                405 invalid_request_error / method_not_allowed
    ├── ClientGone                      499 invalid_request_error / client_closed_request
    │                                   (the client left before its body was read)
    ├── QueueFull                       429 resource_admission / queue_full (+ Retry-After)
    ├── StalledTooOften                 429 rate_limit_error / stalled_too_often (+ Retry-After)
    ├── WorkerLoadFailed                503 server_error / model_load_failed
    ├── InsufficientMemory              503 server_error / insufficient_memory (+ Retry-After)
    │   ├── Paused                      503 server_error / paused (+ Retry-After)
    │   └── ModelFailed                 503 server_error / model_failed (+ Retry-After)
    ├── ModelTooLarge                   503 server_error / model_too_large
    ├── ModelMisconfigured              503 server_error / model_misconfigured
    ├── ShuttingDown                    503 server_error / shutting_down
    ├── ServerBusy                      503 server_error / server_busy (+ Retry-After)
    ├── InsufficientStorage             507 server_error / insufficient_storage
    ├── PullFailed                      502 server_error / pull_failed
    └── EngineUnavailable               502 server_error / engine_unavailable

Lower layers raise these with ``raise ... from`` the original exception; the HTTP edge turns
them into ``{"error": {"message", "type", "code", "param"}}`` in one place
(:func:`error_body`). Nothing matches on message text.

``message`` is what any caller may read: it names no server path and quotes no file or
process output. What only the operator should see (a worker's last output lines, a file's
path) goes in ``detail``: the log has it, and an admin-key caller gets it appended. The log
has it once: an error made where its fault was logged (a failed load, with its worker's
output, logged once per failure by residency) is marked ``logged``, and each request it then
answers logs one short line (:func:`log_line`), not the output again.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar


class BunkhouseError(Exception):
    """Base of every error bunkhouse raises on purpose."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    refusal: ClassVar[bool] = False  # a state of the host refuses it, not a fault: WARNING

    def __init__(self, message: str, *, param: str | None = None,
                 detail: str | None = None, logged: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.detail = detail  # for the log and admin-key callers only (module doc)
        self.logged = logged  # its fault, detail included, was logged where it happened

    def full_message(self) -> str:
        """The message with its detail: for the log and for admin-key callers."""
        return f"{self.message}\n{self.detail}" if self.detail else self.message

    retry_after_s: float | None = None
    """Seconds a client should wait before trying again, sent as ``Retry-After`` (whole
    seconds, at least 1); None: no such header."""

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers that go with this error: ``Retry-After`` when it has one."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(self.retry_after_s + 0.999)))}


class ConfigError(BunkhouseError):
    """Flags, environment or the TOML config file are invalid."""


class CatalogError(BunkhouseError):
    """The model catalog cannot be built."""


class GGUFError(CatalogError):
    """A file is not a readable GGUF model."""


class PackagedModelError(CatalogError):
    """A model shipped in Python packages is incomplete or fails its checksum."""


class InvalidRequest(BunkhouseError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus max_tokens can never fit one slot of the model."""

    code = "context_length_exceeded"


class QueueFull(BunkhouseError):
    """Every slot of the model is busy and its queue is full."""

    status = 429
    type = "resource_admission"
    code = "queue_full"
    retry_after_s = 1


class StalledTooOften(BunkhouseError):
    """This client's constraints stalled workers too often lately: its requests with one are
    refused until the oldest stall is out of the window (front/constraints.py)."""

    status = 429
    type = "rate_limit_error"
    code = "stalled_too_often"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthorized(BunkhouseError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(BunkhouseError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class RequestTooLarge(BunkhouseError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class NotFound(BunkhouseError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(BunkhouseError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class MethodNotAllowed(BunkhouseError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class ClientGone(BunkhouseError):
    """The client disconnected while its request was read: nobody gets the answer."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class WorkerLoadFailed(BunkhouseError):
    """A worker did not become ready; the detail quotes the last lines of its output.
    ``retry_after_s``: whole seconds until the model is tried again (its crash-loop backoff
    or cool-down), sent as ``Retry-After`` when known."""

    status = 503
    code = "model_load_failed"

    def __init__(self, message: str, *, param: str | None = None, detail: str | None = None,
                 logged: bool = False, retry_after_s: int | None = None) -> None:
        super().__init__(message, param=param, detail=detail, logged=logged)
        self.retry_after_s = retry_after_s


class InsufficientMemory(BunkhouseError):
    """The model would fit once leased models let go, but they did not within the wait."""

    status = 503
    code = "insufficient_memory"

    refusal = True

    def __init__(self, message: str, *, retry_after_s: int = 5,
                 detail: str | None = None, logged: bool = False) -> None:
        super().__init__(message, detail=detail, logged=logged)
        self.retry_after_s = retry_after_s


class Paused(InsufficientMemory):
    """Every model is held paused (``POST /admin/pause``) and was not resumed within the
    admission wait."""

    code = "paused"


class ModelFailed(InsufficientMemory):
    """The model's workers kept dying; it rests until its cool-down passes."""

    code = "model_failed"


class ModelTooLarge(BunkhouseError):
    """The model can never fit the memory budget (less what pinned models hold)."""

    status = 503
    code = "model_too_large"
    refusal = True


class ModelMisconfigured(BunkhouseError):
    """The model's options cannot be served (a draft of another vocabulary, a cache type its
    engine lacks): it is listed as failed, and loads only once its options are fixed."""

    status = 503
    code = "model_misconfigured"
    refusal = True


class ShuttingDown(BunkhouseError):
    """The front is stopping: it starts no worker and takes no new lease."""

    status = 503
    code = "shutting_down"

    def __init__(self, model_id: str | None = None) -> None:
        about = f"model {model_id!r}: " if model_id else ""
        super().__init__(f"{about}the server is shutting down; retry once it is back")


class ServerBusy(BunkhouseError):
    """A budget shared by all clients (request bodies being read, uploads, event streams) is
    full, or this client holds its share of it (bunkhouse/shares.py); retry shortly."""

    status = 503
    code = "server_busy"
    retry_after_s = 1


class InsufficientStorage(BunkhouseError):
    """A pull whose files do not fit the free disk: refused before any byte is written."""

    status = 507
    code = "insufficient_storage"
    refusal = True


class PullFailed(BunkhouseError):
    """A pull that the hub, the network or a checksum failed (the message says which)."""

    status = 502
    code = "pull_failed"


class EngineUnavailable(BunkhouseError):
    """A worker could not be reached or went away during a request."""

    status = 502
    code = "engine_unavailable"


def log_line(err: BunkhouseError) -> tuple[int, str, str | None] | None:
    """How a request answered with ``err`` is logged at the HTTP edge, once: (level, text,
    output: the detail, logged as indented lines under the text, ``extra={"output": ...}``),
    or None for not at all. A fault of the server (5xx) at ERROR with its detail; one whose
    fault was logged where it happened (``logged``: a failed load's output, once per
    failure) and a refusal by the host's state (a full budget, a failed model, a model too
    large) at WARNING, one short line; a client's error with a detail at INFO; a stop and an
    operator's pause not at all."""
    if isinstance(err, ShuttingDown | Paused):
        return None
    if err.logged or (err.refusal and err.status >= 500):
        return logging.WARNING, err.message, None
    if err.status >= 500:
        return logging.ERROR, err.message, err.detail
    if err.detail:
        return logging.INFO, err.message, err.detail
    return None


def error_body(err: BunkhouseError, *, detail: bool = False) -> dict[str, Any]:
    """The OpenAI-style envelope for ``err``; with its detail only when ``detail``."""
    return envelope(err.full_message() if detail else err.message, err.type, err.code,
                    err.param)


def envelope(
    message: str, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}
