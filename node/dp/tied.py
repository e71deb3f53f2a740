"""Tied embeddings across processes: the head and the tail sum their gradients of the tied tensor.

A tied model (SmolLM2: ``embed_tokens`` is ``lm_head``) split into stages leaves one copy of the
tensor on the head (the input embedding) and one on the tail (lm_head). Each would train its copy
on its own part of the gradient only, and the copies would drift apart. As Megatron all-reduces
the embedding gradient between its first and last stage, at every inner step, after the mean and
before clipping and AdamW, each side sends its mean gradient of the tied tensor to the ready peers
of the partner stage (``vnode.tied``) and adds what the partner sent for the same step index. Both
copies then take the same summed gradient (fp32 addition commutes: a + b == b + a bit for bit),
the same clip (``node.dp.strategies.mean_and_clip`` clips the tied tensor by its own norm, on both sides)
and the same AdamW update from the same AdamW state: they stay bit-identical. That is the model
``bench/quality/quality.py`` trains in one process, where the tensor is one shared parameter.

Bytes per step: the head's gradient is sparse (only rows of tokens in its batch are non-zero), so
it sends the ids and those rows: rows x (H + 2) x 4 bytes. The tail's is dense V x H, sent in the
gradient's dtype (fp32 here) for exactness: 4·V·H bytes (the bundled SmolLM2-135M: 49152 x 576 x 4
= 113 MB a step; SmolLM2-360M: 189 MB; far more than its activations). bf16 would halve it but
end bit-identity; it is also low rank (dlogitsᵀ·h over the n labelled positions: rank <= n), so
its exact factors, n·(V + H) numbers, are much smaller whenever a step labels fewer than ~H
positions. Neither is built yet, nor a split into several frames: one frame holds at most
MAX_FRAME_BYTES (256 MiB), so V·H above 64 M parameters (e.g. 128k x 4096) cannot be sent yet.

A partner's gradient that has not come within ``deadline_s`` is given up: the side steps with its
own gradient and counts ``tied_missed``. The copies then differ, and nothing re-ties them yet: the
DiLoCo rounds average replicas of one stage, never the head with the tail (a periodic copy of the
tail's tensor to the heads could).

Replicas: the pairing by step index (and the wait) is for one head and one tail peer, where it is
exact. With several peers on an end stage the stages step at different rates (a tail fed by two
heads steps twice as often as each), so there is no step to pair, and an unpaired exchange would
still cost a dense V x H gradient per step per partner (9 GB in a 40-step demo on loopback, which
starved the replicas' CPU until their DiLoCo rounds no longer met) without keeping the copies
equal. So with replicas nothing is exchanged (each skipped step counts in ``tied_unpaired``): the
copies train apart, as an untied model's would, and export writes them untied.

Each side judges "one head, one tail" from its own view of the DHT, and the views can differ for a
heartbeat or longer (a replica one side sees and the other does not yet, or no longer). So a side
waits for the partner only once the partner has answered ours with ``paired``: it pairs with us
too, and has not yet ended that step's exchange. One that answers ``paired: 0`` will not send; the
sender steps at once, and offers again after ``REPAIR_EVERY`` steps (a dense tail gradient is
113 MB), or at once when the partner offers first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from node.net import rpc
from node.net.caps import Limits
from node.net.serve import NotAllowed, Stream, serve
from node.stage.context import StageContext
from node.stage.step import StepGate
from node.swarm.recheck import RouteRecheck
from node.swarm.routing import fast_peers_of_stage
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, decode_frame

log = logging.getLogger("node")

TIED_HANDLER = "vnode.tied"
STEP_WINDOW = 2  # a gradient more than this many steps away from ours is refused, not stored
# a partner sends one gradient per step (a replica of the partner stage too, before it learns
# that it does not pair); a dense tail gradient is ~100 MB, so few are read at once
LIMITS = Limits(per_peer=2, total=4)
REPAIR_EVERY = 10  # steps between offers to a partner that answered it does not pair with us


def tied_parameter(ctx: StageContext) -> torch.nn.Parameter | None:
    """This stage's copy of the tied tensor: the head's embedding or the tail's lm_head; None when the
    run does not keep tied weights tied or this stage holds the one shared tensor (a 1-stage run)."""
    if not ctx.run.tied or ctx.is_head == ctx.is_tail:
        return None
    return ctx.stage.embed_tokens.weight if ctx.is_head else ctx.stage.lm_head.weight


def tied_payload(mean: torch.Tensor, from_head: bool) -> dict[str, torch.Tensor]:
    """The tensors a side sends: the head the ids and rows of its non-zero (in-batch) embedding
    rows, the tail its dense lm_head gradient; both exact, in the gradient's dtype."""
    if from_head:
        ids = (mean != 0).any(dim=1).nonzero().flatten()
        return {"ids": ids, "rows": mean[ids].contiguous()}
    return {"grad": mean.contiguous()}


