"""Tie a worker's life to its parent's: a worker whose front dies exits by itself.

Two mechanisms, because either alone has a gap: Linux's parent-death signal (immediate,
but bound to the thread that forked us) and a watchdog thread that notices re-parenting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child of ``parent_pid`` (this process): between fork and exec
    it arms the parent-death signal (SIGKILL), which survives exec, and exits at once if the
    parent is already gone. None off Linux. Only a resolved C function runs in the forked
    child: no import, no allocation of note."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = _libc().prctl
    getppid, exit_now, kill = os.getppid, os._exit, int(signal.SIGKILL)

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if getppid() != parent_pid:
            exit_now(1)

    return arm


def hold(parent_pid: int, on_orphaned: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call ``on_orphaned`` (once) as soon as ``parent_pid`` is no longer our parent."""
    # SIGKILL, not SIGTERM: a worker the compute gate suspended (SIGSTOP) when its front died
    # would hold a SIGTERM pending for ever; a dead front has nothing left to save.
    _set_parent_death_signal(signal.SIGKILL)
    fired = threading.Event()

    def fire() -> None:
        if not fired.is_set():
            fired.set()
            on_orphaned()

    def watch() -> None:
        while not fired.wait(interval_s):
            if os.getppid() != parent_pid:
                log.warning("parent %d is gone; exiting", parent_pid)
                fire()

    if os.getppid() != parent_pid:  # died before the signal was armed
        fire()
        return
    threading.Thread(target=watch, name="lifeline", daemon=True).start()
