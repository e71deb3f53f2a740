"""SCAPE in the swarm (DESIGN.md 4.5): replicas of a stage sync a sparse gradient every inner step.

(Over 400 lines on purpose: one replica's side of a three-phase exchange (values, mask,
re-anchoring) is one state machine, kept in one class so its transitions read in one place;
its message formats and lineage rules are ``node.dp.scape_wire``.)

The math is ``compression.scape`` (AdamS, per-tensor partitioned top-|m| masks, error
feedback); this module moves it between node processes over libp2p, the way the pipeline
links do (one-way streams to the ``vnode.scape`` handler, frames of kind ``scape``).

Inner step t of a replica, with no microbatch in flight (``StepGate``):

1. local gradient: mean over its microbatches, clipped to the run's clip, flattened; plus its
   error buffer e (``acc = g + e``).
2. mask M_t: the union of the slices every replica of step t−1's group proposed right after
   its step t−1 (its own slice included; they arrive while step t's microbatches run, so the
   wait is normally zero). Step 0, or a step after a replica went alone, syncs densely.
3. values: ``acc[M_t]`` rounded to bf16, sent to every live fast peer of the stage, with a
   digest of M_t. It waits (refusing new microbatches, which upstream retries on another
   replica) until every peer's values for step t arrived, or ``dp.timeout`` seconds; then it
   goes on with those that came (a dead replica is counted in ``missing``, never waited for
   again: it is no longer in the routes). Values with another digest (a replica that saw a
   different group) are refused and counted in ``mismatched``.
4. the mean over the group, summed in peer-id order over the same bf16 numbers on every
   member (so members stay bit-identical), goes into ``adams_masked_step_``; error feedback:
   e ← acc with M_t zeroed.
5. next slice: with the group of step t sorted by peer id, this replica scores its strided
   slice {i : i mod world = rank} per tensor (``next_mask`` with one segment per parameter)
   and sends it to the group as int32 indices or a bitmap of the slice, whichever is smaller
   (the exchange ``step_bytes`` counts).

Bytes are counted where frames are written (``wire.send`` return value, frame headers
included) and kept per step with the group size, the mask size and a CRC of the parameters
after the step, so a report can check that synchronised replicas hold the same weights.
A replica alone on its stage takes a plain AdamS step on its own gradient (``alone``).

Re-anchoring. Each replica carries a *lineage* (a hash chained over the group steps it took)
and the count of steps applied to its state, both sent with its values. Replicas that took
the same steps together hold the same lineage and bit-identical state. When the values of a
step show different lineages (a replica that went alone after a missed exchange, one that
joined mid-run and pulled only bf16 weights, one resumed from an older checkpoint), the group
picks one (``winning_lineage``: most steps applied, then most holders, then the lowest peer
id). Its holders take the step among themselves; the lowest-id holder (the donor) then sends
its post-step weights, m and e in fp32 to the others, which drop their own gradient of that
step and adopt the donor's state and lineage; the next step syncs densely, so no mask has
to be agreed across the change. A replica behind in step count (a joiner, a resumed node)
jumps to the step its peers' values name. Adoption costs 12 bytes per parameter, once.

The first moments, the error buffer, the lineage and the step count are checkpointed with
the stage (``state_dict``). ``ScapeSync`` is a step strategy (``node.stage.step.StepStrategy``): it gets the
stage's shared context, the step gate and the route refresh, never the runtime, and returns
the step index it took (a replica that lags joins its peers at theirs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import torch

from compression.scape import adams_masked_step_, adams_step_, mask_scores, next_mask
from node.dp.scape_wire import (  # noqa: F401  (INITIAL_LINEAGE, winning_lineage: re-exported)
    ANCHOR_CHUNK,
    INITIAL_LINEAGE,
    anchor_key,
    decode_slice,
    encode_slice,
    mask_digest,
    next_lineage,
    param_digest,
    winning_lineage,
)
from node.dp.strategies import mean_and_clip
from node.net.caps import Limits
from node.net.rpc import PeerUnreachable, send_only
from node.net.serve import NotAllowed, serve
from node.net.wire import IDLE_S
from node.stage.step import StepGate, StepResult
from node.swarm.recheck import RouteRecheck
from node.swarm.routing import fast_peers_of_stage
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, decode_frame, encode_frame

log = logging.getLogger("node")

SCAPE_HANDLER = "vnode.scape"
BETAS = (0.9, 0.95)
EPS = 1e-8
_PHASES = ("values", "mask", "anchor")
_KEEP_STEPS = 4  # inbox entries older than this many steps are dropped
AHEAD_STEPS = 8  # frames for steps further ahead (of ours and of the sender's record) are refused
# replicas send one message per phase per step, a few at once when one lags; a stranger's
# streams are refused unread, so the node-wide bound is what a flood of minted ids meets
LIMITS = Limits(per_peer=8, total=64)


class Refused(FrameError):
    """A well-formed scape message this replica does not take (its step or its size): a strike."""

    code = "range"


class Unknown(NotAllowed):
    """A scape stream from a peer that is no replica of this stage (refused unread, no strike)."""


def _frame_bytes(frame: Frame) -> int:
    return sum(t.numel() * t.element_size() for t in frame.tensors.values())


class ScapeSync:
    """One replica's side of SCAPE (see the module docstring); its ``step`` replaces AdamW."""

    def __init__(
        self,
        ctx,
        gate: StepGate,
        refresh_routes: Callable[[], Awaitable[None]],
        density: float,
        timeout: float,
    ):
        self.rt = ctx  # node.stage.context.StageContext
        self.gate, self.refresh_routes = gate, refresh_routes
        self.density, self.timeout = float(density), float(timeout)
        self.params = ctx.params
        self.segments = [p.numel() for p in self.params]
        self.numel = sum(self.segments)
        self.m = torch.zeros(self.numel)
        self.err = torch.zeros(self.numel)
        self.own_slice: torch.Tensor | None = None  # this replica's part of the next mask
        self.slice_group: list[str] = []  # peers that owe us their slice of the next mask
        self.inbox: dict[tuple[str, int], dict[str, Frame]] = defaultdict(dict)
        self._cond: asyncio.Condition | None = None
        self.records: list[dict] = []
        self.values_bytes = self.mask_bytes = 0
        self.alone = self.missing = self.mismatched = self.refused = 0
        self.lineage, self.applied = INITIAL_LINEAGE, 0
        self.reanchors = self.anchor_bytes = self.anchor_received = 0  # sent by a donor / adopted
        self._recheck = RouteRecheck(refresh_routes)
        # what one honest sender can have in the inbox: a whole re-anchoring state (12 bytes per
        # parameter), bf16 values and a mask slice (< 1 byte per parameter) for the steps kept
        self.inbox_bytes_per_peer = 12 * self.numel + (_KEEP_STEPS + 2) * 3 * self.numel + (1 << 20)

    # ------------------------------------------------------------------ network
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

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
            what="scape message",
            answer=False,  # one-way: the sender reads no reply
            on_error=self._refused,
            caps=rt.wire.caps(SCAPE_HANDLER, LIMITS),
        )

    async def _replica(self, peer: str) -> int:
        """The sender check: only the stage's own replicas may fill the inbox (unread otherwise)."""
        if not await self._serves_stage(peer):
            raise Unknown("the sender does not serve this stage")
        return MAX_FRAME_BYTES

    def _refused(self, _s, _e: Exception) -> None:
        self.refused += 1
        self.rt.metrics.refused_messages += 1

    async def _take(self, s) -> None:
        rt = self.rt
        frame = decode_frame(await s.receive(self._replica, idle=IDLE_S), run_id=rt.run.run_id)
        phase = frame.meta.get("phase")
        if frame.kind != "scape" or phase not in _PHASES or frame.boundary != rt.index:
            raise FrameError("expected a scape frame of this stage")
        if phase == "values":
            v = frame.tensors.get("v")
            if v is None or v.dtype != torch.bfloat16 or v.dim() != 1 or v.numel() > self.numel:
                raise FrameError("scape values malformed")
        if phase == "anchor":
            phase = anchor_key(frame)
        if self._check_step(s.peer, frame.step):
            cond = self._condition()
            async with cond:
                self._store(s.peer, phase, frame)
                cond.notify_all()

    async def _serves_stage(self, peer: str) -> bool:
        """True if ``peer`` announces a fast replica of this stage; a peer not yet in our routes
        (it joined since the last heartbeat) gets one route refresh, at most every few seconds."""
        if peer in fast_peers_of_stage(self.rt):
            return True
        await self._recheck()
        return peer in fast_peers_of_stage(self.rt)

    def _check_step(self, peer: str, step: int) -> bool:
        """True for a step to keep; False for one too old to matter (a lagging replica sends
        those until it catches up: not hostile); Refused past a few steps ahead of ours or of
        the sender's announced step (a replica that lags catches up to the steps its peers name)."""
        rt = self.rt
        rec = rt.routes[rt.index].get(peer)
        ahead = max(rt.inner_step, rec.inner_step if rec is not None else 0) + AHEAD_STEPS
        if step > ahead:
            raise Refused(f"step {step} outside the window [{rt.inner_step - _KEEP_STEPS}, {ahead}]")
        return step >= rt.inner_step - _KEEP_STEPS

    def _store(self, sender: str, phase: str, frame: Frame) -> None:
        """Keep ``frame`` unless the sender's frames already held would pass its byte budget."""
        key = (phase, frame.step)
        for k in [k for k in self.inbox if k[1] < self.rt.inner_step - _KEEP_STEPS]:
            del self.inbox[k]
        size = _frame_bytes(frame)
        held = sum(_frame_bytes(got[sender]) for k, got in self.inbox.items() if k != key and sender in got)
        if held + size > self.inbox_bytes_per_peer:
            raise Refused(f"its inbox would hold {held + size} bytes, over {self.inbox_bytes_per_peer}")
        self.inbox[key][sender] = frame

    async def _send(self, peer: str, frame: Frame) -> int:
        rt = self.rt
        try:
            return await send_only(rt.p2p, rt.wire, peer, SCAPE_HANDLER, encode_frame(frame), self.timeout)
        except PeerUnreachable as e:
            log.info("scape: %s", e)
        except Exception as e:
            log.info("scape: sending to %s failed: %s", peer[:12], type(e).__name__)
        return 0

    async def _broadcast(self, peers: list[str], frame: Frame) -> int:
        sent = await asyncio.gather(*(self._send(p, frame) for p in peers))
        return int(sum(sent))

    async def _collect(self, phase: str, step: int, peers: list[str]) -> dict[str, Frame]:
        """Frames of (phase, step) from ``peers``: all of them, or those in by the deadline."""
        cond = self._condition()
        want = set(peers)
        async with cond:
            try:
                await asyncio.wait_for(
                    cond.wait_for(lambda: want <= set(self.inbox.get((phase, step), {}))), self.timeout
                )
            except asyncio.TimeoutError:
                pass
            got = {p: f for p, f in self.inbox.get((phase, step), {}).items() if p in want}
            for key in [k for k in self.inbox if k[1] < step - _KEEP_STEPS]:
                del self.inbox[key]
        self.missing += len(want) - len(got)
        return got

    # ------------------------------------------------------------------ compute (worker thread)
    def _local_acc(self, microbatches: int) -> tuple[torch.Tensor, bool]:
        ok = mean_and_clip(self.params, microbatches, self.rt.run.clip)
        if ok:
            g = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                    for p in self.params
                ]
            )
        else:  # a non-finite gradient never reaches the weights: this replica contributes zeros
            g = torch.zeros(self.numel)
        for p in self.params:
            p.grad = None
        return g + self.err, ok

    def _apply(
        self, acc: torch.Tensor, mask: torch.Tensor | None, mean: torch.Tensor, rank: int, world: int
    ) -> tuple[torch.Tensor | None, int]:
        run = self.rt.run
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        if mask is None:
            self.err.zero_()
        else:
            acc[mask] = 0.0
            self.err = acc
        adams_masked_step_(flat, self.m, mean, mask, run.lr, BETAS, EPS, run.weight_decay)
        self._write(flat)
        nxt = None
        if self.density < 1.0:
            scores = mask_scores(self.m, self.err, BETAS[0])
            nxt = next_mask(scores, self.density, (rank, world), self.segments)
        return nxt, param_digest(flat)

    def _alone(self, acc: torch.Tensor) -> int:
        run = self.rt.run
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        adams_step_(flat, acc, self.m, run.lr, BETAS, EPS, run.weight_decay)
        self.err.zero_()
        self._write(flat)
        return param_digest(flat)

    @torch.no_grad()
    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.dtype))
            offset += n

    # ------------------------------------------------------------------ re-anchoring
    def _state_vector(self) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        return torch.cat([flat, self.m, self.err])

    def _adopt(self, state: torch.Tensor) -> int:
        n = self.numel
        flat = state[:n].clone()
        self.m, self.err = state[n : 2 * n].clone(), state[2 * n :].clone()
        self._write(flat)
        return param_digest(flat)

    async def _send_anchor(self, t: int, peers: list[str]) -> int:
        """The donor's post-step state to the replicas that adopt it (fp32, in chunks)."""
        state = await self.rt.compute(self._state_vector)
        chunks = max(1, -(-state.numel() // ANCHOR_CHUNK))
        sent = 0
        for i in range(chunks):
            frame = Frame(
                kind="scape",
                run_id=self.rt.run.run_id,
                step=t,
                boundary=self.rt.index,
                tensors={"v": state[i * ANCHOR_CHUNK : (i + 1) * ANCHOR_CHUNK].contiguous()},
                meta={
                    "phase": "anchor",
                    "chunk": i,
                    "chunks": chunks,
                    "lineage": self.lineage,
                    "applied": self.applied,
                },
            )
            sent += await self._broadcast(peers, frame)
        return sent

    async def _receive_anchor(self, t: int, donor: str) -> tuple[torch.Tensor, dict] | None:
        """The donor's state of step t, or None if it did not all arrive in time."""
        first = (await self._collect("anchor0", t, [donor])).get(donor)
        if first is None:
            return None
        chunks = int(first.meta["chunks"])
        parts = [first.tensors["v"]]
        for i in range(1, chunks):
            f = (await self._collect(f"anchor{i}", t, [donor])).get(donor)
            if f is None or f.meta.get("lineage") != first.meta["lineage"]:
                return None
            parts.append(f.tensors["v"])
        state = torch.cat(parts)
        if state.numel() != 3 * self.numel or not bool(torch.isfinite(state).all()):
            log.info("scape: the re-anchoring state from %s is unusable", donor[:12])
            return None
        return state, first.meta

    def _catch_up(self, t: int, peers: list[str]) -> int:
        """The step this replica should exchange at: later than t if its peers already sent values
        for a later step (it joined, or resumed from an older checkpoint, and lags behind them)."""
        ahead = [
            s
            for (phase, s), got in self.inbox.items()
            if phase == "values" and s > t and set(got) & set(peers)
        ]
        return max(ahead, default=t)

    async def _alone_step(self, t: int, acc: torch.Tensor) -> int:
        self.alone += 1
        self.own_slice, self.slice_group = None, []
        self.lineage = next_lineage(self.lineage, t, f"alone:{self.rt.peer_id}")
        self.applied += 1
        return await self.rt.compute(self._alone, acc)

    # ------------------------------------------------------------------ one inner step
    async def step(self, t: int, microbatches: int) -> StepResult:
        """Inner step ``t`` over the gradients of ``microbatches`` microbatches (see the module docstring)."""
        rt = self.rt
        t0 = time.perf_counter()
        acc, ok = await rt.compute(self._local_acc, microbatches)
        await self.refresh_routes()
        peers = sorted(fast_peers_of_stage(rt))
        record = {"step": t, "group": 1, "nnz": self.numel, "values_bytes": 0, "mask_bytes": 0}
        if not peers:  # alone on the stage: a plain AdamS step on our own gradient
            record["digest"] = await self._alone_step(t, acc)
            record["seconds"] = time.perf_counter() - t0
            self.records.append(record)
            return StepResult(ok, t)
        caught_up = self._catch_up(t, peers)
        if caught_up != t:
            log.info(
                "scape: the stage's replicas are at step %d, this one at %d; joining them there", caught_up, t
            )
            t = caught_up  # returned: the runtime counts on from here
            record["step"] = t
            self.own_slice, self.slice_group = None, []  # no mask agreed for this step: sync densely
        mask = None
        if self.own_slice is not None:
            slices = await self._collect("mask", t - 1, self.slice_group)
            parts = [self.own_slice]
            for f in slices.values():
                try:
                    parts.append(
                        decode_slice(f.tensors, int(f.meta["rank"]), int(f.meta["world"]), self.numel)
                    )
                except (FrameError, KeyError, ValueError) as e:
                    log.info("scape: a slice of step %d is unusable: %s", t - 1, e)
            mask = torch.sort(torch.cat(parts)).values
        digest = mask_digest(mask, self.numel)
        own = (acc if mask is None else acc[mask]).to(torch.bfloat16)
        frame = Frame(
            kind="scape",
            run_id=rt.run.run_id,
            step=t,
            boundary=rt.index,
            tensors={"v": own},
            meta={"phase": "values", "digest": digest, "lineage": self.lineage, "applied": self.applied},
        )
        await self.gate.set_refusing(True)  # upstream sends microbatches to the replicas still computing
        try:
            sent = await self._broadcast(peers, frame)
            got = await self._collect("values", t, peers)
        finally:
            await self.gate.set_refusing(False)
        self.values_bytes += sent
        views = {rt.peer_id: (self.lineage, self.applied)}
        for peer, f in got.items():
            lin, n = f.meta.get("lineage"), f.meta.get("applied")
            if isinstance(lin, str) and isinstance(n, int):
                views[peer] = (lin, n)
        win = winning_lineage(views)
        holders = sorted(p for p, v in views.items() if v[0] == win)
        others_lineage = sorted(p for p in views if p not in holders)
        if self.lineage != win:  # our state left the group's: take the donor's after its step
            self.reanchors += 1
            got_state = await self._receive_anchor(t, holders[0])
            if got_state is None:  # no donor state in time: step alone, re-anchor at a later step
                record["digest"] = await self._alone_step(t, acc)
            else:
                state, meta = got_state
                record["digest"] = await rt.compute(self._adopt, state)
                self.lineage, self.applied = meta["lineage"], int(meta["applied"])
                self.own_slice, self.slice_group = None, []
                self.anchor_received += state.numel() * 4
                record.update(group=len(views), reanchor="adopted", donor=holders[0])
            record.update(
                nnz=int(own.numel()), dense=mask is None, values_bytes=sent, seconds=time.perf_counter() - t0
            )
            self.records.append(record)
            return StepResult(ok, t)
        values = {rt.peer_id: own}
        for peer, f in got.items():
            if peer not in holders:
                continue
            v = f.tensors["v"]
            if f.meta.get("digest") != digest or v.numel() != own.numel():
                self.mismatched += 1
                continue
            values[peer] = v
        group = sorted(values)
        mean = torch.zeros(own.numel())
        for peer in group:  # the same numbers in the same order on every member: identical results
            mean += values[peer].float()
        mean /= len(group)
        rank, world = group.index(rt.peer_id), len(group)
        self.own_slice, digest_after = await rt.compute(self._apply, acc, mask, mean, rank, world)
        self.lineage = next_lineage(self.lineage, t, f"{digest}:{','.join(group)}")
        self.applied += 1
        others = [p for p in group if p != rt.peer_id]
        mask_sent = 0
        if others_lineage:
            # replicas on another lineage adopt our state now: the next step syncs densely, so the
            # mask never has to be agreed across the change
            self.own_slice = None
            if rt.peer_id == holders[0]:
                record["reanchor"] = "donor"
                self.anchor_bytes += await self._send_anchor(t, others_lineage)
        elif self.own_slice is not None and others:
            sl = Frame(
                kind="scape",
                run_id=rt.run.run_id,
                step=t,
                boundary=rt.index,
                tensors=encode_slice(self.own_slice, rank, world, self.numel),
                meta={"phase": "mask", "rank": rank, "world": world},
            )
            mask_sent = await self._broadcast(others, sl)
        if not others:
            self.alone += 1
            self.own_slice = None  # nobody to agree a mask with: the next step starts dense again
        self.slice_group = others
        self.mask_bytes += mask_sent
        record.update(
            group=world,
            nnz=int(own.numel()),
            dense=mask is None,
            values_bytes=sent,
            mask_bytes=mask_sent,
            digest=digest_after,
            seconds=time.perf_counter() - t0,
        )
        self.records.append(record)
        return StepResult(ok, t)

    def joined(self) -> None:
        """This replica pulled the current weights (bf16, without m and e) from a running stage."""
        self.lineage, self.applied = f"pulled:{self.rt.peer_id}", 0

    def state_dict(self) -> dict:
        """First moments, error buffer, lineage and steps applied (the mask is agreed afresh)."""
        lineage = torch.frombuffer(bytearray(self.lineage.encode()), dtype=torch.uint8)
        return {"m": self.m, "err": self.err, "lineage": lineage, "applied": torch.tensor(self.applied)}

    def load_state_dict(self, sd: dict) -> None:
        m, err = sd["m"], sd["err"]
        if m.shape != self.m.shape or err.shape != self.err.shape:
            raise ValueError("scape state does not match this stage's parameters")
        self.m, self.err = m.float().clone(), err.float().clone()
        if "lineage" in sd:
            self.lineage = bytes(sd["lineage"].to(torch.uint8).tolist()).decode()
            self.applied = int(sd["applied"])
        self.own_slice, self.slice_group = None, []  # the first step after a resume syncs densely

    def summary(self) -> dict:
        return {
            "mode": "scape",
            "density": self.density,
            "numel": self.numel,
            "segments": len(self.segments),
            "bytes": self.values_bytes + self.mask_bytes,
            "values_bytes": self.values_bytes,
            "mask_bytes": self.mask_bytes,
            "steps": len(self.records),
            "alone": self.alone,
            "missing": self.missing,
            "mismatched": self.mismatched,
            "refused": self.refused,
            "reanchors": self.reanchors,
            "anchor_bytes": self.anchor_bytes,
            "anchor_received": self.anchor_received,
            "lineage": self.lineage,
            "records": self.records[-500:],
        }
