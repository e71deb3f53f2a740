"""Relays: a public node carries streams between two peers that cannot open a connection to each
other (both behind NAT), one stream at a time.

Why not libp2p's circuit relay v2 (the bundled p2pd has it): its relay service starts only once a
node's AutoNAT says it is public and a NAT'd node reserves a slot only once AutoNAT says it is
private, and both are fixed when p2pd starts, before a node has asked anyone to dial it back. Tried
in namespaces (a public relay forced public, two homes forced private with it as their trusted
relay): no relayed address appeared within 30 s, and a dial through the daemon's client to a
``/p2p-circuit`` address failed in the client's multiaddr encoding. Its circuits also end at a data
and a time limit (go-libp2p's default relay: 128 KiB or 2 minutes; p2pd's flags: 4 GiB or 30
minutes), which a run of days must renew without cutting a frame.

So the node relays at the level of its own streams. Every stream a node opens is one request (a
FORWARD frame and its BACKWARD reply, a weights pull, a metrics read): there is no long-lived
circuit to renew, and no frame can be cut by a limit. The three roles:

* **caller** (A, behind NAT): to reach B, a peer behind NAT that it has no connection to, A opens
  a stream to one of the relays B announces (``StageRecord.relays``), handler ``vnode.relay``, and
  sends one frame naming B and the handler it wants;
* **relay** (R, a public node of the run; ``RelayServer``): opens a stream to B's ``vnode.relayed``
  on the connection B keeps to it (B dials its relays, as it dials the peers that call it), names A
  and the handler, waits for B's yes, answers A, and then copies bytes both ways until both ends
  close, counting them (``relayed_bytes``), under an optional rate cap (``--relay-rate``);
* **callee** (B; ``RelayedIn``): accepts relayed streams only from the run's relays, and hands
  the rest of the stream to its own handler as if A had opened it (the handler sees A's peer id,
  so every sender check holds). B trusts a relay to name the sender truly: a relay that lies can
  send frames in another peer's name (frames of a keyed swarm are still checked against the key).

``node.net.paths`` decides how a stream to a peer is opened (directly when a connection exists or
the peer can be dialled, else through the peer's relays) and which relays a node keeps;
``node.net.rpc`` opens it, the caller's side of a relayed stream included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from node.net.caps import Limits
from node.net.paths import HEADER_BYTES, RELAY_HANDLER, RELAYED_HANDLER, parse_header, relay_header
from node.net.rpc import PeerUnreachable, open_stream
from node.net.serve import NotAllowed, Stream, serve
from node.net.transport import close_quietly
from node.net.wire import IDLE_S, Wire
from protocol.frames import Frame, FrameError, decode_frame, encode_frame

log = logging.getLogger("node")

CHUNK = 1 << 16
# streams one relay carries at once, and per caller: a relay is a volunteer's node with its own
# stage to serve; a pipeline keeps a few frames in flight per peer (--max-inflight 4, BULK_SLOTS 2)
LIMITS = Limits(per_peer=16, total=128, rate=200.0, burst=64)
PIPE_IDLE_S = 4 * IDLE_S  # a relayed stream that moves no byte either way for this long is closed


async def until_cancelled(work) -> None:
    """Await a handler's work; a cancellation (the node shutting down under a relayed stream that
    is still open) ends it quietly: hivemind logs a handler task that ended cancelled as an error,
    with a traceback, once for every stream."""
    with contextlib.suppress(asyncio.CancelledError):
        await work


class RateCap:
    """A token bucket over the bytes a relay copies (all its streams together); 0: no cap."""

    def __init__(self, bits_per_s: float) -> None:
        self.rate = bits_per_s / 8.0
        self.tokens = self.rate  # a second's worth of burst
        self.t = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= n or self.tokens >= self.rate:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / self.rate)


async def _pump(reader, writer, count, cap: RateCap | None, idle: float | None) -> None:
    """Copy ``reader`` to ``writer`` until EOF; ``count(n)`` for each chunk."""
    while True:
        data = await asyncio.wait_for(reader.read(CHUNK), idle)
        if not data:
            return
        if cap is not None:
            await cap.take(len(data))
        writer.write(data)
        await asyncio.wait_for(writer.drain(), idle)
        count(len(data))


async def splice(
    a: tuple, b: tuple, count, cap: RateCap | None = None, idle: float | None = PIPE_IDLE_S
) -> None:
    """Copy bytes both ways between streams ``a`` and ``b`` (each (reader, writer)) until both
    directions end; the first end that closes half-closes the other side where it can. ``idle``:
    seconds without a byte that end it (None: never)."""

    async def one_way(src, dst) -> None:
        try:
            await _pump(src[0], dst[1], count, cap, idle)
        finally:
            with contextlib.suppress(Exception):
                if dst[1].can_write_eof():
                    dst[1].write_eof()

    ab = asyncio.ensure_future(one_way(a, b))
    ba = asyncio.ensure_future(one_way(b, a))
    try:
        # the reply side ending ends the exchange: every relayed request is answered last
        done, _ = await asyncio.wait({ab, ba}, return_when=asyncio.FIRST_EXCEPTION)
        if ba not in done:
            await ba
    except Exception:
        pass
    finally:
        for t in (ab, ba):
            t.cancel()
        close_quietly(a[1])
        close_quietly(b[1])


class RelayServer:
    """``vnode.relay`` on a public node (the module docstring): carries streams for NAT'd peers."""

    def __init__(self, p2p, wire: Wire, run_id: str, timeout: float, rate_bits: float = 0.0) -> None:
        self.p2p, self.wire, self.run_id, self.timeout = p2p, wire, run_id, timeout
        self.cap = RateCap(rate_bits) if rate_bits > 0 else None
        self.relayed_bytes = 0  # bytes copied, both directions together
        self.streams = 0  # relayed streams opened
        self.active = 0
        self.refused = 0  # streams whose target could not be reached

    def metrics(self) -> dict:
        return {
            "relayed_bytes": self.relayed_bytes,
            "streams": self.streams,
            "active": self.active,
            "refused": self.refused,
            "rate_cap_bits": round(self.cap.rate * 8) if self.cap else 0,
        }

    async def handle(self, stream_info, reader, writer) -> None:
        await until_cancelled(
            serve(
                stream_info, reader, writer, self.wire, self._body, run_id=self.run_id, timeout=self.timeout,
                what="relay request", caps=self.wire.caps(RELAY_HANDLER, LIMITS), strikes=False,
            )
        )  # fmt: skip

    async def _body(self, s: Stream) -> None:
        target, handler = parse_header(decode_frame(await s.receive(HEADER_BYTES), run_id=self.run_id), "t")
        try:
            # never through another relay: the target keeps a connection to us, or it is not ours
            r, w = await open_stream(self.p2p, target, RELAYED_HANDLER, self.timeout, direct=True)
        except PeerUnreachable:
            self.refused += 1
            raise FrameError(f"relay cannot reach {target[:12]}") from None
        try:
            await self.wire.send(
                w, encode_frame(relay_header(RELAYED_HANDLER, self.run_id, s.peer, handler)), self.timeout
            )
            ack = decode_frame(await self.wire.recv(r, HEADER_BYTES, self.timeout), run_id=self.run_id)
            if ack.kind == "error":
                raise FrameError(str(ack.meta.get("message", "refused")))
        except Exception:
            close_quietly(w)
            self.refused += 1
            raise
        await s.send(Frame(kind="relay", run_id=self.run_id, meta={"ok": 1}))
        self.streams += 1
        self.active += 1

        def count(n: int) -> None:
            self.relayed_bytes += n

        try:
            await splice((s.reader, s.writer), (r, w), count, self.cap)
        finally:
            self.active -= 1


