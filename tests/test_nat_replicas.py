"""Two home nodes behind NAT that are replicas of one stage average their outer rounds (network
namespaces; the pair of adjacent stages is ``tests/test_nat_pair.py``, whose helpers these share).

* behind two port-preserving routers they punch a direct connection and hivemind's averager rides it;
* behind two symmetric NATs no connection between them can exist, and the averager's streams go
  through the public node's relay (``node.dp.relayed_averaging``).
"""

from __future__ import annotations

import pytest

from tests.test_nat import Node, _support_reason, _wait
from tests.test_nat_pair import BIG, RUN_ID, _bootstrap, _topology

pytestmark = pytest.mark.skipif(bool(reason := _support_reason()), reason=f"needs namespaces + NAT: {reason}")


@pytest.fixture
def routers():
    """Two port-preserving home routers (endpoint-independent mapping, as most are)."""
    yield from _topology()


def _start(topo, tmp_path, nodes: list) -> Node:
    """A public tail (stage 1, rounds every 4 steps), then two heads in homes 0 and 1 (stage 0),
    appended to ``nodes`` as they start (the caller stops them); returns the tail."""
    tail = Node(
        topo, topo.public_ns(0), topo.public_addr(0), tmp_path / "pub",
        ["--stages", "2", "--stage", "1", "--outer-every", "4", *BIG, *RUN_ID],
    )  # fmt: skip
    nodes.append(tail)
    peers = [*_bootstrap(tail, topo.public_addr(0)), "--stage", "0", *RUN_ID]
    for j in (0, 1):
        nodes.append(Node(topo, topo.home_ns_of(j), topo.home_addr_of(j), tmp_path / f"h{j}", peers))
    return tail


# -m slow: the relayed pair below is the case a punch cannot reach; the CI-sized volunteer internet
# (tests/test_volunteer_net.py) commits rounds of NAT'd replicas, punched and relayed
@pytest.mark.slow
def test_two_nat_replicas_average_outer_rounds(routers, tmp_path):
    """Two heads behind two routers are replicas of stage 0 next to a public tail: they punch a
    direct connection (the lower peer id calls), and hivemind's averager, which opens its streams
    by peer id through p2pd, rides it; their outer rounds commit with each other."""
    nodes = []
    try:
        _start(routers, tmp_path, nodes)

        def together() -> int:  # rounds each head committed in a group of two
            return min(
                sum(
                    1
                    for r in n.metrics().get("outer_rounds", [])
                    if not r["skipped"] and r["group_size"] == 2
                )
                for n in nodes[1:]
            )

        def punched() -> bool:  # both ends carry their connection as punched
            a, b = (n.metrics() for n in nodes[1:])
            kinds = (
                a.get("connections", {}).get(b.get("peer_id")),
                b.get("connections", {}).get(a.get("peer_id")),
            )
            return kinds == ("punched", "punched")

        # (a round may commit through the relay before the punch: node.dp.relayed_averaging)
        _wait(punched, 240, "a punched connection between the NAT'd replicas", *nodes)
        done = together()
        _wait(lambda: together() > done, 240, "an outer round of the NAT'd replicas, punched", *nodes)
        a, b = (n.metrics() for n in nodes[1:])
        assert a["reachability"] == b["reachability"] == "nat"
        # both ends say so: the caller dialled it, the callee carries it to its p2pd
        kinds = (a["connections"][b["peer_id"]], b["connections"][a["peer_id"]])
        assert kinds == ("punched", "punched"), (a["connections"], b["connections"])
        assert max(a["punch"]["spliced"], b["punch"]["spliced"]) >= 1, (a["punch"], b["punch"])
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.fixture
def two_symmetric():
    """Both home routers randomise ports: no punch gets through; the public node relays."""
    yield from _topology(random_ports=(0, 1))


def test_two_nat_replicas_average_through_a_relay(two_symmetric, tmp_path):
    """Two heads behind symmetric NATs are replicas of stage 0 next to a public tail (their relay):
    no connection between them can exist, and hivemind's averager opens its streams through its own
    daemon client, so its matchmaking and all-reduce go through the tail's relay
    (``node.dp.relayed_averaging``); their outer rounds commit with each other."""
    nodes = []
    try:
        tail = _start(two_symmetric, tmp_path, nodes)

        def groups(n) -> list[str]:  # the groups of two a head committed rounds in
            return [
                r["group"]
                for r in n.metrics().get("outer_rounds", [])
                if not r["skipped"] and r["group_size"] == 2
            ]

        together = "a relayed outer round of the NAT'd replicas"
        _wait(lambda: set(groups(nodes[1])) & set(groups(nodes[2])), 300, together, *nodes)
        a, b = (n.metrics() for n in nodes[1:])
        assert a["reachability"] == b["reachability"] == "nat"
        assert a["connections"].get(b["peer_id"]) in (None, "relayed"), a["connections"]
        assert tail.metrics()["relay"]["relayed_bytes"] > 0
    finally:
        for n in reversed(nodes):
            n.stop()
