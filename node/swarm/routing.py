"""Choosing the next hop: stochastic wiring among live peers of the next stage (as in SWARM).

A peer is drawn with probability proportional to its announced throughput divided by
(1 + its queue), so fast, idle peers get more work while slow ones still get some, and
a peer that just failed us is excluded for the retry.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from protocol.records import StageRecord

UNMEASURED_THROUGHPUT = 1.0  # when nobody has measured anything yet, all peers weigh the same
# A peer behind NAT (reach ``reverse``) weighs this share of its announced throughput. Not zero: its
# streams ride the connection it keeps to us at full speed. Not one: that connection dies with its
# NAT's mapping and a microbatch sent then is lost until its next heartbeat re-dials, so between
# two equal peers the one that can be dialled is the safer pick (Petals weighs relayed servers 0.2;
# a reversed one costs no relay, so less of a discount).
REVERSE_WEIGHT = 0.5
# A peer this node reaches only through a relay (both behind NAT, no punched connection) weighs this
# share, as Petals weighs relayed servers: every byte crosses a third machine's line, and a relay
# that leaves costs a retry. A punched connection is a direct one and weighs as a reversed peer.
RELAYED_WEIGHT = 0.2


def announced_throughput(rec: StageRecord, fallback: float = UNMEASURED_THROUGHPUT) -> float:
    return rec.throughput if rec.throughput > 0 else fallback


def peer_weights(records: list[StageRecord], relayed: list[bool] | None = None) -> list[float]:
    """Throughput / (1 + queue), discounted by how the peer is reached (``reach_weight``; each
    ``relayed`` one by RELAYED_WEIGHT). A peer that has measured nothing yet weighs as the mean
    measured peer: weighing it by zero would starve it forever (it can only measure what it is sent)."""
    measured = [r.throughput for r in records if r.throughput > 0]
    fallback = sum(measured) / len(measured) if measured else UNMEASURED_THROUGHPUT
    relayed = relayed or [False] * len(records)
    return [
        (RELAYED_WEIGHT if via else reach_weight(r)) * announced_throughput(r, fallback) / (1.0 + r.queue)
        for r, via in zip(records, relayed)
    ]


def reach_weight(rec: StageRecord) -> float:
    """A direct peer's weight is its throughput's; a reversed one's is discounted (REVERSE_WEIGHT)."""
    return REVERSE_WEIGHT if rec.reach == "reverse" else 1.0


def choose_peer(
    candidates: Mapping[str, StageRecord],
    circuit: str,
    exclude: set[str],
    rng: random.Random,
    relayed: Callable[[str], bool] = lambda peer: False,
) -> str | None:
    """A ready peer of ``circuit`` not in ``exclude``, or None when there is none; ``relayed(peer)``:
    whether this node reaches it only through a relay (``node.net.relay.Paths.via``)."""
    live = [
        (pid, r)
        for pid, r in sorted(candidates.items())
        if r.ready and r.circuit == circuit and pid not in exclude
    ]
    if not live:
        return None
    weights = peer_weights([r for _, r in live], [relayed(pid) for pid, _ in live])
    x = rng.random() * sum(weights)
    for (pid, _), w in zip(live, weights):
        x -= w
        if x <= 0:
            return pid
    return live[-1][0]


def choose_stage(
    stages: list[Mapping[str, StageRecord]], circuit: str, allowed: set[int] | None = None
) -> int:
    """The least-served stage: lowest total announced throughput, then fewest peers, then lowest index.

    Not-yet-ready peers count: they have claimed the stage and will serve it shortly.
    """

    def load(i: int) -> tuple[float, int, int]:
        peers = [r for r in stages[i].values() if r.circuit == circuit]
        return (sum(announced_throughput(r) for r in peers), len(peers), i)

    candidates = [i for i in range(len(stages)) if allowed is None or i in allowed]
    return min(candidates, key=load)


def fast_peers_of_stage(rt) -> dict:
    """Ready fast peers of this node's stage, other than itself."""
    return {
        p: r for p, r in rt.routes[rt.index].items() if r.ready and r.circuit == "fast" and p != rt.peer_id
    }


def anchor_peers_of_stage(rt) -> dict:
    """Anchor peers this node's stage records announce (ready or still pulling), other than itself."""
    return {p: r for p, r in rt.routes[rt.index].items() if r.circuit == "anchor" and p != rt.peer_id}


def must_call_me(
    routes: list[Mapping[str, StageRecord]], index: int, peer_id: str, circuit: str, tied: bool
) -> set[str]:
    """The peers that open streams to this node, so a node behind NAT keeps a connection to each.

    * the previous stage's peers of its circuit: their FORWARD frames (the backward rides back on
      the same stream, and the next stage is only ever called by us);
    * every other peer of its own stage, ready or not: a joiner pulls our weights before it is
      ready, replicas average with us, anchors push packets to fast peers and pull their weights;
    * with tied embeddings, the other end stage (head and tail send each other the tied gradient).
    """
    peers = {p for p, r in routes[index - 1].items() if r.circuit == circuit} if index > 0 else set()
    peers |= set(routes[index])
    last = len(routes) - 1
    if tied and last > 0 and index in (0, last):
        peers |= {p for p, r in routes[last - index].items() if r.circuit == circuit}
    peers.discard(peer_id)
    return peers


def unreachable_neighbour(
    routes: list[Mapping[str, StageRecord]], index: int, peer_id: str, circuit: str
) -> int | None:
    """For a node behind NAT serving ``index``: a neighbouring stage whose every peer is behind NAT
    too (None: none is). Neither side of such a pair can open a connection to the other, so no
    frame could cross; an empty neighbour is not one (a direct node may still come)."""
    for s in (index - 1, index + 1):
        if not 0 <= s < len(routes):
            continue
        peers = [r for p, r in routes[s].items() if r.circuit == circuit and p != peer_id]
        if peers and all(r.reach == "reverse" for r in peers):
            return s
    return None


def relays_of(routes: list[Mapping[str, StageRecord]], peer_id: str) -> list[str]:
    """The peers of the run that relay for NAT'd ones (node.net.relay): reachable (reach direct),
    ready, offering to relay, not ``peer_id``; sorted, each once."""
    return sorted(
        {p for stage in routes for p, r in stage.items() if r.relay and r.ready and r.reach == "direct"}
        - {peer_id}
    )
