"""Reachability and connection reversal without namespaces: the pure decisions, the dial-back
handler between two real p2pd daemons on loopback, the Reverser against a fake daemon client,
and the one-line refusal of a stage no frame could reach. tests/test_nat.py runs it all behind a
real NAT."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from node.net import reach
from node.net.reach import DIALBACK_HANDLER, DialBack, decide, rechecked, tcp_target
from node.net.wire import Wire
from node.swarm.reverse import Reverser, dialable, dialback_questions
from node.swarm.routing import REVERSE_WEIGHT, must_call_me, peer_weights, unreachable_neighbour
from protocol.records import RecordError, StageRecord


def R(reach: str = "direct", circuit: str = "fast", ready: bool = True, **kw) -> StageRecord:
    return StageRecord(circuit=circuit, ready=ready, reach=reach, **kw)


# ------------------------------------------------------------------------------------------ decide
@pytest.mark.parametrize(
    "mode, answers, has_peers, expected",
    [
        ("direct", [False, False], True, "direct"),  # the volunteer said so
        ("nat", [True], True, "nat"),
        ("auto", [], False, "direct"),  # it starts the swarm: it is the bootstrap
        ("auto", [False], True, "nat"),
        ("auto", [True, False], True, "direct"),  # half reached it (Petals' rule)
        ("auto", [False, False, True], True, "nat"),
        ("auto", [None, False, None], True, "nat"),  # the silent ones do not count
        ("auto", [None, None], True, "direct"),  # nobody could check: as before, and said in the log
    ],
)
def test_decide(mode, answers, has_peers, expected):
    got, why = decide(mode, answers, has_peers)
    assert got == expected, why
    assert why


def test_tcp_targets_and_dialable_addresses():
    assert tcp_target("/ip4/10.0.0.1/tcp/31337") == ("10.0.0.1", 31337)
    assert tcp_target("/ip4/10.0.0.1/tcp/31337/p2p/QmX") == ("10.0.0.1", 31337)
    assert tcp_target("/dns4/example.org/tcp/1") == ("example.org", 1)
    for bad in ("/ip4/10.0.0.1/udp/1/quic", "/ip4/10.0.0.1/tcp/0", "/ip4/1.2.3.4/tcp/x", "tcp/1", "/unix/a"):
        assert tcp_target(bad) is None, bad
    assert dialable(["/ip4/1.2.3.4/tcp/5/p2p/QmX", "/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/udp/5/quic"]) == [
        "/ip4/1.2.3.4/tcp/5"
    ]


def test_loopback_addresses_are_asked_only_of_peers_on_loopback():
    own = ["/ip4/127.0.0.1/tcp/5", "/ip4/10.0.0.2/tcp/5"]
    assert reach.addresses_for(own, ["/ip4/10.0.0.1/tcp/1"]) == ["/ip4/10.0.0.2/tcp/5"]
    assert reach.addresses_for(own, ["/ip4/127.0.0.1/tcp/1"]) == own  # a local swarm
    assert reach.addresses_for(["/ip4/127.0.0.1/tcp/5"], ["/ip4/203.0.113.7/tcp/1"]) == []

    async def main():  # nothing to ask: a "no" without a question (no daemon is touched)
        return await reach.ask_many(None, Wire(), [("QmX", [])], "r")

    assert asyncio.run(main()) == [False]


def test_a_question_names_one_to_four_addresses():
    q = reach.question("r", [f"/ip4/10.0.0.{i}/tcp/1" for i in range(9)])
    assert reach.addresses_of(q) == [f"/ip4/10.0.0.{i}/tcp/1" for i in range(reach.MAX_ADDRS)]
    from protocol.frames import Frame, FrameError

    with pytest.raises(FrameError):
        reach.addresses_of(Frame(kind="dialback", run_id="r"))
    with pytest.raises(FrameError):
        reach.addresses_of(Frame(kind="dialback", run_id="r", meta={"a0": 5}))


# ------------------------------------------------------------------------------------------ records
def test_stage_records_say_how_a_node_is_reached():
    assert StageRecord.from_dict({"circuit": "fast"}).reach == "direct"  # an older node's record
    assert StageRecord.from_dict(R("reverse").to_dict()).reach == "reverse"
    with pytest.raises(RecordError, match="reach"):
        StageRecord.from_dict({**R().to_dict(), "reach": "teleport"})


# ------------------------------------------------------------------------------------------ routing
def test_routing_prefers_direct_peers():
    direct, reverse = R(throughput=10.0), R("reverse", throughput=10.0)
    assert peer_weights([direct, reverse]) == [10.0, 10.0 * REVERSE_WEIGHT]
    assert 0 < REVERSE_WEIGHT < 1  # discounted, never excluded: a reversed path runs at full speed


def test_the_peers_that_call_a_node():
    routes = [
        {"h1": R(), "h2": R(circuit="anchor")},
        {"me": R("reverse"), "rep": R(ready=False), "anc": R(circuit="anchor")},
        {"t": R()},
    ]
    # its upstream (its circuit), and every other peer of its stage, ready or not
    assert must_call_me(routes, 1, "me", "fast", tied=False) == {"h1", "rep", "anc"}
    # the head: nobody upstream; tied embeddings add the tail, and the tail the heads
    assert must_call_me([{"me": R()}, {"t": R()}], 0, "me", "fast", tied=True) == {"t"}
    assert must_call_me([{"me": R()}, {"t": R()}], 0, "me", "fast", tied=False) == set()
    # the tail: stage 1's fast peers (not its anchor: anchors call anchors), and the head
    assert must_call_me(routes, 2, "t", "fast", tied=True) == {"rep", "me", "h1"}


def test_a_neighbour_served_only_behind_nat_is_unreachable():
    both = [{"a": R("reverse")}, {}, {"c": R(), "d": R("reverse")}]
    assert unreachable_neighbour(both, 1, "me", "fast") == 0
    assert unreachable_neighbour(both, 0, "me", "fast") is None  # stage 1 is empty: a direct node may come
    assert unreachable_neighbour([{"a": R("reverse", circuit="anchor")}, {}], 1, "me", "fast") is None
    assert unreachable_neighbour([{"a": R()}, {}], 1, "me", "fast") is None


def test_a_nat_node_refuses_a_stage_no_frame_could_reach(monkeypatch):
    from node import join
    from node.config import NodeConfig
    from node.swarm.membership import JoinError

    run = type("Run", (), {"run_id": "r", "stages": [[0, 1], [1, 2]]})()
    records = [{"h": R("reverse")}, {}]
    stored = []
    monkeypatch.setattr(join, "read_stage_records_sync", lambda *a: records)
    monkeypatch.setattr(join, "store_stage_record_sync", lambda *a: stored.append(a))
    with pytest.raises(JoinError, match="behind NAT.*Forward a TCP port"):
        join.claim_stage(NodeConfig(stage="1"), None, run, "me", reachability="nat")
    assert not stored  # refused before it claimed anything
    assert join.claim_stage(NodeConfig(stage="1"), None, run, "me", reachability="direct") == 1
    assert stored[-1][4].reach == "direct"
    records[0] = {"h": R()}
    assert join.claim_stage(NodeConfig(stage="1"), None, run, "me", reachability="nat") == 1
    assert stored[-1][4].reach == "reverse"  # its claim already says so


# ------------------------------------------------------------------------------------------ dial-back
def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused at once
    return port


def test_dialback_between_two_daemons():
    from hivemind.p2p import P2P

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        try:
            await srv.add_binary_stream_handler(DIALBACK_HANDLER, DialBack(Wire(), "r").handle)
            peer = srv.peer_id.to_base58()
            mine = dialable([str(a) for a in await cli.get_visible_maddrs()])
            closed = [f"/ip4/127.0.0.1/tcp/{_closed_port()}"]
            yes = await reach.ask(cli, Wire(), peer, "r", mine)
            no = await reach.ask(cli, Wire(), peer, "r", closed)
            wrong_run = await reach.ask(cli, Wire(), peer, "other", mine)
            no_handler = await reach.ask(srv, Wire(), cli.peer_id.to_base58(), "r", mine, timeout=5)
            return yes, no, wrong_run, no_handler
        finally:
            await cli.shutdown()
            await srv.shutdown()

    yes, no, wrong_run, no_handler = asyncio.run(main())
    assert yes is True and no is False
    assert wrong_run is None and no_handler is None  # no answer is not a "no"


# ------------------------------------------------------------------------------------------ Reverser
class FakeClient:
    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.connected: set[str] = set()
        self.calls: list[tuple[str, str, list[str]]] = []
        self.fail = set(fail)

    async def connect(self, peer_id, maddrs) -> None:
        peer = peer_id.to_base58()
        self.calls.append(("connect", peer, [str(a) for a in maddrs]))
        if peer in self.fail:
            raise ConnectionError("all dials failed")
        self.connected.add(peer)

    async def disconnect(self, peer_id) -> None:
        self.calls.append(("disconnect", peer_id.to_base58(), []))
        self.connected.discard(peer_id.to_base58())


class FakeP2P:
    def __init__(self, client: FakeClient) -> None:
        self._client = client

    async def list_peers(self):
        from hivemind.p2p import PeerID

        info = type("Info", (), {})
        return [type("Info", (info,), {"peer_id": PeerID.from_base58(p)})() for p in self._client.connected]


def _peer_ids(n: int) -> list[str]:
    import hashlib

    from hivemind.p2p import PeerID

    return [PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()).to_base58() for i in range(n)]


def test_reverser_dials_probes_and_redials(caplog):
    a, b, c = _peer_ids(3)
    client = FakeClient(fail={c})
    answering = {a: True, b: False}
    probed: list[str] = []

    async def probe(p2p, peer, timeout):
        probed.append(peer)
        return answering[peer]

    wire = Wire()
    rv = Reverser(FakeP2P(client), wire, beat_s=1.0, probe=probe)
    targets = {a: ["/ip4/10.0.0.1/tcp/1/p2p/" + a], b: ["/ip4/10.0.0.2/tcp/2"], c: ["/ip4/10.0.0.3/tcp/3"]}

    async def beats():
        with caplog.at_level(logging.WARNING, logger="node"):
            first = await rv.keep(targets)  # nobody connected: dial all three, c fails
            wire.heard[a] = __import__("time").monotonic()  # a stream from a just arrived
            second = await rv.keep(targets)  # a: heard, no probe; b: quiet, no answer: redial
            return first, second

    first, second = asyncio.run(beats())
    assert first == {a, b} and second == {a, b}
    assert ("connect", a, ["/ip4/10.0.0.1/tcp/1"]) in client.calls  # its own /p2p/ part left out
    assert probed == [b]  # only the quiet one was asked
    assert [x[0] for x in client.calls if x[1] == b] == ["connect", "disconnect", "connect"]
    assert rv.redials == 1 and rv.dials == 3 and rv.kept == 2  # a and b, then b again
    warned = [r for r in caplog.records if "cannot open a connection" in r.getMessage()]
    assert len(warned) == 1  # c, once: the next beat's failure is not repeated within WARN_EVERY_S


def test_questions_ask_each_peer_about_the_addresses_it_can_dial():
    own = ["/ip4/127.0.0.1/tcp/5/p2p/QmSelf", "/ip4/10.0.0.2/tcp/5/p2p/QmSelf"]
    peers = {"QmB": ["/ip4/10.0.0.9/tcp/7/p2p/QmB"], "QmA": ["/ip4/127.0.0.1/tcp/6/p2p/QmA"]}
    assert dialback_questions(peers, own) == [
        ("QmA", ["/ip4/127.0.0.1/tcp/5", "/ip4/10.0.0.2/tcp/5"]),  # on loopback: both
        ("QmB", ["/ip4/10.0.0.2/tcp/5"]),  # elsewhere: our loopback would be its own
    ]


@pytest.mark.parametrize(
    "current, answers, expected",
    [
        ("direct", [False, False, True], "nat"),  # the mapping went away: reverse
        ("nat", [True, True], "direct"),  # a port was forwarded meanwhile: stop reversing
        ("nat", [None, None], None),  # nobody answered: silence says nothing, stay reversed
        ("direct", [True, None, False], None),  # half reached it: still direct
        ("nat", [], None),  # no ready peer to ask
    ],
)
def test_a_recheck_switches_only_on_answers(current, answers, expected):
    got = rechecked(current, answers)
    assert (got and got[0]) == expected, got


def test_a_serving_node_rechecks_its_addresses_and_reachability(monkeypatch):
    """Lifecycle.recheck_reachability on a node whose NAT appeared, then went away: the addresses
    the daemon sees are announced, the ready peers (not itself) are asked, a reverser is kept
    only while behind NAT, and each switch is published."""
    import types

    import node.lifecycle as lc

    ready = StageRecord(circuit="fast", throughput=1.0, queue=0, inner_step=0, ready=True,
                        maddrs=["/ip4/10.0.0.9/tcp/7/p2p/QmHead"])  # fmt: skip
    gone = StageRecord(circuit="fast", throughput=1.0, queue=0, inner_step=0, ready=False,
                       maddrs=["/ip4/10.0.0.8/tcp/7/p2p/QmOld"])  # fmt: skip
    asked: list = []
    answers: list = [[False]]

    async def fake_ask_many(p2p, wire, questions, run_id):
        asked.append(questions)
        return answers[-1]

    class P2P:
        async def get_visible_maddrs(self):
            return ["/ip4/10.0.0.3/tcp/5/p2p/QmSelf"]

    published: list = []

    async def publish():
        published.append(node.reachability)

    monkeypatch.setattr(lc, "ask_many", fake_ask_many)
    ctx = types.SimpleNamespace(
        routes=[{"QmHead": ready, "QmOld": gone}, {"QmSelf": ready}],
        peer_id="QmSelf",
        wire=Wire(None),
        run=types.SimpleNamespace(run_id="r"),
        cfg=types.SimpleNamespace(heartbeat_s=1.0),
    )
    node = types.SimpleNamespace(
        ctx=ctx,
        maddrs=["/ip4/10.0.0.2/tcp/5/p2p/QmSelf"],
        reachability="direct",
        reverser=None,
        publish=publish,
    )
    asyncio.run(lc.Lifecycle.recheck_reachability(node, P2P()))
    assert node.maddrs == ["/ip4/10.0.0.3/tcp/5/p2p/QmSelf"]  # the new address, from the next record on
    assert asked[-1] == [("QmHead", ["/ip4/10.0.0.3/tcp/5"])]  # ready peers only, not itself
    assert node.reachability == "nat" and isinstance(node.reverser, Reverser) and published == ["nat"]
    answers.append([None])  # silence: no switch, nothing published
    asyncio.run(lc.Lifecycle.recheck_reachability(node, P2P()))
    assert node.reachability == "nat" and node.reverser is not None and published == ["nat"]
    answers.append([True])  # reachable again (a forwarded port): the reverser goes
    asyncio.run(lc.Lifecycle.recheck_reachability(node, P2P()))
    assert node.reachability == "direct" and node.reverser is None and published == ["nat", "direct"]
