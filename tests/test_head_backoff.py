"""A head whose next stage has no live peer backs off instead of dropping microbatches at full speed.

Found by the chaos benchmark (bench/reliability/chaos.py): with the sole tail killed, the head drew, computed
and dropped ~20 microbatches a second until the tail came back (664 drops in one restart).
"""

import asyncio
import time

from node import runtime as rt_mod
from node.config import NodeConfig
from node.model.data import ByteTokenizer, load_examples, microbatches
from node.model.loading import load_model
from node.model.stages import build_stage
from node.runtime import StageRuntime
from protocol.records import RunRecord


def _head(run_id: str) -> StageRuntime:
    """The head of a 2-stage tiny run with no DHT: stage 1 has no live peer."""
    ranges = [[0, 1], [1, 2]]
    model = load_model("tiny:2")[0]
    run = RunRecord(
        run_id=run_id, model_name="tiny", model_hash="x", num_layers=2, hidden=model.config.hidden_size,
        stages=ranges, codec={"codec": "dense", "wire_dtype": "bfloat16"},
    )  # fmt: skip
    cfg = NodeConfig(run_id=run_id, hop_timeout=1.0, max_inflight=4)
    data = microbatches(load_examples("arithmetic"), ByteTokenizer(512), 2, 32, seed=0)
    return StageRuntime(cfg, run, 0, build_stage(model, ranges, 0), None, "QmHead", data)


def _drive(rt: StageRuntime, seconds: float) -> None:
    """Run the head's loop for ``seconds``, then stop it (a slot in back-off wakes at stop)."""

    async def drive():
        task = asyncio.create_task(rt.head_loop())
        await asyncio.sleep(seconds)
        rt.stop.set()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(drive())
    finally:
        rt.pool.shutdown(wait=True)
        rt.ckpt_pool.shutdown(wait=True)


def test_head_without_downstream_drops_at_a_bounded_rate(monkeypatch):
    from node.swarm import membership

    monkeypatch.setattr(rt_mod, "DROP_BACKOFF_S", 0.5)
    monkeypatch.setattr(membership, "EMPTY_STAGE_NOTICE_S", 0.0)  # taken as empty at once: no holding
    rt = _head("backoff")
    _drive(rt, 2.0)
    # 4 slots, each held 0.5 s per drop: at most ~4 * (2.0 / 0.5) + 4 drops in 2 s (was hundreds)
    assert 1 <= rt.metrics.dropped <= 24, rt.metrics.dropped


def test_head_says_once_that_the_next_stage_is_empty_and_backs_off(monkeypatch, caplog):
    """Past the notice time: one line naming the empty stage, then silent drops at a growing interval."""
    from node.swarm import membership

    monkeypatch.setattr(rt_mod, "DROP_BACKOFF_S", 0.2)
    monkeypatch.setattr(membership, "EMPTY_STAGE_NOTICE_S", 1.0)
    rt = _head("empty")
    caplog.set_level("INFO", logger="node")
    _drive(rt, 6.0)
    lines = [r.getMessage() for r in caplog.records if "no live peer serves stage 1" in r.getMessage()]
    notices = [m for m in lines if "taken as empty" in m]
    assert len(notices) == 1, lines
    # the first second's microbatches were held (one line says so), not dropped; after the notice
    # the drops are silent
    holds = [m for m in lines if "holding microbatches back" in m]
    assert len(holds) == 1 and rt.metrics.held >= 4, (holds, rt.metrics.held)
    assert len(lines) - 2 < rt.metrics.dropped, (len(lines), rt.metrics.dropped)
    # a constant 0.2 s hold would drop ~4 * 6 / 0.2 = 120 in 6 s; back-off doubling to 30 s far fewer
    assert rt.metrics.dropped <= 4 * (1.0 / 0.2 + 1) + 4 * 5, rt.metrics.dropped


def test_head_holds_a_microbatch_while_the_next_stage_is_empty_for_a_moment(monkeypatch):
    """A next stage empty for a moment (its only node restarting): the head's microbatches wait for
    it and are all trained, none dropped; the wait is counted."""
    from node.stage.hop import HopFailed

    monkeypatch.setattr(rt_mod, "DROP_BACKOFF_S", 0.2)
    rt = _head("hold")
    back = time.monotonic() + 1.0  # the tail is back after a second
    served: list[int] = []

    async def downstream(ids, labels, step, mb, path, tokens):  # the hop past the head's own compute
        if time.monotonic() < back:
            raise HopFailed("no live peer serves stage 1", retry=False)
        served.append(mb)
        return {"loss": 1.0, "tokens": tokens}, b""

    rt.pipeline.run_rest = downstream
    _drive(rt, 2.0)
    assert rt.metrics.dropped == 0, rt.metrics.dropped
    assert rt.metrics.held >= 4 and len(served) > 4, (rt.metrics.held, len(served))
    assert len(set(served[:4])) == 4  # the four held in the empty second went through, each once
