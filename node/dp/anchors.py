"""The anchor circuit (DESIGN.md 4.2): dense replicas a few steps behind feed the fast ones' filter.

* Fast nodes serve their stage's weights (``vnode.weights``, node/swarm/weights.py) and accept
  gradient packets (``vnode.anchor``), which go into their SpectralFilter, tagged with the source step.
* Anchor nodes pull weights from a fast peer of their stage whenever those are more than
  ``pull_every`` fast steps old, train unmasked on their own dense pipeline without an
  optimizer step, and after each local batch send the gradients of the targeted matrices
  (2-D decoder projections) to every fast peer of their stage.

Transport: each matrix gradient travels as rank-r factors (U·diag(s), V) in bf16, from a
randomized SVD: the filter only uses the leading subspace, so r(m+n) numbers stand in for
mn. Weights travel in bf16 (fp32 with a sha256 digest when ``node export`` asks), in frames of
at most ``MAX_TENSORS`` tensors.

The parts here get the stage's shared context (``node.stage.context.StageContext``: run, stage,
routes, transport, compute thread), never the runtime; a ``StageRuntime`` offers the same
attributes, so ``pull_weights(runtime)`` works too.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from compression.spectral import is_target_matrix
from node.net import rpc
from node.net.caps import Limits
from node.net.serve import NotAllowed, serve
from node.net.wire import IDLE_S
from node.swarm.routing import anchor_peers_of_stage, fast_peers_of_stage
from node.swarm.weights import chunks, pull_weights
from protocol.frames import (
    MAX_FRAME_BYTES,
    MAX_TENSORS,
    Frame,
    FrameError,
    OutOfRange,
    decode_frame,
)

log = logging.getLogger("node")

ANCHOR_HANDLER = "vnode.anchor"
# an anchor sends its packet every few steps, a frame per group of factors, one after another
LIMITS = Limits(per_peer=2, total=16)
FACTORS_PER_FRAME = MAX_TENSORS // 2
# |entry| of a factor (U·diag(s) or V): an honest one is bounded by the gradient's spectral norm,
# far below this; the filter only uses the leading subspace, so only a hostile packet gets near it
MAX_FACTOR = 1e6


class NotAnAnchor(NotAllowed):
    """An anchor packet stream from a peer this stage's records do not announce as an anchor."""