def partner_gradient(
    tensors: dict[str, torch.Tensor], param: torch.nn.Parameter, from_head: bool
) -> torch.Tensor:
    """The partner's gradient (``tied_payload``) as a dense tensor like ``param``; FrameError when it
    does not fit (shape, dtype, ids out of range or repeated; the frame decoder checked finiteness)."""
    v, h = param.shape
    if not from_head:
        g = tensors.get("grad")
        if g is None or set(tensors) != {"grad"} or g.shape != param.shape or g.dtype != param.dtype:
            raise FrameError(f"tied gradient must be one {param.dtype} tensor of shape {list(param.shape)}")
        return g.to(param.device)
    ids, rows = tensors.get("ids"), tensors.get("rows")
    if ids is None or rows is None or set(tensors) != {"ids", "rows"}:
        raise FrameError("tied gradient from the head must hold 'ids' and 'rows'")
    if (
        ids.dtype != torch.int64
        or ids.ndim != 1
        or rows.shape != (ids.numel(), h)
        or rows.dtype != param.dtype
    ):
        raise FrameError(f"tied rows must be int64 ids (n,) and {param.dtype} rows (n, {h})")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != ids.numel()):
        raise FrameError(f"tied row ids must be distinct and in [0, {v})")
    return torch.zeros_like(param).index_copy_(0, ids.to(param.device), rows.to(param.device))


