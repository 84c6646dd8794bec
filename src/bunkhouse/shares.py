"""Budgets every client draws on, of which one client may hold only a share.

A budget shared by all (request bodies being read, audio uploads held, event streams open)
is one that a single client could otherwise fill and keep full: every other client's
request would get 503 for as long as it liked. So each budget also bounds what one client
holds (:data:`CLIENT_SHARE` of it). A client is its API key when the request carries a
configured one, else its remote address (front/auth.py ``Keys.client_of``); behind a
reverse proxy every client is the proxy's address, and keys tell them apart.
"""

from __future__ import annotations

from bunkhouse.errors import ServerBusy

CLIENT_SHARE = 4
"""One client holds at most ``1 / CLIENT_SHARE`` of a shared budget: a quarter, so that at
least four clients (keys, or addresses without keys) fill it, and one that holds its share
leaves three quarters to every other client. Our choice."""


class Shares:
    """``limit`` units held at once by all clients, at most ``share`` by one (one owner: the
    front's event loop). ``what`` names the units in a refusal ("request body bytes")."""

    def __init__(self, limit: int, what: str, share: int | None = None) -> None:
        self.limit = limit
        self.share = share if share is not None else max(1, limit // CLIENT_SHARE)
        self.what = what
        self.held = 0
        self._by_client: dict[str, int] = {}

    def held_by(self, client: str) -> int:
        return self._by_client.get(client, 0)

    def take(self, client: str, n: int) -> None:
        """Hold ``n`` more for ``client``, or ServerBusy (503, Retry-After) past the budget
        or past its share."""
        mine = self.held_by(client)
        if mine + n > self.share:
            raise ServerBusy(f"this client (its API key, or its address without one) holds "
                             f"its share of the server's {self.what} ({self.share} of "
                             f"{self.limit}); finish or close one of its requests, then retry")
        if self.held + n > self.limit:
            raise ServerBusy(f"the server holds as many {self.what} as it may; retry shortly")
        self.held += n
        self._by_client[client] = mine + n

    def give(self, client: str, n: int) -> None:
        """Give back ``n`` that ``client`` held."""
        if n <= 0:
            return
        self.held -= n
        left = self.held_by(client) - n
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
