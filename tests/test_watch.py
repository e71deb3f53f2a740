"""The dashboard's decisions and wire format, without a swarm (node/watch).

The bottleneck, the events derived from two polls of stage records, the link table against
dense, the metrics reply's round trip and its refusal of what a node would not send, the
Prometheus text, the HTTP routes, and a real p2pd pair: a peer that answers the metrics stream
with garbage, too much, or nothing is unreachable, and a real ``MetricsServer`` is read back.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.net.rpc import open_stream
from node.net.wire import Wire
from node.watch import state as st
from node.watch.collect import Collector
from node.watch.prom import render
from node.watch.stream import (
    LOSS_KEPT,
    METRICS_HANDLER,
    REPLY_BYTES,
    MetricsError,
    MetricsServer,
    fetch,
    parse_reply,
    reply_frame,
)
from node.watch.web import DashboardServer
from protocol.frames import Frame, decode_frame, encode_frame
from protocol.records import RunRecord, StageRecord

RUN = "watch-test"


def _rec(tp: float, ready: bool = True, circuit: str = "fast") -> StageRecord:
    return StageRecord(circuit=circuit, throughput=tp, ready=ready, inner_step=3)


def _metrics(peer: str, stage: int, role: str, losses: int = 0, **kw) -> dict:
    """A runtime's metrics_dict, as much of it as the stream reads."""
    return {
        "peer_id": peer,
        "stage": stage,
        "role": role,
        "circuit": "fast",
        "device": "cpu",
        "inner_step": losses,
        "step_losses": [5.0 - 0.001 * i for i in range(losses)]
        if role == "tail"
        else [],  # the tail has a loss
        "trained_tokens": 100 * losses,
        "microbatches": 2 * losses,
        "dropped_microbatches": 1,
        "rejected_frames": 0,
        "throughput": 1234.5,
        "compute_s": 1.5,
        "links": [{"boundary": 0, "direction": "forward", "bytes": 1300, "tokens": 10, "frames": 1}],
        "outer_rounds": [{"skipped": False, "bytes_sent": 10, "dense_bytes": 40}, {"skipped": True}],
        "outer_alone": 2,
        "memory": {"rss": 1 << 20},
        "dp": {"mode": "diloco"},
        "time": 1.0,
        **kw,
    }


def _run(n_stages: int = 2) -> RunRecord:
    return RunRecord(
        run_id=RUN,
        model_name="tiny",
        model_hash="0" * 64,
        num_layers=2 * n_stages,
        hidden=64,
        stages=[[2 * i, 2 * i + 2] for i in range(n_stages)],
    )


# ---------------------------------------------------------------------- pure decisions


def test_the_bottleneck_is_the_stage_with_the_least_summed_throughput():
    assert st.bottleneck([{"a": _rec(100), "b": _rec(100)}, {"c": _rec(150)}]) == 1
    assert st.bottleneck([{"a": _rec(100)}, {"c": _rec(150)}]) == 0
    assert st.bottleneck([{"a": _rec(100)}, {}]) == 1  # an empty stage: nothing trains
    assert st.bottleneck([{}, {}]) is None
    # anchors do not carry the fast circuit's work
    assert st.bottleneck([{"a": _rec(100), "x": _rec(1e6, circuit="anchor")}, {"c": _rec(150)}]) == 0


def test_events_are_the_differences_between_two_polls():
    before = {"a": (0, True), "b": (1, True), "c": (1, False)}
    after = {"a": (1, True), "c": (1, True), "d": (0, False), "e": (0, True)}
    events = st.diff_events(before, after, 7.0, known={"a", "b", "c", "e"})
    assert [(e["kind"], e["peer"], e["stage"]) for e in events] == [
        ("join", "d", 0),
        ("rejoin", "e", 0),
        ("leave", "b", 1),
        ("move", "a", 1),
        ("ready", "c", 1),
    ]
    assert events[3]["from"] == 0 and all(e["time"] == 7.0 for e in events)
    assert st.diff_events(None, after, 7.0, set()) == []  # the first poll saw no one join
    assert st.diff_events(after, after, 8.0, set(after)) == []


