"""What a stage must keep across a restart: its weights, optimizer and registered stateful parts.

Parts with a ``state_dict``/``load_state_dict`` pair (the spectral filter, the outer optimizer,
SCAPE) register under a name; a checkpoint is a consistent copy of all of them taken in the
compute thread between steps, written in the background by its own thread.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Protocol

import torch

from node.model.adapters import AdapterError, load_trained_state, trained_state
from node.model.checkpoint import CheckpointError, checkpoint_dir, clone_state, note_failure, save_checkpoint
from node.model.devices import return_freed_memory
from node.stage.context import StageContext

log = logging.getLogger("node")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class StageState:
    def __init__(self, ctx: StageContext, opt: torch.optim.Optimizer) -> None:
        self.ctx, self.opt = ctx, opt
        self.parts: dict[str, Stateful] = {}  # saved as the checkpoint's extra states
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self.resumed_from: int | None = None

    def register(self, name: str, part: Stateful) -> None:
        self.parts[name] = part

    def directory(self) -> str:
        ctx = self.ctx
        return checkpoint_dir(ctx.cfg.state_dir, ctx.run.run_id, ctx.index)

    def snapshot(self) -> dict:
        """A consistent copy of everything a resume needs (runs in the compute thread, between steps)."""
        ctx = self.ctx
        return clone_state(
            {
                "stage_state": trained_state(ctx.stage),  # the adapters only, over a frozen base
                "optimizer_state": self.opt.state_dict(),
                "extra_states": {name: part.state_dict() for name, part in self.parts.items()},
                "counters": {
                    "inner_step": ctx.inner_step,
                    "trained_tokens": ctx.metrics.trained_tokens,
                    "run_id": ctx.run.run_id,
                    "stage": ctx.index,
                    "model_hash": ctx.run.model_hash,
                    "layers": list(ctx.run.stages[ctx.index]),
                    "finetune": asdict(ctx.run.finetune),
                },
            }
        )

    async def checkpoint(self, wait: bool) -> None:
        """Snapshot now, write in the background (or wait for it); skip if the last write still runs."""
        if self._pending is not None and not self._pending.done():
            if not wait:
                return
            await asyncio.wrap_future(self._pending)
        snap = await self.ctx.compute(self.snapshot)
        self._pending = self.pool.submit(self._write, snap)
        if wait:
            await asyncio.wrap_future(self._pending)

    def _write(self, snap: dict) -> None:
        try:
            path = save_checkpoint(self.directory(), **snap, keep=self.ctx.cfg.keep_checkpoints)
            self.ctx.metrics.checkpoints += 1
            log.info("checkpoint %s", path)
        except Exception as e:  # a full disk must not stop training; the previous checkpoint stays
            why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            log.warning("checkpoint failed: %s", why)
            note_failure(self.directory(), why)  # for export, should no checkpoint be there
        finally:
            # the pool's work item holds ``snap`` until this returns: drop the clones now, and give
            # their pages back rather than keep a checkpoint's worth of free heap between checkpoints
            snap.clear()
            return_freed_memory()

    def restore(self, ck) -> None:
        """Load a checkpoint of this run and stage (before serving)."""
        ctx, c = self.ctx, ck.counters
        if (
            c.get("run_id") != ctx.run.run_id
            or c.get("stage") != ctx.index
            or c.get("model_hash") != ctx.run.model_hash
        ):
            raise CheckpointError(f"checkpoint {ck.path} is of another run, stage or model")
        try:
            load_trained_state(ctx.stage, ck.stage_state)
        except AdapterError as e:
            raise CheckpointError(f"checkpoint {ck.path}: {e}") from None
        self.opt.load_state_dict(ck.optimizer_state)
        for name, part in self.parts.items():
            if name in ck.extra_states:
                part.load_state_dict(ck.extra_states[name])
        ctx.inner_step = int(c["inner_step"])
        ctx.metrics.trained_tokens = int(c.get("trained_tokens", 0))
        self.resumed_from = int(c["inner_step"])
