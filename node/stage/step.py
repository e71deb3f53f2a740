"""The inner step: the gate that drains in-flight work, the accumulator, and the strategy interface.

A microbatch's backward must run through the same weights its forward used, so the step
waits for in-flight microbatches to drain and holds new ones back while it runs (``StepGate``).
``Stepper`` counts what the microbatches since the last step contributed and, once the run's
``batch_tokens`` are in, runs this node's ``StepStrategy`` with explicit arguments (the step index
and how many microbatches the gradients sum over). The strategies live in ``node.dp``:
``node.dp.strategies`` (AdamW with DiLoCo outer rounds; anchors) and ``node.dp.scape``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from node.stage.context import StageContext
from node.stage.heldout import HeldOut

log = logging.getLogger("node")

STEP_DRAIN_TIMEOUT_S = 120.0


class Busy(RuntimeError):
    """This node cannot take work now; the sender should try another replica."""


class StepGate:
    """Bounds in-flight microbatches and lets the optimizer step only when none is in flight."""

    def __init__(self, cap: int):
        self.cap = cap
        self.inflight = 0
        self.peak = 0  # the most microbatches held at once: what the memory estimate's cap met
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
            self.peak = max(self.peak, self.inflight)

    def check_open(self) -> None:
        """Raise Busy at once while work is turned away (before any of it is queued anywhere)."""
        if self.refusing:
            raise Busy("in an outer round; try another replica")

    async def set_refusing(self, refusing: bool) -> None:
        async with self._cond:
            self.refusing = refusing
            self._cond.notify_all()  # waiters re-check and leave at once

    async def exit(self) -> None:
        async with self._cond:
            self.inflight -= 1
            self._cond.notify_all()

    async def run_exclusive(self, fn: Callable[[], Awaitable[None]], timeout: float) -> bool:
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
class StepResult:
    ok: bool  # False: the gradient was not finite and the weights did not move
    step: int  # the step index taken (SCAPE may join its replicas at a later one)


class StepStrategy(Protocol):
    async def step(self, t: int, microbatches: int) -> StepResult: ...


class Stepper:
    """Counts microbatches into the next step and takes it once the run's batch is in."""

    def __init__(
        self,
        ctx: StageContext,
        gate: StepGate,
        strategy: StepStrategy,
        checkpoint: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.ctx, self.gate, self.strategy, self.checkpoint = ctx, gate, strategy, checkpoint
        self.tokens = 0
        self.microbatches = 0
        # a fast tail with --eval-every: the held-out loss, scored beside the steps, never in them
        self.heldout = HeldOut.for_stage(ctx)

    def account(self, tokens: int, loss: float | None, n_loss: int) -> None:
        """A microbatch's gradients are in (its reply may go upstream now; the step comes after)."""
        self.tokens += tokens
        self.microbatches += 1
        self.ctx.metrics.microbatches += 1
        if loss is not None:
            self.ctx.metrics.add_loss(loss, n_loss)

    async def step_if_due(self) -> None:
        if self.tokens >= self.ctx.run.batch_tokens:
            await self.gate.run_exclusive(self._step, STEP_DRAIN_TIMEOUT_S)

    async def _step(self) -> None:
        ctx, m = self.ctx, self.ctx.metrics
        if self.microbatches == 0:
            return
        m.steps_begun.append((time.monotonic(), ctx.inner_step))
        result = await self.strategy.step(ctx.inner_step, self.microbatches)
        m.trained_tokens += self.tokens
        if not result.ok:
            m.skipped_steps += 1
        self.tokens = self.microbatches = 0
        ctx.inner_step = result.step + 1
        m.close_step()
        if self.heldout is not None:
            self.heldout.after_step(ctx.inner_step)  # starts a task at most; the step goes on
        every = ctx.cfg.checkpoint_every
        if every and ctx.inner_step % every == 0 and self.checkpoint is not None:
            await self.checkpoint()
        if ctx.cfg.max_steps and ctx.inner_step >= ctx.cfg.max_steps:
            ctx.stop.set()
