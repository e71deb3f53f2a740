"""What the dashboard shows, decided from records and metrics: pure functions, no I/O.

``build_state`` turns one poll (the run record, the stage records, each peer's metrics or the
reason it could not be read) into the JSON that ``/api/state`` serves and the page draws;
``bottleneck`` marks the slowest stage; ``diff_events`` turns two polls' stage records into
joins, leaves, moves and readiness changes, since the swarm publishes no event log of its own;
``replica_distance`` estimates how far a stage's replicas have drifted apart; ``Rates`` turns
each node's own token counter, sampled at every poll, into the tokens/s it trains.

Two throughputs, not to be confused: a stage record's ``throughput`` is the rate of the stage's
own compute (tokens per second of forward and backward, an average of its last microbatches,
announced for routing), which does not include waiting for the other stages and keeps its last
value while the stage idles; ``tokens_per_s`` is what was trained: the rise of the nodes'
``trained_tokens`` counters over the last ``RATE_WINDOW_S`` seconds of their own clocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from node.swarm.rebalance import stage_throughputs
from protocol.records import RunRecord, StageRecord

EVENTS_KEPT = 200  # the page lists the latest; a long run must not grow the state without bound
RATE_WINDOW_S = 10.0  # tokens/s over this much of a node's time: a step's tokens land at once

Seen = dict[str, tuple[int, bool]]  # peer -> (stage, ready) at one poll


def bottleneck(stages: list[Mapping[str, StageRecord]]) -> int | None:
    """The stage the pipeline waits on: the lowest summed throughput of its fast peers, as the
    rebalancer counts it (``node.swarm.rebalance.stage_throughputs``: an empty stage is 0, an
    unmeasured peer counts as the mean). None before any stage is served.

    Each stage announces the rate of its own work (a tail's includes the backward), so the tail
    tends to look slowest; the page says which measure it marks."""
    if not any(stages):
        return None
    rates = stage_throughputs(list(stages))
    return min(range(len(rates)), key=lambda i: (rates[i], i))


def seen(stages: list[Mapping[str, StageRecord]]) -> Seen:
    """Who serves which stage at one poll (a peer on two stages' records: the higher one, where
    a move lands; its old record expires within a few beats)."""
    return {pid: (i, r.ready) for i, stage in enumerate(stages) for pid, r in stage.items()}


def diff_events(before: Seen | None, after: Seen, t: float, known: set[str]) -> list[dict]:
    """Events between two polls: ``join`` (a peer appears; ``rejoin`` if ``known`` has seen it
    before, e.g. a restarted node with its identity), ``leave`` (its record expired), ``move``
    (its stage changed: a rebalance), ``ready`` / ``not ready``. The first poll reports nothing:
    a dashboard started mid-run did not see those peers join."""
    if before is None:
        return []
    out = []
    for pid in sorted(after.keys() - before.keys()):
        out.append(_event(t, "rejoin" if pid in known else "join", pid, after[pid][0]))
    for pid in sorted(before.keys() - after.keys()):
        out.append(_event(t, "leave", pid, before[pid][0]))
    for pid in sorted(after.keys() & before.keys()):
        (s0, r0), (s1, r1) = before[pid], after[pid]
        if s0 != s1:
            out.append({**_event(t, "move", pid, s1), "from": s0})
        elif r0 != r1:
            out.append(_event(t, "ready" if r1 else "not ready", pid, s1))
    return out


class Rates:
    """Tokens/s each node trains, from its own ``trained_tokens`` counter: the rise between the
    oldest and the newest of its samples within ``window`` seconds of the node's own clock (the
    ``time`` of its metrics snapshot, so a reply cached for a second or a slow poll does not skew
    it). None until a node has two samples of different times; a counter that went back (the node
    restarted, or moved to another stage) starts the node's samples afresh."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def update(self, nodes: Mapping[str, dict]) -> dict[str, float | None]:
        """Add one poll's metrics; each of those nodes' tokens/s (peers not in ``nodes`` are
        forgotten: one that answers again starts afresh)."""
        for pid in self._samples.keys() - nodes.keys():
            del self._samples[pid]
        out: dict[str, float | None] = {}
        for pid, m in nodes.items():
            t, n = float(m["time"]), int(m["trained_tokens"])
            q = self._samples.setdefault(pid, deque())
            if q and (n < q[-1][1] or t < q[-1][0]):
                q.clear()
            if not q or t > q[-1][0]:  # the same snapshot twice adds nothing
                q.append((t, n))
            while len(q) > 2 and q[1][0] <= t - self.window:
                q.popleft()
            (t0, n0), (t1, n1) = q[0], q[-1]
            out[pid] = (n1 - n0) / (t1 - t0) if t1 > t0 else None
        return out


# what a peer's inner step counts, by role: each is one optimizer step of that node, taken once the
# microbatches it computed since its last step reach the run's batch_tokens
STEP_MEANING = {
    "head": "its optimizer steps, each on at least {b} tokens of microbatches it drew and sent down",
    "middle": "its optimizer steps, each on at least {b} tokens of microbatches it served",
    "tail": "its optimizer steps, each on at least {b} tokens whose loss it computed (the loss chart's x)",
    "head+tail": "its optimizer steps, each on at least {b} tokens of microbatches it drew and scored",
}


