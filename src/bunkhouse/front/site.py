"""Requests a web page made the browser send: DNS rebinding and cross-site simple requests.

A page the user opens in a browser can send requests to ``http://127.0.0.1:8080`` itself
(a "simple" request: no preflight) or, through DNS rebinding, make its own host name resolve
to 127.0.0.1 and read the answers (the class of Ollama's CVE-2024-28224). Two rules, as
Ollama applies them, checked before any route:

- **Host.** When the server is bound to a loopback address, only ``Host`` values that name
  this machine are served: an IP address literal, ``localhost`` and ``*.localhost``, and the
  names given with ``--allowed-host``. A rebinding page's requests carry its own host name
  and get 403. Bound to any other address, the operator chose to serve the network; keys are
  the protection then (docs/security.md).
- **Cross-site bodies.** A body whose content type a browser may send cross-site without a
  preflight (``text/plain``, form types, or none at all: a ``fetch`` of raw bytes, a
  ``sendBeacon``) is refused when the request comes from another site
  (``Sec-Fetch-Site: cross-site``, or an ``Origin`` that is neither this server nor a
  loopback address, a local name or an allowed host). ``curl -d`` sends such a content type
  too, but no ``Origin``: it keeps working, as Ollama's and llama.cpp's docs show it.
- **Cross-site streams.** A long-lived stream (``GET /admin/events``) is refused to a
  request from another site, however it is loaded: a page's iframes, embeds and objects send
  no ``Origin`` but ``Sec-Fetch-Site: cross-site``, and held every event stream open, so the
  console's own got 503.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from bunkhouse.errors import BunkhouseError, Forbidden, InvalidRequest
from bunkhouse.front.protocols import error_envelope

log = logging.getLogger(__name__)

# What a browser sends cross-site without a preflight (the Fetch standard's CORS-safelisted
# request header values for Content-Type).
_SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded",
                           "multipart/form-data"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_STREAMS = frozenset({"/admin/events"})
"""Routes a GET holds open for as long as the client likes: the residency event stream (a
generation's stream is a POST, and runs out with its tokens)."""


def is_loopback_bind(host: str) -> bool:
    """Whether listening on ``host`` (the ``--host`` value) serves this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    """The name or address of a ``Host`` header value, without port or IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


@dataclass(frozen=True, slots=True)
class SitePolicy:
    """Which hosts and origins are this server's. ``allowed_hosts``: exact names, or
    ``.example.com`` for every name under it, or ``*`` for any."""

    loopback_only: bool = True  # bound to a loopback address: check Host
    allowed_hosts: tuple[str, ...] = ()
    # origins the operator named with --cors-origin (never "*"): their pages are trusted as
    # this server's own, simple bodies included
    trusted_origins: tuple[str, ...] = ()

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: Iterable[str] = (),
                 cors_origins: Iterable[str] = ()) -> SitePolicy:
        return cls(is_loopback_bind(bind_host), tuple(h.lower() for h in allowed_hosts),
                   tuple(o.lower() for o in cors_origins if o != "*"))

    def local_name(self, name: str) -> bool:
        """Whether ``name`` (no port) is an address literal, a local name, or allowed."""
        if not name:
            return False
        try:
            ipaddress.ip_address(name)
            return True  # a page served from an address is its own origin: no rebinding
        except ValueError:
            pass
        if name == "localhost" or name.endswith(".localhost"):
            return True
        return any(a == "*" or a == name or (a.startswith(".") and name.endswith(a))
                   for a in self.allowed_hosts)

    def refusal(self, method: str, headers: Headers, path: str) -> str | None:
        """Why this request is refused (403), or None to serve it."""
        host = headers.get("host")
        if self.loopback_only and host is not None and not self.local_name(_hostname(host)):
            return (f"host {host[:100]!r} is not served: this server listens on a loopback "
                    "address and answers only requests for localhost or an IP address "
                    "(a web page may be using DNS rebinding); start it with --allowed-host "
                    "NAME to serve another name")
        if method in _BODY_METHODS and self._simple_body(headers) and self._cross_site(headers):
            return ("a cross-site request with a form or text/plain body is refused; send "
                    "the body as application/json")
        if path in _STREAMS and self._cross_site(headers):
            return ("a page of another site may not open this stream (in an iframe, embed "
                    "or object, or with an EventSource unless --cors-origin names its origin)")
        return None

    @staticmethod
    def _simple_body(headers: Headers) -> bool:
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        return media in _SIMPLE_TYPES or not media

    def _cross_site(self, headers: Headers) -> bool:
        origin = headers.get("origin")
        if origin is not None and origin.lower() in self.trusted_origins:
            return False  # named by the operator with --cors-origin
        if headers.get("sec-fetch-site", "").lower() == "cross-site":
            return True
        if origin is None:
            return False  # not a browser's cross-origin request (curl, SDKs)
        try:
            parts = urlsplit(origin)
            name = (parts.hostname or "").lower()
        except ValueError:  # not a URL: "null" and worse
            return True
        if parts.netloc and parts.netloc.lower() == headers.get("host", "").lower():
            return False  # same origin
        try:
            return not ipaddress.ip_address(name).is_loopback  # a page served from an address
        except ValueError:
            return not self.local_name(name)


class SiteGuard:
    """ASGI middleware applying a :class:`SitePolicy` before any route (403 in the OpenAI
    envelope, ``param`` null)."""

    def __init__(self, app: ASGIApp, policy: SitePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            hosts = headers.getlist("host")
            err: BunkhouseError | None = None
            if len(hosts) > 1 or (not hosts and scope.get("http_version") == "1.1"):
                err = InvalidRequest("an HTTP/1.1 request needs exactly one Host header "
                                     "(RFC 9112)")
            elif (reason := self.policy.refusal(scope["method"], headers,
                                                scope["path"])) is not None:
                log.warning("refused %s %s: %s", scope["method"], scope["path"][:200], reason)
                err = Forbidden(reason)
            if err is not None:
                body = error_envelope(scope["path"], err)
                await JSONResponse(body, status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
