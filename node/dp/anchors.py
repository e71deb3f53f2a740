"""The anchor circuit (DESIGN.md 4.2): dense replicas a few steps behind feed the fast ones' filter.

* Fast nodes serve their stage's weights (``vnode.weights``) and accept gradient packets
  (``vnode.anchor``), which go into their SpectralFilter, tagged with the source step.
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
import hashlib
import logging

import torch

from compression.spectral import is_target_matrix
from node.net import rpc
from node.net.transport import close_quietly
from node.net.wire import IDLE_S
from protocol.frames import (
    MAX_FRAME_BYTES,
    MAX_TENSORS,
    Frame,
    FrameError,
    OutOfRange,
    decode_frame,
    encode_frame,
    error_frame,
)

log = logging.getLogger("node")

WEIGHTS_HANDLER = "vnode.weights"
ANCHOR_HANDLER = "vnode.anchor"
FACTORS_PER_FRAME = MAX_TENSORS // 2
# |entry| of a factor (U·diag(s) or V): an honest one is bounded by the gradient's spectral norm,
# far below this; the filter only uses the leading subspace, so only a hostile packet gets near it
MAX_FACTOR = 1e6


class NotAnAnchor(FrameError):
    """An anchor packet stream from a peer this stage's records do not announce as an anchor."""

    code = "unauthorized"


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


def chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


class WeightServer:
    """Fast side: serve a consistent snapshot of the stage's weights (taken in the compute thread)."""

    def __init__(self, ctx):
        self.rt = ctx
        self.bytes_served = 0

    async def handle(self, stream_info, reader, writer) -> None:
        rt = self.rt
        try:
            req = decode_frame(await rt.wire.recv(reader, 4096, rt.cfg.hop_timeout), run_id=rt.run.run_id)
            if req.kind != "weights":
                raise FrameError("expected a weights request")
            # export asks for the exact fp32 weights and a digest; joiners and anchors get bf16
            exact = req.meta.get("dtype") == "float32"
            step, named = await rt.compute(self._snapshot, torch.float32 if exact else torch.bfloat16)
            digest = await asyncio.to_thread(weights_digest, named) if exact else ""  # off the event loop
            groups = chunks(sorted(named.items()), MAX_TENSORS)
            for i, group in enumerate(groups):
                last = i == len(groups) - 1
                data = encode_frame(
                    Frame(
                        kind="weights",
                        run_id=rt.run.run_id,
                        step=step,
                        tensors=dict(group),
                        meta={"last": 1, "digest": digest} if last else {"last": 0},
                    )
                )
                self.bytes_served += len(data)
                await rt.wire.send(writer, data, rt.cfg.hop_timeout)
        except Exception as e:
            log.debug("weights stream ended: %s", e)
        finally:
            close_quietly(writer)

    def _snapshot(self, dtype: torch.dtype = torch.bfloat16) -> tuple[int, dict[str, torch.Tensor]]:
        return self.rt.inner_step, {
            n: p.detach().to(dtype).cpu().clone() for n, p in self.rt.stage.named_parameters()
        }


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a weight snapshot (sent with its last frame)."""
    h = hashlib.sha256()
    for name, t in sorted(named.items()):
        h.update(f"{name}|{str(t.dtype)}|{list(t.shape)}|".encode())
        raw = t.detach().contiguous().cpu()
        h.update(raw.reshape(-1).view(torch.uint8).numpy().tobytes() if raw.numel() else b"")
    return h.hexdigest()


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
        sender = str(stream_info.peer_id)
        try:
            if rt.wire.bans.is_banned(sender):
                return
            # before a byte is read: only the anchors this stage's records announce feed the filter
            if sender not in anchor_peers_of_stage(rt):  # refused unread: no strike
                raise NotAnAnchor("the sender is not an announced anchor of this stage")
            frame = decode_frame(
                await rt.wire.recv(reader, MAX_FRAME_BYTES, rt.cfg.hop_timeout, idle=IDLE_S),
                run_id=rt.run.run_id,
            )
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
            rt.wire.bans.record_good(sender)
            ack = Frame(kind="anchor", run_id=rt.run.run_id, meta={"last": 1, "accepted": accepted})
            await rt.wire.send(writer, encode_frame(ack), rt.cfg.hop_timeout)
        except FrameError as e:
            self.refused += 1
            rt.metrics.refused_messages += 1
            if not isinstance(e, NotAnAnchor) and rt.wire.bans.record_bad(sender):
                log.warning("banning %s for repeated refused anchor packets (last: %s)", sender[:12], e)
            log.info("anchor packet from %s refused: %s", sender[:12], e)
            try:  # the anchor logs why (node.net.rpc.request raises the message)
                await rt.wire.send(writer, encode_frame(error_frame(rt.run.run_id, e)), rt.cfg.hop_timeout)
            except Exception as e2:  # the sender went away
                log.debug("anchor refusal not delivered: %s", e2)
        except Exception as e:
            log.info("anchor packet from %s refused: %s: %s", sender[:12], type(e).__name__, e)
        finally:
            close_quietly(writer)

    def _observe(self, pairs, source_step: int) -> int:
        n = 0
        for name, a, b in pairs:
            grad = a.float() @ b.float().T
            n += bool(self.spectral.observe(name, grad, source_step, self.rt.inner_step))
        return n


def fast_peers_of_stage(rt) -> dict:
    """Ready fast peers of this node's stage, other than itself."""
    return {
        p: r for p, r in rt.routes[rt.index].items() if r.ready and r.circuit == "fast" and p != rt.peer_id
    }


