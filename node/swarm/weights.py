"""A stage's weights over the swarm (``vnode.weights``): served by every fast node, pulled by joiners.

A node joining a stage mid-run pulls the most advanced replica's weights once, so it starts from
the swarm's current weights rather than the pretrained ones; anchors pull them every few fast
steps; ``node export`` pulls an exact fp32 copy with a sha256 digest (``weights_digest``).
Weights travel in bf16 (fp32 when export asks), in frames of at most ``MAX_TENSORS`` tensors; a
LoRA run's stages send their adapters only, always in fp32 (``moving_parameters``).

Who may pull, and how often: a pull clones the stage and sends all of it, so strangers must not
be able to keep a node doing it. A *member* (a peer with a stage record of this node's stage: a
joiner's claim, an anchor, a replica) gets one pull at a time, ``MEMBER_LIMITS`` in all. Anyone
else (``node export``, which has no stage record, or a stranger) is a *visitor*: all visitors
together share one key of ``VISITOR_LIMITS``, one pull at a time node-wide and a few a minute,
however many peer ids they mint. Over a bound: ``busy`` before the request is read.

The server gets the stage's shared context (run, stage, transport, compute thread), never the
runtime; a ``StageRuntime`` offers the same attributes, so ``pull_weights(runtime)`` works too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import torch

from node.model.adapters import moving_parameters
from node.net import rpc
from node.net.caps import Limits
from node.net.serve import Stream, serve
from node.swarm.routing import fast_peers_of_stage
from protocol.frames import MAX_TENSORS, Frame, FrameError, decode_frame, encode_frame

log = logging.getLogger("node")

WEIGHTS_HANDLER = "vnode.weights"
REQUEST_BYTES = 4096  # a weights request is a frame without tensors
# a member pulls once on joining, an anchor every few steps; each pull is one whole stage
MEMBER_LIMITS = Limits(per_peer=1, total=4)
# every visitor together: one pull at a time, three in a row, then one per 20 s (an export pulls
# each stage once, from one peer, and tries the next peer if refused)
VISITOR_LIMITS = Limits(per_peer=1, total=1, rate=0.05, burst=3, who="peers without a record of this stage")
VISITORS = "visitors"  # the one key all visitors share


def chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


class WeightServer:
    """Fast side: serve a consistent snapshot of the stage's weights (taken in the compute thread)."""

    def __init__(self, ctx):
        self.rt = ctx
        self.bytes_served = 0

    async def handle(self, stream_info, reader, writer) -> None:
        rt = self.rt
        await serve(
            stream_info,
            reader,
            writer,
            rt.wire,
            self._send_weights,
            run_id=rt.run.run_id,
            timeout=rt.cfg.hop_timeout,
            what="weights request",
            strikes=False,
        )

    async def _send_weights(self, s: Stream) -> None:
        rt = self.rt
        if s.peer in rt.routes[rt.index]:  # any circuit, ready or still pulling
            caps, key = rt.wire.caps(f"{WEIGHTS_HANDLER}/member", MEMBER_LIMITS), s.peer
        else:
            caps, key = rt.wire.caps(f"{WEIGHTS_HANDLER}/visitor", VISITOR_LIMITS), VISITORS
        with caps.hold(key):  # before the request is read
            await self._send_snapshot(s)

    async def _send_snapshot(self, s: Stream) -> None:
        rt = self.rt
        req = decode_frame(await s.receive(REQUEST_BYTES, idle=None), run_id=rt.run.run_id)
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
            await s.send(data)

    def _snapshot(self, dtype: torch.dtype = torch.bfloat16) -> tuple[int, dict[str, torch.Tensor]]:
        """The weights training moved: every weight, or a LoRA run's adapters only. Adapters go in
        fp32 whatever was asked: they are small, and a bf16 copy would put a joiner off its replicas."""
        moving = moving_parameters(self.rt.stage)
        if len(moving) < sum(1 for _ in self.rt.stage.parameters()):
            dtype = torch.float32
        return self.rt.inner_step, {n: p.detach().to(dtype).cpu().clone() for n, p in moving.items()}


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a weight snapshot (sent with its last frame)."""
    h = hashlib.sha256()
    for name, t in sorted(named.items()):
        h.update(f"{name}|{str(t.dtype)}|{list(t.shape)}|".encode())
        raw = t.detach().contiguous().cpu()
        h.update(raw.reshape(-1).view(torch.uint8).numpy().tobytes() if raw.numel() else b"")
    return h.hexdigest()


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
            own = moving_parameters(rt.stage)
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
        for n, p in moving_parameters(stage).items():
            p.copy_(named[n].to(p.dtype))
