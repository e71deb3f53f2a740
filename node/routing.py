"""Choosing the next hop: stochastic wiring among live peers of the next stage (as in SWARM).

A peer is drawn with probability proportional to its announced throughput divided by
(1 + its queue), so fast, idle peers get more work while slow ones still get some, and
a peer that just failed us is excluded for the retry.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from protocol.records import StageRecord

UNMEASURED_THROUGHPUT = 1.0  # a fresh peer has measured nothing yet; give it an even chance


def announced_throughput(rec: StageRecord) -> float:
    return rec.throughput if rec.throughput > 0 else UNMEASURED_THROUGHPUT


def peer_weight(rec: StageRecord) -> float:
    return announced_throughput(rec) / (1.0 + rec.queue)


def choose_peer(candidates: Mapping[str, StageRecord], circuit: str, exclude: set[str],
                rng: random.Random) -> str | None:
    """A ready peer of ``circuit`` not in ``exclude``, or None when there is none."""
    live = [(pid, peer_weight(r)) for pid, r in sorted(candidates.items())
            if r.ready and r.circuit == circuit and pid not in exclude]
    if not live:
        return None
    total = sum(w for _, w in live)
    x = rng.random() * total
    for pid, w in live:
        x -= w
        if x <= 0:
            return pid
    return live[-1][0]


def choose_stage(stages: list[Mapping[str, StageRecord]], circuit: str) -> int:
    """The least-served stage: lowest total announced throughput, then fewest peers, then lowest index.

    Not-yet-ready peers count: they have claimed the stage and will serve it shortly.
    """
    def load(i: int) -> tuple[float, int, int]:
        peers = [r for r in stages[i].values() if r.circuit == circuit]
        return (sum(announced_throughput(r) for r in peers), len(peers), i)

    return min(range(len(stages)), key=load)
