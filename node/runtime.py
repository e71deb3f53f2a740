"""The stage runtime: serve one pipeline stage, and on the head drive microbatches.

One forward request is one libp2p stream: the sender writes a FORWARD frame and the
receiver answers with the BACKWARD frame for the same microbatch once everything
downstream of it has finished (or an ERROR frame). The backward therefore travels the
recorded path for free, every hop has a deadline, and a failed hop is retried once
through another peer of the same stage. Compute runs in one worker thread, off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import time
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from compression.codec import LinkContext
from compression.prf import mask_seed
from compression.spectral import SpectralFilter, filter_gradients
from node.anchors import (
    ANCHOR_HANDLER,
    WEIGHTS_HANDLER,
    AnchorClient,
    PacketSink,
    WeightServer,
    fast_peers_of_stage,
    pull_weights,
)
from node.bans import BanList
from node.basis import BasisUnavailable
from node.checkpoint import CheckpointError, checkpoint_dir, clone_state, save_checkpoint
from node.config import NodeConfig
from node.health import write_health
from node.links import Link
from node.membership import EmptyStageBackoff, read_stage_records, store_stage_record
from node.routing import choose_peer
from node.stages import IGNORE_INDEX, Stage
from node.transport import close_quietly
from node.wire import Unauthorized, Wire
from protocol.frames import (
    MAX_FRAME_BYTES,
    BadDtype,
    Frame,
    FrameError,
    MalformedFrame,
    OutOfRange,
    ShapeMismatch,
    check_payload_magnitude,
    decode_frame,
    encode_frame,
    error_frame,
    pack_labels,
    unpack_labels,
)
from protocol.records import RunRecord, StageRecord

log = logging.getLogger("node")

HANDLER = "vnode.forward"
STEP_DRAIN_TIMEOUT_S = 120.0


def gone_peers(watched: dict[str, int], routes: list[dict[str, StageRecord]]) -> list[str]:
    """Watched peers (peer -> its stage) whose stage, freshly read, lists others but not them.

    A stage read that came back empty proves nothing (a DHT lookup can miss under churn), and
    abandoning hops on it would drop healthy work; a record that is merely not ready (a node
    draining before it leaves) still counts as present.
    """
    return [p for p, st in watched.items() if 0 <= st < len(routes) and routes[st] and p not in routes[st]]


DROP_BACKOFF_S = 1.0  # head: pause after a dropped microbatch (a stage with no live peer fails them all)


class HopFailed(RuntimeError):
    """The next stage could not be reached or did not answer; ``retry`` if another peer may help."""

    def __init__(self, msg: str, retry: bool = True):
        super().__init__(msg)
        self.retry = retry


class Busy(RuntimeError):
    """This node cannot take work now; the sender should try another replica."""


class StepGate:
    """Bounds in-flight microbatches and lets the optimizer step only when none is in flight.

    A microbatch's backward must run through the same weights its forward used, so the
    inner step waits for in-flight work to drain and holds new work back while it runs.
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.inflight = 0
        self.stepping = False
        self.refusing = False  # during a long exclusive phase (an outer round): turn work away at once
        self._cond = asyncio.Condition()

    async def enter(self, timeout: float) -> None:
        async with self._cond:
            await asyncio.wait_for(
                self._cond.wait_for(
                    lambda: self.refusing or (not self.stepping and self.inflight < self.cap)
                ),
                timeout,
            )
            if self.refusing:
                raise Busy("in an outer round; try another replica")
            self.inflight += 1

    async def set_refusing(self, refusing: bool) -> None:
        async with self._cond:
            self.refusing = refusing
            self._cond.notify_all()  # waiters re-check and leave at once

    async def exit(self) -> None:
        async with self._cond:
            self.inflight -= 1
            self._cond.notify_all()

    async def run_exclusive(self, fn, timeout: float) -> bool:
        """Wait for in-flight work to drain, then run ``fn``; False if a step is already pending."""
        async with self._cond:
            if self.stepping:
                return False
            self.stepping = True
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.inflight == 0), timeout)
            except asyncio.TimeoutError:
                self.stepping = False
                self._cond.notify_all()
                return False
        try:
            await fn()
        finally:
            async with self._cond:
                self.stepping = False
                self._cond.notify_all()
        return True


@dataclass
class LinkCount:
    bytes: int = 0
    tokens: int = 0
    frames: int = 0


