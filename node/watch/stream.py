"""``vnode.metrics``: a node's recent counters and loss history, for the dashboard.

Every serving node answers it; the dashboard (``node.watch.collect``) asks every peer it finds
in the stage records. The request and the reply go through the node's ``Wire`` (signed with the
swarm key when the run has one) and the server side is ``node.net.serve``'s, like every handler.

Bounded both ways: a request is a frame without tensors (``REQUEST_BYTES``), a reply at most
``REPLY_BYTES``, with at most ``LOSS_KEPT`` losses, ``EVAL_KEPT`` held-out losses (a tail's, with
their steps: ``node.stage.heldout``), ``LINKS_KEPT`` links and ``PROBE_N`` sampled
weights (``node.watch.probe``). The reply is the
node's ``metrics_dict`` at most ``CACHE_S`` old: a visitor that asks in a loop costs one
snapshot a second, not one per request (the rate limit). The asker checks everything it was
sent (``parse_reply``): a peer that answers garbage raises ``MetricsError`` and is shown as
unreachable, never trusted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from node.net import rpc
from node.net.caps import Limits
from node.net.serve import Stream, serve
from node.net.transport import close_quietly
from node.net.wire import Wire
from node.watch.probe import PROBE_N, Probe
from protocol.frames import Frame, FrameError, decode_frame, encode_frame

METRICS_HANDLER = "vnode.metrics"
# a dashboard polls every 2 s; several may watch one node, none needs more than this
LIMITS = Limits(per_peer=2, total=16, rate=2.0, burst=4)
REQUEST_BYTES = 1024
REPLY_BYTES = 64 * 1024  # 512 losses (2 KiB) + links + ~30 scalars fit many times over
LOSS_KEPT = 512  # the last inner steps' losses sent; the chart needs the trend, not all of it
LINKS_KEPT = 64
EVAL_KEPT = 128  # the last held-out losses a tail scored (one every --eval-every steps)
CACHE_S = 1.0
DIRECTIONS = ("forward", "backward")

# the scalars of metrics_dict that travel, with their types (meta carries str/int/float only)
INTS = (
    "stage",
    "inner_step",
    "trained_tokens",
    "microbatches",
    "dropped_microbatches",
    "rejected_frames",
    "skipped_steps",
    "shed_streams",
    "idle_streams",
    "checkpoints",
    "state_pull_bytes",
    "outer_committed",
    "outer_skipped",
    "outer_bytes",
    "outer_dense_bytes",
    "memory_rss",
    "memory_peak",
    "losses_first",
    "probe_size",
    "relayed_bytes",
    "eval_every",
    "sent_bytes",
)
FLOATS = ("throughput", "compute_s", "time")
STRS = ("peer_id", "role", "circuit", "device", "dp_mode", "connections")


class MetricsError(ValueError):
    """A metrics reply that is not what a node sends: the peer is shown as unreachable."""


def connections_summary(kinds: dict) -> str:
    """{peer: kind} -> "direct 2, punched 1": how a node talks to its neighbours, in one short line."""
    order = ("direct", "reversed", "punched", "relayed")
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in order}
    return ", ".join(f"{k} {n}" for k, n in counts.items() if n)


def flatten(m: dict) -> tuple[dict, list[float], list[list[int]]]:
    """``metrics_dict`` -> (the scalars that travel, the last losses, link rows
    [boundary, direction, bytes, tokens]); the held-out losses travel apart (``eval_rows``)."""
    rounds = m.get("outer_rounds", [])
    memory = m.get("memory") or {}
    losses = list(m.get("step_losses", []))
    kept = losses[-LOSS_KEPT:]
    scalars = {
        **{k: m.get(k, "") for k in ("peer_id", "role", "circuit", "device")},
        "dp_mode": (m.get("dp") or {}).get("mode", ""),
        "connections": connections_summary(m.get("connections") or {}),
        "relayed_bytes": int((m.get("relay") or {}).get("relayed_bytes", 0)),
        # every kind the node counts (node.stage.metrics.sent_bytes): the run's bytes per token
        "sent_bytes": int(sum(((m.get("sent") or {}).get("bytes") or {}).values())),
        **{k: int(m.get(k, 0)) for k in INTS if k in m},
        "outer_committed": sum(1 for r in rounds if not r.get("skipped")),
        "outer_skipped": sum(1 for r in rounds if r.get("skipped")) + int(m.get("outer_alone", 0)),
        "outer_bytes": sum(int(r.get("bytes_sent", 0)) for r in rounds),
        "outer_dense_bytes": sum(int(r.get("dense_bytes", 0)) for r in rounds),
        "memory_rss": int(memory.get("rss", 0)),
        "memory_peak": int(memory.get("device_peak", memory.get("peak_rss", 0))),
        "losses_first": len(losses) - len(kept),  # index of the first kept loss: its inner step
        **{k: float(m.get(k, 0.0)) for k in FLOATS},
    }
    links = [
        [int(lk["boundary"]), DIRECTIONS.index(lk["direction"]), int(lk["bytes"]), int(lk["tokens"])]
        for lk in m.get("links", [])
        if lk.get("direction") in DIRECTIONS
    ][:LINKS_KEPT]
    return scalars, kept, links


def eval_rows(m: dict) -> tuple[list[int], list[float]]:
    """The last ``EVAL_KEPT`` held-out losses of ``m`` ([step, loss] pairs), as (steps, losses)."""
    rows = [(int(s), float(v)) for s, v in m.get("eval_losses", [])[-EVAL_KEPT:] if math.isfinite(v)]
    return [s for s, _ in rows], [v for _, v in rows]


def reply_frame(m: dict, run_id: str, probe: Probe | None = None) -> Frame:
    """The reply: ``m`` (a ``metrics_dict``) flattened, with ``probe``'s sample of the weights."""
    scalars, losses, links = flatten(m)
    eval_steps, eval_losses = eval_rows(m)
    size, sample = probe.sample() if probe is not None else (0, torch.zeros(0))
    return Frame(
        kind="metrics",
        run_id=run_id,
        step=max(int(m.get("inner_step", 0)), 0),
        tensors={
            "losses": torch.tensor(losses, dtype=torch.float32),
            "links": torch.tensor(links, dtype=torch.int64).reshape(-1, 4),
            "probe": sample.to(torch.float32),
            "eval_steps": torch.tensor(eval_steps, dtype=torch.int64),
            "eval_losses": torch.tensor(eval_losses, dtype=torch.float32),
        },
        meta={**scalars, "probe_size": size},
    )


