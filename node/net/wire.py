"""Messages on libp2p streams, signed with the swarm key when the run has one.

Every handler (forward, basis, weights, anchor, scape, tied) sends and receives through one
``Wire``, so membership is checked in one place, on raw bytes, before any frame is parsed; the
ban list every handler strikes lives here too, so a peer banned by one handler is refused by all
(the server side of every handler, ``node.net.serve``, checks it first).

A handler reads its request with ``idle``: a stream that sends no byte for ``idle`` seconds is
closed (``Idle``) however long the frame, so a held stream costs little while a slow but
steady sender (100 MB at 80 Mbit/s: 10 s) still gets through.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from node.net.bans import BanList
from node.net.caps import Caps, Limits
from node.net.transport import HEADER_LEN, write_message
from protocol.auth import HEADER_BYTES, ReplayGuard, Unauthorized, sign, verify
from protocol.frames import FrameTooLarge, MalformedFrame

log = logging.getLogger("node")

# a handler closes a request stream that sent nothing for this long. Not shorter: behind
# saturated links a stream's flow-control window can stay shut for seconds while its window
# update waits behind the frames going the other way (harness, dense with 16 in flight: 3
# frames cut at 5 s and sent again; linkprobe: small messages wait up to 2 s)
IDLE_S = 15.0
_CHUNK = 1 << 20
# pending connections the handler socket queues: p2pd opens one per incoming stream, and
# hivemind listens with asyncio's default of 100, so a burst of streams past it was reset
ACCEPT_BACKLOG = 4096
# pipeline frames (FORWARD out, BACKWARD replies) one node writes at once to one peer (one
# libp2p connection); the rest to that peer wait their turn. Written all at once, the frames in
# flight share the connection, finish together, and a pipeline's forwards and backwards then
# take turns on the link instead of overlapping (bench/results/linkprobe.md: 16.8 MB frames,
# 4 in flight, both directions busy: RTT 40 ms 52% -> 63% of 80 Mbit/s with 2 at once; RTT 0
# 48% -> 80% with 1). Two, not one: one stream alone is held to its libp2p flow-control window
# per round trip. Per peer, not per node: a peer that stalls (its link cut, its receive window
# shut) must not hold up the frames to the others.
BULK_SLOTS = 2


class Idle(asyncio.TimeoutError):
    """A request stream sent no byte within the inactivity deadline."""


MAX_HEARD = 4096  # peers whose last stream time is kept (Wire.hear)


class Wire:
    def __init__(self, key: bytes | None = None):
        self.key = key
        self.replay = ReplayGuard() if key else None
        self.bans = BanList()
        self._bulk: dict[str, asyncio.Semaphore] = {}
        # peer id -> monotonic time its last stream to us began (``node.net.serve``): a stream that
        # arrived proves the connection it rode works, so a node behind NAT need not probe it
        self.heard: dict[str, float] = {}
        self._caps: dict[str, Caps] = {}

    def caps(self, handler: str, limits: Limits) -> Caps:
        """This node's bounds in force for ``handler`` (``node.net.caps``): one per handler and
        node, kept here beside the ban list, since join.py replaces a runtime's Wire once built.
        New ``limits`` start afresh (streams held release into the ``Caps`` that admitted them)."""
        caps = self._caps.get(handler)
        if caps is None or caps.limits != limits:
            caps = self._caps[handler] = Caps(limits)
        return caps

    def bulk(self, peer: str) -> asyncio.Semaphore:
        """The turns to write a pipeline frame to ``peer`` (BULK_SLOTS). A sender opens its stream
        on its turn, since a handler closes a stream that sent nothing for IDLE_S."""
        return self._bulk.setdefault(peer, asyncio.Semaphore(BULK_SLOTS))

    def hear(self, peer: str) -> None:
        """A stream from ``peer`` began now. Bounded: minted peer ids must not grow it without end,
        and only recent streams matter to ``heard_within``, so the oldest half goes when full."""
        self.heard.pop(peer, None)
        self.heard[peer] = time.monotonic()  # insertion order is age order
        if len(self.heard) > MAX_HEARD:
            for old in list(self.heard)[: MAX_HEARD // 2]:
                del self.heard[old]

    def heard_within(self, peer: str, seconds: float) -> bool:
        """A stream from ``peer`` began within the last ``seconds``."""
        return time.monotonic() - self.heard.get(peer, float("-inf")) <= seconds

    @property
    def overhead(self) -> int:
        return HEADER_BYTES if self.key else 0

    def seal(self, data: bytes) -> bytes:
        return sign(self.key, data) if self.key else data

    def open(self, data: bytes) -> bytes:
        """The frame bytes inside ``data``; raises Unauthorized when the swarm key does not verify."""
        return verify(self.key, data, replay=self.replay) if self.key else data

    async def send(
        self, writer: asyncio.StreamWriter, data: bytes, timeout: float, sealed: bool = True
    ) -> int:
        out = self.seal(data) if sealed else data
        await write_message(writer, out, timeout)
        return len(out)

    async def recv(
        self,
        reader: asyncio.StreamReader,
        max_bytes: int | Callable[[], int | Awaitable[int]],
        timeout: float,
        idle: float | None = None,
    ) -> bytes:
        """One message of at most ``max_bytes`` frame bytes. A callable ``max_bytes`` is asked for
        the limit after the length header and before any payload byte (a handler's sender check,
        ``node.net.serve``: it may refuse, or allow a sender's role more). With ``idle``, the
        deadline is on inactivity (no byte for ``min(idle, timeout)`` seconds: never longer than
        the caller's deadline), not on the whole message; without, ``timeout`` for the header and
        again for the payload."""
        steady = idle is not None
        deadline = min(idle, timeout) if steady else timeout
        n = await read_header(reader, deadline, steady)
        if not isinstance(max_bytes, int):
            limit = max_bytes()
            max_bytes = await limit if inspect.isawaitable(limit) else limit
        check_size(n, max_bytes + self.overhead)
        return self.open(await read_payload(reader, n, deadline, steady))


def raise_accept_backlog(p2p, backlog: int = ACCEPT_BACKLOG) -> bool:
    """Raise the accept backlog of the unix socket hivemind's P2P serves its stream handlers on.

    hivemind keeps that socket inside a context manager and offers no setting; listen() on a
    duplicate of its descriptor resizes the queue of the same socket (Linux). False if it was
    not found (no P2P yet, another platform); the node then works with the default queue."""
    try:
        path = p2p._client_listen_maddr.value_for_protocol("unix")
        names = os.listdir("/proc/self/fd")
    except Exception as e:  # not hivemind's P2P, or no /proc
        log.debug("accept backlog left as it is: %s", e)
        return False
    for name in names:
        try:
            fd = os.dup(int(name))
        except OSError:  # closed since the listing
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        try:
            if sock.family == socket.AF_UNIX and sock.getsockname() == path:
                sock.listen(backlog)
                return True
        except OSError:
            pass
        finally:
            sock.close()  # only the duplicate: the socket stays open on its own descriptor
    return False


async def read_header(reader: asyncio.StreamReader, deadline: float, steady: bool = True) -> int:
    """The declared length of the next message: its 8-byte header, within ``deadline`` seconds
    (``steady``: no byte for that long raises ``Idle``; else ``asyncio.TimeoutError``)."""
    return int.from_bytes(await _read_exactly(reader, HEADER_LEN, deadline, steady), "big")


def check_size(n: int, max_bytes: int) -> None:
    """Before a single payload byte is read: a hostile header costs nothing."""
    if n > max_bytes:
        raise FrameTooLarge(f"declared message of {n} bytes exceeds the {max_bytes}-byte limit")


async def read_payload(reader: asyncio.StreamReader, n: int, deadline: float, steady: bool = True) -> bytes:
    """The ``n`` bytes after a header. ``steady``: ``deadline`` is on inactivity (no byte for that
    long raises ``Idle``), read a MiB at a time; else on the whole payload."""
    if not steady:
        return await _read_exactly(reader, n, deadline, steady)
    buf = bytearray()
    while len(buf) < n:
        buf += await _read_some(reader, min(n - len(buf), _CHUNK), deadline)
    return bytes(buf)


async def _read_exactly(reader: asyncio.StreamReader, n: int, deadline: float, steady: bool) -> bytes:
    if steady:
        return await _read_some(reader, n, deadline, exact=True)
    try:
        return await asyncio.wait_for(reader.readexactly(n), deadline)
    except asyncio.IncompleteReadError:
        raise MalformedFrame("stream closed mid-message") from None


async def skip_payload(reader: asyncio.StreamReader, n: int, idle: float) -> None:
    """Read ``n`` payload bytes and throw them away, holding at most a chunk of them."""
    while n > 0:
        n -= len(await _read_some(reader, min(n, _CHUNK), idle))


async def skip_message(reader: asyncio.StreamReader, max_bytes: int, idle: float) -> None:
    """Read one message and throw it away, holding at most a chunk of it: closing a stream with
    unread bytes resets it, and the reply written before would be lost with it."""
    n = await read_header(reader, idle)
    check_size(n, max_bytes)
    await skip_payload(reader, n, idle)


async def _read_some(reader: asyncio.StreamReader, n: int, idle: float, exact: bool = False) -> bytes:
    try:
        chunk = await asyncio.wait_for(reader.readexactly(n) if exact else reader.read(n), idle)
    except asyncio.IncompleteReadError:
        raise MalformedFrame("stream closed mid-message") from None
    except asyncio.TimeoutError:
        raise Idle(f"no bytes for {idle:g} s; idle streams are closed after {idle:g} s") from None
    if not chunk:
        raise MalformedFrame("stream closed mid-message")
    return chunk


__all__ = [
    "BULK_SLOTS",
    "IDLE_S",
    "Idle",
    "Wire",
    "Unauthorized",
    "check_size",
    "read_header",
    "read_payload",
    "skip_message",
]
