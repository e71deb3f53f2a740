"""Two home nodes behind NAT train next to each other (network namespaces).

A public node P (the bootstrap, a stage-0 replica, and a relay), a head A behind one router and a
tail B behind another: A's frames to B have no connection to ride (neither can dial the other),
so they go through P's relay (``node.net.relay``). With B's router a symmetric NAT (ports
randomised), no hole punch gets through, so the relay carries them for the whole run; with two
port-preserving routers, A punches a direct connection to B (``node.net.punch``) and the frames
leave the relay.

What is proven (each part can fail on its own):
* A, which can reach stage 1 only through B, trains >= 20 steps with 0 dropped microbatches, with
  frames of 256 KiB (above go-libp2p's default relay limit of 128 KiB per circuit);
* the frames went through the relay: P counts relayed bytes, B counts relayed streams accepted,
  and A reports its connection to B as ``relayed``;
* A was not refused at join, and its record announces its relays;
* through two port-preserving routers the pair ends on a punched connection: the head's router
  tracks a connection to the tail router's public address, and the relay's byte count stops
  growing while the head trains on.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.test_nat import MAX_INFLIGHT, PORT, Node, _support_reason, _wait

pytestmark = pytest.mark.skipif(bool(reason := _support_reason()), reason=f"needs namespaces + NAT: {reason}")

# 16 rows of 32 tokens of a 256-wide model in bf16: 256 KiB forward frames
BIG = ["--microbatch", "16", "--batch-tokens", "512"]
# every node: a joiner reads the rest of the run from the DHT. Heartbeat 2 s, not test_nat's 1 s: a
# NAT'd node's DHT reaches its NAT'd neighbour's record only through the public node's copy, which a
# 1 s beat on a CI machine running two test files at once let expire (5 beats) for a moment: 8
# microbatches dropped as "no live peer serves stage 1" in one full-suite run
BEAT_S = 2.0
RUN_ID = ["--run-id", "natpair", "--heartbeat", str(BEAT_S)]


def _topology(**kw):
    from bench.network.netns import NatTopology, leftover_nat_namespaces

    t = NatTopology(**{"n_public": 1, "n_homes": 2, **kw})
    try:
        t.build()
        yield t
    finally:
        t.teardown()
        assert not [n for n in leftover_nat_namespaces() if n.startswith(f"vnat{t.tag}-")]


@pytest.fixture
def symmetric():
    """Home 1's router randomises ports (a symmetric NAT): no punch gets through it."""
    yield from _topology(random_ports=(1,))


@pytest.fixture
def routers():
    """Two port-preserving home routers (endpoint-independent mapping, as most are)."""
    yield from _topology()


def _peer_id(node: Node) -> str:
    return json.loads((node.dir / "ready.json").read_text())["peer_id"]


def _bootstrap(node: Node, host: str) -> list[str]:
    """``--peers`` for a joiner: ``node`` (listening at ``host``) once it is ready."""
    _wait(lambda: (node.dir / "ready.json").exists(), 60, f"{node.dir.name} to be ready", node)
    return ["--peers", f"/ip4/{host}/tcp/{PORT}/p2p/{_peer_id(node)}"]


def _tx_bytes(ns: str) -> int:
    """Bytes sent through every interface of namespace ``ns`` but loopback, by the kernel's count."""
    import subprocess

    out = subprocess.run(
        ["ip", "-n", ns, "-s", "-j", "link", "show"], capture_output=True, text=True, check=True
    )
    return sum(i["stats64"]["tx"]["bytes"] for i in json.loads(out.stdout) if i["ifname"] != "lo")


def _pair(topo, tmp_path) -> list[Node]:
    """The public node, then the NAT'd tail (stage 1), then the NAT'd head (stage 0); returns them
    once the head made 20 steps (it can only make them with the tail)."""
    pub = Node(
        topo,
        topo.public_ns(0),
        topo.public_addr(0),
        tmp_path / "pub",
        ["--stages", "2", "--stage", "0", *BIG, *RUN_ID],
    )
    nodes = [pub]
    try:
        peers = _bootstrap(pub, topo.public_addr(0))
        tail = Node(
            topo,
            topo.home_ns_of(1),
            topo.home_addr_of(1),
            tmp_path / "tail",
            [*peers, "--stage", "1", *RUN_ID],
        )
        nodes.append(tail)
        _wait(lambda: tail.metrics().get("inner_step", 0) >= 1, 120, "the NAT'd tail to train", pub, tail)
        head = Node(
            topo,
            topo.home_ns_of(0),
            topo.home_addr_of(0),
            tmp_path / "head",
            [*peers, "--stage", "0", *RUN_ID],
        )
        nodes.append(head)
        _wait(lambda: head.metrics().get("inner_step", 0) >= 20, 180, "20 steps of the NAT'd head", *nodes)
        return nodes
    except BaseException:
        for n in reversed(nodes):
            n.stop()
        raise