class TiedExchange:
    """One end of the exchange: send our step's mean gradient, receive the partner's (``handle``)."""

    def __init__(
        self,
        ctx: StageContext,
        param: torch.nn.Parameter,
        deadline_s: float,
        refresh_routes: Callable[[], Awaitable[None]],
    ) -> None:
        self.ctx, self.param, self.deadline_s, self.refresh_routes = ctx, param, deadline_s, refresh_routes
        self._recheck = RouteRecheck(refresh_routes)
        self.partner = ctx.n_stages - 1 if ctx.is_head else 0
        # (step, sender) -> a partner's mean gradient, dense; the newest step of each sender
        self.inbox: dict[tuple[int, str], torch.Tensor] = {}
        self.newest: dict[str, int] = {}
        self._arrived = asyncio.Condition()
        self.declined: tuple[int, str] | None = None  # (step, partner) of the last "paired: 0" answer
        self.done_step = -1  # the last step whose exchange has ended: a later offer for it is declined

    # ------------------------------------------------------------ sending side
    def own_mean(self, microbatches: int) -> torch.Tensor:
        """Our mean gradient of the tied tensor, computed as ``mean_and_clip`` will compute it."""
        g = self.param.grad
        if g is None:
            return torch.zeros_like(self.param)
        return g / max(microbatches, 1)

    def _partners(self) -> list[str]:
        return [p for p, r in self.ctx.routes[self.partner].items() if r.ready and r.circuit == "fast"]

    def paired(self, partners: list[str]) -> bool:
        """One head and one tail: steps pair by index, and the exchange is exact."""
        return len(partners) == 1 and not fast_peers_of_stage(self.ctx)

    async def exchange(self, step: int, mean: torch.Tensor, gate: StepGate) -> torch.Tensor | None:
        """Send ``mean`` for ``step`` to the partner stage; the partner's, or None at the deadline.

        ``gate``: our step's; while we wait for the partner it turns new microbatches away, since
        the partner's own step may wait for one of them to drain (upstream drops or retries it).
        """
        try:
            return await self._exchange(step, mean, gate)
        finally:
            self.done_step = max(self.done_step, step)

    async def _exchange(self, step: int, mean: torch.Tensor, gate: StepGate) -> torch.Tensor | None:
        ctx, m = self.ctx, self.ctx.metrics
        peers = self._partners()
        if not peers:  # routes are refreshed each heartbeat: a partner that just came may be missing
            await self.refresh_routes()
            peers = self._partners()
        if not self.paired(peers):  # replicas: no step to pair, see the module docstring
            m.tied_unpaired += 1
            return None
        (partner,) = peers
        if self.declined and self.declined[1] == partner and step - self.declined[0] < REPAIR_EVERY:
            m.tied_unpaired += 1  # it does not pair with us: do not offer again each step
            return None
        payload = await ctx.compute(tied_payload, mean, ctx.is_head)
        frame = Frame(kind="tied", run_id=ctx.run.run_id, step=step, tensors=payload)
        try:
            replies, sent, _ = await rpc.request(
                ctx.p2p, ctx.wire, partner, TIED_HANDLER, frame, self.deadline_s, ctx.run.run_id, stream=True
            )
        except Exception as e:  # unreachable, timed out, or refused (a malformed frame): it lacks ours
            log.info("tied gradient to %s failed: %s", partner[:12], e)
            m.tied_missed += 1
            return None
        m.tied_bytes_sent += sent
        if not replies[-1].meta.get("paired"):
            # its view differs from ours (see the module docstring): waiting would hold our gate for
            # the whole deadline while it never sends (seen: a stalled run). Step at once.
            m.tied_unpaired += 1
            self.declined = (step, partner)
            return None
        self.declined = None
        deadline = time.monotonic() + self.deadline_s
        await gate.set_refusing(True)
        try:
            while (step, partner) not in self.inbox and time.monotonic() < deadline:
                if not self.paired(self._partners()):  # a replica came (heartbeat routes): do not wait
                    m.tied_unpaired += 1
                    return None
                with contextlib.suppress(asyncio.TimeoutError):
                    async with self._arrived:
                        arrived = self._arrived.wait_for(lambda: (step, partner) in self.inbox)
                        await asyncio.wait_for(arrived, 1.0)
        finally:
            await gate.set_refusing(False)
        if (step, partner) not in self.inbox:
            m.tied_missed += 1
            log.warning(
                "no tied gradient from stage %d for step %d within %.0f s; stepping with our own: "
                "the tied copies now differ",
                self.partner,
                step,
                self.deadline_s,
            )
            return None
        grad, self.inbox = self.inbox[(step, partner)], {}  # older ones: steps we gave up on
        m.tied_exchanged += 1
        return grad

    # ------------------------------------------------------------ receiving side
    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ctx = self.ctx
        await serve(
            stream_info,
            reader,
            writer,
            ctx.wire,
            self._take,
            run_id=ctx.run.run_id,
            timeout=ctx.cfg.hop_timeout,
            what="tied gradient",
            strikes=False,
            caps=ctx.wire.caps(TIED_HANDLER, LIMITS),
        )

    async def _partner_peer(self, peer: str) -> int:
        """The sender check: only a peer of the partner stage may send (before its gradient is read)."""
        ctx = self.ctx
        if peer not in ctx.routes[self.partner]:
            await self._recheck()  # throttled: a stranger's stream must not cost a DHT read each
        if peer not in ctx.routes[self.partner]:
            raise NotAllowed(f"{peer[:12]} does not serve stage {self.partner}")
        return MAX_FRAME_BYTES

    async def _take(self, s: Stream) -> None:
        ctx = self.ctx
        peer = s.peer
        data = await s.receive(self._partner_peer, idle=None)
        ctx.metrics.tied_bytes_received += len(data)
        frame = decode_frame(data, run_id=ctx.run.run_id)  # finite floats only
        if frame.kind != "tied":
            raise FrameError("expected a tied gradient")
        partners = self._partners()
        if not (self.paired(partners) and partners == [peer]) or frame.step <= self.done_step:
            # we do not pair with this sender (we see a replica it does not), or we are past that
            # step's exchange: we will not send ours, so it must not wait
            await self._ack(s, frame.step, paired=False)
            return
        if abs(frame.step - ctx.inner_step) > STEP_WINDOW:  # paired, the partner's step is ours
            raise FrameError(
                f"tied gradient of step {frame.step}, {STEP_WINDOW}+ steps from ours ({ctx.inner_step})"
            )
        if frame.step <= self.newest.get(peer, -1):
            raise FrameError(f"tied gradient of step {frame.step} is not newer than the last one")
        grad = await ctx.compute(partner_gradient, frame.tensors, self.param, not ctx.is_head)
        async with self._arrived:
            self.newest[peer] = frame.step
            self.inbox = {k: g for k, g in self.inbox.items() if k[1] != peer}  # the newest only
            self.inbox[(frame.step, peer)] = grad
            self._arrived.notify_all()
        self.declined = None  # it pairs with us again: offer ours at this step
        await self._ack(s, frame.step, paired=True)

    async def _ack(self, s: Stream, step: int, paired: bool) -> None:
        ack = Frame(
            kind="tied", run_id=self.ctx.run.run_id, step=step, meta={"last": 1, "paired": int(paired)}
        )
        await s.send(ack)
