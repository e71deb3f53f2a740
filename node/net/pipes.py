"""A request pipe that survives a request whose sender died: a fix for hivemind's background loops.

hivemind's DHT and averager each serve requests from a ``multiprocessing`` pipe in their own
process. A request carries an ``MPFuture``, whose pickle holds file descriptors (its reply pipe,
its shared state) passed through ``multiprocessing.resource_sharer``: unpickling connects back to
the *sender's* process to fetch them. When the sender is gone by then (an averager shut down
between two outer rounds, a node that left), that connect fails with ``EOFError``. hivemind's
loop catches ``OSError`` there but not ``EOFError``, so one such request ended the loop: the DHT
(or averager) process stayed alive and answered nothing again, and every later call on it timed
out (the fresh-clone failure of tests/test_diloco_sync.py, issue 18).

``tolerate_dead_senders`` wraps the pipe so that a request that cannot be unpickled is dropped with
one log line and replaced by a no-op request (the sender is gone, so nobody waits for its answer;
raising ``OSError`` instead would survive too, but hivemind logs it with a traceback). A pipe whose
other end closed still ends the loop, as before.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

log = logging.getLogger("node")


NOOP = "_vnode_dropped_request"
NOOP_REQUEST = (NOOP, [], {})


async def _noop() -> None:
    return None


class TolerantPipe:
    """A ``Connection`` whose ``recv`` turns a failed unpickle into an ``OSError``."""

    def __init__(self, conn: Connection, owner: str):
        self._conn, self._owner = conn, owner
        self.dropped = 0

    def recv(self) -> Any:
        buf = self._conn.recv_bytes()  # EOFError here: our end's peer closed the pipe; end the loop
        try:
            return ForkingPickler.loads(buf)
        except Exception as e:  # any handle inside the request may be dead
            self.dropped += 1
            log.warning("%s: dropped a request whose sender is gone (%s)", self._owner, type(e).__name__)
            return NOOP_REQUEST

    def __getattr__(self, name: str) -> Any:  # poll, fileno, send, close: the real connection's
        return getattr(self._conn, name)


def tolerate_dead_senders(obj: Any, owner: str) -> None:
    """Wrap ``obj._inner_pipe`` (a hivemind DHT or averager, in its own process) in a TolerantPipe."""
    if not isinstance(obj._inner_pipe, TolerantPipe):
        obj._inner_pipe = TolerantPipe(obj._inner_pipe, owner)
        setattr(obj, NOOP, _noop)  # the loop runs getattr(obj, method)(*args, **kwargs) as a task