def stage_role(index: int, n_stages: int) -> str:
    """head, middle or tail; a one-stage run's stage is both ends (its nodes call themselves head)."""
    if n_stages == 1:
        return "head+tail"
    return "head" if index == 0 else "tail" if index == n_stages - 1 else "middle"


def _sum(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def reach(maddrs: list[str], record_reach: str = "direct") -> str:
    """How a peer is reached: ``reversed`` when its record says it is behind NAT and dials its
    callers (node.swarm.reverse), else from the addresses it announces: through a relay
    (``/p2p-circuit``), directly, or unknown (it announced none)."""
    if record_reach == "reverse":
        return "reversed"
    if any("/p2p-circuit" in a for a in maddrs):
        return "relayed"
    return "direct" if maddrs else "unknown"


def _event(t: float, kind: str, peer: str, stage: int) -> dict:
    return {"time": t, "kind": kind, "peer": peer, "stage": stage}


def dense_bytes_per_token(run: RunRecord) -> int:
    """What one token's hidden state costs on a dense link in the run's wire dtype (bf16: 2 B a
    channel); the link table compares each codec against it."""
    width = 4 if run.codec.get("wire_dtype") == "float32" else 2
    return run.hidden * width


def link_rows(nodes: Mapping[str, dict], run: RunRecord) -> list[dict]:
    """Bytes per token of each boundary and direction, summed over the fast nodes that sent them,
    against dense."""
    total: dict[tuple[int, str], list[int]] = {}
    for m in nodes.values():
        if m.get("circuit", "fast") != "fast":
            continue
        for lk in m["links"]:
            c = total.setdefault((lk["boundary"], lk["direction"]), [0, 0])
            c[0] += lk["bytes"]
            c[1] += lk["tokens"]
    dense = dense_bytes_per_token(run)
    return [
        {
            "boundary": b,
            "direction": d,
            "bytes": n,
            "tokens": t,
            "bytes_per_token": n / t if t else None,
            "dense_bytes_per_token": dense,
            "ratio": (n / t) / dense if t and dense else None,
        }
        for (b, d), (n, t) in sorted(total.items())
    ]


def replica_distance(nodes: Mapping[str, dict]) -> dict[int, float]:
    """Per stage with two or more fast replicas, the largest estimated L2 distance between two of
    their weight vectors: sqrt(P / n · Σ (a_i − b_i)²) over the n coordinates every replica samples
    alike (``node.watch.probe``). Pairs whose samples do not match in P or n are left out."""
    by_stage: dict[int, list[dict]] = {}
    for m in nodes.values():
        if m.get("circuit", "fast") == "fast" and m.get("probe"):
            by_stage.setdefault(m["stage"], []).append(m)
    out = {}
    for stage, ms in sorted(by_stage.items()):
        dists = [
            (a["probe_size"] / len(a["probe"]) * sum((x - y) ** 2 for x, y in zip(a["probe"], b["probe"])))
            ** 0.5
            for i, a in enumerate(ms)
            for b in ms[i + 1 :]
            if a["probe_size"] == b["probe_size"] and len(a["probe"]) == len(b["probe"])
        ]
        if dists:
            out[stage] = max(dists)
    return out


def sent_per_token(nodes: Mapping[str, dict], tails: Mapping[str, dict]) -> float | None:
    """Bytes every answering node sent, every kind it counts, per token the tails trained; None
    before the first token (or from nodes that predate the count)."""
    tokens = sum(m["trained_tokens"] for m in tails.values())
    sent = sum(m.get("sent_bytes", 0) for m in nodes.values())
    return sent / tokens if tokens and sent else None


def run_view(run: RunRecord) -> dict:
    """The run's description as the page shows it."""
    return {
        "run_id": run.run_id,
        "model": run.model_name,
        "mode": run.mode,
        "layers": run.num_layers,
        "hidden": run.hidden,
        "stages": run.stages,
        "codec": run.codec,
        "dense_every": run.dense_every,
        "dp": {
            "mode": run.dp.mode,
            "outer_every": run.outer.every,
            "outer_mode": run.outer.mode,
            "powersgd_rank": run.outer.rank,
            "outer_bits": run.outer.bits,
            "group_size": run.outer.group_size,
        },
        "batch_tokens": run.batch_tokens,
        "protocol": run.protocol,
        "keyed": bool(run.key_id),
    }


def build_state(
    run: RunRecord | None,
    stages: list[Mapping[str, StageRecord]],
    nodes: Mapping[str, dict],
    unreachable: Mapping[str, str],
    events: list[dict],
    t: float,
    rates: Mapping[str, float | None] | None = None,
) -> dict:
    """The JSON of ``/api/state``: ``nodes`` holds each reachable peer's metrics
    (``node.watch.stream.parse_reply``), ``unreachable`` why the others could not be read;
    ``rates``: each peer's trained tokens/s (``Rates.update``). A stage's tokens/s is the sum over
    its fast peers that have one (None when none has); the run's is its last stage's: the tokens
    that came through the whole pipeline. Unknown is None (the page shows "-"), never 0."""
    if run is None:
        return {
            "time": t,
            "run": None,
            "stages": [],
            "events": events[-EVENTS_KEPT:],
            "error": "no run record",
        }
    rates = rates or {}
    n_stages = len(run.stages)
    neck = bottleneck(stages)
    computes = stage_throughputs(list(stages)) if stages else []
    view = []
    for i, stage in enumerate(stages):
        peers = []
        for pid, r in sorted(stage.items()):
            m = nodes.get(pid)
            peers.append(
                {
                    "peer": pid,
                    "circuit": r.circuit,
                    "ready": r.ready,
                    "throughput": r.throughput,
                    "tokens_per_s": rates.get(pid) if m else None,
                    "queue": r.queue,
                    # its metrics' count when it answered: the record's is up to a heartbeat old
                    "inner_step": m["inner_step"] if m else r.inner_step,
                    "reachable": m is not None,
                    "error": unreachable.get(pid, ""),
                    "device": m["device"] if m else "",
                    "memory": m["memory_rss"] if m else 0,
                    "reach": reach(r.maddrs, r.reach)
                    + (f" · {len(r.relays)} relays" if r.relays else "")
                    + (" · relays" if r.relay else ""),
                    "connections": m.get("connections", "") if m else "",
                    "relayed_bytes": m.get("relayed_bytes", 0) if m else 0,
                    "base": r.base,
                    "maddrs": r.maddrs[:3],
                }
            )
        start, end = run.stages[i] if i < len(run.stages) else (0, 0)
        role = stage_role(i, n_stages)
        view.append(
            {
                "index": i,
                "layers": [start, end],
                "role": role,
                "steps_count": STEP_MEANING[role].format(b=run.batch_tokens),
                "throughput": computes[i],  # announced compute rate (the bottleneck's measure)
                "tokens_per_s": _sum([p["tokens_per_s"] for p in peers if p["circuit"] == "fast"]),
                "bottleneck": i == neck,
                "peers": peers,
            }
        )
    fast = {pid: m for pid, m in nodes.items() if m.get("circuit", "fast") == "fast"}
    # the last stage's nodes, by index: a one-stage run's nodes are heads and tails at once
    tails = {pid: m for pid, m in fast.items() if m["stage"] == n_stages - 1}
    distances = replica_distance(nodes)
    return {
        "time": t,
        "run": run_view(run),
        "bottleneck": neck,
        "stages": view,
        "loss": {
            pid: {"first_step": m["losses_first"], "values": m["losses"]} for pid, m in sorted(tails.items())
        },
        "eval": {
            pid: {"steps": m.get("eval_steps", []), "values": m.get("eval_losses", [])}
            for pid, m in sorted(tails.items())
            if m.get("eval_losses")
        },
        "training": {
            "tokens": sum(m["trained_tokens"] for m in tails.values()),
            "tokens_per_s": view[-1]["tokens_per_s"] if len(view) == n_stages and n_stages else None,
            "rate_window_s": RATE_WINDOW_S,
            "dropped_microbatches": sum(m["dropped_microbatches"] for m in nodes.values()),
            # what every answering node sent (links, outer rounds, relaying, ...) per trained token
            "sent_per_token": sent_per_token(nodes, tails),
            "rejected_frames": sum(m["rejected_frames"] for m in nodes.values()),
            "inner_step": max((m["inner_step"] for m in tails.values()), default=0),
            "tail_steps_count": STEP_MEANING[stage_role(n_stages - 1, n_stages)].format(b=run.batch_tokens),
            **eval_summary(tails),
        },
        "links": link_rows(nodes, run),
        "dp": {
            "mode": run.dp.mode,
            "outer_every": run.outer.every,
            "committed": sum(m["outer_committed"] for m in fast.values()),
            "skipped": sum(m["outer_skipped"] for m in fast.values()),
            "bytes": sum(m["outer_bytes"] for m in fast.values()),
            "dense_bytes": sum(m["outer_dense_bytes"] for m in fast.values()),
            # estimated from a sample of each replica's weights; the run's report measures it exactly
            "replica_distance": max(distances.values(), default=None),
            "replica_distance_by_stage": {str(k): v for k, v in distances.items()},
        },
        "nodes": dict(sorted(nodes.items())),
        "unreachable": dict(sorted(unreachable.items())),
        "events": events[-EVENTS_KEPT:],
    }


def eval_summary(tails: Mapping[str, dict]) -> dict:
    """The live held-out loss (``--eval-every``, node.stage.heldout): the newest a tail scored
    (the most advanced tail's, when replicas score apart), its step, and how often tails score
    (0: none does)."""
    latest = max(
        ((m["eval_steps"][-1], m["eval_losses"][-1]) for m in tails.values() if m.get("eval_losses")),
        default=None,
    )
    return {
        "eval_loss": latest[1] if latest else None,
        "eval_step": latest[0] if latest else None,
        "eval_every": max((m.get("eval_every", 0) for m in tails.values()), default=0),
    }
