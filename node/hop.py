"""One hop: choose a peer of the next stage, call it, retry once elsewhere, give up on peers that left.

A hop is one libp2p stream (several for a big frame: node/parts.py): the FORWARD frame goes out
and the BACKWARD frame for the same microbatch comes back once everything downstream has
finished, or an ERROR frame. The reply's
bytes are parsed in the compute thread (``parse``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
import zlib
from collections.abc import Callable

from node import parts
from node.context import StageContext
from node.membership import read_stage_records
from node.parts import PART_HANDLER
from node.routing import choose_peer
from node.rpc import open_stream
from node.transport import close_quietly
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError
from protocol.records import StageRecord

log = logging.getLogger("node")

HANDLER = "vnode.forward"


class HopFailed(RuntimeError):
    """The next stage could not be reached or did not answer; ``retry`` if another peer may help.

    ``busy``: the peer answered that it takes no work now (an outer round, a SCAPE exchange, a tied
    sync): it is alive, and will take work again in about a second.
    """

    def __init__(self, msg: str, retry: bool = True, busy: bool = False):
        super().__init__(msg)
        self.retry = retry
        self.busy = busy


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


async def _open_streams(p2p, peer: str, count: int, timeout: float) -> list:
    """``count`` streams to ``peer`` at once (the first to the forward handler, the rest to the
    part handler); if any fails to open, the others are closed and the hop fails."""
    got = await asyncio.gather(
        *(open_stream(p2p, peer, PART_HANDLER if i else HANDLER, timeout) for i in range(count)),
        return_exceptions=True,
    )
    streams = [g for g in got if not isinstance(g, BaseException)]
    if len(streams) < count:
        for _, w in streams:
            close_quietly(w)
        raise HopFailed(str(next(g for g in got if isinstance(g, BaseException))))
    return streams


class HopClient:
    def __init__(self, ctx: StageContext, parse: Callable[[bytes], Frame]) -> None:
        self.ctx = ctx
        self.parse = parse  # reply bytes -> Frame (node.linkio.LinkIO.parse), run in the compute thread
        self.rng = random.Random(zlib.crc32(ctx.peer_id.encode()) ^ ctx.cfg.seed)
        # peers we have hops in flight to -> (their stage, an event set when their record leaves
        # the DHT; see call_peer)
        self._gone: dict[str, tuple[int, asyncio.Event]] = {}

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

    async def call_peer(self, peer: str, data: bytes, boundary: int) -> Frame:
        ctx = self.ctx
        timeout = self.deadline(boundary)
        opened: list[asyncio.StreamWriter] = []

        async def exchange() -> bytes:
            count = parts.part_count(len(data))
            token = secrets.token_bytes(parts.TOKEN_BYTES)
            msgs = [data] if count == 1 else parts.split(data, token, count)
            async with ctx.wire.bulk(peer):  # the streams open on our turn to write (node/wire.py)
                streams = await _open_streams(ctx.p2p, peer, count, ctx.cfg.hop_timeout)
                opened.extend(w for _, w in streams)
                await asyncio.gather(*(ctx.wire.send(w, m, timeout) for (_, w), m in zip(streams, msgs)))
            first = await ctx.wire.recv(streams[0][0], MAX_FRAME_BYTES, timeout)
            head = parts.parse(first)
            if head is None:  # a whole reply: the frame's own, or an error met before it
                return first
            rest = await asyncio.gather(*(ctx.wire.recv(r, MAX_FRAME_BYTES, timeout) for r, _ in streams[1:]))
            got = [head] + [parts.parse(m) for m in rest]
            if any(p is None for p in got):
                raise FrameError("a reply in parts mixed with a whole one")
            return parts.join(got, token, count)

        # A cut link resets nothing: the hop would hang until its deadline (minutes for a long
        # pipeline) with the head's in-flight slots stuck behind it. Once the peer's record
        # expires from the DHT (it cannot heartbeat), give the hop up and retry elsewhere.
        _, gone = self._gone.setdefault(peer, (boundary + 1, asyncio.Event()))
        io, left = asyncio.ensure_future(exchange()), asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({io, left}, return_when=asyncio.FIRST_COMPLETED)
            if not io.done():  # cancelled below
                raise HopFailed(f"{peer[:12]} left the swarm mid-hop (its record expired)")
            reply = io.result()
        except (asyncio.TimeoutError, ConnectionError, OSError, FrameError) as e:
            raise HopFailed(f"{peer[:12]} did not answer: {type(e).__name__} {e}") from None
        finally:
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

    async def send_downstream(self, data: bytes, microbatch: int, tokens: int) -> Frame:
        """Send FORWARD frame bytes to a peer of the next stage; retry once through another peer
        after a failure, and wait out replicas that are busy (see ``BUSY_RETRY_S``)."""
        ctx = self.ctx
        nxt = ctx.index + 1
        tried: set[str] = set()
        last: HopFailed | None = None
        failures = 0
        wait, give_up = BUSY_RETRY_S[0], time.monotonic() + self.deadline(ctx.index)
        while failures < 2:
            peer = choose_peer(ctx.routes[nxt], ctx.cfg.circuit, tried, self.rng)
            if peer is None:
                await self.refresh_routes()
                peer = choose_peer(ctx.routes[nxt], ctx.cfg.circuit, tried, self.rng)
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
            sent = parts.wire_bytes(len(data), parts.part_count(len(data)), ctx.wire.overhead)
            ctx.metrics.count_frame(ctx.index, "forward", sent, tokens)
            try:
                reply = await self.call_peer(peer, data, ctx.index)
            except HopFailed as e:
                last = e
                if e.busy:  # alive and back soon: keep its route, try the others first
                    log.debug("hop to stage %d: %s", nxt, e)
                    continue
                log.info("hop to stage %d failed: %s", nxt, e)
                ctx.routes[nxt].pop(peer, None)  # stop choosing it until it heartbeats again
                failures += 1
                if not e.retry:
                    break
                continue
            if reply.microbatch != microbatch:
                raise HopFailed("reply for a different microbatch", retry=False)
            return reply
        raise last or HopFailed("no attempt made")
