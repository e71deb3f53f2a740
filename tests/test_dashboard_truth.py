"""The dashboard tells the truth about what trains (node/watch): tokens/s, held-out loss, steps.

Metrics samples recorded from real local swarms (tiny:2:64 on two shared cores) go through the
dashboard's own path, ``Collector.poll`` -> ``Rates`` -> ``build_state``, with only the DHT and the
metrics streams replayed:

* a one-stage swarm of two replicas training at ~24k tokens/s: the old collector summed the
  counters of nodes whose role is "tail", and a one-stage run's nodes call themselves "head",
  so the training panel said 0 tokens/s (and showed no loss);
* a 3-node, 2-stage swarm whose stage-0 replica was killed: the survivor's DiLoCo round waited out
  its partner and nothing trained for ~18 s. The trained rate falls to 0 then (the truth), while
  the stage records kept announcing their last compute rates (56647 and 39014 tok/s): the page
  shows both, named apart, and the trained rate comes back when training does;
* a tail that does not answer is an unknown rate ("-"), not 0; a reply served twice from the
  node's one-second cache is not a second with nothing trained.

Then one live swarm of two stages: the state shows a positive tokens/s for the run and for each
stage while it trains, and a finite held-out loss that the tail scored through the other stage's
pulled weights, which is not the training loss (~45 s on two cores).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from node.net.wire import Wire
from node.watch import collect
from node.watch import state as st
from node.watch.collect import Collector
from node.watch.stream import parse_reply, reply_frame
from protocol.frames import encode_frame
from protocol.records import RunRecord, StageRecord
from tests.conftest import wait_for

RUN = "truth-test"


def _run(n_stages: int) -> RunRecord:
    return RunRecord(
        run_id=RUN,
        model_name="tiny-llama-2x64",
        model_hash="0" * 64,
        num_layers=2,
        hidden=64,
        stages=[[0, 2]] if n_stages == 1 else [[0, 1], [1, 2]],
    )


def _node(peer: str, stage: int, role: str, t: float, tokens: int, step: int, last: bool = False) -> dict:
    """A node's metrics as the dashboard parses them (through the real reply frame); ``last``: a
    node of the last stage, with a loss per step."""
    m = {
        "peer_id": peer,
        "stage": stage,
        "role": role,
        "circuit": "fast",
        "device": "cpu",
        "time": t,
        "trained_tokens": tokens,
        "inner_step": step,
        "step_losses": [1.0] * step if last else [],
        "links": [],
    }
    return parse_reply(encode_frame(reply_frame(m, RUN)), RUN)


# one-stage swarm (node swarm --nodes 2 --stages 1 --model tiny:2:64): per dashboard poll, each
# node's (snapshot time, trained tokens, inner step) as its metrics stream sent them
ONE_STAGE = [
    (1796673417.758, {"A": (1796673417.765, 482928, 717), "B": (1796673417.764, 484832, 720)}),
    (1796673419.779, {"A": (1796673419.942, 510672, 758), "B": (1796673419.942, 511760, 760)}),
    (1796673421.951, {"A": (1796673421.960, 533656, 792), "B": (1796673421.958, 533792, 792)}),
    (1796673423.967, {"A": (1796673423.973, 564664, 838), "B": (1796673423.973, 565480, 839)}),
]

# two stages, 3 nodes (heads H1, H2 on stage 0, tail T on stage 1), polls 2 s apart; H1 is
# SIGKILLed after the third poll, and the stage records keep the last announced compute rates
TWO_STAGE = [
    (884.3, {"H1": (182088, 270), "H2": (181288, 269), "T": (364736, 726)}, (95454, 33573)),
    (886.4, {"H1": (202488, 300), "H2": (201008, 298), "T": (404312, 807)}, (56025, 38906)),
    (888.4, {"H1": (217312, 321), "H2": (218008, 323), "T": (435320, 872)}, (92012, 36545)),
    (919.4, {"H2": (437512, 650), "T": (873496, 1768)}, (103257, 39014)),
    (921.4, {"H2": (437512, 650), "T": (873496, 1768)}, (104261, 39014)),
    (925.5, {"H2": (437512, 650), "T": (873496, 1768)}, (56647, 39014)),
    (929.6, {"H2": (437512, 650), "T": (873496, 1768)}, (56647, 39014)),
    (933.6, {"H2": (437512, 650), "T": (873496, 1768)}, (56647, 39014)),
    (939.7, {"H2": (463344, 687), "T": (899192, 1834)}, (44984, 32300)),
    (941.7, {"H2": (501696, 744), "T": (937272, 1920)}, (51201, 34390)),
]


def _replay(run: RunRecord, polls: list[tuple[float, list[dict], dict[str, dict | str]]]) -> list[dict]:
    """Each poll through ``Collector.poll``: (time, stage records, each peer's metrics or why it
    could not be read) -> the states the page would have drawn."""
    now = {"t": 0.0}
    c = Collector(None, None, Wire(), RUN, clock=lambda: now["t"])
    answers: dict[str, dict | str] = {}
    records: list = []

    async def run_record():
        return run

    async def stage_records(dht, run_id, n, timeout):
        return records

    async def metrics(peer):
        return answers[peer]

    c._run_record, c._metrics = run_record, metrics
    out = []

    async def main():
        orig = collect.read_stage_records
        collect.read_stage_records = stage_records
        try:
            for t, recs, ans in polls:
                now["t"] = t
                records[:] = recs
                answers.clear()
                answers.update(ans)
                out.append(await c.poll())
        finally:
            collect.read_stage_records = orig

    asyncio.run(main())
    return out


def test_a_one_stage_swarm_shows_the_tokens_it_trains():
    run = _run(1)
    polls = []
    for t, nodes in ONE_STAGE:
        recs = [{p: StageRecord(throughput=26000.0, inner_step=s) for p, (_, _, s) in nodes.items()}]
        polls.append(
            (t, recs, {p: _node(p, 0, "head", nt, n, s, last=True) for p, (nt, n, s) in nodes.items()})
        )
    states = _replay(run, polls)
    assert states[0]["training"]["tokens_per_s"] is None  # one sample: no rate yet, not 0
    for s in states[1:]:
        tps = s["training"]["tokens_per_s"]
        assert tps is not None and tps > 15000, s["training"]  # it was 0: no node called itself tail
        assert s["stages"][0]["tokens_per_s"] == tps and s["stages"][0]["role"] == "head+tail"
    first, last = ONE_STAGE[0][1], ONE_STAGE[-1][1]
    want = sum(last[p][1] - first[p][1] for p in "AB") / (last["A"][0] - first["A"][0])
    assert states[-1]["training"]["tokens_per_s"] == pytest.approx(want, rel=0.01)
    assert states[-1]["training"]["tokens"] == sum(n for _, n, _ in last.values())
    assert set(states[-1]["loss"]) == {"A", "B"}  # their losses are the run's training loss
    assert "drew and scored" in states[-1]["stages"][0]["steps_count"]


def test_a_stall_reads_0_trained_while_stages_keep_announcing_their_compute_rate():
    run = _run(2)
    stage_of = {"H1": 0, "H2": 0, "T": 1}
    polls = []
    for t, nodes, (c0, c1) in TWO_STAGE:
        recs = [
            {
                p: StageRecord(throughput=c0 / (len(nodes) - 1), inner_step=s)
                for p, (_, s) in nodes.items()
                if p != "T"
            },
            {"T": StageRecord(throughput=c1, inner_step=nodes["T"][1])},
        ]
        ans = {
            p: _node(p, stage_of[p], "tail" if p == "T" else "head", t, n, s, p == "T")
            for p, (n, s) in nodes.items()
        }
        polls.append((t, recs, ans))
    states = _replay(run, polls)
    rates = [s["training"]["tokens_per_s"] for s in states]
    assert rates[0] is None and all(r > 15000 for r in rates[1:3]), rates  # training: ~19k tokens/s
    # the stall: the tail's counter does not move for 10 s of its clock -> 0, stage by stage too
    assert rates[7] == 0 and [x["tokens_per_s"] for x in states[7]["stages"]] == [0, 0]
    # ... while the stage records still announce tens of thousands of tokens/s of compute
    assert states[7]["stages"][0]["throughput"] > 50000 and states[7]["stages"][1]["throughput"] > 30000
    assert rates[-2] > 0 and rates[-1] > rates[-2], rates  # and back once it trains again
    # every peer's step says what it counts
    assert [x["role"] for x in states[-1]["stages"]] == ["head", "tail"]
    assert "loss it computed" in states[-1]["training"]["tail_steps_count"]


def test_an_unanswering_tail_is_an_unknown_rate_and_a_cached_reply_no_zero():
    run = _run(2)
    recs = [{"H": StageRecord(throughput=1e4)}, {"T": StageRecord(throughput=1e4)}]

    def poll(t: float, tail_time: float, tail_tokens: int | None) -> tuple:
        tail = (
            "no answer within 5 s"
            if tail_tokens is None
            else _node("T", 1, "tail", tail_time, tail_tokens, 1, True)
        )
        return (t, recs, {"H": _node("H", 0, "head", t, int(t * 1000), 1), "T": tail})

    states = _replay(run, [poll(0, 0, 0), poll(2, 2, 2000), poll(4, 4, None), poll(6, 6, None)])
    assert states[1]["training"]["tokens_per_s"] == pytest.approx(1000)
    assert states[3]["training"]["tokens_per_s"] is None  # the old collector said 0
    assert states[3]["stages"][0]["tokens_per_s"] == pytest.approx(1000)  # the head still answers
    # a node's one-second reply cache: the same snapshot read by two polls is one sample, not a stop
    states = _replay(run, [poll(0, 0, 0), poll(2, 1.5, 1500), poll(3, 1.5, 1500)])
    assert states[2]["training"]["tokens_per_s"] == pytest.approx(1000)


def test_rates_window_and_restart():
    r = st.Rates(window=10)
    node = {"time": 0.0, "trained_tokens": 0}
    assert r.update({"a": node}) == {"a": None}
    for t in range(2, 30, 2):
        got = r.update({"a": {"time": float(t), "trained_tokens": 100 * t}})
    assert got["a"] == pytest.approx(100)
    # a restarted node counts from 0 again: a fresh start, never a negative rate
    assert r.update({"a": {"time": 31.0, "trained_tokens": 10}}) == {"a": None}
    assert r.update({"a": {"time": 33.0, "trained_tokens": 210}})["a"] == pytest.approx(100)
    assert r.update({}) == {} and not r._samples  # a peer gone is forgotten


# ---------------------------------------------------------------------- a live swarm


def _url(path, proc) -> str | None:
    text = path.read_text()
    assert proc.poll() is None, text[-2000:]
    m = re.search(r"^dashboard: (http://\S+)", text, re.M)
    return m.group(1) if m else None


def test_a_training_swarm_shows_its_tokens_per_s_and_a_held_out_loss(tmp_path):
    cmd = [sys.executable, "-m", "node", "swarm", "--codec", "dense", "--nodes", "2", "--stages", "2"]
    cmd += ["--steps", "1000000", "--model", "tiny:2:64", "--no-rebalance", "--dashboard", "0"]
    cmd += ["--eval-every", "5", "--report", str(tmp_path / "r"), "--timeout", "300"]
    with open(tmp_path / "swarm.out", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for(lambda: _url(tmp_path / "swarm.out", proc), 120, "the dashboard's URL")

        def shown() -> dict | None:
            s = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
            t = s.get("training") or {}
            return s if (t.get("tokens_per_s") or 0) > 0 and t.get("eval_loss") is not None else None

        s = wait_for(shown, 120, "a positive tokens/s and a held-out loss on the dashboard")
        t = s["training"]
        assert all(x["tokens_per_s"] > 0 for x in s["stages"]), s["stages"]
        assert t["eval_every"] == 5 and math.isfinite(t["eval_loss"])
        (tail,) = s["eval"]
        step = s["eval"][tail]["steps"][-1]
        loss = s["loss"][tail]
        train = loss["values"][step - 1 - loss["first_step"]]  # the training loss of that step
        assert abs(t["eval_loss"] - train) > 1e-4, (t["eval_loss"], train)
        assert "loss it computed" in t["tail_steps_count"]
        # every trained token crossed the one dense bf16 boundary forward and its gradient came back:
        # 2 x 64 x 2 B at least; the held-out scoring's weight pulls and frame headers come on top
        assert t["sent_per_token"] >= 2 * 64 * 2, t["sent_per_token"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            import os

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