def parse_reply(data: bytes, run_id: str) -> dict:
    """A peer's reply -> the dashboard's view of that node; ``MetricsError`` for anything a node
    would not send (wrong kind, shapes, types, sizes)."""
    if len(data) > REPLY_BYTES:
        raise MetricsError(f"reply of {len(data)} bytes exceeds {REPLY_BYTES}")
    try:
        frame = decode_frame(data, run_id=run_id, max_bytes=REPLY_BYTES)
    except FrameError as e:
        raise MetricsError(str(e)) from None
    if frame.kind == "error":
        raise MetricsError(str(frame.meta.get("message", "error reply")))
    losses, links, probe = (frame.tensors.get(k) for k in ("losses", "links", "probe"))
    if frame.kind != "metrics" or losses is None or links is None or probe is None:
        raise MetricsError(f"not a metrics reply (kind {frame.kind!r})")
    if probe.dtype != torch.float32 or probe.dim() != 1 or probe.numel() > PROBE_N:
        raise MetricsError("probe must be at most PROBE_N float32 values")
    if losses.dtype != torch.float32 or losses.dim() != 1 or losses.numel() > LOSS_KEPT:
        raise MetricsError("losses must be at most LOSS_KEPT float32 values")
    if links.dtype != torch.int64 or links.dim() != 2 or links.shape[1] != 4 or links.shape[0] > LINKS_KEPT:
        raise MetricsError("links must be an int64 table of [boundary, direction, bytes, tokens]")
    # held-out losses: absent from a node that scores none (or predates them)
    eval_steps = frame.tensors.get("eval_steps", torch.zeros(0, dtype=torch.int64))
    eval_losses = frame.tensors.get("eval_losses", torch.zeros(0))
    if (
        eval_steps.dtype != torch.int64
        or eval_losses.dtype != torch.float32
        or eval_steps.dim() != 1
        or eval_steps.shape != eval_losses.shape
        or eval_steps.numel() > EVAL_KEPT
        or bool((eval_steps < 0).any())
    ):
        raise MetricsError("held-out losses must be at most EVAL_KEPT float32 values with int64 steps")
    out: dict = {}
    for keys, kind in ((INTS, int), (FLOATS, float), (STRS, str)):
        for k in keys:
            v = frame.meta.get(k, kind())
            if kind is float and isinstance(v, int):
                v = float(v)
            if type(v) is not kind or (kind is int and v < 0) or (kind is float and not math.isfinite(v)):
                raise MetricsError(f"{k} must be a {'non-negative ' if kind is int else ''}{kind.__name__}")
            out[k] = v
    rows = links.tolist()
    if any(d not in (0, 1) or min(b, n, t) < 0 for b, d, n, t in rows):
        raise MetricsError("link rows out of range")
    out["links"] = [
        {"boundary": b, "direction": DIRECTIONS[d], "bytes": n, "tokens": t} for b, d, n, t in rows
    ]
    out["losses"] = losses.tolist()  # decode_frame already refused non-finite values
    out["probe"] = probe.tolist()
    out["eval_steps"] = eval_steps.tolist()
    out["eval_losses"] = eval_losses.tolist()
    return out