class Metrics:
    def __init__(self):
        self.links: dict[tuple[int, str], LinkCount] = defaultdict(LinkCount)
        self.step_losses: list[float] = []  # tail: mean loss of each inner step
        self._pending_losses: list[tuple[float, int]] = []
        self.trained_tokens = 0
        self.microbatches = 0
        self.dropped = 0
        self.rejected_frames = 0
        self.skipped_steps = 0
        self.compute_s = 0.0
        self.filter_s = 0.0
        self.state_pull_bytes = 0
        self.outer_rounds: list[dict] = []
        self.outer_alone = 0
        self.checkpoints = 0

    def count_frame(self, boundary: int, direction: str, nbytes: int, tokens: int) -> None:
        c = self.links[(boundary, direction)]
        c.bytes += nbytes
        c.tokens += tokens
        c.frames += 1

    def add_loss(self, loss: float, n: int) -> None:
        self._pending_losses.append((loss, n))

    def close_step(self) -> None:
        if self._pending_losses:
            total = sum(n for _, n in self._pending_losses)
            self.step_losses.append(sum(loss * n for loss, n in self._pending_losses) / max(total, 1))
        self._pending_losses = []


class StageRuntime:
    def __init__(
        self,
        cfg: NodeConfig,
        run: RunRecord,
        stage_index: int,
        stage: Stage,
        dht,
        peer_id: str,
        data_stream=None,
        device: torch.device | None = None,
        outer=None,
    ):
        self.cfg, self.run, self.index, self.stage = cfg, run, stage_index, stage
        self.n_stages = len(run.stages)
        self.is_head, self.is_tail = stage_index == 0, stage_index == self.n_stages - 1
        dense_only = cfg.circuit == "anchor"
        self.link_in = None if self.is_head else Link(run, stage_index - 1, dense_only)
        self.link_out = None if self.is_tail else Link(run, stage_index, dense_only)
        a = run.anchor
        self.filter = None
        self.anchor = None
        if cfg.circuit == "anchor":
            self.anchor = AnchorClient(self, pull_every=int(a["pull_every"]), rank=int(a["rank"]))
        else:
            self.filter = SpectralFilter(
                alpha=a["alpha"],
                tau=a["tau"],
                beta=a["beta"],
                max_staleness=int(a["max_staleness"]),
                tau_relative=bool(a["tau_relative"]),
            )
            self.weight_server = WeightServer(self)
            self.packet_sink = PacketSink(self)
        self.dht, self.peer_id = dht, peer_id
        self.data = data_stream
        self.device = device or torch.device("cpu")
        self.metrics = Metrics()
        self.gate = StepGate(cfg.max_inflight)
        self.empty_downstream = EmptyStageBackoff()  # head: a next stage with no live peer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.rng = random.Random(zlib.crc32(peer_id.encode()) ^ cfg.seed)
        self.routes: list[dict[str, StageRecord]] = [{} for _ in range(self.n_stages)]
        # peers we have hops in flight to -> (their stage, an event set when their record leaves
        # the DHT; see _call_peer)
        self._gone: dict[str, tuple[int, asyncio.Event]] = {}
        self.inner_step = 0
        self._acc_tokens = 0
        self._acc_micro = 0
        self._throughput = 0.0
        self._mb_counter = 0
        self._mb_prefix = (zlib.crc32(peer_id.encode()) & 0xFFFFFF) << 32
        self.stop = asyncio.Event()
        self.p2p = None
        self.maddrs: list[str] = []
        self.wire = Wire()  # signs and verifies with the swarm key, when the run has one
        self.resumed_from: int | None = None
        self.bans = BanList()
        self.bases = None  # node.basis.BasisStore when the run's codec needs a basis
        self.ckpt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._ckpt_pending = None
        self.outer = outer  # node.diloco.OuterSync when the run averages replicas
        params = [p for p in stage.parameters() if p.requires_grad]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=run.weight_decay)
        self.scape = None  # node.scape.ScapeSync: AdamS + a sparse sync with the stage's replicas every step
        if run.dp.get("mode") == "scape" and cfg.circuit == "fast":
            from node.scape import ScapeSync

            self.scape = ScapeSync(self, float(run.dp["density"]), float(run.dp.get("timeout", 10.0)))

    # ---------------------------------------------------------------- compute (worker thread)
    async def compute(self, fn, *args):
        t0 = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        self.metrics.compute_s += time.perf_counter() - t0
        return out

    def _amp(self):
        """bf16 autocast on CUDA (weights and optimizer stay fp32); plain fp32 on CPU."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap compute
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.enable_grad(), self._amp():
            if self.is_head:
                return self.stage(self._to_device(x)), None
            leaf = self._to_device(x).requires_grad_(True)
            return self.stage(leaf), leaf

    def _tail(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[float, int, torch.Tensor | None]:
        with torch.enable_grad():
            leaf = self._to_device(x).requires_grad_(not self.is_head)
            with self._amp():
                loss, n = self.stage.loss(leaf, self._to_device(labels).long())
            if not bool(torch.isfinite(loss)):  # never let one microbatch poison the step's gradients
                raise OutOfRange("the loss of this microbatch is not finite")
            loss.backward()
        return float(loss.detach()), n, (leaf.grad if not self.is_head else None)

    @staticmethod
    def _backward(y: torch.Tensor, grad_y: torch.Tensor, leaf: torch.Tensor | None) -> torch.Tensor | None:
        y.backward(grad_y.to(y.device, y.dtype))
        return leaf.grad if leaf is not None else None

    def _optimizer_step(self) -> bool:
        n = max(self._acc_micro, 1)
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(n)  # mean over this node's microbatches
        if self.filter is not None:  # anchor priors: filter, then clip, then AdamW (DESIGN 4.2)
            t0 = time.perf_counter()
            filter_gradients(self.filter, self.stage.named_parameters())
            self.metrics.filter_s += time.perf_counter() - t0
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.run.clip)
        ok = bool(torch.isfinite(norm))
        if ok:  # a non-finite gradient never reaches the weights
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return ok

    # ---------------------------------------------------------------- bookkeeping
    def _link_ctx(self, frame: Frame) -> LinkContext:
        return LinkContext(seed=frame.seed, basis_version=frame.basis_version)

    async def _account(self, tokens: int, loss: float | None, n_loss: int) -> None:
        self._acc_tokens += tokens
        self._acc_micro += 1
        self.metrics.microbatches += 1
        if loss is not None:
            self.metrics.add_loss(loss, n_loss)
        if self._acc_tokens >= self.run.batch_tokens:
            await self.gate.run_exclusive(self._step, STEP_DRAIN_TIMEOUT_S)

    async def _step(self) -> None:
        if self._acc_micro == 0:
            return
        if self.anchor is not None:  # anchors take no optimizer step: their gradients go to the fast peers
            await self.anchor.send_packets()
            if self.anchor.needs_pull():
                await self.anchor.pull()
            ok = True
        elif self.scape is not None:
            ok = await self.scape.step(self.inner_step)
        else:
            ok = await self.compute(self._optimizer_step)
            await self._maybe_outer_round(self.inner_step + 1)
        self.metrics.trained_tokens += self._acc_tokens
        if not ok:
            self.metrics.skipped_steps += 1
        self._acc_tokens = self._acc_micro = 0
        self.inner_step += 1
        self.metrics.close_step()
        every = self.cfg.checkpoint_every
        if every and self.inner_step % every == 0 and self.anchor is None:
            await self.checkpoint(wait=False)
        if self.cfg.max_steps and self.inner_step >= self.cfg.max_steps:
            self.stop.set()

    def _save_theta(self) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in self.outer.theta_global().items()},
            os.path.join(self.cfg.state_dir, "outer_theta.safetensors"),
        )

    async def _maybe_outer_round(self, step: int) -> None:
        """Every H inner steps, average pseudo-gradients with the stage's live replicas (DESIGN 4.3)."""
        every = int(self.run.outer["every"])
        if self.outer is None or step % every:
            return
        if not fast_peers_of_stage(self):  # alone on the stage: nobody to average with
            self.metrics.outer_alone += 1
            return
        # Replicas meet only if the others can reach their round while we wait in ours: turn
        # microbatches away (upstream retries them on another replica) instead of holding them.
        await self.gate.set_refusing(True)
        try:
            stats = await self.compute(self.outer.round, step // every)
        finally:
            await self.gate.set_refusing(False)
        self.metrics.outer_rounds.append(stats.as_dict())
        if stats.skipped:
            log.info("outer round %d skipped: %s", stats.round, stats.reason)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_dir(self) -> str:
        return checkpoint_dir(self.cfg.state_dir, self.run.run_id, self.index)

    def _snapshot(self) -> dict:
        """A consistent copy of everything a resume needs (runs in the compute thread, between steps)."""
        extra = {}
        if self.filter is not None:
            extra["filter"] = self.filter.state_dict()
        if self.outer is not None:
            extra["outer"] = self.outer.state_dict()
        if self.scape is not None:
            extra["scape"] = self.scape.state_dict()
        return clone_state(
            {
                "stage_state": self.stage.state_dict(),
                "optimizer_state": self.opt.state_dict(),
                "extra_states": extra,
                "counters": {
                    "inner_step": self.inner_step,
                    "trained_tokens": self.metrics.trained_tokens,
                    "run_id": self.run.run_id,
                    "stage": self.index,
                    "model_hash": self.run.model_hash,
                },
            }
        )

    async def checkpoint(self, wait: bool) -> None:
        """Snapshot now, write in the background (or wait for it); skip if the last write still runs."""
        if self._ckpt_pending is not None and not self._ckpt_pending.done():
            if not wait:
                return
            await asyncio.wrap_future(self._ckpt_pending)
        snap = await self.compute(self._snapshot)
        self._ckpt_pending = self.ckpt_pool.submit(self._write_checkpoint, snap)
        if wait:
            await asyncio.wrap_future(self._ckpt_pending)

    def _write_checkpoint(self, snap: dict) -> None:
        try:
            path = save_checkpoint(self.checkpoint_dir(), **snap)
            self.metrics.checkpoints += 1
            log.info("checkpoint %s", path)
        except Exception as e:  # a full disk must not stop training; the previous checkpoint stays
            log.warning("checkpoint failed: %s: %s", type(e).__name__, e)

    def restore(self, ck) -> None:
        """Load a checkpoint of this run and stage (before serving)."""
        c = ck.counters
        if (
            c.get("run_id") != self.run.run_id
            or c.get("stage") != self.index
            or c.get("model_hash") != self.run.model_hash
        ):
            raise CheckpointError(f"checkpoint {ck.path} is of another run, stage or model")
        self.stage.load_state_dict(ck.stage_state)
        self.opt.load_state_dict(ck.optimizer_state)
        if self.filter is not None and "filter" in ck.extra_states:
            self.filter.load_state_dict(ck.extra_states["filter"])
        if self.outer is not None and "outer" in ck.extra_states:
            self.outer.load_state_dict(ck.extra_states["outer"])
        if self.scape is not None and "scape" in ck.extra_states:
            self.scape.load_state_dict(ck.extra_states["scape"])
        self.inner_step = int(c["inner_step"])
        self.metrics.trained_tokens = int(c.get("trained_tokens", 0))
        self.resumed_from = int(c["inner_step"])

    def _record_throughput(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            rate = tokens / seconds
            self._throughput = rate if self._throughput == 0 else 0.8 * self._throughput + 0.2 * rate

    def stage_record(self, ready: bool = True) -> StageRecord:
        return StageRecord(
            circuit=self.cfg.circuit,
            throughput=round(self._throughput, 3),
            queue=self.gate.inflight,
            inner_step=self.inner_step,
            ready=ready,
            maddrs=self.maddrs,
        )

    # ---------------------------------------------------------------- network: sending
    def _hop_deadline(self, boundary: int) -> float:
        # the reply needs every remaining stage's compute, so the deadline grows with the hops ahead
        return self.cfg.hop_timeout * (self.n_stages - 1 - boundary)

    async def _call_peer(self, peer: str, data: bytes, boundary: int) -> Frame:
        timeout = self._hop_deadline(boundary)
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), HANDLER), self.cfg.hop_timeout
            )
        except Exception as e:
            raise HopFailed(f"cannot open a stream to {peer[:12]}: {type(e).__name__}") from None

        async def exchange() -> bytes:
            await self.wire.send(writer, data, timeout)
            return await self.wire.recv(reader, MAX_FRAME_BYTES, timeout)

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
            close_quietly(writer)
        try:
            frame = decode_frame(reply, run_id=self.run.run_id)
        except FrameError as e:
            raise HopFailed(f"{peer[:12]} sent an invalid reply: {e}") from None
        if frame.kind == "error":
            # a peer whose own downstream failed already retried; do not multiply retries upstream
            raise HopFailed(
                f"{peer[:12]}: {frame.meta.get('message', '?')}", retry=frame.meta.get("code") != "downstream"
            )
        if frame.kind != "backward":
            raise HopFailed(f"{peer[:12]} answered with a {frame.kind} frame")
        return frame

    async def send_downstream(self, frame: Frame, tokens: int) -> Frame:
        """Send a FORWARD frame to a peer of the next stage; retry once through another peer."""
        data = encode_frame(frame)
        nxt = self.index + 1
        tried: set[str] = set()
        last: HopFailed | None = None
        for _attempt in range(2):
            peer = choose_peer(self.routes[nxt], self.cfg.circuit, tried, self.rng)
            if peer is None:
                await self.refresh_routes()
                peer = choose_peer(self.routes[nxt], self.cfg.circuit, tried, self.rng)
            if peer is None:
                raise HopFailed(f"no live peer serves stage {nxt}", retry=False)
            tried.add(peer)
            self.metrics.count_frame(self.index, "forward", len(data) + self.wire.overhead, tokens)
            try:
                reply = await self._call_peer(peer, data, self.index)
            except HopFailed as e:
                last = e
                log.info("hop to stage %d failed: %s", nxt, e)
                self.routes[nxt].pop(peer, None)  # stop choosing it until it heartbeats again
                if not e.retry:
                    break
                continue
            if reply.microbatch != frame.microbatch:
                raise HopFailed("reply for a different microbatch", retry=False)
            return reply
        raise last or HopFailed("no attempt made")

    def _forward_frame(
        self,
        step: int,
        mb: int,
        path: list[str],
        y: torch.Tensor,
        labels: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> Frame:
        boundary = self.index
        codec = self.link_out.for_step(step)
        seed = mask_seed(self.run.seed, step, mb, boundary)
        ctx = LinkContext(seed=seed, basis_version=getattr(codec, "version", None) or 0)
        if hasattr(codec, "encode_forward_with_tokens"):  # subspace: k numbers + the token id per position
            if token_ids is None:
                raise HopFailed("the subspace link needs the microbatch's token ids", retry=False)
            tensors = dict(codec.encode_forward_with_tokens(y.detach(), token_ids.to(y.device), ctx))
        else:
            tensors = dict(codec.encode_forward(y.detach(), ctx))
        tensors["labels"] = pack_labels(labels, self.stage.config.vocab_size)
        return Frame(
            kind="forward",
            run_id=self.run.run_id,
            step=step,
            microbatch=mb,
            boundary=boundary,
            path=path + [self.peer_id],
            codec=codec.codec_id,
            seed=seed,
            basis_version=ctx.basis_version,
            shape=list(y.shape),
            tensors=tensors,
        )

    # ---------------------------------------------------------------- network: serving
    async def handle_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = str(stream_info.peer_id)
        sealed = True
        try:
            if self.bans.is_banned(peer):  # costs a banned peer's frames nothing but a closed stream
                return
            try:
                data = await self.wire.recv(reader, MAX_FRAME_BYTES, self.cfg.hop_timeout)
                frame = decode_frame(data, run_id=self.run.run_id)
                reply = await self.serve_forward(frame)
                self.bans.record_good(peer)
            except FrameError as e:
                self.metrics.rejected_frames += 1
                if self.bans.record_bad(peer):
                    log.warning("banning %s for repeated invalid frames (last: %s)", peer[:12], e)
                log.info("rejected a frame from %s: %s", peer[:12], e)
                reply = error_frame(self.run.run_id, e)
                sealed = not isinstance(e, Unauthorized)  # a keyless sender must still read why
            except HopFailed as e:
                reply = Frame(
                    kind="error", run_id=self.run.run_id, meta={"code": "downstream", "message": str(e)[:300]}
                )
            except (asyncio.TimeoutError, RuntimeError) as e:
                reply = Frame(
                    kind="error",
                    run_id=self.run.run_id,
                    meta={"code": "busy", "message": f"{type(e).__name__}: {e}"[:300]},
                )
            except Exception as e:  # a bug of ours must still answer, never leave the sender waiting
                log.warning("internal error serving %s: %s: %s", peer[:12], type(e).__name__, e)
                reply = Frame(
                    kind="error",
                    run_id=self.run.run_id,
                    meta={"code": "internal", "message": f"{type(e).__name__}: {e}"[:300]},
                )
            sent = await self.wire.send(writer, encode_frame(reply), self.cfg.hop_timeout, sealed=sealed)
            if reply.kind == "backward":
                self.metrics.count_frame(
                    self.index - 1, "backward", sent, int(reply.meta.get("mb_tokens", 0))
                )
        except Exception as e:  # the requester went away; nothing of ours is held any more
            log.debug("stream ended: %s", e)
        finally:
            close_quietly(writer)

    def _check_forward(self, frame: Frame) -> None:
        if frame.kind != "forward":
            raise MalformedFrame(f"expected a forward frame, got {frame.kind}")
        if frame.boundary != self.index - 1:
            raise MalformedFrame(f"frame for boundary {frame.boundary} reached stage {self.index}")
        if self.link_in.by_id(frame.codec) is None:
            raise MalformedFrame(f"codec {frame.codec!r} is not this run's ({self.run.codec['codec']!r})")
        if len(frame.shape) != 3 or frame.shape[2] != self.run.hidden:
            raise ShapeMismatch(f"activation shape {frame.shape} does not end in hidden {self.run.hidden}")
        labels = frame.tensors.get("labels")
        if labels is None or list(labels.shape) != frame.shape[:2]:
            raise ShapeMismatch("labels missing or not (batch, tokens)")
        if not (1 <= frame.shape[0] <= self.run.microbatch and 1 <= frame.shape[1] <= self.run.seq_len):
            raise ShapeMismatch(f"microbatch {frame.shape[:2]} is empty or exceeds the run's limits")
        codec = self.link_in.by_id(frame.codec)
        for name, want in codec.payload_dtypes().items():
            t = frame.tensors.get(name)
            if t is not None and t.dtype != want:
                raise BadDtype(f"payload {name!r} is {t.dtype}, this run sends {want}")

    def _check_labels(self, labels: torch.Tensor) -> None:
        vocab = self.stage.config.vocab_size
        if bool(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))).any()):
            raise OutOfRange(f"labels outside [0, {vocab})")

    async def _run_rest(
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
        t0 = time.perf_counter()
        if self.is_tail:
            loss, n_loss, grad_x = await self.compute(self._tail, x, labels)
            self._record_throughput(tokens, time.perf_counter() - t0)
            return grad_x, {"loss": loss, "tokens": n_loss}
        y, leaf = await self.compute(self._forward, x)
        self._record_throughput(tokens, time.perf_counter() - t0)
        down = self._forward_frame(step, mb, path, y, labels, x if self.is_head else token_ids)
        bwd = await self.send_downstream(down, tokens)
        codec = self.link_out.by_id(down.codec)
        ctx = LinkContext(seed=down.seed, basis_version=down.basis_version)
        try:
            check_payload_magnitude(bwd.tensors, "gradient")
            grad_y = codec.decode_backward(bwd.tensors, ctx, tuple(y.shape))
        except (FrameError, KeyError, RuntimeError, ValueError) as e:
            raise HopFailed(f"the next stage's gradient is unusable: {e}", retry=False) from None
        grad_x = await self.compute(self._backward, y, grad_y, leaf)
        return grad_x, {k: bwd.meta[k] for k in ("loss", "tokens") if k in bwd.meta}

    async def serve_forward(self, frame: Frame) -> Frame:
        self._check_forward(frame)
        codec = self.link_in.by_id(frame.codec)
        ctx = self._link_ctx(frame)
        shape = tuple(frame.shape)
        await self._ensure_basis(codec, frame)
        payload = {k: v for k, v in frame.tensors.items() if k != "labels"}
        check_payload_magnitude(payload, "activations")
        try:
            x = codec.decode_forward(payload, ctx, shape)
        except (KeyError, RuntimeError, ValueError) as e:
            raise MalformedFrame(f"payload does not decode with codec {frame.codec}: {e}") from None
        token_ids = None
        if hasattr(codec, "tokens_from_payload"):  # passed on to the next link's payload
            token_ids = codec.tokens_from_payload(frame.tensors).reshape(shape[:2])
        labels = unpack_labels(frame.tensors["labels"])
        self._check_labels(labels)
        tokens = shape[0] * shape[1]
        await self.gate.enter(self.cfg.hop_timeout)
        try:
            grad_x, meta = await self._run_rest(
                x, labels, frame.step, frame.microbatch, frame.path, tokens, token_ids
            )
        finally:
            await self.gate.exit()
        reply = Frame(
            kind="backward",
            run_id=self.run.run_id,
            step=frame.step,
            microbatch=frame.microbatch,
            boundary=frame.boundary,
            codec=frame.codec,
            seed=frame.seed,
            basis_version=frame.basis_version,
            shape=list(shape),
            tensors=codec.encode_backward(grad_x.cpu(), ctx),
            meta={**meta, "mb_tokens": tokens},
        )
        await self._account(tokens, meta.get("loss") if self.is_tail else None, int(meta.get("tokens", 0)))
        return reply

    async def _ensure_basis(self, codec, frame: Frame) -> None:
        """Basis codecs: fetch a basis version this node does not hold yet (once per version)."""
        if (
            self.bases is not None
            and hasattr(codec, "versions")
            and frame.basis_version not in codec.versions
        ):
            await self.bases.fetch(frame.boundary, frame.basis_version, codec)

    # ---------------------------------------------------------------- head: driving microbatches
    async def run_microbatch(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        tokens = ids.numel()
        self._mb_counter += 1
        mb = self._mb_prefix | self._mb_counter
        try:
            _, meta = await self._run_rest(ids, labels, self.inner_step, mb, [], tokens)
        except HopFailed as e:
            self.metrics.dropped += 1
            # holding the slot a moment keeps a head whose downstream stage has no live peer from
            # drawing, computing and dropping microbatches as fast as it can (hundreds a minute)
            if "no live peer" in str(e):  # an empty stage: one clear line, then back-off (stop cuts it)
                hold = self.empty_downstream.dropped(str(e), DROP_BACKOFF_S)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), hold)
            else:
                log.warning("dropped microbatch %x: %s", mb, e)
                await asyncio.sleep(DROP_BACKOFF_S)
            return
        finally:
            await self.gate.exit()
        self.empty_downstream.served()
        loss = float(meta["loss"]) if "loss" in meta else None
        await self._account(tokens, loss, int(meta.get("tokens", 0)))

    async def head_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self.stop.is_set():
            try:
                await self.gate.enter(timeout=1.0)
            except asyncio.TimeoutError:
                continue
            except Busy:  # our own outer round: no new microbatches until it ends
                await asyncio.sleep(0.2)
                continue
            if self.stop.is_set():
                await self.gate.exit()
                break
            ids, labels = next(self.data)
            t = asyncio.create_task(self.run_microbatch(ids, labels))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:  # let in-flight microbatches finish (each is bounded by its hop deadlines)
            await asyncio.wait(tasks, timeout=self._hop_deadline(0) + 5)

    # ---------------------------------------------------------------- membership loops
    async def refresh_routes(self) -> None:
        try:
            self.routes = await read_stage_records(
                self.dht, self.run.run_id, self.n_stages, timeout=self.cfg.hop_timeout
            )
        except Exception as e:
            log.info("could not refresh routes: %s", e)
            return
        for peer in gone_peers({p: st for p, (st, _) in self._gone.items()}, self.routes):
            self._gone.pop(peer)[1].set()  # its hops in flight give up; a later hop gets a fresh event

    async def publish(self, ready: bool = True, timeout: float | None = None) -> None:
        """Our stage record: ready peers get routed to; a leaving node publishes ready=False first."""
        await store_stage_record(
            self.dht,
            self.run.run_id,
            self.index,
            self.peer_id,
            self.stage_record(ready),
            timeout=timeout or self.cfg.hop_timeout,
        )

    async def heartbeat_loop(self) -> None:
        while not self.stop.is_set():
            try:
                await self.publish()
            except Exception as e:
                log.info("heartbeat failed: %s", e)
            await self.refresh_routes()
            if self.bases is not None:
                try:
                    await self.bases.announce()
                except Exception as e:
                    log.info("basis announce failed: %s", e)
            self.write_metrics()
            self.write_health(serving=True)
            try:
                await asyncio.wait_for(self.stop.wait(), self.cfg.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    def metrics_dict(self) -> dict:
        m = self.metrics
        return {
            "peer_id": self.peer_id,
            "stage": self.index,
            "circuit": self.cfg.circuit,
            "role": "head" if self.is_head else "tail" if self.is_tail else "body",
            "inner_step": self.inner_step,
            "step_losses": m.step_losses,
            "trained_tokens": m.trained_tokens,
            "microbatches": m.microbatches,
            "dropped_microbatches": m.dropped,
            "rejected_frames": m.rejected_frames,
            "skipped_steps": m.skipped_steps,
            "basis_bytes_fetched": self.bases.bytes_fetched if self.bases else 0,
            "anchor_bytes": self.anchor.packet_bytes if self.anchor else 0,
            "anchor_pull_bytes": self.anchor.pull_bytes if self.anchor else 0,
            "anchor_pulls": self.anchor.pulls if self.anchor else 0,
            "anchor_packets_received": self.packet_sink.received if self.filter is not None else 0,
            "anchor_packets_stale": self.packet_sink.dropped_stale if self.filter is not None else 0,
            "filter_s": m.filter_s,
            "state_pull_bytes": m.state_pull_bytes,
            "outer_rounds": m.outer_rounds,
            "outer_alone": m.outer_alone,
            "dp": self.scape.summary() if self.scape is not None else {"mode": self.run.dp.get("mode")},
            "state_dir": self.cfg.state_dir,
            "checkpoints": m.checkpoints,
            "resumed_from": self.resumed_from,
            "basis_bytes_served": self.bases.bytes_served if self.bases else 0,
            "throughput": self._throughput,
            "compute_s": m.compute_s,
            "links": [
                {"boundary": b, "direction": d, "bytes": c.bytes, "tokens": c.tokens, "frames": c.frames}
                for (b, d), c in sorted(m.links.items())
            ],
            "peers": {str(s): sorted(r) for s, r in enumerate(self.routes)},
            "time": time.time(),
        }

    def write_health(self, serving: bool) -> None:
        try:
            write_health(
                self.cfg.state_dir,
                {
                    "serving": serving,
                    "stage": self.index,
                    "peer_id": self.peer_id,
                    "inner_step": self.inner_step,
                    "state": "serving" if serving else "stopped",
                },
            )
        except OSError as e:
            log.debug("could not write the health file: %s", e)

    def write_metrics(self) -> None:
        path = self.cfg.metrics_file
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.metrics_dict(), f)
        os.replace(tmp, path)  # readers never see a half-written file

    async def serve(self, p2p) -> None:
        """Register the handler, heartbeat, drive data (head), until stopped."""
        self.p2p = p2p
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        if self.bases is not None:
            self.bases.wire = self.wire
            await self.bases.start(p2p)
            await self._install_bases()
        if self.anchor is not None:
            await self._first_pull()
        else:
            await self._join_from_peers()
            await p2p.add_binary_stream_handler(WEIGHTS_HANDLER, self.weight_server.handle)
            await p2p.add_binary_stream_handler(ANCHOR_HANDLER, self.packet_sink.handle)
        if self.scape is not None:
            from node.scape import SCAPE_HANDLER

            await p2p.add_binary_stream_handler(SCAPE_HANDLER, self.scape.handle)
        await p2p.add_binary_stream_handler(HANDLER, self.handle_stream)
        await self.publish()
        tasks = [asyncio.create_task(self.heartbeat_loop())]
        if self.is_head:
            await self.wait_for_pipeline()
            tasks.append(asyncio.create_task(self.head_loop()))
        await self.stop.wait()
        log.info("leaving the swarm")
        # announce we are gone before we stop answering, so routing stops choosing us
        try:
            await self.publish(ready=False, timeout=5.0)
        except Exception:
            pass
        for t in tasks:
            try:
                await asyncio.wait_for(t, timeout=self._hop_deadline(0) + 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
        if self.cfg.checkpoint_every and self.anchor is None:
            try:
                await asyncio.wait_for(self.checkpoint(wait=True), 120)
            except Exception as e:
                log.warning("final checkpoint failed: %s", e)
        if self.outer is not None:  # the replicas' shared outer model, for the report's drift figure
            with contextlib.suppress(Exception):
                await self.compute(self._save_theta)
        self.write_metrics()
        self.write_health(serving=False)
        try:
            await asyncio.wait_for(p2p.remove_binary_stream_handler(HANDLER), 5.0)
        except Exception:
            pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.ckpt_pool.shutdown(wait=True)

    async def _join_from_peers(self) -> None:
        """A node joining a stage that others already train starts from their current weights.

        With outer rounds that is the replicas' shared outer state (theta_global, momentum,
        PowerSGD Q), not one peer's local weights: those would count its local progress twice.
        """
        await self.refresh_routes()
        if fast_peers_of_stage(self) and self.outer is not None:
            ok = await self.compute(self.outer.load_state_from_peers, self.cfg.join_timeout)
            log.info("outer state %s from the stage's replicas", "loaded" if ok else "not available")
        elif self.scape is not None and not any(r.inner_step for r in fast_peers_of_stage(self).values()):
            # SCAPE keeps replicas bit-identical: peers that have not stepped hold exactly the weights we
            # built (same model hash), and a bf16 copy of them would make this replica differ from step 0
            log.info("the stage's replicas have not stepped yet; starting from the same initial weights")
        elif fast_peers_of_stage(self):
            pulled = await pull_weights(self)
            if pulled is None:
                log.warning(
                    "could not pull the current weights of stage %d; starting from the checkpoint", self.index
                )
            else:
                self.metrics.state_pull_bytes += pulled[1]
                if self.scape is not None:  # bf16 weights without m and e: re-anchored at the first step
                    self.scape.joined()
                    self.inner_step = max(self.inner_step, pulled[0])

    async def _first_pull(self) -> None:
        """An anchor starts from a fast peer's current weights, not the pretrained ones."""
        while not self.stop.is_set():
            await self.refresh_routes()
            if self.anchor.fast_peers() and await self.anchor.pull():
                return
            log.info("anchor waiting for a fast peer of stage %d to pull weights from", self.index)
            try:
                await asyncio.wait_for(self.stop.wait(), 2.0)
            except asyncio.TimeoutError:
                pass

    async def _install_bases(self) -> None:
        """Basis codecs: get the newest basis of both links before serving (the sender needs it)."""
        for boundary, link in ((self.index - 1, self.link_in), (self.index, self.link_out)):
            if link is None or not link.needs_basis:
                continue
            version = await self.bases.latest_version(boundary)
            if version is None:
                raise BasisUnavailable(f"no peer announces a basis for boundary {boundary}")
            await self.bases.fetch(boundary, version, link.main)

    async def wait_for_pipeline(self) -> None:
        """The head waits until every stage has a ready peer, with a progress line."""
        last = 0.0
        while not self.stop.is_set():
            await self.refresh_routes()
            missing = [
                s
                for s in range(1, self.n_stages)
                if not any(r.ready and r.circuit == self.cfg.circuit for r in self.routes[s].values())
            ]
            ready = sum(r.ready for stage in self.routes for r in stage.values())
            if not missing and ready >= self.cfg.wait_peers:
                return
            if time.monotonic() - last > 10:
                log.info(
                    "waiting for peers: stages without one %s, %d/%d ready",
                    missing,
                    ready,
                    self.cfg.wait_peers,
                )
                last = time.monotonic()
            await asyncio.sleep(1.0)
