"""Re-reading the configuration while serving: ``SIGHUP``, ``POST /admin/reload`` and
``bunkhouse reload`` all come here.

The TOML file and the model folders are read again into a new catalog off the event loop
(the same code that built the first one, so the same checks); a file that does not parse or
check is refused whole with its error, and the running configuration stays. A good one is
applied by residency (``ResidencyManager.apply_catalog``): added models appear, removed ones
are drained without cutting a running request, changed ones take their settings at their
next load. Key files are read again and their keys replace the running ones, so a leaked key
is revoked by editing its file and reloading (a key file that now holds no key refuses the
reload). Other flags of the command line (address, budget) are not reloaded: they need a
restart. One reload runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bunkhouse.catalog import Catalog
from bunkhouse.errors import BunkhouseError, InvalidRequest
from bunkhouse.front.auth import Keys
from bunkhouse.residency.manager import ResidencyManager

log = logging.getLogger(__name__)


class Reloader:
    def __init__(self, rebuild: Callable[[], tuple[Catalog, Keys]], residency: ResidencyManager,
                 keys: Keys | None = None) -> None:
        """``rebuild()``: the catalog the configuration describes now and the keys the key
        files hold now (blocking; raises BunkhouseError, e.g. ConfigError, for a bad one);
        ``keys``: the running keys, replaced by those."""
        self._rebuild = rebuild
        self._residency = residency
        self._keys = keys
        self._lock = asyncio.Lock()

    async def reload(self, why: str) -> dict[str, list[str]]:
        """Apply the configuration as it is now. Returns the model ids added, removed and
        changed; raises InvalidRequest with the configuration's error (nothing changed)."""
        async with self._lock:
            try:
                catalog, keys = await asyncio.to_thread(self._rebuild)
            except BunkhouseError as e:
                log.error("configuration not reloaded (%s): %s; the running configuration "
                          "stays", why, e.message, extra={"output": e.detail})  # once
                # every client key reads events: the error (paths) is the detail, for the
                # log and admins; the admin's reload call answers it in full
                self._residency.events.emit(
                    "*", "config refused", f"{why}: the configuration has an error (the "
                    "server log has it); the running configuration stays", e.full_message())
                raise InvalidRequest(f"the configuration was not reloaded: {e.message}; "
                                     "the running configuration stays") from e
            change = await self._residency.apply_catalog(catalog)
            if self._keys is not None and self._keys.replace(keys):
                log.warning("keys reloaded (%s): %d client key(s), %d admin key(s); the ones "
                            "no longer in their files are refused from now on", why,
                            len(keys.client), len(keys.admin))
            log.info("configuration reloaded (%s): added %s, removed %s, changed %s", why,
                     change["added"] or "none", change["removed"] or "none",
                     change["changed"] or "none")
            self._residency.events.emit("*", "config reloaded", why)
            return change
