"""The server side of every stream handler: bans, the sender check, a bounded read, a typed answer.

Every handler (forward, tied, SCAPE, anchor packets, weights, basis, alive) used to read its own
request, check its own sender and size, write its own error reply and close its own stream, each
a little differently: one checked its sender only after reading the whole frame (a dense tied
gradient is 113 MB), some answered no error at all, some struck bad senders and some did not.
The client side of these streams is one module (``node.net.rpc``); this is the other half, so a
rule about who may send what, and how much, is written once.

``serve`` runs a handler's ``body`` on one incoming stream:

* a banned peer (``Wire.bans``, one list for every handler) gets a closed stream, nothing read;
* ``Stream.receive`` reads the 8-byte length header, then asks the handler's sender check
  (``Sender``: this peer id's byte limit, or ``NotAllowed``), and only then the payload, through
  the node's ``Wire`` (swarm key, inactivity deadline ``IDLE_S``). A refused sender's message is
  never read: a declared 100 MB from a stranger costs 8 bytes. The limit may depend on the
  sender's role;
* whatever the body raises before it answered is answered with a typed error frame (a
  ``FrameError``'s code, ``busy`` for a deadline, ``internal`` otherwise, or the code the
  handler's ``on_error`` returns) and, if a ``FrameError`` other than ``NotAllowed``, struck
  against the sender (``strikes``); a body that returns forgives a strike. The stream is always closed
  quietly, and nothing escapes into the transport.

* a handler's ``caps`` (``node.net.caps``: streams per peer and node-wide, a per-peer rate) are
  checked after the ban list and before a byte is read; a stream over them is answered ``busy``
  with the bound it passed, and struck only when it passed the rate. A handler whose bound
  depends on the sender's role holds its ``Caps`` in its body instead (the weight server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from node.net.caps import Caps, OverCap
from node.net.transport import close_quietly
from node.net.wire import IDLE_S, Idle, Wire, skip_message
from protocol.auth import Unauthorized
from protocol.frames import Frame, FrameError, encode_frame, error_frame

log = logging.getLogger("node")

# a stream over a handler's caps whose request is this small is read and thrown away before it is
# answered: closing a stream with unread bytes resets it and loses the answer (a weights or basis
# request is < 4 KiB). A larger one is left unread: its sender may see a reset instead of busy.
# A stream that sends nothing is answered after REFUSED_IDLE_S, so a refusal costs little time.
REFUSED_READ_BYTES = 64 << 10
REFUSED_IDLE_S = 2.0

Sender = Callable[[str], "int | Awaitable[int]"]
"""A handler's sender check: the byte limit of one message from this peer id; raises ``NotAllowed``
when the peer may not use the handler. Asked after the length header, before any payload byte."""

Body = Callable[["Stream"], Awaitable[None]]
"""A handler's work on one stream: receive, act, answer (``Stream.send``); raise to refuse."""

OnError = Callable[["Stream", Exception], "str | None"]
"""Called once for each exception a body raised before answering: count it, and return the error
code to answer with (None: ``error_reply``'s)."""


class NotAllowed(FrameError):
    """The sender may not use this handler: refused before its message is read, and not struck
    (it cost nothing, and an honest peer our routes do not show yet must not be banned)."""

    code = "unauthorized"


def error_reply(run_id: str, err: BaseException, code: str | None = None) -> Frame:
    """The error frame answering ``err``: ``code``, else a ``FrameError``'s own, ``busy`` for a
    deadline (try again, or another replica), ``internal`` for anything else."""
    if code is None and isinstance(err, FrameError):
        code = err.code
    elif code is None:
        code = "busy" if isinstance(err, asyncio.TimeoutError) else "internal"
    message = str(err) if isinstance(err, (FrameError, Idle)) else f"{type(err).__name__}: {err}"
    frame = error_frame(run_id, err)
    frame.meta.update(code=code, message=message[:300], last=1)  # ``last``: ends a streamed reply too
    return frame


