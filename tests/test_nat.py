"""A home node behind NAT serves a pipeline stage with no forwarded port (network namespaces).

A head (stage 0, also the swarm's bootstrap) on a public bridge; a gateway doing NAT (nftables
masquerade, a forward chain that drops everything inbound but what the home side opened); behind
it a node that claims stage 1 of a 2-stage run of a tiny model with the default
``--reachability auto``. The head dials it back, fails, and the node runs behind-NAT mode: it
keeps a connection open to the head, and the head's streams ride it.

What is proven, in one run (each part can fail on its own):
* the node found itself behind NAT, trained >= 20 steps with the head, 0 microbatches dropped;
* a plain TCP connect from the public side to the node's port fails (the gateway drops it);
* the gateway tracks only flows the node opened;
* the gateway's uplink bounces (every NAT mapping lost): the node serves again within 2 heartbeats;
* in a run where no reachable node relays (``--no-relay-service``), a second node behind a second
  gateway, asking for stage 0 (next to the NAT'd stage 1), is refused in one line that says what to
  do, and the run goes on (with a relay it joins: tests/test_nat_pair.py).

The negative control: the same node with ``--reachability direct`` (no reversal). Fresh, it trains
anyway, by accident: its own DHT requests opened connections to every DHT server (a store goes to
the 5 nearest, here all of them), and libp2p reuses a connection whoever opened it. What it does
not survive is the uplink bounce: nobody re-opens the connection, the head cannot dial it, and
the run makes no step by the deadline. Measured before the reversal existed: no recovery in 60 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 1.0
PORT = 31337
# microbatches completed at the head that prove the pipeline flows: more than the head keeps in
# flight (--max-inflight), so none of them can be work that started before a reset
FLOWING = 12
MAX_INFLIGHT = 4  # --max-inflight of every node (the default)
# all on the command line, as a volunteer runs it (the joiner learns the run from the DHT)
RUN = ["--model", "tiny:2:256", "--codec", "dense", "--seq-len", "32", "--microbatch", "4"]
RUN += ["--batch-tokens", "128", "--run-id", "nat"]
NODE = ["--threads", "1", "--device", "cpu", "--heartbeat", str(HEARTBEAT_S), "--checkpoint-every", "0"]
NODE += ["--no-rebalance", "--p2pd-timeout", "60", "--join-timeout", "60"]
NODE += ["--max-inflight", str(MAX_INFLIGHT)]


def _support_reason() -> str | None:
    from bench.network.netns import NetnsUnavailable, check_nat_support

    try:
        check_nat_support()
    except NetnsUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(bool(reason := _support_reason()), reason=f"needs namespaces + NAT: {reason}")


class Node:
    def __init__(self, topo, ns: str, host: str, d: Path, args: list[str]) -> None:
        self.dir = d
        d.mkdir(parents=True)
        cmd = [sys.executable, "-m", "node", "join", "--host", host, "--port", str(PORT), *RUN, *NODE]
        cmd += [
            "--state-dir",
            str(d),
            "--metrics-file",
            str(d / "m.json"),
            "--ready-file",
            str(d / "ready.json"),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        self.log = open(d / "log", "w")
        self.proc = subprocess.Popen(
            topo.exec_prefix(ns) + cmd + args, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )

    def metrics(self) -> dict:
        try:
            return json.loads((self.dir / "m.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def tail(self) -> str:
        return "\n".join((self.dir / "log").read_text().splitlines()[-15:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def _wait(cond, timeout: float, what: str, *nodes: Node):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for n in nodes:
            assert n.proc.poll() is None, f"{n.dir.name} exited while waiting for {what}:\n{n.tail()}"
        time.sleep(0.25)
    raise AssertionError(
        f"timed out ({timeout:.0f}s) waiting for {what}:\n" + "\n---\n".join(n.tail() for n in nodes)
    )


def _after_bounce(topo, head: Node, home: Node, deadline_s: float) -> tuple[float, float | None, int]:
    """Bounce the gateway's uplink. Returns (the wall time it was up again; seconds until the head
    has completed ``FLOWING`` microbatches more than it had a heartbeat after the bounce, or None
    if not within ``deadline_s``; the head's drops since the bounce).

    Counted at the head, from a metrics file written after that heartbeat (its ``time``): a file
    is written every heartbeat, and a heartbeat that waited on the dead connection writes late,
    counting microbatches done before the bounce (seen: 28 of them, 5 s after, in a run that had
    in fact stopped)."""
    dropped = head.metrics()["dropped_microbatches"]
    t_wall = time.time()
    up = topo.bounce_uplink(down_s=0.2)
    t0 = time.monotonic()
    before, took = None, None
    while time.monotonic() - t0 < deadline_s:
        m = head.metrics()
        if before is None and m.get("time", 0) >= t_wall + HEARTBEAT_S:
            before = m["microbatches"]  # what was under way at the bounce has finished, or failed
        elif before is not None and m["microbatches"] >= before + FLOWING:
            took = time.monotonic() - t0
            break
        assert home.proc.poll() is None and head.proc.poll() is None, home.tail() + head.tail()
        time.sleep(0.1)
    return up, took, head.metrics()["dropped_microbatches"] - dropped


@pytest.fixture
def topo():
    from bench.network.netns import NatTopology, leftover_nat_namespaces

    t = NatTopology(n_public=1, n_homes=2)
    try:
        t.build()
        yield t
    finally:
        t.teardown()
        assert not [n for n in leftover_nat_namespaces() if n.startswith(f"vnat{t.tag}-")]


# -m slow: the CI-sized volunteer internet (tests/test_volunteer_net.py) has NAT'd nodes of every kind
# serve stages by reversal, and tests/test_nat_pair.py bounces a NAT'd node's router
@pytest.mark.slow
def test_node_behind_nat_serves_a_stage(topo, tmp_path):
    head = Node(
        topo,
        topo.public_ns(0),
        topo.public_addr(0),
        tmp_path / "head",
        # no relay: the refusal below is for a run with nobody to carry streams between NAT'd nodes
        ["--stages", "2", "--stage", "0", "--no-relay-service"],
    )
    nodes = [head]
    try:
        ready = _wait(lambda: (head.dir / "ready.json").exists(), 60, "the head", head)
        assert ready
        peer = json.loads((head.dir / "ready.json").read_text())["peer_id"]
        peers = ["--peers", f"/ip4/{topo.public_addr(0)}/tcp/{PORT}/p2p/{peer}"]
        bootstrap = [*peers, "--stage", "1"]
        home = Node(topo, topo.home_ns, topo.home_addr, tmp_path / "home", bootstrap)
        nodes.append(home)
        steps = lambda: min(n.metrics().get("inner_step", 0) for n in (head, home))  # noqa: E731
        _wait(lambda: steps() >= 20, 120, "20 steps behind NAT", head, home)
        m, h = home.metrics(), head.metrics()
        assert m["reachability"] == "nat", m["reachability"]  # auto found it: nobody set it
        assert m["reverse"]["kept"] == 1, m["reverse"]  # the head: the one peer that calls it
        assert h["inner_step"] >= 20 and h["dropped_microbatches"] == 0, h
        assert m["dropped_microbatches"] == 0, m

        # the port the node listens on is closed to the public side, a route to it notwithstanding
        assert not topo.tcp_connects(topo.public_ns(0), topo.home_addr, PORT)
        assert topo.tcp_connects(topo.home_ns, topo.public_addr(0), PORT)  # the probe itself works
        flows = topo.conntrack_flows()
        if flows is not None:  # only what the home node opened, all of it to the head
            assert flows, "no tracked flow: the gateway did not carry the run"
            assert all(f["src"] == topo.home_addr for f in flows), flows

        # a second volunteer behind a second router asks for stage 0: its neighbour, stage 1, is
        # served only from behind NAT, so neither side could open a connection to the other
        other = Node(
            topo, topo.home_ns_of(1), topo.home_addr_of(1), tmp_path / "home2", [*peers, "--stage", "0"]
        )
        nodes.append(other)
        try:
            rc = other.proc.wait(90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the second NAT'd node did not refuse stage 0:\n{other.tail()}") from None
        log = (other.dir / "log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(errors) == 1 and "Traceback" not in log, (rc, log[-3000:])
        assert "behind NAT and so is every node of stage 1" in errors[0], errors
        assert "Forward a TCP port" in errors[0], errors  # and says what the volunteer can do
        assert "this node is behind NAT or a firewall" in log, log[-3000:]  # found by asking, not told
        assert head.metrics()["dropped_microbatches"] == 0, head.metrics()  # the run did not notice

        bounced, took, lost = _after_bounce(topo, head, home, deadline_s=20)
        assert took is not None, f"did not serve again after the uplink bounce:\n{home.tail()}"
        r = home.metrics()["reverse"]
        assert r["redials"] >= 1, r  # its probe found the dead connection: nobody else would
        # dialled again within 2 heartbeats of the uplink's return (what this node controls; the head
        # then needs its own hop retry and a DHT read before it routes to it again: `took`)
        assert r["last_dial"] - bounced <= 2 * HEARTBEAT_S, (r, bounced)
        assert took <= 10.0, f"the head completed microbatches again only {took:.1f}s after the bounce"
        assert lost <= MAX_INFLIGHT, f"{lost} microbatches dropped: more than were in flight"

        # negative control: the same node without reversal
        home.stop()
        ctl = Node(
            topo, topo.home_ns, topo.home_addr, tmp_path / "control", [*bootstrap, "--reachability", "direct"]
        )
        nodes.append(ctl)
        _wait(lambda: ctl.metrics().get("inner_step", 0) >= 3, 120, "the control to train", head, ctl)
        assert ctl.metrics()["reachability"] == "direct"
        _, took, _ = _after_bounce(topo, head, ctl, deadline_s=15)
        assert took is None, f"the control served again {took:.1f}s after the bounce, without reversal"
    finally:
        for n in reversed(nodes):
            n.stop()
        if shutil.which("conntrack") is None:
            print("conntrack is not installed: the gateway's flows were not checked")
