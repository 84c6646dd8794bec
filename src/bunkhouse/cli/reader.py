"""A following command's end when the reader of its output leaves.

``bunkhouse events | head -2`` spends its time waiting for the server, not writing: the
closed pipe would be found only at the next event's line. :func:`ends_with_its_reader` has a
thread wait for stdout's hang-up (``POLLERR``/``POLLHUP`` on its descriptor: a pipe whose
read end closed, a terminal hung up) and end the process there, quietly with status 1, as
``main`` ends a command whose write met the closed pipe. The command holds nothing to
finish (the server sees its connection close), so the end is immediate: an exception raised
into the waiting thread could land anywhere, an import's lock included."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable, Iterator

_GONE = select.POLLERR | select.POLLHUP


def end_quietly() -> None:
    """Exit now with status 1, stdout on /dev/null (Python's "Note on SIGPIPE")."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    os._exit(1)


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a descriptor (a test's capture)
        return None


def watch(fd: int, stop: int, end: Callable[[], None]) -> None:
    """Until ``stop`` is readable: on ``fd``'s hang-up, ``end()``."""
    poller = select.poll()
    poller.register(fd, 0)  # only what is always reported: an error or a hang-up
    poller.register(stop, select.POLLIN)
    while True:
        for ready, events in poller.poll():
            if ready == stop or events & select.POLLNVAL:  # done, or stdout closed by us
                return
            if events & _GONE:
                end()
                return


@contextlib.contextmanager
def ends_with_its_reader(end: Callable[[], None] = end_quietly) -> Iterator[None]:
    """Run the body; if stdout's reader leaves meanwhile, ``end()`` (by default the
    process ends at once, status 1). A stdout that is not a descriptor is not watched."""
    fd = _stdout_fd()
    if fd is None:
        yield
        return
    stop_r, stop_w = os.pipe()
    watcher = threading.Thread(target=watch, args=(fd, stop_r, end), daemon=True,
                               name="stdout-reader")
    watcher.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        watcher.join()
        os.close(stop_r)
        os.close(stop_w)
