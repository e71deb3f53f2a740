"""The forward stream handler: bans, parsing off the loop, error mapping, byte counting, reply first.

Every stream gets exactly one answer: the BACKWARD frame, or an ERROR frame whose code says
what the sender should do (``downstream``: our next stage failed, do not retry again;
``busy``: try another replica; the frame errors: the frame was bad). The reply goes out, and
the stream is closed, *before* this node's optimizer step (``after_reply``): a step (drain,
AdamW, an outer round, a SCAPE exchange, a checkpoint) never delays the stages upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from node.bans import BanList
from node.context import StageContext
from node.hop import HopFailed
from node.step import Busy
from node.transport import close_quietly
from node.wire import Unauthorized
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, encode_frame, error_frame

log = logging.getLogger("node")


class ForwardServer:
    def __init__(
        self,
        ctx: StageContext,
        serve: Callable[[bytes], Awaitable[tuple[Frame, bytes]]],
        after_reply: Callable[[], Awaitable[None]],
    ) -> None:
        self.ctx = ctx
        # FORWARD frame bytes -> the BACKWARD frame and its bytes, built in the compute thread
        # (node.pipeline.Pipeline.serve)
        self.serve = serve
        self.after_reply = after_reply  # the step, when one is due
        self.bans = BanList()
        self.leaving = False  # set when the node leaves: streams that start now are turned away
        self.active = 0  # streams being served, from the first byte read to the step after the reply
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Wait until no stream is being served (replies sent, steps taken); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.active += 1
        self._idle.clear()
        try:
            await self._handle(stream_info, reader, writer)
        finally:
            self.active -= 1
            if not self.active:
                self._idle.set()

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        ctx = self.ctx
        peer = str(stream_info.peer_id)
        sealed = True
        served = False
        try:
            if self.bans.is_banned(peer):  # costs a banned peer's frames nothing but a closed stream
                return
            try:
                data = await ctx.wire.recv(reader, MAX_FRAME_BYTES, ctx.cfg.hop_timeout)
                if self.leaving:  # upstream retries it on another replica
                    raise Busy("this node is leaving the swarm; try another replica")
                reply, out = await self.serve(data)
                served = True
                self.bans.record_good(peer)
            except FrameError as e:
                ctx.metrics.rejected_frames += 1
                if self.bans.record_bad(peer):
                    log.warning("banning %s for repeated invalid frames (last: %s)", peer[:12], e)
                log.info("rejected a frame from %s: %s", peer[:12], e)
                reply = error_frame(ctx.run.run_id, e)
                sealed = not isinstance(e, Unauthorized)  # a keyless sender must still read why
            except HopFailed as e:
                reply = _error(ctx.run.run_id, "downstream", str(e))
            except (asyncio.TimeoutError, RuntimeError) as e:
                reply = _error(ctx.run.run_id, "busy", f"{type(e).__name__}: {e}")
            except Exception as e:  # a bug of ours must still answer, never leave the sender waiting
                log.warning("internal error serving %s: %s: %s", peer[:12], type(e).__name__, e)
                reply = _error(ctx.run.run_id, "internal", f"{type(e).__name__}: {e}")
            if not served:  # error frames carry no tensors: cheap to encode here
                out = encode_frame(reply)
            sent = await ctx.wire.send(writer, out, ctx.cfg.hop_timeout, sealed=sealed)
            if served:
                ctx.metrics.replies_sent.append((time.monotonic(), reply.microbatch))
                ctx.metrics.count_frame(ctx.index - 1, "backward", sent, int(reply.meta.get("mb_tokens", 0)))
        except Exception as e:  # the requester went away; nothing of ours is held any more
            log.debug("stream ended: %s", e)
        finally:
            close_quietly(writer)
        if served:  # the reply is out (or its sender gone): now this node may step
            try:
                await self.after_reply()
            except Exception as e:  # a failed step must not escape into the transport's handler
                log.warning("inner step failed: %s: %s", type(e).__name__, e)


def _error(run_id: str, code: str, message: str) -> Frame:
    return Frame(kind="error", run_id=run_id, meta={"code": code, "message": message[:300]})