class MetricsServer:
    """Answers ``vnode.metrics`` with ``source()`` (the runtime's ``metrics_dict``), at most
    ``CACHE_S`` old. Anyone who holds the swarm key may ask: a dashboard is a visitor with a
    throwaway identity, not a member our routes know."""

    def __init__(
        self, source: Callable[[], dict], wire: Wire, run_id: str, timeout: float, probe: Probe | None = None
    ) -> None:
        self.source, self.wire, self.run_id, self.timeout = source, wire, run_id, timeout
        self.probe = probe
        self._cached: tuple[float, bytes] | None = None
        self.served = 0

    def reply(self) -> bytes:
        """The encoded reply, at most ``CACHE_S`` old (the node's own dashboard reads it too)."""
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > CACHE_S:
            self._cached = (
                now,
                encode_frame(reply_frame(self.source(), self.run_id, self.probe), REPLY_BYTES),
            )
        return self._cached[1]

    async def handle(self, stream_info, reader, writer) -> None:
        await serve(
            stream_info,
            reader,
            writer,
            self.wire,
            self._answer,
            run_id=self.run_id,
            timeout=self.timeout,
            what="metrics request",
            caps=self.wire.caps(METRICS_HANDLER, LIMITS),
        )

    async def _answer(self, s: Stream) -> None:
        req = decode_frame(
            await s.receive(REQUEST_BYTES, idle=None), run_id=self.run_id, max_bytes=REQUEST_BYTES
        )
        if req.kind != "metrics" or req.tensors:
            raise FrameError("expected a metrics request")
        await s.send(self.reply())
        self.served += 1


async def fetch(p2p, wire: Wire, peer: str, run_id: str, timeout: float) -> dict:
    """One peer's metrics; ``MetricsError`` (garbage, oversized, an error reply) or
    ``ConnectionError`` / ``asyncio.TimeoutError`` (no answer) when it cannot be shown."""
    reader, writer = await rpc.open_stream(p2p, peer, METRICS_HANDLER, timeout)
    try:
        await wire.send(writer, _request(run_id), timeout)
        try:
            data = await wire.recv(reader, REPLY_BYTES, timeout)
        except FrameError as e:  # declared too large, or cut mid-message: refused before it is read
            raise MetricsError(str(e)) from None
        return parse_reply(data, run_id)
    finally:
        close_quietly(writer)


def _request(run_id: str) -> bytes:
    return encode_frame(Frame(kind="metrics", run_id=run_id))


__all__ = [
    "METRICS_HANDLER",
    "MetricsError",
    "MetricsServer",
    "fetch",
    "flatten",
    "parse_reply",
    "reply_frame",
]
