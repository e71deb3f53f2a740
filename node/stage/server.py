"""The forward stream handler: parsing off the loop, error mapping, byte counting, reply first.

The stream itself (bans, the bounded read, the typed error reply, closing) is ``node.net.serve``'s,
as for every handler; this module says what a FORWARD stream answers, and when this node steps.

Every stream gets exactly one answer: the BACKWARD frame, or an ERROR frame whose code says
what the sender should do (``downstream``: our next stage failed, do not retry again;
``busy``: try another replica; the frame errors: the frame was bad). The reply goes out, and
the stream is closed, *before* this node's optimizer step (``after_reply``): a step (drain,
AdamW, an outer round, a SCAPE exchange, a checkpoint) never delays the stages upstream.

What a flood costs: a peer of the stage before (a record in this node's routes) gets at most
``MAX_STREAMS_PER_PEER`` streams served at once, and all of them together ``MAX_STREAMS``. A sender
the routes do not show (after one throttled refresh: it may have joined since the last heartbeat)
is a visitor: visitors get ``VISITOR_STREAMS_PER_PEER`` each and ``VISITOR_STREAMS`` together, so
a flood of minted peer ids fills only the visitors' lane while the stage's own upstreams are
served, and an honest upstream not yet in the routes still gets its microbatches through. The
rest are answered ``busy``
(their frame read and thrown away, or the stream resets and the reply is lost) and counted
(``metrics.shed_streams``), so a flood is answered, not dropped. A stream that sends no byte for
``IDLE_S`` seconds is closed with a ``busy`` that names the deadline (``metrics.idle_streams``),
so held streams cost little. The handler socket's accept queue is raised from hivemind's 100
(``node.net.wire.raise_accept_backlog``) so that a burst of streams waits to be answered instead
of being reset by the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from node.net.bans import BanList
from node.net.caps import Caps, Limits, OverCap
from node.net.serve import Stream, serve
from node.net.wire import IDLE_S, Idle, raise_accept_backlog
from node.stage.context import StageContext
from node.stage.hop import HANDLER, HopFailed
from node.stage.step import Busy
from node.swarm.recheck import RouteRecheck
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError

log = logging.getLogger("node")

# streams one peer may have served at once: an honest upstream has at most its max_inflight
# microbatches out, spread over the replicas; past this a flood only queues
MAX_STREAMS_PER_PEER = 16
# streams served at once from every peer together: a stage's upstream replicas times their
# max_inflight, with room; past it a flood of minted peer ids only queues
MAX_STREAMS = 256
# a sender not in the routes of the stage before: an honest one's max_inflight (default 4) in
# flight, all of them together a couple of upstreams' worth
VISITOR_STREAMS_PER_PEER = 4
VISITOR_STREAMS = 8
SHED_LOG_EVERY_S = 5.0  # one log line per flooding peer per this many seconds, with the count


class ForwardServer:
    def __init__(
        self,
        ctx: StageContext,
        serve: Callable[[bytes], Awaitable[tuple[Frame, bytes]]],
        after_reply: Callable[[], Awaitable[None]],
        refresh_routes: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ctx = ctx
        # an unknown sender may have joined since the last heartbeat: one refresh, throttled
        self._recheck = None if refresh_routes is None else RouteRecheck(refresh_routes)
        # FORWARD frame bytes -> the BACKWARD frame and its bytes, built in the compute thread
        # (node.stage.pipeline.Pipeline.serve)
        self.serve = serve
        self.after_reply = after_reply  # the step, when one is due
        self.leaving = False  # set when the node leaves: streams that start now are turned away
        self.active = 0  # streams being served, from the first byte read to the step after the reply
        self._idle = asyncio.Event()
        self._idle.set()
        self._shed_logged: dict[str, float] = {}  # peer -> when its shedding was last logged
        self._backlog_checked = False

    @property
    def caps(self) -> Caps:
        """The bounds in force for the stage before's peers (on the node's Wire, beside the bans)."""
        return self.ctx.wire.caps(HANDLER, Limits(per_peer=MAX_STREAMS_PER_PEER, total=MAX_STREAMS))

    @property
    def visitor_caps(self) -> Caps:
        """The bounds in force for senders the routes do not show."""
        limits = Limits(per_peer=VISITOR_STREAMS_PER_PEER, total=VISITOR_STREAMS)
        return self.ctx.wire.caps(f"{HANDLER}/visitor", limits)

    async def _upstream(self, peer: str) -> bool:
        """Whether ``peer`` has a record of the stage before ours (any circuit, ready or not)."""
        ctx = self.ctx
        if ctx.index == 0:  # nothing sends a head forward frames
            return False
        if peer not in ctx.routes[ctx.index - 1] and self._recheck is not None:
            await self._recheck()
        return peer in ctx.routes[ctx.index - 1]

    @property
    def bans(self) -> BanList:
        """The node's ban list (on its Wire: every handler strikes and checks the same one)."""
        return self.ctx.wire.bans

    @bans.setter
    def bans(self, value: BanList) -> None:
        self.ctx.wire.bans = value

    async def drain(self, timeout: float) -> bool:
        """Wait until no stream is being served (replies sent, steps taken); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if not self._backlog_checked and self.ctx.p2p is not None:
            # the handler socket exists once a stream arrives: queue a burst instead of resetting it
            self._backlog_checked = True
            if not raise_accept_backlog(self.ctx.p2p):
                log.info("could not raise the stream accept backlog; bursts past 100 streams may be reset")
        peer = str(stream_info.peer_id)
        caps = self.caps if await self._upstream(peer) else self.visitor_caps
        try:
            caps.admit(peer)
        except OverCap as why:
            await self._shed(stream_info, reader, writer, why)
            return
        self.active += 1
        self._idle.clear()
        try:
            await self._handle(stream_info, reader, writer)
        finally:
            self.active -= 1
            caps.release(peer)
            if not self.active:
                self._idle.set()

    async def _shed(
        self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, why: OverCap
    ) -> None:
        """Answer a stream over a bound with ``busy``, its frame read but never kept (an upstream
        that is answered before it wrote its frame would see a reset, not the reason)."""
        ctx = self.ctx
        peer = str(stream_info.peer_id)
        ctx.metrics.shed_streams += 1
        now = time.monotonic()
        if now - self._shed_logged.get(peer, -SHED_LOG_EVERY_S) >= SHED_LOG_EVERY_S:
            self._shed_logged[peer] = now
            if len(self._shed_logged) > 1024:  # bounded: forget the peer logged longest ago
                del self._shed_logged[next(iter(self._shed_logged))]
            log.warning(
                "shedding streams from %s: %s (%d shed in all)", peer[:12], why, ctx.metrics.shed_streams
            )

        async def discard(s: Stream) -> None:
            try:
                await s.skip(MAX_FRAME_BYTES, IDLE_S)
            except (FrameError, Idle):  # a cut or stalled frame still gets the same answer
                pass
            await s.refuse(why, "busy")

        await serve(
            stream_info,
            reader,
            writer,
            ctx.wire,
            discard,
            run_id=ctx.run.run_id,
            timeout=ctx.cfg.hop_timeout,
            what="shed stream",
            strikes=False,  # neither a strike nor a forgiven one
        )

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        ctx = self.ctx
        served = False

        async def body(s: Stream) -> None:
            nonlocal served
            data = await s.receive(MAX_FRAME_BYTES, idle=IDLE_S)
            if self.leaving:  # upstream retries it on another replica
                raise Busy("this node is leaving the swarm; try another replica")
            reply, out = await self.serve(data)
            served = True
            async with ctx.wire.bulk(s.peer):  # a BACKWARD frame takes its turn on the uplink (BULK_SLOTS)
                sent = await s.send(out)
            ctx.metrics.replies_sent.append((time.monotonic(), reply.microbatch))
            ctx.metrics.count_frame(ctx.index - 1, "backward", sent, int(reply.meta.get("mb_tokens", 0)))

        # an error reply is small: it never waits behind the pipeline's frames for a turn
        await serve(
            stream_info,
            reader,
            writer,
            ctx.wire,
            body,
            run_id=ctx.run.run_id,
            timeout=ctx.cfg.hop_timeout,
            what="frame",
            on_error=self._refused,
        )
        if served:  # the reply is out (or its sender gone): now this node may step
            try:
                await self.after_reply()
            except Exception as e:  # a failed step must not escape into the transport's handler
                log.warning("inner step failed: %s: %s", type(e).__name__, e)

    def _refused(self, _s: Stream, e: Exception) -> str | None:
        """The answer's code: a frame error its own (and counted), ``downstream``: our next stage
        failed (do not retry again), ``busy``: a deadline, this node busy or leaving (try another
        replica); else ``internal``."""
        if isinstance(e, FrameError):
            self.ctx.metrics.rejected_frames += 1
            return None
        if isinstance(e, HopFailed):
            return "downstream"
        if isinstance(e, Idle):
            self.ctx.metrics.idle_streams += 1
        if isinstance(e, (asyncio.TimeoutError, RuntimeError)):
            return "busy"
        return None
