"""Rebalancing: whether this node should leave its stage for another (after Petals' block selection).

The swarm trains at the pace of its slowest stage: its throughput is the pipeline's bottleneck,
the minimum over stages of the summed announced throughput of their live peers (an empty stage:
zero, nothing trains). ``choose_move`` takes this node out of its stage, puts it into each other
stage in turn, and moves only when the bottleneck grows by ``margin`` (a relative gain), as Petals'
``should_choose_other_blocks`` compares the swarm's throughput with and without re-choosing its
own blocks. The margin is the hysteresis: measured throughputs wobble, and a move that gains 5%
on paper is lost in the restart (weights pulled, pipeline refilled) and may be undone next beat.

``Rebalancer`` adds the time rules the pure function cannot see: a minimum dwell after joining or
moving, and a random jitter before a move, after which the caller decides again on fresh records.
Two replicas of one stage see the same empty stage at the same beat; the jitter lets the first
one's claim reach the DHT, so the second sees the stage served and its own stage down to one
ready peer, and stays.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

from node.swarm.routing import UNMEASURED_THROUGHPUT, announced_throughput
from protocol.records import StageRecord

MOVE_MARGIN = 0.25  # move only when the bottleneck grows by at least 25%
FAR_BELOW = 0.5  # a served stage below half the mean of the others counts as starved
DWELL_BEATS = 20  # no move within this many heartbeats of joining or of the last move
CHECK_EVERY_BEATS = 3  # heartbeats between evaluations
JITTER_BEATS = 3.0  # a move waits uniform(0, this) beats, then is decided again


def _peers(stage: Mapping[str, StageRecord], circuit: str) -> dict[str, StageRecord]:
    return {pid: r for pid, r in stage.items() if r.circuit == circuit}


def _fallback(stages: list[Mapping[str, StageRecord]], circuit: str) -> float:
    measured = [r.throughput for s in stages for r in _peers(s, circuit).values() if r.throughput > 0]
    return sum(measured) / len(measured) if measured else UNMEASURED_THROUGHPUT


def stage_throughputs(stages: list[Mapping[str, StageRecord]], circuit: str = "fast") -> list[float]:
    """Summed announced throughput of each stage's live peers of ``circuit``.

    A peer that has measured nothing yet (just joined) counts as the mean measured peer, as in
    routing: counting it as zero would make a stage someone just claimed look empty, and a second
    node would move there too. Peers not ready count: they have claimed the stage (a leaving
    node's record counts until it expires, which errs towards not moving).
    """
    fallback = _fallback(stages, circuit)
    return [sum(announced_throughput(r, fallback) for r in _peers(s, circuit).values()) for s in stages]


def choose_move(
    stages: list[Mapping[str, StageRecord]],
    mine: int,
    peer_id: str,
    circuit: str = "fast",
    allowed: set[int] | None = None,
    margin: float = MOVE_MARGIN,
) -> int | None:
    """The stage this node should move to, or None to stay.

    ``stages``: every stage's live records (subkey peer id), this node's own among them at ``mine``;
    ``allowed``: the stages that fit this node's memory (None: all). A node moves only to a stage
    that is empty or starved (below ``FAR_BELOW`` of the mean of the others) and that ends with
    no more peers than it leaves behind, never leaves a stage without another ready peer, and
    only when the bottleneck gains by ``margin``.
    """
    own = _peers(stages[mine], circuit)
    if not any(r.ready for pid, r in own.items() if pid != peer_id):
        return None  # we are the stage's last ready peer: leaving would empty it
    totals = stage_throughputs(stages, circuit)
    fallback = _fallback(stages, circuit)
    # what we would carry: our own rate (a stage of another depth would differ; stages are near equal)
    ours = announced_throughput(own[peer_id], fallback) if peer_id in own else fallback
    candidates = [t for t in range(len(stages)) if t != mine and (allowed is None or t in allowed)]
    # an empty stage first: with it the swarm trains nothing, so serving it is the gain (with two
    # empty stages no single move lifts the bottleneck, yet each filled one is needed)
    empty = [t for t in candidates if totals[t] == 0]
    if empty:
        return empty[0]
    before = min(totals)
    best, best_after = None, before * (1.0 + margin)
    for target in candidates:
        others = [t for i, t in enumerate(totals) if i != target]
        if totals[target] >= FAR_BELOW * (sum(others) / len(others)):
            continue  # not starved: a stage merely a little slower is left to routing
        if len(own) - 1 < len(_peers(stages[target], circuit)) + 1:
            # Stages announce rates of different work (a tail: forward, loss and backward; the
            # others: forward only), so a tail always looks slower. Not inverting the peer counts
            # keeps that bias from draining every other stage into the tail.
            continue
        after = list(totals)
        after[mine] -= ours
        after[target] += ours
        if min(after) > best_after:  # strictly: ties keep the lowest index
            best, best_after = target, min(after)
    return best


def is_empty(stages: list[Mapping[str, StageRecord]], target: int, circuit: str = "fast") -> bool:
    """No peer of ``circuit`` has claimed stage ``target`` (ready or not): ``choose_move``'s empty."""
    return not _peers(stages[target], circuit)


def filler_rank(
    stages: list[Mapping[str, StageRecord]], target: int, peer_id: str, circuit: str = "fast"
) -> int:
    """This node's place among the nodes that could fill the empty stage ``target``: the peers of the
    other stages that ``choose_move`` lets leave (another peer of theirs is ready), in an order every
    node computes the same from the same records (a hash of stage and peer id: no node always first).

    Every such node sees the empty stage at about the same beat, and a mover's claim shows only once
    it has left, restarted and published (17 s in the 16-node volunteer run, against a 0-3 beat
    random wait): three nodes of one stage moved into an emptied stage within 3 s and left their own
    without a peer. The caller waits longer the later its place, so the first's claim is seen first.
    Not listed (its own record missed): last."""

    def key(pid: str) -> str:
        return hashlib.sha256(f"{target}:{pid}".encode()).hexdigest()

    movers = []
    for i, stage in enumerate(stages):
        if i == target:
            continue
        peers = _peers(stage, circuit)
        # as choose_move: a peer may leave while another peer of its stage is ready
        movers += [pid for pid in peers if any(r.ready for q, r in peers.items() if q != pid)]
    movers.sort(key=key)
    return movers.index(peer_id) if peer_id in movers else len(movers)


def move_reason(stages: list[Mapping[str, StageRecord]], target: int, circuit: str = "fast") -> str:
    """The log line's why: the target stage's state against the others'."""
    totals = stage_throughputs(stages, circuit)
    if not _peers(stages[target], circuit):
        return f"stage {target} has no live peer"
    others = [t for i, t in enumerate(totals) if i != target]
    return (
        f"stage {target} serves {totals[target]:.0f} tok/s against a mean of "
        f"{sum(others) / len(others):.0f} tok/s for the other stages"
    )


class Rebalancer:
    """When to ask ``choose_move``: not within ``dwell_s`` of joining or moving, every ``every_s``;
    ``jitter()`` is the random wait before a move is decided again. Times are the caller's clock."""

    def __init__(self, now: float, heartbeat_s: float, rng: random.Random | None = None) -> None:
        self.since = now  # joined (or moved) at
        self.last_check = now
        self.heartbeat_s = heartbeat_s
        self.rng = rng or random.Random()

    def due(self, now: float) -> bool:
        if now - self.since < DWELL_BEATS * self.heartbeat_s:
            return False
        if now - self.last_check < CHECK_EVERY_BEATS * self.heartbeat_s:
            return False
        self.last_check = now
        return True

    def jitter(self) -> float:
        return self.rng.uniform(0.0, JITTER_BEATS * self.heartbeat_s)
