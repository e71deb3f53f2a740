"""The step strategies: what a stage does with its summed gradients once its batch is in.

* ``AdamWStep``: mean, the tied tensor's exchange (``node.dp.tied``), spectral filter (anchor
  priors), clip, AdamW; DiLoCo outer rounds every H (``node.dp.diloco``).
* ``node.dp.scape.ScapeSync``: mean, clip, a sparse exchange with the stage's replicas, AdamS.
* ``AnchorStep``: mean, then the gradients go to the fast peers; no optimizer step.

``mean_and_clip`` is the one place the summed gradients become the step's mean, clipped. Each
strategy fills ``node.stage.step.StepStrategy``; the stage's ``Stepper`` calls it under its gate.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compression.spectral import SpectralFilter, filter_gradients
from node.dp.anchors import AnchorClient
from node.dp.deferred import DeferredOuter
from node.dp.tied import TiedExchange
from node.stage.context import StageContext
from node.stage.step import StepGate, StepResult
from node.swarm.routing import fast_peers_of_stage

log = logging.getLogger("node")


def mean_and_clip(
    params: list[torch.nn.Parameter],
    microbatches: int,
    clip: float | None,
    before_clip: Callable[[], None] | None = None,
    tied: tuple[torch.nn.Parameter, torch.Tensor | None] | None = None,
) -> bool:
    """Turn summed gradients into their mean over ``microbatches``, then clip them to ``clip``.

    ``before_clip`` runs on the mean (the spectral filter). False when the gradient norm is not
    finite: such a gradient must never reach the weights. ``clip=None`` only takes the mean.
    ``tied``: this stage's copy of a tied tensor and the partner stage's mean gradient of it
    (``node.dp.tied``), added to ours; the tensor is clipped by its own norm, which both copies
    share, so the head and the tail clip it alike whatever the rest of their stages hold.
    """
    n = max(microbatches, 1)
    for p in params:
        if p.grad is not None:
            p.grad.div_(n)
    own = None
    if tied is not None:
        own, partner = tied
        if partner is not None:
            own.grad = partner.clone() if own.grad is None else own.grad.add_(partner)
    if before_clip is not None:
        before_clip()
    if clip is None:
        return True
    rest = [p for p in params if p is not own]
    ok = bool(torch.isfinite(torch.nn.utils.clip_grad_norm_(rest, clip)))
    if own is not None:
        ok = bool(torch.isfinite(torch.nn.utils.clip_grad_norm_([own], clip))) and ok
    return ok


class AdamWStep:
    """AdamW on the stage's mean gradient; with ``outer``, a DiLoCo round every H inner steps."""

    def __init__(
        self,
        ctx: StageContext,
        gate: StepGate,
        opt: torch.optim.Optimizer,
        spectral: SpectralFilter | None,
        outer=None,
        tied: TiedExchange | None = None,
        deferred: DeferredOuter | None = None,
    ) -> None:
        self.ctx, self.gate, self.opt, self.spectral, self.outer = ctx, gate, opt, spectral, outer
        self.tied = tied
        self.deferred = None if outer is not None else deferred  # builds ``outer`` once a partner appears
        self.rounds = RoundClock()  # the stage round this replica took last
        self._begun: dict = {}  # where the round under way began (for its metrics record)

    def _apply(self, microbatches: int, tied_partner: torch.Tensor | None = None) -> bool:
        ctx = self.ctx

        def spectral_filter() -> None:  # anchor priors: filter, then clip, then AdamW (DESIGN 4.2)
            t0 = time.perf_counter()
            filter_gradients(self.spectral, ctx.stage.named_parameters())
            ctx.metrics.filter_s += time.perf_counter() - t0

        hook = spectral_filter if self.spectral is not None else None
        tied = (self.tied.param, tied_partner) if self.tied is not None else None
        ok = mean_and_clip(ctx.params, microbatches, ctx.run.clip, hook, tied)
        if ok:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return ok

    async def step(self, t: int, microbatches: int) -> StepResult:
        partner = None
        if self.tied is not None:
            mean = await self.ctx.compute(self.tied.own_mean, microbatches)
            partner = await self.tied.exchange(t, mean, self.gate)
        ok = await self.ctx.compute(self._apply, microbatches, partner)
        # step t is taken: announce t + 1 before a round, so the replicas still short of the
        # boundary see from this record that the stage's round has begun (outer_round_due)
        self.ctx.inner_step = t + 1
        await self._maybe_outer_round(t + 1)
        return StepResult(ok, t)

    async def _maybe_outer_round(self, step: int) -> None:
        """Average pseudo-gradients with the stage's live replicas once per stage round (DESIGN 4.3)."""
        ctx = self.ctx
        every = ctx.run.outer.every
        if (self.outer is None and self.deferred is None) or every <= 0:
            return
        peers = fast_peers_of_stage(ctx)
        steps = [r.inner_step for r in peers.values()]
        overlap = ctx.run.outer.overlap
        if self.outer is not None and self.outer.under_way:  # an overlapped round, begun earlier
            stats = await ctx.compute(self.outer.poll)
            if stats is not None:
                self._record(stats)
        # a missed DHT read hides a live replica for a heartbeat; a dead one's record is gone for good
        patience = FOLLOW_AFTER_BEATS * ctx.cfg.heartbeat_s
        due = outer_round_due(step, steps, every, self.rounds, time.monotonic(), patience)
        if due is None:
            return
        if not peers:  # alone on the stage: nobody to average with
            ctx.metrics.outer_alone += 1
            return
        if self.outer is None:  # the first partner: the outer state this replica held all along
            theta0 = await ctx.compute(self.deferred.initial)
            t0 = time.monotonic()
            self.outer = self.deferred.build(theta0)  # here, on the event loop's (main) thread
            self.deferred = None
            del theta0
            log.info("outer state built for the stage's first partner in %.1fs", time.monotonic() - t0)
        # Replicas meet only if the others can reach their round while we wait in ours: turn
        # microbatches away (upstream retries them on another replica) instead of holding them.
        log.debug("outer round %d at inner step %d (replicas at %s)", due, step, steps)
        if self.outer.under_way:  # the last overlapped round is still going: it ends first
            await ctx.compute(self.outer.settle)
            self._record(await ctx.compute(self.outer.poll))
        self._begun = {"step": step, "peer_steps": steps, "started": time.time(), "overlapped": overlap}
        if overlap:  # the averager works while the inner steps go on (OuterSync.begin)
            await ctx.compute(functools.partial(self.outer.begin, due, overlap=True))
            return
        await self.gate.set_refusing(True)
        try:
            stats = await ctx.compute(self.outer.round, due)
        finally:
            await self.gate.set_refusing(False)
        self._record(stats)

    async def land_round(self) -> None:
        """The node leaves: an overlapped round under way ends (briefly if the node was told to stop)
        and lands, so the outer model saved and reported is the one the partners hold too."""
        if self.outer is not None and self.outer.under_way:
            await self.ctx.compute(self.outer.settle)
            self._record(await self.ctx.compute(self.outer.poll))

    def _record(self, stats) -> None:
        self.ctx.metrics.outer_rounds.append(
            {**stats.as_dict(), **self._begun, "applied": self.ctx.inner_step}
        )
        if stats.skipped:
            log.info("outer round %d skipped: %s", stats.round, stats.reason)