def test_reach_follows_the_announced_addresses():
    relay = "/ip4/1.2.3.4/tcp/1/p2p/QmRelay/p2p-circuit/p2p/QmPeer"
    assert st.reach(["/ip4/127.0.0.1/tcp/5"]) == "direct"
    assert st.reach(["/ip4/127.0.0.1/tcp/5", relay]) == "relayed"
    assert st.reach([]) == "unknown"
    # a record behind NAT (node.swarm.reverse) is reversed whatever it announces
    assert st.reach(["/ip4/10.0.0.2/tcp/5"], "reverse") == "reversed"
    assert st.reach(["/ip4/10.0.0.2/tcp/5"], "direct") == "direct"


def test_link_rows_compare_bytes_per_token_with_dense():
    run = _run()
    rows = st.link_rows(
        {"a": parse_reply(encode_frame(reply_frame(_metrics("a", 0, "head"), RUN)), RUN)}, run
    )
    assert rows == [
        {
            "boundary": 0,
            "direction": "forward",
            "bytes": 1300,
            "tokens": 10,
            "bytes_per_token": 130.0,
            "dense_bytes_per_token": 128,  # hidden 64 in bf16
            "ratio": 130.0 / 128,
        }
    ]


def test_the_probe_estimates_the_distance_between_replicas():
    import torch

    from node.watch.probe import PROBE_N, Probe

    torch.manual_seed(0)
    a, b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.copy_(pa + 0.01 * torch.randn_like(pa))
    true = sum(((pa - pb) ** 2).sum() for pa, pb in zip(a.parameters(), b.parameters())).sqrt().item()

    def node(module, stage: int = 1, seed: int = 7) -> dict:
        size, values = Probe(module, seed, stage).sample()
        return {"stage": stage, "circuit": "fast", "probe_size": size, "probe": values.tolist()}

    est = st.replica_distance({"a": node(a), "b": node(b)})
    assert set(est) == {1} and est[1] == pytest.approx(true, rel=0.1)  # 1024 of 65792 coordinates
    assert len(node(a)["probe"]) == PROBE_N
    assert st.replica_distance({"a": node(a), "a2": node(a)}) == {1: 0.0}  # the same coordinates alike
    assert st.replica_distance({"a": node(a, seed=7), "b": node(b, seed=8)})[1] > 2 * true  # others: not
    assert st.replica_distance({"a": node(a), "c": node(torch.nn.Linear(8, 8))}) == {}  # unlike stages
    assert st.replica_distance({"a": node(a)}) == {}


# ---------------------------------------------------------------------- the metrics reply


def _reply(m: dict) -> dict:
    return parse_reply(encode_frame(reply_frame(m, RUN)), RUN)


def test_a_reply_round_trips_and_keeps_the_last_losses():
    got = _reply(_metrics("p", 1, "tail", losses=LOSS_KEPT + 88))
    assert got["peer_id"] == "p" and got["stage"] == 1 and got["role"] == "tail" and got["device"] == "cpu"
    assert len(got["losses"]) == LOSS_KEPT and got["losses_first"] == 88
    assert got["losses"][0] == pytest.approx(5.0 - 0.088)
    assert (got["outer_committed"], got["outer_skipped"], got["outer_bytes"]) == (1, 3, 10)
    assert got["links"] == [{"boundary": 0, "direction": "forward", "bytes": 1300, "tokens": 10}]
    assert got["throughput"] == 1234.5 and got["memory_rss"] == 1 << 20


