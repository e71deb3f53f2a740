import random
from collections import Counter

from node.swarm.routing import choose_peer, choose_stage
from protocol.records import StageRecord


def _recs(**peers):
    return {pid: StageRecord(**kw) for pid, kw in peers.items()}


def test_choose_peer_skips_unready_other_circuit_and_excluded():
    recs = _recs(
        a=dict(ready=False), b=dict(ready=True, circuit="anchor"), c=dict(ready=True), d=dict(ready=True)
    )
    rng = random.Random(0)
    picks = {choose_peer(recs, "fast", {"d"}, rng) for _ in range(50)}
    assert picks == {"c"}
    assert choose_peer(recs, "fast", {"c", "d"}, rng) is None


def test_choose_peer_weights_throughput_and_queue():
    recs = _recs(
        fast=dict(ready=True, throughput=900.0),
        slow=dict(ready=True, throughput=100.0),
        busy=dict(ready=True, throughput=900.0, queue=8),
    )
    rng = random.Random(1)
    n = Counter(choose_peer(recs, "fast", set(), rng) for _ in range(4000))
    # expected shares 900 : 100 : 100 (900 / (1 + 8))
    assert 0.78 < n["fast"] / 4000 < 0.86
    assert 0.05 < n["slow"] / 4000 < 0.11
    assert 0.05 < n["busy"] / 4000 < 0.11


def test_unmeasured_peer_is_not_starved():
    recs = _recs(old=dict(ready=True, throughput=5000.0), new=dict(ready=True, throughput=0.0))
    rng = random.Random(2)
    n = Counter(choose_peer(recs, "fast", set(), rng) for _ in range(2000))
    assert 0.4 < n["new"] / 2000 < 0.6


def test_choose_stage_least_served():
    empty = {}
    one = _recs(a=dict(throughput=100.0))
    strong = _recs(a=dict(throughput=1000.0))
    assert choose_stage([one, empty, one], "fast") == 1
    assert choose_stage([strong, one], "fast") == 1
    assert choose_stage([one, one], "fast") == 0
    # anchors do not count towards the fast circuit's service
    assert choose_stage([_recs(a=dict(circuit="anchor")), empty], "fast") == 0


def test_hops_are_given_up_only_on_peers_whose_stage_lists_others():
    from node.runtime import gone_peers

    rec = object()  # records are only looked up by peer id here
    routes = [{"h": rec}, {"a": rec, "b": rec}, {}]
    watched = {"a": 1, "c": 1, "x": 2, "h": 0}
    # c's stage lists a and b but not c: c's record expired (a cut link cannot heartbeat);
    # stage 2 came back empty: a missed DHT read proves nothing, x keeps its hops
    assert gone_peers(watched, routes) == ["c"]
    assert gone_peers({"c": 5}, routes) == []  # a stage this run does not have


def _hop_client(routes: dict):
    """A real HopClient on a head of a 2-stage run whose peers answer through ``call_peer``."""
    import types

    from node.stage.hop import HopClient

    metrics = types.SimpleNamespace(count_frame=lambda *a: None)
    cfg = types.SimpleNamespace(circuit="fast", hop_timeout=2.0, seed=0)
    ctx = types.SimpleNamespace(
        index=0, n_stages=2, routes=[{}, routes], cfg=cfg, peer_id="QmHead", metrics=metrics,
        wire=types.SimpleNamespace(overhead=0),
    )  # fmt: skip
    client = HopClient(ctx, parse=None)

    async def no_refresh():
        return None

    client.refresh_routes = no_refresh  # the routes are the test's: no DHT here
    return client


def test_a_hop_waits_out_replicas_that_are_all_busy_and_keeps_their_routes():
    """Replicas of a stage average together (an outer round): for about a second every one answers
    busy. The hop waits and retries instead of dropping the microbatch or forgetting the routes."""
    import asyncio

    from node.stage.hop import HopFailed
    from protocol.frames import Frame

    routes = {p: StageRecord(ready=True) for p in ("QmA", "QmB")}
    client = _hop_client(routes)
    calls = []

    async def call_peer(peer, data, boundary, tokens=0):
        calls.append(peer)
        if len(calls) <= 4:  # both replicas busy, twice over
            raise HopFailed(f"{peer}: Busy: in an outer round", busy=True)
        return Frame(kind="backward", run_id="r", microbatch=7)

    client.call_peer = call_peer
    reply = asyncio.run(client.send_downstream(b"x", 7, 1))
    assert reply.microbatch == 7 and len(calls) == 5, calls
    assert set(calls[:2]) == set(calls[2:4]) == {"QmA", "QmB"}, calls  # each replica once per pass
    assert set(client.ctx.routes[1]) == {"QmA", "QmB"}  # busy peers stay routable


def test_a_hop_tries_the_only_replica_again_when_it_was_reached_but_never_one_it_could_not_reach():
    """A stream closed mid-message (a relay dropping it) leaves the peer alive: with no other
    replica the microbatch goes to it once more instead of being dropped. A peer that could not be
    reached, or answered nothing in time, is not tried twice."""
    import asyncio

    import pytest

    from node.stage.hop import HopFailed
    from protocol.frames import Frame

    for reached, calls_made in ((True, 2), (False, 1)):
        calls = []

        async def call_peer(peer, data, boundary, tokens=0, reached=reached, calls=calls):
            calls.append(peer)
            if len(calls) == 1:
                raise HopFailed(f"{peer} did not answer: stream closed mid-message", reached=reached)
            return Frame(kind="backward", run_id="r", microbatch=7)

        client = _hop_client({"QmA": StageRecord(ready=True)})
        client.call_peer = call_peer
        if reached:
            assert asyncio.run(client.send_downstream(b"x", 7, 1)).microbatch == 7
        else:
            with pytest.raises(HopFailed, match="no live peer serves stage 1"):
                asyncio.run(client.send_downstream(b"x", 7, 1))
        assert calls == ["QmA"] * calls_made

    async def closes(peer, data, boundary, tokens=0):  # reached, but closes every time
        raise HopFailed(f"{peer} did not answer: stream closed mid-message", reached=True)

    client = _hop_client({"QmA": StageRecord(ready=True)})
    client.call_peer = closes
    with pytest.raises(HopFailed, match="stream closed"):
        asyncio.run(client.send_downstream(b"x", 7, 1))


def test_a_hop_gives_up_after_two_failures_and_past_its_deadline_when_busy():
    import asyncio
    import time

    import pytest

    from node.stage.hop import HopFailed

    async def refuse(peer, data, boundary, tokens=0):
        raise HopFailed(f"{peer} did not answer")

    client = _hop_client({p: StageRecord(ready=True) for p in ("QmA", "QmB", "QmC")})
    client.call_peer = refuse
    with pytest.raises(HopFailed, match="did not answer"):
        asyncio.run(client.send_downstream(b"x", 7, 1))
    assert len(client.ctx.routes[1]) == 1  # the two that failed are dropped until they heartbeat

    async def busy(peer, data, boundary, tokens=0):
        raise HopFailed(f"{peer}: Busy", busy=True)

    client = _hop_client({"QmA": StageRecord(ready=True)})
    client.call_peer = busy
    t0 = time.monotonic()
    with pytest.raises(HopFailed, match="Busy"):  # a hop that never gives up fails the wait_for instead
        asyncio.run(asyncio.wait_for(client.send_downstream(b"x", 7, 1), 10.0))
    assert 1.0 <= time.monotonic() - t0 <= 2.5  # the hop's deadline (hop_timeout 2 s), not forever
