"""Relays and hole punching without namespaces: the pure decisions (which relays, which path, what
kind of connection, how routing weighs it), the byte splice both use, and the stage record's new
fields. tests/test_nat_pair.py runs them between real NATs."""

from __future__ import annotations

import asyncio
import random

import pytest

from node.net.paths import RELAY_DOWN_S, Paths, choose_relays, connection_kind, parse_header, relay_header
from node.net.punch import as_maddr
from node.net.relay import splice, until_cancelled
from node.net.serve import NotAllowed
from node.net.wire import Wire
from node.swarm.routing import RELAYED_WEIGHT, REVERSE_WEIGHT, choose_peer, peer_weights, relays_of
from protocol.frames import MalformedFrame
from protocol.records import RecordError, StageRecord

IDS = [f"Qm{'abcdefghijklmnop'[i]}" + "x" * 44 for i in range(16)]


def R(reach: str = "direct", ready: bool = True, **kw) -> StageRecord:
    return StageRecord(ready=ready, reach=reach, **kw)


# ------------------------------------------------------------------------------- choose_relays
def test_choose_relays_is_stable_and_spreads():
    cands = IDS[:6]
    mine = choose_relays(cands, IDS[10])
    assert len(mine) == 2 and set(mine) <= set(cands)
    assert choose_relays(list(reversed(cands)), IDS[10]) == mine  # order of the candidates: irrelevant
    assert IDS[3] not in choose_relays(cands, IDS[3])  # never itself
    # a relay that leaves changes only that slot: the other one stays
    gone = mine[0]
    assert mine[1] in choose_relays([c for c in cands if c != gone], IDS[10])
    # a new candidate either outranks one of ours or changes nothing
    more = choose_relays([*cands, IDS[7]], IDS[10])
    assert more == mine or IDS[7] in more
    # many NAT'd nodes spread over the relays: nobody is everyone's first choice
    firsts = [choose_relays(cands, f"node{i}")[0] for i in range(200)]
    counts = [firsts.count(c) for c in cands]
    assert max(counts) < 70 and min(counts) > 10, counts  # 200 / 6 = 33 each if even
    assert choose_relays([], IDS[0]) == []


def test_relays_of_counts_only_reachable_ready_offering_peers():
    routes = [
        {IDS[0]: R(relay=True), IDS[1]: R("reverse", relay=True), IDS[2]: R(relay=False)},
        {IDS[3]: R(relay=True, ready=False), IDS[4]: R(relay=True)},
    ]
    assert relays_of(routes, IDS[9]) == sorted([IDS[0], IDS[4]])
    assert relays_of(routes, IDS[0]) == [IDS[4]]


# ------------------------------------------------------------------------------------------ Paths
def test_paths_relay_only_unconnected_nat_peers():
    paths = Paths(Wire(), "run")
    records = {
        IDS[0]: R("direct"),
        IDS[1]: R("reverse", relays=[IDS[5], IDS[6]]),
        IDS[2]: R("reverse", relays=[IDS[5], IDS[6]]),
    }
    paths.update(records, connected={IDS[2], IDS[6]})
    assert paths.via(IDS[0]) == []  # reachable: dialled
    assert paths.via(IDS[2]) == []  # behind NAT but connected (it dialled us, or a punch)
    assert paths.via(IDS[1]) == [IDS[6], IDS[5]]  # the relay we are connected to first
    # a relay that could not be reached goes last for a while, whatever the connection list says
    paths.relay_down(IDS[6], now=100.0)
    assert paths.via(IDS[1], now=101.0) == [IDS[5], IDS[6]]
    paths.connected.add(IDS[6])  # the daemon still lists its dead connection at the next refresh
    assert paths.via(IDS[1], now=101.0) == [IDS[5], IDS[6]]
    assert paths.via(IDS[1], now=100.0 + RELAY_DOWN_S + 1) == [IDS[6], IDS[5]]  # then tried first again
    paths.connected.clear()
    paths.relay_down(IDS[5], now=200.0)
    assert paths.via(IDS[1], now=201.0) == [IDS[6], IDS[5]]
    paths.relay_up(IDS[5])  # a stream opened through it: the record's order again
    assert paths.via(IDS[1], now=201.0) == [IDS[5], IDS[6]]
    paths.update(records, connected=set())
    assert paths.via(IDS[1]) == [IDS[5], IDS[6]]  # none connected: try them all
    assert paths.via(IDS[9]) == []  # unknown: as before relays existed
    # a record missing from one read, or naming no relay for a moment: the relays last seen stay
    paths.update({IDS[0]: records[IDS[0]], IDS[2]: R("reverse")}, connected=set())
    assert paths.via(IDS[1]) == [IDS[5], IDS[6]] and paths.via(IDS[2]) == [IDS[5], IDS[6]]
    paths.update({IDS[1]: R("direct")}, connected=set())  # it is reachable now: dialled
    assert paths.via(IDS[1]) == []