def _frame(**kw) -> bytes:
    f = reply_frame(_metrics("p", 0, "head", losses=3), RUN)
    for k, v in kw.items():
        if k == "tensors":
            f.tensors.update(v)
        elif k == "meta":
            f.meta.update(v)
        else:
            setattr(f, k, v)
    return encode_frame(f)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00garbage",
        msgpack.packb({"v": 1, "k": "metrics"}),
        _frame(kind="weights"),
        _frame(run_id="another-run"),
        _frame(meta={"inner_step": -1}),
        _frame(meta={"inner_step": "many"}),
        _frame(meta={"throughput": float("inf")}),
        _frame(meta={"peer_id": 7}),
        _frame(tensors={"losses": __import__("torch").zeros(LOSS_KEPT + 1)}),
        _frame(tensors={"links": __import__("torch").zeros(2, 3, dtype=__import__("torch").int64)}),
        _frame(tensors={"links": __import__("torch").tensor([[0, 5, 1, 1]])}),
        _frame(tensors={"probe": __import__("torch").zeros(2000)}),
        encode_frame(Frame(kind="error", run_id=RUN, meta={"message": "no"})),
        b"\x00" * (REPLY_BYTES + 1),
    ],
    ids=[
        "bytes", "not-a-frame", "kind", "run", "negative", "type", "inf", "peer-type", "losses-long",
        "links-shape", "direction", "probe-long", "error", "oversized",
    ],
)  # fmt: skip
def test_a_reply_a_node_would_not_send_is_refused(data):
    with pytest.raises(MetricsError):
        parse_reply(data, RUN)


# ---------------------------------------------------------------------- the state, Prometheus, HTTP


def _state(steps: int = 5, unreachable: dict | None = None) -> dict:
    stages = [{"h": _rec(100)}, {"t": _rec(50), "x": _rec(50)}]
    nodes = {
        "h": _reply(_metrics("h", 0, "head", losses=steps)),
        "t": _reply(_metrics("t", 1, "tail", steps)),
    }
    unreachable = {"x": "bad metrics reply: not a msgpack frame"} if unreachable is None else unreachable
    return st.build_state(_run(), stages, nodes, unreachable, [], 1.0, rates={"h": 10.0, "t": 12.0})


def test_the_state_marks_unreachable_peers_and_carries_the_tails_loss():
    s = _state()
    peers = {p["peer"]: p for stage in s["stages"] for p in stage["peers"]}
    assert not peers["x"]["reachable"] and "msgpack" in peers["x"]["error"]
    assert peers["h"]["reachable"] and peers["h"]["device"] == "cpu"
    assert s["bottleneck"] == 0 and s["stages"][0]["bottleneck"]
    assert list(s["loss"]) == ["t"] and len(s["loss"]["t"]["values"]) == 5
    assert s["training"]["tokens_per_s"] == 12.0 and s["dp"]["committed"] == 2
    assert [x["tokens_per_s"] for x in s["stages"]] == [10.0, 12.0]  # x is unreachable: not counted
    json.dumps(s)  # what /api/state serves


def test_prometheus_text_parses_and_follows_the_counters():
    def samples(state: dict) -> dict:
        fams = text_string_to_metric_families(render(state).decode())
        return {(s.name, s.labels.get("peer")): s.value for f in fams for s in f.samples}

    a, b = samples(_state(5)), samples(_state(9))
    assert a[("vnode_trained_tokens_total", "t")] == 500 and b[("vnode_trained_tokens_total", "t")] == 900
    assert a[("vnode_inner_step", "h")] == 5
    assert a[("vnode_peer_reachable", "x")] == 0 and a[("vnode_peer_reachable", "t")] == 1
    assert a[("vnode_link_bytes_total", "h")] == 1300
    assert ("vnode_loss", "t") in a and ("vnode_loss", "h") not in a  # only a tail has a loss


