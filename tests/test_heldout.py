"""The live held-out loss (node/stage/heldout.py), without a swarm.

The held-out split is disjoint by prompt from what a head trains on, and the same on every node;
the loss through the stages one at a time equals ``node.model.evaluate.eval_loss`` on the whole
model; a tail driven step by step (a one-stage run, so no other stage's weights are pulled)
records a finite held-out loss at the due steps, equal to the whole model's at those weights and
not the training loss, and with ``--eval-every 0`` records none. The multi-stage path (weights
pulled from the other stages' peers) runs in tests/test_dashboard_truth.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from node.config import NodeConfig
from node.model.data import ByteTokenizer, Example, load_examples, microbatches
from node.model.evaluate import eval_loss
from node.model.loading import open_model
from node.stage import heldout
from node.stage.compute import Compute
from node.stage.context import StageContext
from node.stage.metrics import Metrics
from node.stage.step import StepGate, Stepper, StepResult
from node.watch import state as st
from node.watch.prom import render
from node.watch.stream import parse_reply, reply_frame
from protocol.frames import encode_frame
from protocol.records import RunRecord

MODEL = "tiny:2:64"


def _run(stages: list[list[int]], batch_tokens: int = 96) -> RunRecord:
    return RunRecord(
        run_id="heldout-test",
        model_name="tiny-llama-2x64",
        model_hash="0" * 64,
        num_layers=2,
        hidden=64,
        stages=stages,
        seq_len=32,
        batch_tokens=batch_tokens,
        seed=3,
    )


def test_the_split_is_disjoint_by_prompt_the_same_everywhere_and_none_from_small_data():
    examples = load_examples("arithmetic", seed=3)
    held, train = heldout.split(examples, 3)
    assert len(held) == heldout.HELD_OUT
    assert not {ex.prompt for ex in held} & {ex.prompt for ex in train}
    assert len(train) + sum(ex.prompt in {h.prompt for h in held} for ex in examples) == len(examples)
    assert [ex.prompt for ex in heldout.split(load_examples("arithmetic", seed=3), 3)[0]] == [
        ex.prompt for ex in held
    ]
    # a head without --eval-every trains on everything; a small file holds nothing out
    assert heldout.training_examples(examples, 3, 0) is examples
    assert heldout.training_examples(examples, 3, 50) == train
    small = [Example(f"q{i}", " a") for i in range(50)]
    assert heldout.split(small, 3) == ([], small)


def test_the_loss_through_the_stages_equals_the_whole_models():
    source = open_model("tiny:4:64", seed=1)
    ranges = [[0, 1], [1, 3], [3, 4]]
    tok = ByteTokenizer(source.config.vocab_size)
    held = heldout.split(load_examples("arithmetic", seed=1), 1)[0]
    from node.model.data import collate, tokenize

    pairs = [tokenize(tok, ex, 32) for ex in held]
    batches = [collate(pairs[i : i + 16], tok.eos_token_id) for i in range(0, len(pairs), 16)]
    builders = [lambda i=i: source.load_stage(ranges, i, torch.device("cpu")) for i in range(3)]
    loss, n = heldout.forward_loss(builders, batches)
    want = eval_loss(source.model, tok, held, seq_len=32, batch=16)
    assert n > 0 and math.isfinite(loss)
    assert loss == pytest.approx(want, abs=1e-5)


def _drive(tmp_path, every: int, steps: int = 6) -> tuple[Metrics, list[float], object]:
    """A one-stage run's tail (also its head) trained ``steps`` inner steps with AdamW, as the node
    steps (the Stepper); each held-out score it starts is awaited before the next microbatch, and
    the whole model's eval_loss at that moment is noted beside it."""
    run = _run([[0, 2]])
    source = open_model(MODEL, seed=run.seed)
    stage = source.load_stage(run.stages, 0, torch.device("cpu"))
    cfg = NodeConfig(model=MODEL, data="arithmetic", eval_every=every, state_dir=str(tmp_path))
    ctx = StageContext(
        cfg=cfg, run=run, index=0, stage=stage, peer_id="tail", compute=Compute(), metrics=Metrics()
    )
    opt = torch.optim.AdamW(ctx.params, lr=1e-2)
    tok = ByteTokenizer(source.config.vocab_size)
    held = heldout.split(load_examples("arithmetic", seed=run.seed), run.seed)[0]
    train = heldout.training_examples(load_examples("arithmetic", seed=run.seed), run.seed, every)
    data = microbatches(train, tok, 8, run.seq_len, seed=0)
    whole: list[float] = []

    class AdamW:
        async def step(self, t: int, microbatches: int) -> StepResult:
            await ctx.compute(opt.step)
            opt.zero_grad()
            return StepResult(True, t)

    async def main() -> Stepper:
        stepper = Stepper(ctx, StepGate(4), AdamW(), None)
        while ctx.inner_step < steps:
            ids, labels = next(data)
            loss, n, _ = await ctx.compute(ctx.compute.tail, stage, ids, labels, True)
            stepper.account(ids.numel(), loss, n)
            await stepper.step_if_due()
            task = stepper.heldout.task if stepper.heldout is not None else None
            if task is not None and not task.done():
                await task
                whole.append(eval_loss(source.model, tok, held, seq_len=run.seq_len, batch=16))
        if stepper.heldout is not None:
            stepper.heldout.shutdown()
        return stepper

    stepper = asyncio.run(main())
    return ctx.metrics, whole, stepper