@pytest.mark.parametrize(
    "me_nat, reach, connected, punched, relayed, kind",
    [
        (False, "direct", True, False, False, "direct"),
        (True, "direct", True, False, False, "reversed"),
        (False, "reverse", True, False, False, "reversed"),
        (True, "reverse", False, False, True, "relayed"),
        (True, "reverse", True, True, False, "punched"),
        (True, "reverse", False, True, True, "relayed"),  # the punched connection died
    ],
)
def test_connection_kind(me_nat, reach, connected, punched, relayed, kind):
    assert connection_kind(me_nat, reach, connected, punched, relayed) == kind


# ---------------------------------------------------------------------------------------- routing
def test_routing_prefers_direct_over_reversed_over_relayed():
    recs = [R(throughput=10.0), R("reverse", throughput=10.0), R("reverse", throughput=10.0)]
    w = peer_weights(recs, [False, False, True])
    assert w == pytest.approx([10.0, 10.0 * REVERSE_WEIGHT, 10.0 * RELAYED_WEIGHT])
    assert RELAYED_WEIGHT < REVERSE_WEIGHT < 1.0
    # drawn many times, the relayed peer gets its share and no more
    cands = {IDS[0]: recs[0], IDS[1]: recs[2]}
    rng = random.Random(0)
    picks = [choose_peer(cands, "fast", set(), rng, lambda p: p == IDS[1]) for _ in range(3000)]
    share = picks.count(IDS[1]) / len(picks)
    assert share == pytest.approx(RELAYED_WEIGHT / (1 + RELAYED_WEIGHT), abs=0.03)


# ------------------------------------------------------------------------------------- the wire
def test_relay_header_round_trip_and_refusals():
    h = relay_header("vnode.relay", "run", IDS[0], "vnode.forward")
    assert parse_header(h, "t") == (IDS[0], "vnode.forward")
    with pytest.raises(NotAllowed):  # a relay cannot be asked to relay a relay (no loops)
        parse_header(relay_header("vnode.relay", "run", IDS[0], "vnode.relay"), "t")
    with pytest.raises(NotAllowed):  # nor to reach anything but the node's own handlers
        parse_header(relay_header("vnode.relay", "run", IDS[0], "hivemind.rpc"), "t")
    # and the outer averager's (node.dp.relayed_averaging), named as its helper registers them
    from node.dp.diloco import _OuterAverager, matchmaking_prefix
    from node.dp.relayed_averaging import handler_names

    names = handler_names(_OuterAverager, matchmaking_prefix("run.v2", 3))
    assert "vnode_run_v2_outer_3::_OuterAverager.rpc_join_group" in names and len(names) >= 3
    for name in names:
        assert parse_header(relay_header("vnode.relay", "run", IDS[0], name), "t") == (IDS[0], name)
    for other in ("vnode_run_outer_3::DHTProtocol.rpc_find", "vnode_run_outer_3::_OuterAverager.x"):
        with pytest.raises(NotAllowed):
            parse_header(relay_header("vnode.relay", "run", IDS[0], other), "t")
    with pytest.raises(MalformedFrame):
        parse_header(relay_header("vnode.relay", "run", "not a peer id!", "vnode.forward"), "t")
    with pytest.raises(MalformedFrame):
        parse_header(h, "f")  # the callee's header names the sender, not the target


