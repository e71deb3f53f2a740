import random
from collections import Counter

from node.routing import choose_peer, choose_stage
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