class RelayedIn:
    """``vnode.relayed`` on a NAT'd node: a stream one of its relays carries from a caller."""

    def __init__(
        self,
        p2p,
        wire: Wire,
        run_id: str,
        timeout: float,
        relays: set[str],
        more: Callable[[], Mapping] = dict,
    ) -> None:
        """``more()``: handlers served beside the node's own (the outer averager's, which run in
        its helper process: ``node.dp.relayed_averaging``)."""
        self.p2p, self.wire, self.run_id, self.timeout = p2p, wire, run_id, timeout
        self.more = more
        # the relays it accepts relayed streams from: every relaying node of the run (its lifecycle
        # updates it each beat). Not only the two it chose and announced: a caller reads that choice
        # from a record up to a few beats old, and a refusal there drops a frame for nothing
        self.relays = relays
        self.accepted = 0

    def handlers(self) -> Mapping:
        return {**self.more(), **local_handlers(self.p2p)}

    async def handle(self, stream_info, reader, writer) -> None:
        relay = str(stream_info.peer_id)
        caller = handler = None

        async def body(s: Stream) -> None:
            nonlocal caller, handler
            if relay not in self.relays:
                raise NotAllowed(f"{relay[:12]} is not a relay of this run")
            caller, handler = parse_header(
                decode_frame(await s.receive(HEADER_BYTES), run_id=self.run_id), "f"
            )
            if handler not in self.handlers():
                raise FrameError(f"no handler {handler} here")
            await s.send(Frame(kind="relay", run_id=self.run_id, meta={"ok": 1}))

        # serve() closes the stream when its body ends: run the handler inside it
        async def body_then_handler(s: Stream) -> None:
            await body(s)
            self.accepted += 1
            info = StreamInfo(PeerID.from_base58(caller), stream_info.addr, handler)
            await self.handlers()[handler](info, reader, writer)

        await until_cancelled(
            serve(
                stream_info, reader, writer, self.wire, body_then_handler, run_id=self.run_id,
                timeout=self.timeout, what="relayed stream", strikes=False,
            )
        )  # fmt: skip


def local_handlers(p2p) -> Mapping:
    """The binary stream handlers this node registered, by name (hivemind keeps them in its daemon
    client's control part; it has no public accessor)."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    return getattr(control, "handlers", None) or {}


__all__ = ["RateCap", "RelayServer", "RelayedIn", "local_handlers", "splice", "until_cancelled"]
