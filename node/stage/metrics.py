"""What a stage counts: bytes and frames per link, losses per step, drops, timings.

The runtime writes ``metrics_dict`` to the metrics file every heartbeat; ``events`` keeps the
monotonic times of the last replies sent upstream and of the last optimizer steps, so the
order of the two can be checked from outside (a reply must never wait for a step).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict, deque
from dataclasses import dataclass

EVENTS_KEPT = 256  # recent reply/step timestamps kept (enough to check their order, bounded memory)


@dataclass
class LinkCount:
    bytes: int = 0
    tokens: int = 0
    frames: int = 0


class Metrics:
    def __init__(self) -> None:
        self.links: dict[tuple[int, str], LinkCount] = defaultdict(LinkCount)
        self.step_losses: list[float] = []  # tail: mean loss of each inner step
        # tail with --eval-every: (inner step, held-out loss) of each score (node.stage.heldout)
        self.eval_losses: list[tuple[int, float]] = []
        self.eval_every = 0  # how often this node scores the held-out set; 0: it does not
        self._pending_losses: list[tuple[float, int]] = []
        self.trained_tokens = 0
        self.microbatches = 0
        self.dropped = 0
        self.held = 0  # head: tries of a microbatch that waited for an empty next stage (not dropped)
        self.rejected_frames = 0
        self.shed_streams = 0  # streams over a peer's concurrency bound, answered busy unread
        self.idle_streams = 0  # request streams closed for sending nothing within the idle deadline
        self.expired_but_alive = 0  # hops whose peer's record expired mid-hop, but which answered
        self.refused_messages = 0  # scape/anchor messages refused (not of this stage's peers, steps, bounds)
        self.skipped_steps = 0
        self.filter_s = 0.0
        self.state_pull_bytes = 0
        # this node took a stage every replica of which had left, in a run that had trained: what
        # they trained since their last checkpoint is gone (node.lifecycle._join_from_peers)
        self.restarted_empty_stage = False
        self.outer_rounds: list[dict] = []
        self.outer_alone = 0
        self.checkpoints = 0
        # the tied tensor's exchange (node.dp.tied): bytes, steps exchanged, steps without the partner's
        self.tied_bytes_sent = 0
        self.tied_bytes_received = 0
        self.tied_exchanged = 0
        self.tied_missed = 0
        self.tied_unpaired = 0  # steps with replicas on an end stage: no tied exchange (node.dp.tied)
        # (time.monotonic(), microbatch) of each backward reply sent upstream / step begun
        self.replies_sent: deque[tuple[float, int]] = deque(maxlen=EVENTS_KEPT)
        self.steps_begun: deque[tuple[float, int]] = deque(maxlen=EVENTS_KEPT)

    def count_frame(self, boundary: int, direction: str, nbytes: int, tokens: int) -> None:
        c = self.links[(boundary, direction)]
        c.bytes += nbytes
        c.tokens += tokens
        c.frames += 1

    def add_loss(self, loss: float, n: int) -> None:
        self._pending_losses.append((loss, n))

    def close_step(self) -> None:
        if self._pending_losses:
            total = sum(n for _, n in self._pending_losses)
            self.step_losses.append(sum(loss * n for loss, n in self._pending_losses) / max(total, 1))
        self._pending_losses = []

    def links_list(self) -> list[dict]:
        return [
            {"boundary": b, "direction": d, "bytes": c.bytes, "tokens": c.tokens, "frames": c.frames}
            for (b, d), c in sorted(self.links.items())
        ]


def sent_bytes(m: dict) -> dict[str, int]:
    """Bytes this node wrote to its peers, by kind, from its metrics dict (``metrics_dict``): link
    frames (forward frames it sent and backward replies it answered with), outer rounds (serialized
    all-reduce parts, every attempt), the tied embedding's exchange, bases, weight snapshots and
    anchor packets it served, and bytes it relayed for other nodes. Not counted: DHT heartbeats and
    lookups, hivemind's matchmaking and libp2p's own traffic (hivemind does not count them)."""
    return {
        "links": sum(lk["bytes"] for lk in m.get("links", [])),
        "outer": sum(r.get("bytes_sent", 0) for r in m.get("outer_rounds", [])),
        "tied": m.get("tied", {}).get("bytes_sent", 0),
        "bases": m.get("basis_bytes_served", 0),
        "weights": m.get("weights_bytes_served", 0),
        "anchors": m.get("anchor_bytes", 0),
        "relay": m.get("relay", {}).get("relayed_bytes", 0),
    }


def bytes_per_token(sent: dict[str, int], tokens: int) -> dict[str, float]:
    """Each kind's bytes, and their ``total``, per trained token (0 before the first token)."""
    per = {k: (v / tokens if tokens else 0.0) for k, v in sent.items()}
    return {**per, "total": sum(per.values())}


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # readers never see a half-written file