def test_as_maddr():
    assert as_maddr("203.0.113.7:31337") == "/ip4/203.0.113.7/tcp/31337"
    for bad in ("203.0.113.7", "x:1", "1.2.3.4:0", "1.2.3.4:70000", ""):
        with pytest.raises(MalformedFrame):
            as_maddr(bad)


def test_stage_record_relay_fields():
    rec = StageRecord.from_dict(R("reverse", relays=[IDS[0], IDS[1]]).to_dict())
    assert rec.relays == [IDS[0], IDS[1]] and rec.relay is False
    with pytest.raises(RecordError, match="relays"):
        StageRecord.from_dict({**R().to_dict(), "relays": IDS[:5]})  # more than MAX_RELAYS
    with pytest.raises(RecordError, match="relay"):
        StageRecord.from_dict({**R().to_dict(), "relay": 1})  # a flag, not a number
    assert StageRecord.from_dict({"ready": True}).relays == []  # a record of an older node


# ----------------------------------------------------------------------------------------- splice
def test_splice_carries_both_ways_and_counts():
    """A client, a splice in the middle, an echo-and-answer server: what the client reads is what
    the server wrote, the request arrived whole, and the count is every byte that crossed."""

    async def main():
        got = {}

        async def server(r, w):
            data = await r.readexactly(300_000)
            got["request"] = data
            w.write(b"reply:" + str(len(data)).encode())
            await w.drain()
            w.close()

        srv = await asyncio.start_server(server, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        counted = [0]

        async def middle(r, w):
            inner = await asyncio.open_connection("127.0.0.1", port)
            await splice((r, w), inner, lambda n: counted.__setitem__(0, counted[0] + n))

        mid = await asyncio.start_server(middle, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", mid.sockets[0].getsockname()[1])
        payload = bytes(range(256)) * 1172 + b"abcd"  # 300,036: the server reads 300,000 of it
        w.write(payload[:300_000])
        await w.drain()
        reply = await asyncio.wait_for(r.read(), 10)
        w.close()
        srv.close()
        mid.close()
        return got["request"], reply, counted[0]

    request, reply, counted = asyncio.run(main())
    assert request == (bytes(range(256)) * 1172)[:300_000]
    assert reply == b"reply:300000"
    assert counted == 300_000 + len(reply)


def test_a_cancelled_handler_ends_quietly():
    """hivemind logs a handler task that ended cancelled as an error with a traceback (seen once per
    open relayed stream when a relay shut down); wrapped, the task ends normally."""

    async def main():
        bare = asyncio.create_task(asyncio.sleep(10))
        wrapped = asyncio.create_task(until_cancelled(asyncio.sleep(10)))
        await asyncio.sleep(0)
        bare.cancel()
        wrapped.cancel()
        await asyncio.gather(bare, wrapped, return_exceptions=True)
        return bare.cancelled(), wrapped.cancelled(), wrapped.exception()

    assert asyncio.run(main()) == (True, False, None)


def test_trusted_relays_outlive_a_short_read_then_expire():
    from node.net.paths import RELAY_TRUST_S, trusted_relays

    seen = trusted_relays({}, IDS[:2], now=100.0)
    assert set(seen) == set(IDS[:2])
    later = trusted_relays(seen, [IDS[0]], now=100.0 + RELAY_TRUST_S / 2)  # a read that missed IDS[1]
    assert set(later) == set(IDS[:2])  # still accepted: a short read must not turn its streams away
    gone = trusted_relays(later, [IDS[0]], now=100.0 + RELAY_TRUST_S + 1)
    assert set(gone) == {IDS[0]}  # unseen for longer: no longer a relay of this run
    assert set(trusted_relays(gone, [IDS[2]], now=500.0)) == {IDS[2]}