def anchor_peers_of_stage(rt) -> dict:
    """Anchor peers this node's stage records announce (ready or still pulling), other than itself."""
    return {p: r for p, r in rt.routes[rt.index].items() if r.circuit == "anchor" and p != rt.peer_id}


def _bad_factors(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> str | None:
    """The first entry whose factors are non-finite or beyond ``MAX_FACTOR``; None if all are sane."""
    for name, a, b in pairs:
        for t in (a, b):
            if t.numel() and not bool(t.float().abs().max() <= MAX_FACTOR):  # NaN fails the comparison
                return name
    return None


async def pull_weights(rt) -> tuple[int, int] | None:
    """Load the weights of the most advanced fast peer of our stage; (its step, bytes) or None.

    Anchors use it to stay a few steps behind; a node joining a stage mid-run uses it once,
    so it starts from the swarm's current weights rather than the pretrained ones.
    """
    peers = sorted(fast_peers_of_stage(rt).items(), key=lambda kv: -kv[1].inner_step)
    for peer, _ in peers:
        try:
            request = Frame(kind="weights", run_id=rt.run.run_id)
            frames, _, _ = await rpc.request(
                rt.p2p,
                rt.wire,
                peer,
                WEIGHTS_HANDLER,
                request,
                rt.cfg.hop_timeout * 4,
                rt.run.run_id,
                stream=True,
            )
            named = {k: v for f in frames for k, v in f.tensors.items()}
            own = dict(rt.stage.named_parameters())
            if set(named) != set(own) or any(named[k].shape != own[k].shape for k in own):
                raise FrameError("weights do not match this stage's parameters")
            await rt.compute(_load_weights, rt.stage, named)
            nbytes = sum(t.numel() * t.element_size() for f in frames for t in f.tensors.values())
            log.info("pulled the weights of step %d from %s (%d bytes)", frames[0].step, peer[:12], nbytes)
            return frames[0].step, nbytes
        except (FrameError, asyncio.TimeoutError, OSError, ConnectionError) as e:
            log.info("weight pull from %s failed: %s", peer[:12], e)
    return None


def _load_weights(stage, named: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in stage.named_parameters():
            p.copy_(named[n].to(p.dtype))


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