def test_two_nat_nodes_train_through_a_relay(symmetric, tmp_path):
    pub, tail, head = nodes = _pair(symmetric, tmp_path)
    try:
        h, t, p = head.metrics(), tail.metrics(), pub.metrics()
        assert h["reachability"] == "nat" and t["reachability"] == "nat", (
            h["reachability"],
            t["reachability"],
        )
        assert h["dropped_microbatches"] == 0, h
        assert h["connections"][t["peer_id"]] == "relayed", h["connections"]
        assert p["relay"]["serving"] and p["relay"]["relayed_bytes"] > 20 * 2 * (256 << 10), p["relay"]
        assert t["relay"]["accepted_in"] >= 20, t["relay"]
        assert h["relay"]["mine"] == [p["peer_id"]] and t["relay"]["mine"] == [p["peer_id"]], (
            h["relay"],
            t["relay"],
        )
        # it tried to punch, failed, said so, and the relay still carries the pair
        _wait(lambda: head.metrics()["punch"]["failed"] >= 1, 60, "a failed punch", *nodes)
        assert "could not punch a direct connection" in (head.dir / "log").read_text()
        assert head.metrics()["punch"]["punched"] == 0 and head.metrics()["dropped_microbatches"] == 0
        assert head.metrics()["connections"][t["peer_id"]] == "relayed"
        # what the head says it sent, by kind, against what its namespace's interface sent (TCP/IP
        # headers, DHT and control on top): its final metrics, written as it left, then the counter
        head.stop()
        counted, tx = sum(head.metrics()["sent"]["bytes"].values()), _tx_bytes(symmetric.home_ns_of(0))
        print(f"head counted {counted} B sent, its interface {tx} B ({counted / tx:.3f})")
        assert 0.9 * tx <= counted <= tx, (counted, tx, head.metrics()["sent"])  # measured: 0.964
    finally:
        for n in reversed(nodes):
            n.stop()


def test_two_nat_nodes_punch_a_direct_connection(routers, tmp_path):
    pub, tail, head = nodes = _pair(routers, tmp_path)
    try:
        t = tail.metrics()
        _wait(
            lambda: head.metrics()["connections"].get(t["peer_id"]) == "punched",
            60,
            "a punched connection",
            *nodes,
        )
        # the head's router tracks a connection to the tail's router's public address, port 31337
        flows = routers.conntrack_flows(0)
        if flows is not None:
            g1 = routers.gw_public_addr_of(1)
            assert any(f["dst"] == g1 and f["dport"] == str(PORT) for f in flows), flows
        # from now on the frames go straight: the relay's byte count stands still while the head trains
        relayed, steps = pub.metrics()["relay"]["relayed_bytes"], head.metrics()["inner_step"]
        _wait(lambda: head.metrics()["inner_step"] >= steps + 10, 120, "10 more steps", *nodes)
        assert pub.metrics()["relay"]["relayed_bytes"] == relayed, (relayed, pub.metrics()["relay"])
        assert head.metrics()["dropped_microbatches"] == 0, head.metrics()
        assert head.metrics()["connections"][t["peer_id"]] == "punched"
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.fixture
def two_relays():
    """Two public nodes, a port-preserving home and a symmetric one (no punch: relays only)."""
    yield from _topology(random_ports=(1,), n_public=2)


