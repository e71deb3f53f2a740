"""The live held-out loss (``--eval-every N``): the tail scores examples no head trains on.

The held-out set is ``HELD_OUT`` examples of the run's data, chosen by the run seed
(``node.model.evaluate.split_heldout``: disjoint by prompt, so no copy of a held-out problem is
trained on), the same on every node: a head with ``--eval-every`` above 0 drops them from the
microbatches it draws (``training_examples``, called by join), and a tail scores them. Data with
fewer than ``MIN_PROMPTS`` distinct prompts holds none out and is not scored (a small file is all
training data). Each node reads its own ``--data`` and ``--eval-every``: the set is held out only
where every node of the run gets the same (``node swarm`` gives them the same; the run record
carries neither).

A fast tail starts a scoring every N of its inner steps, at most one at a time and at most one
per ``MIN_INTERVAL_S`` (``HeldOut.after_step``, called by the step; it only starts a task and
returns, so no step waits for a score). The score is the token-weighted mean next-token loss
over the held-out examples, as ``node.model.evaluate.eval_loss`` computes it on a whole model,
through the swarm's current weights:

* the other stages' weights are pulled from the most advanced ready fast peer of each stage
  (``vnode.weights``, as joiners get them: bf16, a LoRA run's adapters in fp32, over the frozen
  base this node reads from the model's own files), the tail's own are copied in the compute
  thread between two microbatches;
* the stages then run one after the other on the CPU, in a thread of this evaluator's own: each
  stage is built from the model source, loaded with its weights, run on every held-out batch,
  and dropped before the next is built, so at most one extra stage is in memory (an in-memory
  model, tiny or ``--mode pretrain``, is small: its stages are built once and kept).

A round whose weights cannot all be pulled (a stage without a ready peer, a peer that refuses:
its visitors' pulls are rate-limited) is skipped and logged; the next due step tries again.
Each score goes into the tail's metrics as (inner step, loss): the dashboard charts them beside
the training loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from node.model.adapters import add_adapters, moving_parameters
from node.model.data import ByteTokenizer, Example, as_plain_text, collate, load_examples, tokenize
from node.model.evaluate import split_heldout
from node.net import rpc
from node.stage.context import StageContext
from node.swarm.weights import WEIGHTS_HANDLER
from protocol.frames import Frame, FrameError

log = logging.getLogger("node")

HELD_OUT = 32  # examples scored: a small set, scored often, costs little
MIN_PROMPTS = 200  # distinct prompts the data needs before any is held out
MIN_INTERVAL_S = 20.0  # one score at most this often (a weight server's visitors get 1 pull per 20 s)
EVAL_BATCH = 16  # held-out examples per forward


class HeldOutError(RuntimeError):
    """This round cannot be scored (a stage's weights could not be had, or do not fit)."""


def held_out_count(examples: list[Example]) -> int:
    """How many examples the run holds out of ``examples``: none from small data."""
    prompts = len({ex.prompt for ex in examples})
    return min(HELD_OUT, prompts // 20) if prompts >= MIN_PROMPTS else 0


def split(examples: list[Example], seed: int) -> tuple[list[Example], list[Example]]:
    """(held-out examples, training examples) of the run's data, the same on every node."""
    n = held_out_count(examples)
    if not n:
        return [], examples
    return split_heldout(examples, n, seed)


def training_examples(examples: list[Example], seed: int, eval_every: int) -> list[Example]:
    """What a head trains on: its data without the held-out examples while ``--eval-every`` is on."""
    return split(examples, seed)[1] if eval_every else examples


def forward_loss(builders, batches: list[tuple[torch.Tensor, torch.Tensor]], stop=None) -> tuple[float, int]:
    """Mean next-token loss of ``batches`` (ids, labels) through the stages ``builders`` make, in
    order (each a callable returning the stage, built when its turn comes and dropped after it),
    and the labelled tokens it averages over. ``stop`` (an event): give up between two stages."""
    xs = [ids for ids, _ in batches]
    total, count = 0.0, 0
    with torch.no_grad():
        for build in builders:
            if stop is not None and stop.is_set():
                raise HeldOutError("the node is stopping")
            stage = build()
            if stage.is_tail:
                for x, (_, labels) in zip(xs, batches):
                    loss, n = stage.loss(x, labels)
                    total += float(loss) * n
                    count += n
            else:
                xs = [stage(x) for x in xs]
            del stage
    return total / max(count, 1), count


class HeldOut:
    """A fast tail's scorer of the held-out set (``for_stage`` builds one when it should run)."""

    def __init__(self, ctx: StageContext, every: int) -> None:
        self.ctx, self.every = ctx, every
        self.next_due = every
        self.last_start = -float("inf")
        self.task: asyncio.Task | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heldout")
        self._prepared: tuple | None = None  # (model source, held-out batches)
        self._kept: dict[int, torch.nn.Module] = {}  # an in-memory model's stages, built once
        self.ctx.metrics.eval_every = every
        self.rounds = self.skipped = 0

    @classmethod
    def for_stage(cls, ctx: StageContext) -> HeldOut | None:
        every = getattr(ctx.cfg, "eval_every", 0)
        emulated = getattr(ctx.stage.config, "emulate_gpu", None)  # bench: no real weights to score
        if not every or not ctx.is_tail or ctx.cfg.circuit != "fast" or emulated:
            return None
        return cls(ctx, every)

    # ------------------------------------------------------------ when (event loop)
    def after_step(self, step: int) -> None:
        """Called after each inner step: start a score when one is due; never waits for it."""
        if not self.every or step < self.next_due:
            return
        if self.task is not None and not self.task.done():
            return  # the last one still runs: this step's turn passes
        if time.monotonic() - self.last_start < MIN_INTERVAL_S:
            return
        self.next_due = step + self.every
        self.last_start = time.monotonic()
        self.task = asyncio.get_running_loop().create_task(self.score(step))

    async def score(self, step: int) -> float | None:
        """Score the held-out set at ``step``'s weights; record and return the loss (None: skipped)."""
        ctx = self.ctx
        loop = asyncio.get_running_loop()
        try:
            if self._prepared is None:
                self._prepared = await loop.run_in_executor(self.pool, self._prepare)
            if not self._prepared[1]:
                self._disable("the run's data has too few distinct prompts to hold any out")
                return None
            weights = {ctx.index: await ctx.compute(_copy_moving, ctx.stage)}
            for i in range(ctx.n_stages - 1):
                weights[i] = await self._pull(i)
            t0 = time.monotonic()
            loss, n = await loop.run_in_executor(self.pool, self._forward, weights)
        except HeldOutError as e:
            self.skipped += 1
            log.info("held-out loss at step %d skipped: %s", step, e)
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a score must never take the node down
            self.skipped += 1
            log.warning("held-out loss at step %d failed: %s: %s", step, type(e).__name__, e)
            return None
        self.rounds += 1
        ctx.metrics.eval_losses.append((step, loss))
        log.info("held-out loss %.4f at step %d (%d tokens, %.1fs)", loss, step, n, time.monotonic() - t0)
        return loss

    def _disable(self, why: str) -> None:
        if self.every:
            log.warning("no live held-out loss: %s", why)
        self.every = self.ctx.metrics.eval_every = 0

    # ------------------------------------------------------------ the weights (event loop)
    async def _pull(self, index: int) -> dict[str, torch.Tensor]:
        """Stage ``index``'s trained weights from its most advanced ready fast peer."""
        ctx = self.ctx
        peers = sorted(
            ((p, r) for p, r in ctx.routes[index].items() if r.ready and r.circuit == "fast"),
            key=lambda kv: -kv[1].inner_step,
        )
        why = "no ready peer"
        for peer, _ in peers:
            try:
                frames, _, _ = await rpc.request(
                    ctx.p2p,
                    ctx.wire,
                    peer,
                    WEIGHTS_HANDLER,
                    Frame(kind="weights", run_id=ctx.run.run_id),
                    ctx.cfg.hop_timeout * 4,
                    ctx.run.run_id,
                    stream=True,
                )
                return {k: v for f in frames for k, v in f.tensors.items()}
            except (FrameError, asyncio.TimeoutError, OSError, ConnectionError) as e:
                why = f"{peer[:12]}: {e}"
        raise HeldOutError(f"no weights of stage {index} ({why})")

    # ------------------------------------------------------------ the forward (own thread)
    def _prepare(self) -> tuple:
        """The model source and the held-out batches (once, in this scorer's thread)."""
        from node.model.loading import open_model, open_pretrain_model

        ctx, run = self.ctx, self.ctx.run
        if run.mode == "pretrain":
            k = int(run.codec.get("k", 0)) if run.codec.get("codec") == "subspace" else 0
            source = open_pretrain_model(ctx.cfg.model, seed=run.seed, subspace_k=k)
        else:
            source = open_model(ctx.cfg.model, seed=run.seed)
        held = split(load_examples(ctx.cfg.data, seed=run.seed), run.seed)[0]
        if run.mode == "pretrain":
            held = as_plain_text(held)
        tok = source.tokenizer() or ByteTokenizer(source.config.vocab_size)
        pad = tok.eos_token_id if tok.eos_token_id is not None else 0
        pairs = [tokenize(tok, ex, run.seq_len) for ex in held]
        batches = [collate(pairs[i : i + EVAL_BATCH], pad) for i in range(0, len(pairs), EVAL_BATCH)]
        return source, batches

    def _stage(self, index: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Stage ``index`` on the CPU in fp32, holding ``weights`` (its moving parameters)."""
        source, run = self._prepared[0], self.ctx.run
        stage = self._kept.get(index)
        if stage is None:
            stage = source.load_stage(run.stages, index, torch.device("cpu"), torch.float32)
            if run.finetune.mode == "lora":
                add_adapters(stage, run.finetune, run.seed)
            stage.train(False)
            if not source.reloads_weights:  # its tensors are the source's own: build it once
                self._kept[index] = stage
        own = moving_parameters(stage)
        if set(weights) != set(own) or any(weights[n].shape != p.shape for n, p in own.items()):
            raise HeldOutError(f"the weights of stage {index} do not fit its parameters")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(weights[n].to(p.dtype))
        return stage

    def _forward(self, weights: dict[int, dict[str, torch.Tensor]]) -> tuple[float, int]:
        builders = [lambda i=i: self._stage(i, weights.pop(i)) for i in range(self.ctx.n_stages)]
        return forward_loss(builders, self._prepared[1], self.ctx.stop)

    def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _copy_moving(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's moving parameters, copied to the CPU in fp32 (in the compute thread: between two
    microbatches, so never half-way through a step)."""
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in moving_parameters(stage).items()}