def test_a_tail_scores_the_held_out_set_every_n_steps_beside_training(tmp_path, monkeypatch):
    monkeypatch.setattr(heldout, "MIN_INTERVAL_S", 0.0)  # due every 2 steps, not every 20 s
    m, whole, stepper = _drive(tmp_path, every=2)
    assert [s for s, _ in m.eval_losses] == [2, 4, 6] and m.eval_every == 2
    for (step, loss), want in zip(m.eval_losses, whole):
        assert math.isfinite(loss)
        assert loss == pytest.approx(want, abs=1e-5)  # the model's loss at that step's weights
        assert abs(loss - m.step_losses[step - 1]) > 1e-3  # not the training loss of that step
    assert m.eval_losses[-1][1] < m.eval_losses[0][1]  # it trains: the held-out loss falls too

    # through the metrics stream into the dashboard's state
    node = {"peer_id": "tail", "stage": 0, "role": "head", "circuit": "fast", "time": 1.0}
    node.update(trained_tokens=m.trained_tokens, step_losses=m.step_losses, inner_step=6)
    node.update(eval_every=m.eval_every, eval_losses=[list(x) for x in m.eval_losses])
    got = parse_reply(encode_frame(reply_frame(node, "heldout-test")), "heldout-test")
    s = st.build_state(_run([[0, 2]]), [{}], {"tail": got}, {}, [], 1.0)
    assert s["training"]["eval_loss"] == pytest.approx(m.eval_losses[-1][1])
    assert s["training"]["eval_step"] == 6 and s["eval"]["tail"]["steps"] == [2, 4, 6]
    fams = text_string_to_metric_families(render(s).decode())
    held = {x.labels["peer"]: x.value for f in fams for x in f.samples if x.name == "vnode_heldout_loss"}
    assert held == {"tail": pytest.approx(m.eval_losses[-1][1])}  # for Grafana too


def test_with_eval_every_0_a_tail_scores_nothing(tmp_path):
    m, whole, stepper = _drive(tmp_path, every=0, steps=4)
    assert stepper.heldout is None and m.eval_losses == [] and m.eval_every == 0 and not whole
    node = {"peer_id": "tail", "stage": 0, "role": "head", "circuit": "fast", "time": 1.0}
    node.update(trained_tokens=m.trained_tokens, step_losses=m.step_losses, inner_step=4)
    node.update(eval_every=m.eval_every, eval_losses=[list(x) for x in m.eval_losses])
    got = parse_reply(encode_frame(reply_frame(node, "heldout-test")), "heldout-test")
    s = st.build_state(_run([[0, 2]]), [{}], {"tail": got}, {}, [], 1.0)
    assert s["training"]["eval_loss"] is None and s["training"]["eval_every"] == 0 and s["eval"] == {}