def factorize(grad: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r factors (A = U·diag(s), B = V) with A Bᵀ ≈ grad; exact when rank >= min(m, n)."""
    g = grad.detach().float()
    r = min(rank, *g.shape)
    if r == min(g.shape):
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
    else:
        gen_state = torch.random.get_rng_state()
        u, s, v = torch.svd_lowrank(g, q=r, niter=2)
        torch.random.set_rng_state(gen_state)  # svd_lowrank draws from the global RNG
        vh = v.T
    return (u[:, :r] * s[:r]).contiguous(), vh[:r].T.contiguous()


class PacketSink:
    """Fast side: accept anchor gradient packets into the spectral filter (in the compute thread)."""

    def __init__(self, ctx, spectral):
        self.rt = ctx
        self.spectral = spectral  # compression.spectral.SpectralFilter the packets feed
        self.received = 0
        self.dropped_stale = 0
        self.refused = 0

    async def handle(self, stream_info, reader, writer) -> None:
        rt = self.rt
        await serve(
            stream_info,
            reader,
            writer,
            rt.wire,
            self._take,
            run_id=rt.run.run_id,
            timeout=rt.cfg.hop_timeout,
            what="anchor packet",
            on_error=self._refused,
            caps=rt.wire.caps(ANCHOR_HANDLER, LIMITS),
        )

    def _anchor(self, peer: str) -> int:
        """The sender check: only the anchors this stage's records announce feed the filter."""
        if peer not in anchor_peers_of_stage(self.rt):
            raise NotAnAnchor("the sender is not an announced anchor of this stage")
        return MAX_FRAME_BYTES

    def _refused(self, _s, e: Exception) -> None:
        if isinstance(e, FrameError):  # the anchor logs why (node.net.rpc.request raises the message)
            self.refused += 1
            self.rt.metrics.refused_messages += 1

    async def _take(self, s) -> None:
        rt = self.rt
        frame = decode_frame(await s.receive(self._anchor, idle=IDLE_S), run_id=rt.run.run_id)
        if frame.kind != "anchor":
            raise FrameError("expected an anchor packet")
        window = self.spectral.max_staleness
        if not rt.inner_step - window <= frame.step <= rt.inner_step + window:
            raise OutOfRange(
                f"source step {frame.step} outside the staleness window {rt.inner_step} +- {window}"
            )
        names = str(frame.meta.get("names", "")).split(",")
        params = dict(rt.stage.named_parameters())
        pairs = []
        for i, name in enumerate(names):
            a, b = frame.tensors.get(f"{i}.a"), frame.tensors.get(f"{i}.b")
            p = params.get(name)
            if (
                a is None
                or b is None
                or p is None
                or not is_target_matrix(name, p)
                or a.dim() != 2
                or b.dim() != 2
                or a.shape[0] != p.shape[0]
                or b.shape[0] != p.shape[1]
                or a.shape[1] != b.shape[1]
            ):
                raise FrameError(f"anchor packet entry {name!r} does not fit this stage")
            pairs.append((name, a, b))
        bad = await rt.compute(_bad_factors, pairs)
        if bad:
            raise OutOfRange(f"anchor factors of {bad!r} not finite or above {MAX_FACTOR:g} in magnitude")
        accepted = await rt.compute(self._observe, pairs, frame.step)
        self.received += accepted
        self.dropped_stale += len(pairs) - accepted
        await s.send(Frame(kind="anchor", run_id=rt.run.run_id, meta={"last": 1, "accepted": accepted}))

    def _observe(self, pairs, source_step: int) -> int:
        n = 0
        for name, a, b in pairs:
            grad = a.float() @ b.float().T
            n += bool(self.spectral.observe(name, grad, source_step, self.rt.inner_step))
        return n


def _bad_factors(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> str | None:
    """The first entry whose factors are non-finite or beyond ``MAX_FACTOR``; None if all are sane."""
    for name, a, b in pairs:
        for t in (a, b):
            if t.numel() and not bool(t.float().abs().max() <= MAX_FACTOR):  # NaN fails the comparison
                return name
    return None


class AnchorClient:
    """Anchor side: pull weights from fast peers, send gradient packets to them."""

    def __init__(self, ctx, pull_every: int, rank: int):
        self.rt = ctx
        self.pull_every = pull_every
        self.rank = rank
        self.source_step = -1  # the fast step the current weights come from
        self.packet_bytes = 0
        self.pull_bytes = 0
        self.pulls = 0

    def fast_peers(self) -> dict:
        return fast_peers_of_stage(self.rt)

    def needs_pull(self) -> bool:
        newest = max((r.inner_step for r in self.fast_peers().values()), default=None)
        return newest is not None and (self.source_step < 0 or newest - self.source_step >= self.pull_every)

    async def pull(self) -> bool:
        """Copy the weights of the most advanced fast peer of this stage into our stage."""
        pulled = await pull_weights(self.rt)
        if pulled is None:
            return False
        self.source_step, nbytes = pulled
        self.pull_bytes += nbytes
        self.pulls += 1
        return True

    def _packets(self) -> list[dict[str, torch.Tensor]]:
        """Factors of the step's mean gradients of the target matrices, grouped per frame."""
        rt = self.rt
        entries = [
            (name, *factorize(p.grad, self.rank))
            for name, p in rt.stage.named_parameters()
            if p.grad is not None and is_target_matrix(name, p)
        ]
        for p in rt.params:
            p.grad = None
        return [
            {
                "names": ",".join(e[0] for e in group),
                "tensors": {
                    k: v
                    for i, (_, a, b) in enumerate(group)
                    for k, v in ((f"{i}.a", a.to(torch.bfloat16)), (f"{i}.b", b.to(torch.bfloat16)))
                },
            }
            for group in chunks(entries, FACTORS_PER_FRAME)
        ]

    async def send_packets(self) -> None:
        rt = self.rt
        packets = await rt.compute(self._packets)
        for peer in self.fast_peers():
            for pk in packets:
                frame = Frame(
                    kind="anchor",
                    run_id=rt.run.run_id,
                    step=max(self.source_step, 0),
                    tensors=pk["tensors"],
                    meta={"names": pk["names"]},
                )
                try:
                    _, sent, _ = await rpc.request(
                        rt.p2p,
                        rt.wire,
                        peer,
                        ANCHOR_HANDLER,
                        frame,
                        rt.cfg.hop_timeout,
                        rt.run.run_id,
                        stream=True,
                    )
                    self.packet_bytes += sent
                except (FrameError, asyncio.TimeoutError, OSError, ConnectionError) as e:
                    log.info("anchor packet to %s failed: %s", peer[:12], e)
                    break
