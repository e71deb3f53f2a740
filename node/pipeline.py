"""The walk of one microbatch through this stage (docs/ARCHITECTURE.md draws it).

Head: ``head_loop`` draws a microbatch when the step gate has a slot, ``run_microbatch``
walks it. Body and tail: the forward stream handler (``node.server``) parses the FORWARD frame
and calls ``serve_forward``. Both then go through ``run_rest``:

1. forward and encode, one compute call: the stage's forward, then the output link's codec
   and the frame's bytes (the tail instead computes its loss and backward);
2. the hop: the bytes go to a peer of the next stage, whose BACKWARD frame comes back once
   everything downstream has finished (``node.hop``);
3. decode and backward, one compute call: the gradient of our output, then our backward.

``serve_forward`` then encodes the gradient of our input as the BACKWARD reply and counts the
microbatch into the next step; the server sends the reply *before* the step is taken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib

import torch

from node.context import StageContext
from node.hop import HopClient, HopFailed
from node.linkio import LinkError, LinkIO
from node.step import Busy, StepGate, Stepper
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
        self.throughput = 0.0  # tokens per second of this stage's compute, announced to routing
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
        self, down: Frame, bwd: Frame, y: torch.Tensor, leaf: torch.Tensor | None
    ) -> torch.Tensor | None:
        grad_y = self.linkio.decode_gradient(down, bwd)
        return self.ctx.compute.backward(y, grad_y, leaf)

    def _tail(self, x: torch.Tensor, labels: torch.Tensor):
        return self.ctx.compute.tail(self.ctx.stage, x, labels, self.ctx.is_head)

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
    ) -> tuple[torch.Tensor | None, dict]:
        """Run this stage on ``x``, send the result on and backprop the reply.

        ``token_ids`` (batch, tokens): the microbatch's input ids, for codecs whose payload
        carries them (subspace); the head has them in ``x``, a body stage from its input payload.
        Returns the gradient with respect to ``x`` (None on the head) and the tail's loss meta.
        Raises HopFailed when the next stage cannot be reached.
        """
        ctx = self.ctx
        t0 = time.perf_counter()
        if ctx.is_tail:
            loss, n_loss, grad_x = await ctx.compute(self._tail, x, labels)
            self._record_throughput(tokens, time.perf_counter() - t0)
            return grad_x, {"loss": loss, "tokens": n_loss}
        try:
            y, leaf, down, data = await ctx.compute(
                self._forward_encode, x, labels, step, mb, path, token_ids
            )
        except LinkError as e:
            raise HopFailed(str(e), retry=False) from None
        self._record_throughput(tokens, time.perf_counter() - t0)
        bwd = await self.hops.send_downstream(data, mb, tokens)
        try:
            grad_x = await ctx.compute(self._decode_backward, down, bwd, y, leaf)
        except LinkError as e:
            raise HopFailed(str(e), retry=False) from None
        return grad_x, {k: bwd.meta[k] for k in ("loss", "tokens") if k in bwd.meta}

    async def serve_forward(self, frame: Frame) -> Frame:
        """A FORWARD frame from upstream -> the BACKWARD reply; the step is left to the caller."""
        ctx = self.ctx
        codec = self.linkio.check_forward(frame)
        await self.linkio.ensure_basis(codec, frame)
        x, labels, token_ids = await ctx.compute(self.linkio.decode_input, frame)
        tokens = frame.shape[0] * frame.shape[1]
        await self.gate.enter(ctx.cfg.hop_timeout)
        try:
            grad_x, meta = await self.run_rest(
                x, labels, frame.step, frame.microbatch, frame.path, tokens, token_ids
            )
        finally:
            await self.gate.exit()
        reply = await ctx.compute(self.linkio.reply, frame, grad_x, meta)
        self.stepper.account(tokens, meta.get("loss") if ctx.is_tail else None, int(meta.get("tokens", 0)))
        return reply

    # ------------------------------------------------------------ head: driving microbatches
    async def run_microbatch(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        """One microbatch from the head's data, on a gate slot the caller entered."""
        tokens = ids.numel()
        self._mb_counter += 1
        mb = self._mb_prefix | self._mb_counter
        try:
            _, meta = await self.run_rest(ids, labels, self.ctx.inner_step, mb, [], tokens)
        except HopFailed as e:
            self.ctx.metrics.dropped += 1
            log.warning("dropped microbatch %x: %s", mb, e)
            # holding the slot a moment keeps a head whose downstream stage has no live peer from
            # drawing, computing and dropping microbatches as fast as it can (hundreds a minute)
            await asyncio.sleep(self.drop_backoff_s)
            return
        finally:
            await self.gate.exit()
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