FOLLOW_AFTER_BEATS = 2.5  # heartbeats the furthest replica must stay gone before the others follow another


@dataclass
class RoundClock:
    """Where a replica stands in its stage's rounds (``outer_round_due``)."""

    last: int | None = None  # the stage round taken last (None: not looked yet)
    behind_since: float | None = None  # since when the furthest replica seen is below ``last``


def outer_round_due(
    own_step: int, peer_steps: list[int], every: int, clock: RoundClock, now: float, patience_s: float
) -> int | None:
    """The stage round to take now, or None; ``clock`` keeps the last one taken.

    Rounds follow the stage's furthest replica (the inner step its stage record announces), not
    this replica's own count. Replicas step at different rates (two heads share the same tails; a
    volunteer's GPU is slower than another's), so each one's own step-H boundary comes at a
    different time, and the first there waits out the round's timeout alone; following the
    furthest, the slower replicas join the round it is in within a heartbeat. DiLoCo's
    pseudo-gradient is the distance from the last outer model, so a replica that took fewer inner
    steps since then still contributes a valid (shorter) one.

    The first look (a fresh start, a resume, a joiner) takes rounds from the next boundary on, not
    one its replicas are already past. When the furthest replica leaves (killed, moved), the others
    follow the furthest one left from its next boundary on, once it has stayed gone ``patience_s``:
    kept at the one that left, a replica whose own count is far behind (a joiner counts from 0)
    would take no round until it caught up, and one joining it later, following its count, would
    wait in rounds it never enters (the volunteer-internet bench found a stage without a committed
    round for the rest of the run). Not at once: a replica hidden by one missed read would come back
    above, and the others would enter a round it already took, and wait it out alone.
    """
    r = max([own_step, *peer_steps]) // every
    if clock.last is None:
        clock.last = max([own_step - 1, *peer_steps]) // every
    if r > clock.last:
        clock.last, clock.behind_since = r, None
        return r
    if r == clock.last:
        clock.behind_since = None
    elif clock.behind_since is None:
        clock.behind_since = now
    elif now - clock.behind_since >= patience_s:
        clock.last, clock.behind_since = r, None
    return None


class AnchorStep:
    """Anchors take no optimizer step: their mean gradients go to the stage's fast peers."""

    def __init__(self, ctx: StageContext, anchor: AnchorClient) -> None:
        self.ctx, self.anchor = ctx, anchor

    async def step(self, t: int, microbatches: int) -> StepResult:
        await self.ctx.compute(mean_and_clip, self.ctx.params, microbatches, None)
        await self.anchor.send_packets()
        if self.anchor.needs_pull():
            await self.anchor.pull()
        return StepResult(True, t)
