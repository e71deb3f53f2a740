"""Choosing the next hop: stochastic wiring among live peers of the next stage (as in SWARM).

A peer is drawn with probability proportional to its announced throughput divided by
(1 + its queue), so fast, idle peers get more work while slow ones still get some, and
a peer that just failed us is excluded for the retry.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from protocol.records import StageRecord

UNMEASURED_THROUGHPUT = 1.0  # when nobody has measured anything yet, all peers weigh the same


def announced_throughput(rec: StageRecord, fallback: float = UNMEASURED_THROUGHPUT) -> float:
    return rec.throughput if rec.throughput > 0 else fallback


def peer_weights(records: list[StageRecord]) -> list[float]:
    """Throughput / (1 + queue). A peer that has measured nothing yet weighs as the mean measured
    peer: weighing it by zero would starve it forever (it can only measure what it is sent)."""
    measured = [r.throughput for r in records if r.throughput > 0]
    fallback = sum(measured) / len(measured) if measured else UNMEASURED_THROUGHPUT
    return [announced_throughput(r, fallback) / (1.0 + r.queue) for r in records]


def choose_peer(
    candidates: Mapping[str, StageRecord], circuit: str, exclude: set[str], rng: random.Random
) -> str | None:
    """A ready peer of ``circuit`` not in ``exclude``, or None when there is none."""
    live = [
        (pid, r)
        for pid, r in sorted(candidates.items())
        if r.ready and r.circuit == circuit and pid not in exclude
    ]
    if not live:
        return None
    weights = peer_weights([r for _, r in live])
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
