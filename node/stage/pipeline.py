"""The walk of one microbatch through this stage (docs/ARCHITECTURE.md draws it).

Head: ``head_loop`` draws a microbatch when the step gate has a slot, ``run_microbatch``
walks it. Body and tail: the forward stream handler (``node.stage.server``) hands the frame's bytes
to ``serve``. Each side of a hop is one compute call in and one out:

1. in: parse, check and decode the FORWARD frame (``accept``);
2. forward and encode: the stage's forward, the output link's codec and the frame's bytes
   (the tail instead computes its loss and backward, and its reply, in one call);
3. the hop: the bytes go to a peer of the next stage, whose BACKWARD frame comes back once
   everything downstream has finished (``node.stage.hop``);
4. decode and backward: the gradient of our output, our backward, and the BACKWARD reply
   upstream encoded to bytes.

The server sends the reply, and only then is the microbatch's step taken, if one is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import zlib

import torch

from node.stage.context import StageContext
from node.stage.hop import HopClient, HopFailed
from node.stage.linkio import LinkError, LinkIO
from node.stage.step import Busy, StepGate, Stepper
from node.swarm.membership import EmptyStageBackoff
from protocol.frames import Frame, encode_frame

log = logging.getLogger("node")


class Pipeline:
    def __init__(
        self,
        ctx: StageContext,
        gate: StepGate,
        linkio: LinkIO,
        hops: HopClient,
        stepper: Stepper,
        data_stream=None,
        drop_backoff_s: float = 1.0,
    ) -> None:
        self.ctx, self.gate, self.linkio, self.hops, self.stepper = ctx, gate, linkio, hops, stepper
        self.data = data_stream
        # head: pause after a dropped microbatch (a stage with no live peer fails them all)
        self.drop_backoff_s = drop_backoff_s
        self.empty_downstream = EmptyStageBackoff()  # head: a next stage with no live peer
        self.throughput = 0.0  # tokens per second of this stage's compute, announced to routing
        # microbatches whose forward graph (their saved activations) this stage holds now, and the
        # most at once: what the memory estimate's activations are for. At most the gate's count
        # (StepGate.peak), and fewer where microbatches wait to compute or a step drains them.
        self.held = 0
        self.peak_held = 0
        self._mb_counter = 0
        self._mb_prefix = (zlib.crc32(ctx.peer_id.encode()) & 0xFFFFFF) << 32

    # ------------------------------------------------------------ compute calls (worker thread)
    def _forward_encode(
        self, x: torch.Tensor, labels: torch.Tensor, step: int, mb: int, path: list[str], token_ids
    ) -> tuple[torch.Tensor, torch.Tensor | None, Frame, bytes]:
        ctx = self.ctx
        y, leaf = ctx.compute.forward(ctx.stage, x, ctx.is_head)
        down = self.linkio.forward_frame(step, mb, path, y, labels, x if ctx.is_head else token_ids)
        data = encode_frame(down)
        return y, leaf, dataclasses.replace(down, tensors={}), data  # the header is all decode needs

    def _decode_backward(
        self, down: Frame, bwd: Frame, y: torch.Tensor, leaf: torch.Tensor | None, upstream: Frame | None
    ) -> tuple[Frame, bytes] | None:
        grad_x = self.ctx.compute.backward(y, self.linkio.decode_gradient(down, bwd), leaf)
        return self._reply(upstream, grad_x, _loss_meta(bwd))

    def _tail(self, x: torch.Tensor, labels: torch.Tensor, upstream: Frame | None):
        loss, n_loss, grad_x = self.ctx.compute.tail(self.ctx.stage, x, labels, self.ctx.is_head)
        meta = {"loss": loss, "tokens": n_loss}
        return meta, self._reply(upstream, grad_x, meta)

    def _reply(self, upstream: Frame | None, grad_x, meta: dict) -> tuple[Frame, bytes] | None:
        """The BACKWARD frame answering ``upstream`` and its bytes (None on the head)."""
        if upstream is None:
            return None
        reply = self.linkio.reply(upstream, grad_x, meta)
        return reply, encode_frame(reply)

    def _accept(self, data: bytes):
        """Parse and check a FORWARD frame; decode it too unless a basis must be fetched first."""
        frame = self.linkio.parse(data)
        codec = self.linkio.check_forward(frame)
        if self.linkio.bases is not None and not codec.holds_basis(frame.basis_version):
            return frame, codec, None
        return frame, codec, self.linkio.decode_input(frame)

    # ------------------------------------------------------------ the walk
    async def run_rest(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        step: int,
        mb: int,
        path: list[str],
        tokens: int,
        token_ids: torch.Tensor | None = None,
        upstream: Frame | None = None,
    ) -> tuple[dict, tuple[Frame, bytes] | None]:
        """Run this stage on ``x``, send the result on and backprop the reply.

        ``token_ids`` (batch, tokens): the microbatch's input ids, for codecs whose payload
        carries them (subspace); the head has them in ``x``, a body stage from its input payload.
        ``upstream``: the FORWARD frame being served (None on the head), answered in the same
        compute call as the backward. Returns the tail's loss meta and the reply with its bytes.
        Raises HopFailed when the next stage cannot be reached.
        """
        ctx = self.ctx
        t0 = time.perf_counter()
        if ctx.is_tail:  # forward, loss and backward in one call: one graph at a time
            self.peak_held = max(self.peak_held, 1)
            meta, reply = await ctx.compute(self._tail, x, labels, upstream)
            self._record_throughput(tokens, time.perf_counter() - t0)
            return meta, reply
        try:
            y, leaf, down, data = await ctx.compute(
                self._forward_encode, x, labels, step, mb, path, token_ids
            )
        except LinkError as e:
            raise HopFailed(str(e), retry=False) from None
        self._record_throughput(tokens, time.perf_counter() - t0)
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)
        try:
            bwd = await self.hops.send_downstream(data, mb, tokens)
            try:
                reply = await ctx.compute(self._decode_backward, down, bwd, y, leaf, upstream)
            except LinkError as e:
                raise HopFailed(str(e), retry=False) from None
        finally:
            self.held -= 1
            del y, leaf  # the graph goes with them, whatever happened to the hop
        return _loss_meta(bwd), reply

    async def serve(self, data: bytes) -> tuple[Frame, bytes]:
        """FORWARD frame bytes from upstream -> the BACKWARD reply and its bytes; no step taken."""
        # Turned away before the decode queues on the compute thread: an outer round holds that
        # thread for up to --outer-timeout, and a frame queued behind it waited out the sender's
        # hop timeout (30 s stalls of the whole pipeline) instead of going to another replica.
        self.gate.check_open()
        frame, codec, decoded = await self.ctx.compute(self._accept, data)
        return await self._serve(frame, codec, decoded)

    async def serve_forward(self, frame: Frame) -> Frame:
        """A parsed FORWARD frame -> the BACKWARD reply (the benchmarks' fuzzer calls this)."""
        codec = self.linkio.check_forward(frame)
        return (await self._serve(frame, codec, None))[0]

    async def _serve(self, frame: Frame, codec, decoded) -> tuple[Frame, bytes]:
        ctx = self.ctx
        if decoded is None:
            await self.linkio.ensure_basis(codec, frame)
            decoded = await ctx.compute(self.linkio.decode_input, frame)
        x, labels, token_ids = decoded
        tokens = frame.shape[0] * frame.shape[1]
        await self.gate.enter(ctx.cfg.hop_timeout)
        try:
            meta, reply = await self.run_rest(
                x, labels, frame.step, frame.microbatch, frame.path, tokens, token_ids, upstream=frame
            )
        finally:
            await self.gate.exit()
        self.stepper.account(tokens, meta.get("loss") if ctx.is_tail else None, int(meta.get("tokens", 0)))
        return reply

    # ------------------------------------------------------------ head: driving microbatches
    async def run_microbatch(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        """One microbatch from the head's data, on a gate slot the caller entered."""
        tokens = ids.numel()
        self._mb_counter += 1
        mb = self._mb_prefix | self._mb_counter
        try:
            while True:
                try:
                    meta, _ = await self.run_rest(ids, labels, self.ctx.inner_step, mb, [], tokens)
                    break
                except HopFailed as e:
                    if "no live peer" not in str(e) or not self.empty_downstream.keep(str(e)):
                        raise
                    # the next stage is empty for a moment: this microbatch waits for its next peer
                    # (send_downstream reads the DHT again) instead of being dropped
                    self.ctx.metrics.held += 1
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.ctx.stop.wait(), self.drop_backoff_s)
                    if self.ctx.stop.is_set():
                        return
        except HopFailed as e:
            self.ctx.metrics.dropped += 1
            # holding the slot a moment keeps a head whose downstream stage has no live peer from
            # drawing, computing and dropping microbatches as fast as it can (hundreds a minute)
            if "no live peer" in str(e):  # an empty stage: one clear line, then back-off (stop cuts it)
                hold = self.empty_downstream.dropped(str(e), self.drop_backoff_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ctx.stop.wait(), hold)
            else:
                log.warning("dropped microbatch %x: %s", mb, e)
                await asyncio.sleep(self.drop_backoff_s)
            return
        finally:
            await self.gate.exit()
        self.empty_downstream.served()
        loss = float(meta["loss"]) if "loss" in meta else None
        self.stepper.account(tokens, loss, int(meta.get("tokens", 0)))
        await self.stepper.step_if_due()  # the head answers nobody upstream: step at once

    async def head_loop(self) -> None:
        ctx = self.ctx
        tasks: set[asyncio.Task] = set()
        while not ctx.stop.is_set():
            try:
                await self.gate.enter(timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except Busy:  # our own outer round: no new microbatches until it ends
                await asyncio.sleep(0.2)
                continue
            if ctx.stop.is_set():
                await self.gate.exit()
                break
            ids, labels = next(self.data)
            t = asyncio.create_task(self.run_microbatch(ids, labels))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:  # let in-flight microbatches finish (each is bounded by its hop deadlines)
            await asyncio.wait(tasks, timeout=self.hops.deadline(0) + 5)

    def _record_throughput(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            rate = tokens / seconds
            self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate


def _loss_meta(bwd: Frame) -> dict:
    """The tail's loss and token count, passed back up the pipeline with each reply."""
    return {k: bwd.meta[k] for k in ("loss", "tokens") if k in bwd.meta}