class Stream:
    """One incoming stream as a handler's body sees it: the sender, its request, the answer."""

    def __init__(self, stream_info, reader, writer, wire: Wire, run_id: str, timeout: float) -> None:
        self.peer = str(stream_info.peer_id)
        self.reader, self.writer, self.wire = reader, writer, wire
        self.run_id, self.timeout = run_id, timeout
        self.answered = False  # a reply was begun: an error after it is the sender gone, not answered

    async def receive(self, limit: int | Sender, idle: float | None = IDLE_S) -> bytes:
        """The request's frame bytes, verified with the swarm key. ``limit``: the byte limit, or
        the sender check that gives it. ``idle``: the deadline is on inactivity (at most
        ``timeout``); None: ``timeout`` for the header, and again for the payload."""
        if isinstance(limit, int):
            return await self.wire.recv(self.reader, limit, self.timeout, idle)
        sender = limit
        return await self.wire.recv(self.reader, lambda: sender(self.peer), self.timeout, idle)

    async def skip(self, limit: int, idle: float = IDLE_S) -> None:
        """Read one message and throw it away (closing with it unread would reset the stream and
        lose the answer written before)."""
        await skip_message(self.reader, limit + self.wire.overhead, min(idle, self.timeout))

    async def send(self, data: bytes | Frame, sealed: bool = True) -> int:
        """Write one reply (signed unless ``sealed`` is False); the bytes written."""
        self.answered = True
        data = encode_frame(data) if isinstance(data, Frame) else data
        if sealed:
            return await self.wire.send(self.writer, data, self.timeout)
        return await self.wire.send(self.writer, data, self.timeout, sealed=False)

    async def refuse(self, err: BaseException, code: str | None = None) -> int:
        """Answer with ``error_reply``; the bytes written, 0 if the sender went away (never raises).
        Unsigned for ``Unauthorized``: a sender without the swarm key must still read why."""
        reply = error_reply(self.run_id, err, code)
        try:
            return await self.send(reply, sealed=not isinstance(err, Unauthorized))
        except Exception as e:
            log.debug("error reply to %s not delivered: %s", self.peer[:12], e)
            return 0


async def serve(
    stream_info,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    wire: Wire,
    body: Body,
    *,
    run_id: str,
    timeout: float,
    what: str = "message",
    answer: bool = True,
    strikes: bool = True,
    on_error: OnError | None = None,
    caps: Caps | None = None,
) -> bool:
    """Run ``body`` on one incoming stream (the module docstring); True if it returned.

    ``what`` names the request in logs; ``answer``: False for one-way handlers, which write no
    error reply; ``strikes``: False for handlers whose refusals do not count towards a ban (a
    stream over ``caps``' rate is struck all the same: that bound exists to stop floods)."""
    s = Stream(stream_info, reader, writer, wire, run_id, timeout)
    bans = getattr(wire, "bans", None)  # a test double without a ban list bans nobody
    try:
        if bans is not None and bans.is_banned(s.peer):  # costs a banned peer nothing but a closed stream
            return False
        if hasattr(wire, "hear"):  # the connection this stream rode works (node.swarm.reverse reads it)
            wire.hear(s.peer)
        try:
            with contextlib.nullcontext() if caps is None else caps.hold(s.peer):  # before a byte is read
                await body(s)
        except Exception as e:
            if s.answered:  # the reply was under way: the sender went away, there is no one to answer
                log.debug("%s stream from %s ended: %s: %s", what, s.peer[:12], type(e).__name__, e)
                return False
            code = on_error(s, e) if on_error is not None else None
            _log(what, s.peer, e, code)
            if bans is not None and _struck(e, strikes):
                if bans.record_bad(s.peer):
                    log.warning("banning %s for repeated invalid %ss (last: %s)", s.peer[:12], what, e)
            if answer:
                if isinstance(e, OverCap):
                    with contextlib.suppress(FrameError, Idle, OSError):
                        await s.skip(REFUSED_READ_BYTES, REFUSED_IDLE_S)
                await s.refuse(e, code)
            return False
        if strikes and bans is not None:
            bans.record_good(s.peer)
        return True
    finally:
        close_quietly(writer)


def _struck(e: Exception, strikes: bool) -> bool:
    """Whether ``e`` counts against its sender: a frame defect where the handler strikes, never a
    refused role (it cost nothing), a concurrency bound only when it was the rate."""
    if isinstance(e, OverCap):
        return e.strike
    return strikes and isinstance(e, FrameError) and not isinstance(e, NotAllowed)


def _log(what: str, peer: str, e: Exception, code: str | None) -> None:
    if isinstance(e, OverCap):  # a flood would be a flood of lines: its Caps count it
        log.debug("%s from %s refused: %s", what, peer[:12], e)
    elif isinstance(e, FrameError):  # the sender's fault: worth a line
        log.info("%s from %s refused: %s", what, peer[:12], e)
    elif code is None and not isinstance(e, asyncio.TimeoutError):  # ours: a bug, or a part failing
        log.warning("internal error serving a %s from %s: %s: %s", what, peer[:12], type(e).__name__, e)
    else:  # busy, a deadline, downstream: the sender tries elsewhere
        log.debug("%s from %s answered %s: %s", what, peer[:12], code or "busy", e)


__all__ = ["Body", "NotAllowed", "OnError", "Sender", "Stream", "error_reply", "serve"]