# -m slow: the CI-sized volunteer internet (tests/test_volunteer_net.py) kills a relay mid-run too
@pytest.mark.slow
def test_relay_killed_mid_run(two_relays, tmp_path):
    """The relay carrying the pair is killed (SIGKILL): the head trains again through the other one
    within 2 heartbeats, losing at most the microbatches that were in flight."""
    topo = two_relays
    pub0 = Node(
        topo,
        topo.public_ns(0),
        topo.public_addr(0),
        tmp_path / "pub0",
        ["--stages", "2", "--stage", "0", *BIG, *RUN_ID],
    )
    pubs = [pub0]
    try:
        peers = _bootstrap(pub0, topo.public_addr(0))
        pub1 = Node(
            topo, topo.public_ns(1), topo.public_addr(1), tmp_path / "pub1", [*peers, "--stage", "0", *RUN_ID]
        )
        pubs.append(pub1)
        _wait(lambda: (pub1.dir / "ready.json").exists(), 60, "public node 1", *pubs)
    except BaseException:
        for n in pubs:
            n.stop()
        raise
    nodes = list(pubs)
    try:
        tail = Node(
            topo,
            topo.home_ns_of(1),
            topo.home_addr_of(1),
            tmp_path / "tail",
            [*peers, "--stage", "1", *RUN_ID],
        )
        nodes.append(tail)
        head = Node(
            topo,
            topo.home_ns_of(0),
            topo.home_addr_of(0),
            tmp_path / "head",
            [*peers, "--stage", "0", *RUN_ID],
        )
        nodes.append(head)
        ids = {_peer_id(p): p for p in pubs}
        # both relays chosen and announced by the tail, and the head training through them
        _wait(
            lambda: len(tail.metrics().get("relay", {}).get("mine", [])) == 2,
            120,
            "the tail's two relays",
            *nodes,
        )
        _wait(lambda: head.metrics().get("inner_step", 0) >= 10, 180, "10 steps of the NAT'd head", *nodes)
        t = tail.metrics()
        assert head.metrics()["connections"][t["peer_id"]] == "relayed"
        # kill the relay the head tries first (the tail's first choice), and watch the head go on
        victim = ids[t["relay"]["mine"][0]]

        def time_to(n: int) -> float:  # seconds until the head has completed n more microbatches
            start, t0 = head.metrics()["microbatches"], time.monotonic()
            _wait(lambda: head.metrics()["microbatches"] >= start + n, 60, f"{n} microbatches", head, tail)
            return time.monotonic() - t0

        n = 2 * MAX_INFLIGHT + 1  # more than were in flight: some went through the other relay
        normal = time_to(n)  # the same wait with both relays up: what the metrics' cadence costs
        dropped = head.metrics()["dropped_microbatches"]
        victim.proc.kill()
        after = time_to(n)
        assert after - normal <= 2 * BEAT_S, (
            f"{n} microbatches took {after:.1f}s after the kill, {normal:.1f}s before"
        )
        _wait(lambda: len(tail.metrics()["relay"]["mine"]) == 1, 30, "the tail to drop its dead relay", tail)
        lost = head.metrics()["dropped_microbatches"] - dropped
        assert lost <= MAX_INFLIGHT, f"{lost} microbatches dropped: more than were in flight"
        steps = head.metrics()["inner_step"]
        _wait(
            lambda: head.metrics()["inner_step"] >= steps + 10,
            120,
            "10 more steps through the other relay",
            head,
            tail,
        )
        assert head.metrics()["connections"][t["peer_id"]] == "relayed"
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.fixture
def one_home():
    """Two public nodes and one home behind a port-keeping router."""
    yield from _topology(n_public=2, n_homes=1)


def test_nat_node_reconnects_to_a_quiet_peer_after_its_router_reboots(one_home, tmp_path):
    """A head behind NAT, a public replica of it (the bootstrap) and a public tail; the head's
    router loses every mapping (uplink bounced) and drops what arrives for them without an answer.
    The head must connect again to both peers that call it, the replica included, which sends it
    nothing between outer rounds (tests/test_nat.py bounces a tail whose caller is busy)."""
    topo = one_home
    replica = Node(
        topo, topo.public_ns(0), topo.public_addr(0), tmp_path / "replica",
        ["--stages", "2", "--stage", "0", "--outer-every", "1000", *BIG, *RUN_ID],
    )  # fmt: skip
    nodes = [replica]
    try:
        peers = [*_bootstrap(replica, topo.public_addr(0)), *RUN_ID]
        tail = Node(topo, topo.public_ns(1), topo.public_addr(1), tmp_path / "tail", [*peers, "--stage", "1"])
        nodes.append(tail)
        head = Node(topo, topo.home_ns, topo.home_addr, tmp_path / "head", [*peers, "--stage", "0"])
        nodes.append(head)
        _wait(lambda: head.metrics().get("inner_step", 0) >= 10, 120, "10 steps of the NAT'd head", *nodes)
        assert head.metrics()["reverse"]["kept"] == 2  # the replica and the tail both call it
        topo.bounce_uplink(down_s=0.2)
        t0 = time.monotonic()
        _wait(
            lambda: head.metrics()["reverse"]["redials"] >= 1,
            30,
            "the head to see its connections die",
            *nodes,
        )
        # connected to both again, the quiet replica included
        _wait(
            lambda: head.metrics()["reverse"]["kept"] == 2 and time.time() - head.metrics()["time"] < 2,
            30, "the head connected to both peers again", *nodes,
        )  # fmt: skip
        took = time.monotonic() - t0
        assert took <= 4 * BEAT_S + 2.0, f"the head reached its quiet replica again only {took:.1f}s after"
    finally:
        for n in reversed(nodes):
            n.stop()
