"""One hop: choose a peer of the next stage, call it, retry once elsewhere, give up on peers that left.

A hop is one libp2p stream: the FORWARD frame goes out and the BACKWARD frame for the same
microbatch comes back once everything downstream has finished, or an ERROR frame. The reply's
bytes are parsed in the compute thread (``parse``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from collections.abc import Callable

from node.net import paths as routes
from node.net.alive import answers
from node.net.rpc import PeerUnreachable, open_stream
from node.net.transport import close_quietly
from node.stage.context import StageContext
from node.swarm.membership import read_stage_records
from node.swarm.routing import choose_peer
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError
from protocol.records import StageRecord

log = logging.getLogger("node")

HANDLER = "vnode.forward"


class HopFailed(RuntimeError):
    """The next stage could not be reached or did not answer; ``retry`` if another peer may help.

    ``busy``: the peer answered that it takes no work now (an outer round, a SCAPE exchange, a tied
    sync): it is alive, and will take work again in about a second. ``reached``: a stream to the
    peer was open when the hop broke (closed or reset mid-message, not a timeout): it was alive.
    """

    def __init__(self, msg: str, retry: bool = True, busy: bool = False, reached: bool = False):
        super().__init__(msg)
        self.retry = retry
        self.busy = busy
        self.reached = reached


# All replicas of the next stage busy (they average together in an outer round, ~1 s): wait and
# try again, doubling up to the cap, until the hop's deadline, instead of dropping the microbatch.
BUSY_RETRY_S = (0.25, 2.0)


def gone_peers(watched: dict[str, int], routes: list[dict[str, StageRecord]]) -> list[str]:
    """Watched peers (peer -> its stage) whose stage, freshly read, lists others but not them.

    A stage read that came back empty proves nothing (a DHT lookup can miss under churn), and
    abandoning hops on it would drop healthy work; a record that is merely not ready (a node
    draining before it leaves) still counts as present.
    """
    return [p for p, st in watched.items() if 0 <= st < len(routes) and routes[st] and p not in routes[st]]


class HopClient:
    def __init__(self, ctx: StageContext, parse: Callable[[bytes], Frame]) -> None:
        self.ctx = ctx
        self.parse = parse  # reply bytes -> Frame (node.stage.linkio.LinkIO.parse), run in the compute thread
        self.rng = random.Random(zlib.crc32(ctx.peer_id.encode()) ^ ctx.cfg.seed)
        # peers we have hops in flight to -> (their stage, an event set when their record leaves
        # the DHT; see call_peer)
        self._gone: dict[str, tuple[int, asyncio.Event]] = {}
        # peer -> (the expiry it was asked about, the answer): one question per expiry
        self._asked: dict[str, tuple[asyncio.Event, asyncio.Future]] = {}

    def deadline(self, boundary: int) -> float:
        # the reply needs every remaining stage's compute, so the deadline grows with the hops ahead
        return self.ctx.cfg.hop_timeout * (self.ctx.n_stages - 1 - boundary)

    async def refresh_routes(self) -> None:
        ctx = self.ctx
        try:
            ctx.routes = await read_stage_records(
                ctx.dht, ctx.run.run_id, ctx.n_stages, timeout=ctx.cfg.hop_timeout
            )
        except Exception as e:
            log.info("could not refresh routes: %s", e)
            return
        for peer in gone_peers({p: st for p, (st, _) in self._gone.items()}, ctx.routes):
            self._gone.pop(peer)[1].set()  # its hops in flight give up; a later hop gets a fresh event

    async def call_peer(self, peer: str, data: bytes, boundary: int, tokens: int = 0) -> Frame:
        """One hop: write ``data`` (a FORWARD frame of ``tokens`` tokens across ``boundary``) and
        read the reply. The frame's bytes are counted once written, not while it waits its turn:
        frames queued behind the bulk slots would otherwise count as sent before the link carried
        them, and a busy answer or retry would count them twice."""
        ctx = self.ctx
        timeout = self.deadline(boundary)
        opened: list[asyncio.StreamWriter] = []

        async def exchange() -> bytes:
            async with ctx.wire.bulk(peer):  # the stream opens on our turn to write (node/net/wire.py)
                try:
                    reader, writer = await open_stream(ctx.p2p, peer, HANDLER, ctx.cfg.hop_timeout)
                except PeerUnreachable as e:
                    raise HopFailed(str(e)) from None
                opened.append(writer)
                sent = await ctx.wire.send(writer, data, timeout)
                ctx.metrics.count_frame(boundary, "forward", sent, tokens)
            return await ctx.wire.recv(reader, MAX_FRAME_BYTES, timeout)

        # A cut link resets nothing: the hop would hang until its deadline (minutes for a long
        # pipeline) with the head's in-flight slots stuck behind it. Once the peer's record
        # expires from the DHT (it cannot heartbeat), ask it directly (node/net/alive.py); if it does
        # not answer, give the hop up and retry elsewhere. A busy peer answers, and the hop goes on.
        io = asyncio.ensure_future(exchange())
        left: asyncio.Future | None = None
        try:
            while True:
                _, gone = self._gone.setdefault(peer, (boundary + 1, asyncio.Event()))
                left = asyncio.ensure_future(gone.wait())
                await asyncio.wait({io, left}, return_when=asyncio.FIRST_COMPLETED)
                left.cancel()
                if io.done():
                    break
                if not await self._still_there(peer, gone):  # the hop is cancelled below
                    raise HopFailed(f"{peer[:12]} left the swarm mid-hop (its record expired, no answer)")
            reply = io.result()
        except (asyncio.TimeoutError, ConnectionError, OSError, FrameError) as e:
            reached = bool(opened) and not isinstance(e, asyncio.TimeoutError)
            raise HopFailed(f"{peer[:12]} did not answer: {type(e).__name__} {e}", reached=reached) from None
        finally:
            if left is not None:
                left.cancel()
            io.cancel()
            for writer in opened:
                close_quietly(writer)
        try:
            frame = await ctx.compute(self.parse, reply)
        except FrameError as e:
            raise HopFailed(f"{peer[:12]} sent an invalid reply: {e}") from None
        if frame.kind == "error":
            # a peer whose own downstream failed already retried; do not multiply retries upstream
            code = frame.meta.get("code")
            message = f"{peer[:12]}: {frame.meta.get('message', '?')}"
            raise HopFailed(message, retry=code != "downstream", busy=code == "busy")
        if frame.kind != "backward":
            raise HopFailed(f"{peer[:12]} answered with a {frame.kind} frame")
        return frame

    async def _still_there(self, peer: str, gone: asyncio.Event) -> bool:
        """Whether ``peer``, whose record expired (``gone`` was set), answers. Every hop in flight
        to it shares one question per expiry, so a burst of hops sends one probe."""
        asked = self._asked.get(peer)
        first = asked is None or asked[0] is not gone
        if first:
            asked = self._asked[peer] = (gone, asyncio.ensure_future(answers(self.ctx.p2p, peer)))
        alive = await asyncio.shield(asked[1])
        if alive:
            self.ctx.metrics.expired_but_alive += 1
            if first:
                log.info("%s: its record expired, but it answers; its hops go on", peer[:12])
        return alive

    async def send_downstream(self, data: bytes, microbatch: int, tokens: int) -> Frame:
        """Send FORWARD frame bytes to a peer of the next stage; retry once through another peer
        after a failure (through the same one if it is the only one and was reached), and wait out
        replicas that are busy (see ``BUSY_RETRY_S``)."""
        ctx = self.ctx
        nxt = ctx.index + 1
        tried: set[str] = set()
        last: HopFailed | None = None
        failures = 0
        # A stream that closed mid-message (a relay or NAT dropping it) says the peer is alive: with
        # no other replica, one more try through it keeps the microbatch (tests/test_nat.py once
        # lost one so). A peer not reached at all, or timed out, gets no second try.
        again: str | None = None
        wait, give_up = BUSY_RETRY_S[0], time.monotonic() + self.deadline(ctx.index)
        while failures < 2:
            relayed = routes.is_relayed(getattr(ctx, "p2p", None))  # a test double may have none
            peer = choose_peer(ctx.routes[nxt], ctx.cfg.circuit, tried, self.rng, relayed)
            if peer is None and again is not None:  # the one reached, again, before a DHT read
                peer, again = again, None
            if peer is None:
                await self.refresh_routes()
                peer = choose_peer(ctx.routes[nxt], ctx.cfg.circuit, tried, self.rng, relayed)
            if peer is None and last is not None and last.busy and time.monotonic() + wait < give_up:
                await asyncio.sleep(wait)
                wait = min(2 * wait, BUSY_RETRY_S[1])
                tried.clear()  # every replica again: the busy ones are alive
                continue
            if peer is None:
                if last is not None and last.busy:
                    raise last
                raise HopFailed(f"no live peer serves stage {nxt}", retry=False)
            tried.add(peer)
            try:
                reply = await self.call_peer(peer, data, ctx.index, tokens)
            except HopFailed as e:
                last = e
                if e.busy:  # alive and back soon: keep its route, try the others first
                    log.debug("hop to stage %d: %s", nxt, e)
                    continue
                log.info("hop to stage %d failed: %s", nxt, e)
                if not (e.reached and relayed(peer)):
                    # stop choosing it until it heartbeats again. Not a relayed peer that was
                    # reached: its relay broke the stream, and the peer's other relays still carry;
                    # with its route gone every hop would wait on a DHT read (seconds while the dead
                    # relay was one of the DHT's peers: tests/test_nat_pair.py once stalled 4 s)
                    ctx.routes[nxt].pop(peer, None)
                again = peer if e.reached else None
                failures += 1
                if not e.retry:
                    break
                continue
            if reply.microbatch != microbatch:
                raise HopFailed("reply for a different microbatch", retry=False)
            return reply
        raise last or HopFailed("no attempt made")