def test_the_server_routes_and_404():
    s = _state()
    server = DashboardServer("127.0.0.1", 0, lambda: s).start()
    try:
        page = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert (
            "api/state" in page
            and "<script" in page
            and "http://" not in page.replace("http://www.w3.org", "")
        )  # nothing from the internet
        assert json.loads(urllib.request.urlopen(server.url + "api/state", timeout=10).read()) == s
        text = urllib.request.urlopen(server.url + "metrics", timeout=10).read().decode()
        assert list(text_string_to_metric_families(text))
        for path in ("nope", "api/state/x", "metrics.json"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(server.url + path, timeout=10)
            assert e.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as e:  # read-only
            urllib.request.urlopen(urllib.request.Request(server.url + "api/state", data=b"x"), timeout=10)
        assert e.value.code == 501
    finally:
        server.close()


# ---------------------------------------------------------------------- real streams


async def _garbage(info, reader, writer) -> None:
    await reader.read(4096)
    writer.write((20).to_bytes(8, "big") + b"\x07" * 20)  # a well-framed message that is no frame
    await writer.drain()
    writer.close()


async def _huge(info, reader, writer) -> None:
    await reader.read(4096)
    writer.write((REPLY_BYTES * 100).to_bytes(8, "big") + b"\x00" * 1024)  # declares 6 MB
    await writer.drain()
    await asyncio.sleep(3)
    writer.close()


async def _silent(info, reader, writer) -> None:
    await asyncio.sleep(30)


def test_peers_answering_garbage_too_much_or_nothing_are_unreachable(monkeypatch):
    from hivemind.p2p import P2P

    from node.watch import collect

    monkeypatch.setattr(collect, "ASK_S", 2.0)
    out: dict = {}

    async def main():
        peers = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(4)]
        maddrs = [str(a) for p in peers for a in await p.get_visible_maddrs()]
        cli = await P2P.create(initial_peers=maddrs)
        try:
            good = MetricsServer(lambda: _metrics("good", 1, "tail", losses=4), Wire(), RUN, 5.0)
            for p, h in zip(peers, (good.handle, _garbage, _huge, _silent)):
                await p.add_binary_stream_handler(METRICS_HANDLER, h)
            ids = [p.peer_id.to_base58() for p in peers]
            c = Collector(None, cli, Wire(), RUN)
            answers = await asyncio.gather(*(c._metrics(i) for i in ids))
            out.update(zip(("good", "garbage", "huge", "silent"), answers))
            out["direct"] = await fetch(cli, Wire(), ids[0], RUN, 5.0)
            # a garbage request: a typed error reply, and the next good one is answered as before
            reader, writer = await open_stream(cli, ids[0], METRICS_HANDLER, 5.0)
            await Wire().send(writer, b"\x93not a frame", 5.0)
            out["refusal"] = decode_frame(await Wire().recv(reader, REPLY_BYTES, 5.0))
            writer.close()
            out["after"] = await fetch(cli, Wire(), ids[0], RUN, 5.0)
            # a run with a swarm key: only its holders are answered
            key = os.urandom(32)
            keyed = MetricsServer(lambda: _metrics("keyed", 0, "head"), Wire(key), RUN, 5.0)
            await peers[0].remove_binary_stream_handler(METRICS_HANDLER)
            await peers[0].add_binary_stream_handler(METRICS_HANDLER, keyed.handle)
            out["stranger"] = await c._metrics(ids[0])
            out["holder"] = await fetch(cli, Wire(key), ids[0], RUN, 5.0)
        finally:
            await cli.shutdown()
            for p in peers:
                await p.shutdown()

    asyncio.run(main())
    assert isinstance(out["good"], dict) and out["good"]["losses"] == out["direct"]["losses"]
    assert len(out["good"]["losses"]) == 4
    assert out["refusal"].kind == "error" and out["refusal"].meta["code"] == "malformed"
    assert out["after"]["peer_id"] == "good"
    assert out["garbage"].startswith("bad metrics reply"), out["garbage"]
    assert out["huge"].startswith("bad metrics reply") and "exceeds" in out["huge"], out["huge"]
    assert "no answer" in out["silent"], out["silent"]
    assert out["stranger"].startswith("bad metrics reply") and "key" in out["stranger"], out["stranger"]
    assert out["holder"]["peer_id"] == "keyed"
