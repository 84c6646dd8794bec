"""API keys at the HTTP edge, and the access table: who may call which route.

Two kinds of key: client keys open the inference endpoints; admin keys open those and the
control endpoints. With no client key configured the inference endpoints are open (as
Ollama, llama-server and LM Studio are by default); control endpoints always need an admin
key. A key is read from ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in
constant time against every configured key, and never logged.

:data:`ACCESS` names the level of every route, in one place; the app is built from it, and a
route missing from it is an error at startup (docs/security.md prints the same table).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import Response

from bunkhouse.errors import Forbidden, Unauthorized

Handler = Callable[[Request], Awaitable[Response]]


class Level(enum.IntEnum):
    OPEN = 0  # liveness, the API description
    CLIENT = 1  # inference, listings, stats: open when no client key is configured
    ADMIN = 2  # every change of state: off when no admin key is configured


ACCESS: dict[tuple[str, str], Level] = {
    ("GET", "/health"): Level.OPEN,  # model detail only to a CLIENT-level caller
    ("GET", "/openapi.json"): Level.OPEN,
    ("POST", "/v1/chat/completions"): Level.CLIENT,
    ("POST", "/v1/completions"): Level.CLIENT,
    ("POST", "/v1/embeddings"): Level.CLIENT,
    ("POST", "/v1/messages"): Level.CLIENT,
    ("POST", "/v1/messages/count_tokens"): Level.CLIENT,
    ("POST", "/v1/audio/transcriptions"): Level.CLIENT,
    ("POST", "/v1/responses"): Level.CLIENT,
    ("GET", "/v1/responses/{response_id}"): Level.CLIENT,
    ("DELETE", "/v1/responses/{response_id}"): Level.CLIENT,
    ("GET", "/v1/responses/{response_id}/input_items"): Level.CLIENT,
    ("POST", "/api/chat"): Level.CLIENT,  # Ollama's API
    ("POST", "/api/generate"): Level.CLIENT,
    ("POST", "/api/embed"): Level.CLIENT,
    ("GET", "/metrics"): Level.CLIENT,  # Prometheus' scrape
    ("POST", "/infill"): Level.CLIENT,  # llama.cpp's server routes
    ("POST", "/tokenize"): Level.CLIENT,
    ("POST", "/detokenize"): Level.CLIENT,
    ("POST", "/apply-template"): Level.CLIENT,
    ("POST", "/api/embeddings"): Level.CLIENT,
    ("GET", "/api/version"): Level.CLIENT,
    ("GET", "/api/tags"): Level.CLIENT,
    ("GET", "/api/ps"): Level.CLIENT,
    ("POST", "/api/show"): Level.CLIENT,
    ("POST", "/api/pull"): Level.ADMIN,  # downloads a model: a change of state
    ("POST", "/api/push"): Level.CLIENT,  # 501s: nothing changes
    ("POST", "/api/create"): Level.CLIENT,
    ("POST", "/api/copy"): Level.CLIENT,
    ("DELETE", "/api/delete"): Level.CLIENT,
    ("GET", "/v1/models"): Level.CLIENT,
    ("GET", "/v1/models/{model_id:path}"): Level.CLIENT,
    ("GET", "/stats"): Level.CLIENT,
    ("GET", "/admin/events"): Level.CLIENT,  # read-only: the residency event stream
    ("GET", "/"): Level.OPEN,  # the web console: static files, they hold no data
    ("GET", "/console/{name}"): Level.OPEN,
    ("POST", "/v1/models"): Level.ADMIN,
    ("POST", "/v1/models/{model_id:path}/{action}"): Level.ADMIN,
    ("DELETE", "/v1/models/{model_id:path}"): Level.ADMIN,
    ("POST", "/admin/cache/flush"): Level.ADMIN,
    ("POST", "/admin/reload"): Level.ADMIN,
    ("POST", "/admin/default"): Level.ADMIN,
    ("POST", "/admin/pause"): Level.ADMIN,
    ("POST", "/admin/resume"): Level.ADMIN,
    ("DELETE", "/admin/cache"): Level.ADMIN,
    ("DELETE", "/admin/cache/{model_id:path}"): Level.ADMIN,
    ("POST", "/admin/pull"): Level.ADMIN,
    ("GET", "/admin/pull"): Level.ADMIN,
    ("DELETE", "/admin/pull/{pull_id}"): Level.ADMIN,
}
"""(method, route path) → the level a caller needs. Internal detail (a worker's output, server
paths) goes only to ADMIN-level callers, whatever the route."""


def access(method: str, path: str) -> Level:
    """The level ``method path`` needs; KeyError for a route the table does not name."""
    try:
        return ACCESS[(method, path)]
    except KeyError:
        raise KeyError(f"route {method} {path} is not in the access table "
                       "(bunkhouse.front.auth.ACCESS); add it") from None


def _matches(candidate: str, keys: Iterable[str]) -> bool:
    found = False
    for key in keys:  # no early exit: the time does not depend on which key matched
        found |= hmac.compare_digest(candidate.encode(), key.encode())
    return found


def presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key") or None


class Keys:
    def __init__(self, client: Iterable[str] = (), admin: Iterable[str] = ()) -> None:
        self.client = tuple(k for k in client if k)
        self.admin = tuple(k for k in admin if k)

    def replace(self, other: Keys) -> bool:
        """Take ``other``'s keys (a reload read the key files again); whether they changed."""
        changed = (self.client, self.admin) != (other.client, other.admin)
        self.client, self.admin = other.client, other.admin
        return changed

    def check(self, request: Request, level: Level) -> None:
        """Raise Unauthorized (401) or Forbidden (403) unless the request may go on."""
        if level is Level.OPEN or (level is Level.CLIENT and not self.client):
            return
        if level is Level.ADMIN and not self.admin:
            raise Forbidden("admin endpoints are off: this server was started without an "
                            "admin key, so no key can open them; restart it with --admin-key "
                            "KEY (or --admin-key-file FILE, or $BUNKHOUSE_ADMIN_KEYS)")
        key = presented_key(request)
        if key is None:
            raise Unauthorized("this endpoint needs an API key: send 'Authorization: Bearer "
                               "KEY' or 'x-api-key: KEY'")
        is_admin = _matches(key, self.admin)
        if level is Level.ADMIN:
            if is_admin:
                return
            if _matches(key, self.client):
                raise Forbidden("this endpoint needs an admin key; the key given is a "
                                "client key")
            raise Unauthorized("the API key is not valid")
        if not (is_admin or _matches(key, self.client)):
            raise Unauthorized("the API key is not valid")

    def level_of(self, request: Request) -> Level:
        """The highest level the request's key (or its absence) opens; never raises."""
        key = presented_key(request)
        if key is not None and self.admin and _matches(key, self.admin):
            return Level.ADMIN
        if not self.client or (key is not None and _matches(key, self.client)):
            return Level.CLIENT
        return Level.OPEN

    def owner(self, request: Request) -> str | None:
        """Whose stored state (responses) the request may see: a hash of its client key; ""
        on a server without client keys (one shared owner); None for an admin (anyone's)."""
        if self.level_of(request) is Level.ADMIN:
            return None
        key = presented_key(request)
        if not self.client or key is None:
            return ""
        return hashlib.sha256(b"bunkhouse-owner:" + key.encode()).hexdigest()[:32]

    def client_of(self, request: Request) -> str:
        """Who holds a share of the shared budgets (bunkhouse/shares.py): a hash of the
        request's key when it is a configured one, else its remote address (a key that
        matches none would let one client pass as many)."""
        key = presented_key(request)
        if key is not None and (self.client or self.admin) \
                and _matches(key, (*self.client, *self.admin)):
            return "key:" + hashlib.sha256(b"bunkhouse-client:" + key.encode()).hexdigest()[:32]
        return "address:" + (request.client.host if request.client else "")

    def guard(self, level: Level, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            self.check(request, level)
            return await handler(request)

        return guarded
