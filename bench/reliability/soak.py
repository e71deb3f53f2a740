"""Soak run (issue 14 acceptance): one swarm for an hour with short DHT lifetimes, a late joiner,
a clean leave and a SIGKILL + ``--resume`` restart.

    python -m bench.reliability.soak --minutes 60 --nodes 5 --stages 2 --model tiny:4:256 --heartbeat 1 \
        --out bench/results --workdir runs/soak

``--heartbeat 1`` makes stage records live ``stage_record_ttl(1)`` = 5 s and the run record
``run_record_ttl(1)`` = 30 s, so an hour is > 100 run-record lifetimes: the run only survives if
live nodes keep re-publishing it. Schedule (``schedule``): ``--nodes - 1`` nodes start (the
``node swarm`` launcher's ``start_node``, as ``bench.reliability.chaos`` does); the last node joins late,
after at least 3 run-record lifetimes, through a live peer's address (not the first node's);
one node is SIGKILLed (its whole process group) at ``--kill-at`` of the run and restarted
with ``join --resume`` ``--restart-delay`` s later; one node leaves with SIGTERM at
``--leave-at`` of the run. Replicated stages run the node's default DiLoCo outer rounds.

Every ``--sample`` seconds each node's metrics.json and /proc are read: tail loss, steps,
outer rounds committed/skipped, dropped microbatches, stage, RSS of the node process and of
its process group (node, DHT process, p2pd); every ``--distance-every`` seconds the distance
between the replicas of each stage is read from their newest checkpoints. With ``--eval N``,
N held-out problems are scored before and after (the model exported from the final
checkpoints, as ``node swarm --eval`` does). Writes OUT/soak.json, OUT/soak.md, OUT/soak.png.
Exits 1 with one line if the loss did not fall or the late joiner never trained, 2 if the
swarm failed. Every process started is stopped by its PID (process group) on success, failure
or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

from bench.reliability.chaos import Life, Phase, _bootstrap, _check_alive, _maddr, verify_checkpoints
from node.cli import build_parser
from node.local.launcher import SwarmError, kill_group, poll_ready, spawn_node, start_node, stop_nodes
from node.model.checkpoint import newest_for_run
from protocol.records import run_record_ttl, stage_record_ttl

LOSS_TAIL = 10  # a tail's loss at a sample: mean of its last this many step losses
LOSS_WINDOW = 0.1  # loss start / end: mean over the first / last tenth of the training time
LOSS_FALL = 0.95  # "loss fell": end below this share of start
RSS_SETTLE_S = 120.0  # a process's RSS growth is counted from its first sample this long after start
LEAVE_WAIT_S = 120.0  # a SIGTERMed node that has not exited by then is a finding (and is killed)
_PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------- pure decisions


def schedule(minutes: float, heartbeat_s: float, join_at: float, kill_at: float, leave_at: float) -> dict:
    """Seconds after the start of each event; ``join_at`` in minutes, the others as shares of the run.

    The late join must come after >= 3 run-record lifetimes (a run record published once is gone
    by then), and the events in the order join < kill < leave < end, so each one is seen alone.
    """
    total = minutes * 60.0
    ev = {"end": total, "join": join_at * 60.0, "leave": leave_at * total, "kill": kill_at * total}
    lifetimes = ev["join"] / run_record_ttl(heartbeat_s)
    if lifetimes < 3:
        raise ValueError(
            f"--join-at {join_at} min is {lifetimes:.1f} run-record lifetimes of --heartbeat {heartbeat_s}: "
            f"join later (>= {3 * run_record_ttl(heartbeat_s) / 60:.2f} min) or shorten --heartbeat"
        )
    order = ["join", "kill", "leave", "end"] if kill_at > 0 else ["join", "leave", "end"]
    if kill_at <= 0:
        ev.pop("kill")
    if any(ev[a] >= ev[b] for a, b in zip(order, order[1:])):
        shown = ", ".join(f"{k} {ev[k] / 60:.1f} min" for k in order)
        raise ValueError(f"events must come in the order {' < '.join(order)}, got {shown}: adjust --minutes")
    return ev


def window_mean(points: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Mean of the values whose time lies in [t0, t1]."""
    vals = [v for t, v in points if t0 <= t <= t1]
    return sum(vals) / len(vals) if vals else None


def summarize(samples: list[dict], events: list[dict], joiner: int) -> dict:
    """Figures of a run from its samples (``t``, ``loss``, ``nodes``: {id: per-node dict}) and events."""
    losses = [(s["t"], s["loss"]) for s in samples if s["loss"] is not None]
    out: dict = {"loss_start": None, "loss_end": None}
    if losses:
        t_first, t_last = losses[0][0], losses[-1][0]
        w = LOSS_WINDOW * (t_last - t_first)
        out["loss_start"] = window_mean(losses, t_first, t_first + w)
        out["loss_end"] = window_mean(losses, t_last - w, t_last)
    rss: dict[str, dict] = {}  # per process lifetime: "2" for node 2, "2.1" for its restart
    for s in samples:
        for node, n in s["nodes"].items():
            if n.get("rss_mb") is None:
                continue
            key = node + (f".{n['life']}" if n.get("life") else "")
            r = rss.setdefault(
                key, {"start_mb": n["rss_mb"], "start_t": s["t"], "group_start_mb": n["group_rss_mb"]}
            )
            if "settled_mb" not in r and s["t"] >= r["start_t"] + RSS_SETTLE_S:
                r.update(settled_mb=n["rss_mb"], settled_t=s["t"])
                r["anon_settled_mb"] = n.get("anon_mb")
            r.update(
                end_mb=n["rss_mb"], end_t=s["t"], group_end_mb=n["group_rss_mb"], anon_end_mb=n.get("anon_mb")
            )
            r["max_mb"] = max(r.get("max_mb", 0.0), n["rss_mb"])
    for r in rss.values():  # growth once warm: start-up (imports, first steps, buffers) is not a leak
        r["growth_mb"] = r["end_mb"] - r["settled_mb"] if "settled_mb" in r else None
        a0, a1 = r.get("anon_settled_mb"), r.get("anon_end_mb")
        r["anon_growth_mb"] = a1 - a0 if a0 is not None and a1 is not None else None
    out["rss"] = rss
    join = next((e for e in events if e["kind"] == "join"), None)
    j = {"spawned": None, "ready_s": None, "first_microbatch_s": None, "first_step_s": None}
    if join is not None:
        j["spawned"] = t_join = join["t"]
        base = None
        for s in samples:
            n = s["nodes"].get(str(joiner))
            if s["t"] < t_join or not n or n.get("inner_step") is None:
                continue
            base = n["inner_step"] if base is None else base  # a joiner may take the replicas' step count
            if j["first_microbatch_s"] is None and n["microbatches"] > 0:
                j["first_microbatch_s"] = round(s["t"] - t_join, 1)
            if j["first_step_s"] is None and n["inner_step"] > base:
                j["first_step_s"] = round(s["t"] - t_join, 1)
        j["ready_s"] = join.get("ready_s")
    out["late_joiner"] = j
    last = samples[-1]["nodes"] if samples else {}
    out["outer_committed"] = sum(n.get("outer_committed", 0) for n in last.values())
    out["outer_skipped"] = sum(n.get("outer_skipped", 0) for n in last.values())
    return out


def verdict(summary: dict) -> str | None:
    """The one-line reason the soak failed, or None if the loss fell and the late joiner trained."""
    start, end = summary["loss_start"], summary["loss_end"]
    if start is None or end is None:
        return "no tail loss was recorded: the swarm never trained"
    if not end < LOSS_FALL * start:
        return f"loss did not fall: {start:.3f} at the start -> {end:.3f} at the end"
    j = summary["late_joiner"]
    if j["spawned"] is None:
        return "the late joiner was never started (the run ended before its join time)"
    if j["first_microbatch_s"] is None or j["first_step_s"] is None:
        return "the late joiner never trained (no microbatch or no optimizer step after it joined)"
    return None


# ---------------------------------------------------------------------- observation


def _rss_by_group() -> dict[int, dict[int, tuple[float, float]]]:
    """{process group: {pid: (resident MB, anonymous resident MB)}} from /proc (each node leads its
    own group). Anonymous memory is what a leak grows; file-backed pages (torch's libraries) come
    and go with the machine's memory pressure."""
    out: dict[int, dict[int, tuple[float, float]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgrp = int(stat.read_text().rsplit(")", 1)[1].split()[2])
            resident, shared = (int(x) for x in (stat.parent / "statm").read_text().split()[1:3])
        except (OSError, IndexError, ValueError):
            continue
        mb = _PAGE / 2**20
        out.setdefault(pgrp, {})[int(stat.parent.name)] = (resident * mb, (resident - shared) * mb)
    return out


def node_sample(lf: Life, life: int, rss: dict[int, dict[int, tuple[float, float]]], n_stages: int) -> dict:
    m = lf.metrics or {}
    group = rss.get(lf.proc.pid, {})
    rounds = m.get("outer_rounds", [])
    losses = m.get("step_losses", [])
    return {
        "life": life,
        "stage": lf.stage,
        "inner_step": m.get("inner_step"),
        "microbatches": m.get("microbatches", 0),
        "dropped": m.get("dropped_microbatches", 0),
        "loss": sum(losses[-LOSS_TAIL:]) / len(losses[-LOSS_TAIL:])
        if losses and lf.stage == n_stages - 1
        else None,
        "outer_committed": sum(not r["skipped"] for r in rounds),
        "outer_skipped": sum(bool(r["skipped"]) for r in rounds) + m.get("outer_alone", 0),
        "rss_mb": round(group[lf.proc.pid][0], 1) if lf.proc.pid in group else None,
        "anon_mb": round(group[lf.proc.pid][1], 1) if lf.proc.pid in group else None,
        "group_rss_mb": round(sum(r for r, _ in group.values()), 1) if group else None,
        "dht_peers": len({p for peers in m.get("peers", {}).values() for p in peers}),
    }


def replica_distances(phase: Phase) -> dict[str, dict]:
    """Per stage with >= 2 live replicas: distance of their newest checkpoints (local weights and
    the DiLoCo outer model theta_global) and the outer steps each had taken."""
    from compression.outer import param_distance

    by_stage: dict[int, list] = {}
    for lf in phase.alive():
        try:
            ck = newest_for_run(phase.root / "nodes" / str(lf.node), phase.run_id)
        except Exception:  # a checkpoint being replaced under us: read it next time
            continue
        if ck is not None and lf.stage is not None and f"stage-{lf.stage}" in str(ck.path):
            by_stage.setdefault(lf.stage, []).append((lf.node, ck))
    out = {}
    for stage, cks in sorted(by_stage.items()):
        if len(cks) < 2:
            continue
        (na, a), (nb, b) = cks[:2]
        rec = {
            "nodes": [na, nb],
            "steps": [a.step, b.step],
            "weights": param_distance(a.stage_state, b.stage_state),
        }
        oa, ob = a.extra_states.get("outer"), b.extra_states.get("outer")
        if oa and ob:
            rec["theta"] = param_distance(oa["theta"], ob["theta"])
            rec["outer_steps"] = [oa["outer"]["steps"], ob["outer"]["steps"]]
        out[str(stage)] = rec
    return out


# ---------------------------------------------------------------------- the run


class Soak:
    def __init__(self, opts, swarm_args, root: Path) -> None:
        self.opts, self.swarm_args = opts, swarm_args
        self.phase = Phase("soak", root, f"soak-{uuid.uuid4().hex[:6]}", opts.stages)
        self.flags = ["--heartbeat", str(opts.heartbeat), "--checkpoint-every", str(opts.checkpoint_every)]
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.distances: list[dict] = []
        self.leaving: dict[int, tuple[Life, float]] = {}  # SIGTERMed, not exited yet: (life, t)
        self.joiner = opts.nodes - 1

    def log(self, msg: str) -> None:
        print(f"[soak {self.phase.now():6.0f}s] {msg}", flush=True)

    def spawn(self, node: int, peers: list[str], resume: bool) -> Life:
        ph = self.phase
        proc = spawn_node(
            self.swarm_args,
            node,
            ph.root,
            ph.run_id,
            peers,
            extra=self.flags + (["--resume"] if resume else []),
        )
        lf = Life(node, proc, spawned=ph.now(), resumed=resume)
        lf.spawned_wall = time.time()
        ph.lives.append(lf)
        ph.current[node] = lf
        return lf

    def start(self) -> None:
        ph = self.phase
        for i in range(self.opts.nodes - 1):
            t = time.monotonic()
            proc, ready = start_node(self.swarm_args, i, ph.root, ph.run_id, _bootstrap(ph), extra=self.flags)
            lf = Life(i, proc, spawned=0.0, stage=ready["stage"], maddr=_maddr(ready), ready_at=0.0)
            lf.spawned_wall = time.time() - (time.monotonic() - t)
            ph.lives.append(lf)
            ph.current[i] = lf
            print(f"[soak] node {i} -> stage {ready['stage']}", flush=True)
        ph.t_zero = time.monotonic()

    def victim(self, exclude: set[int]) -> Life:
        """A ready node of the stage with the most live replicas (so every stage keeps a peer)."""
        alive = [lf for lf in self.phase.alive() if lf.ready_at is not None and lf.node not in exclude]
        count = {s: sum(lf.stage == s for lf in self.phase.alive()) for s in range(self.opts.stages)}
        pick = [lf for lf in alive if count[lf.stage] >= 2] or alive
        return max(pick, key=lambda lf: (count[lf.stage], lf.node))

    def join_late(self) -> None:
        # through one live peer that is not the first node (the address a user would be handed)
        via = max((lf for lf in self.phase.alive() if lf.maddr), key=lambda lf: (lf.node != 0, lf.node))
        lf = self.spawn(self.joiner, [via.maddr], resume=False)
        self.events.append(
            {"kind": "join", "t": lf.spawned, "node": self.joiner, "via": via.maddr, "via_node": via.node}
        )
        self.log(f"late join: node {self.joiner} through node {via.node} ({via.maddr})")

    def spared(self) -> set[int]:
        """Nodes neither the kill nor the leave may take: the late joiner and the peer it joined
        through (killing its only bootstrap peer while it starts tests the schedule, not the node)."""
        return {self.joiner} | {e["via_node"] for e in self.events if e["kind"] == "join"}

    def kill(self, restarts: list) -> None:
        ph = self.phase
        lf = self.victim(self.spared())
        ck = newest_for_run(ph.root / "nodes" / str(lf.node), ph.run_id)
        ph.read(lf)
        kill_group(lf.proc)
        lf.killed_at = ph.now()
        self.events.append(
            {
                "kind": "kill",
                "t": lf.killed_at,
                "node": lf.node,
                "stage": lf.stage,
                "inner_step": (lf.metrics or {}).get("inner_step"),
                "newest_checkpoint": None if ck is None else ck.step,
            }
        )
        restarts.append((ph.now() + self.opts.restart_delay, lf.node))
        self.log(
            f"SIGKILL node {lf.node} (stage {lf.stage}); newest checkpoint {None if ck is None else ck.step}"
        )

    def restart(self, node: int) -> None:
        lf = self.spawn(node, _bootstrap(self.phase, node), resume=True)
        self.events.append({"kind": "restart", "t": lf.spawned, "node": node})
        self.log(f"restart node {node} with --resume")

    def leave(self) -> None:
        ph = self.phase
        lf = self.victim(self.spared() | {e["node"] for e in self.events if e["kind"] == "kill"})
        lf.proc.send_signal(signal.SIGTERM)
        lf.killed_at = ph.now()  # gone from the schedule's point of view: its exit is expected
        self.leaving[lf.node] = (lf, lf.killed_at)
        self.events.append({"kind": "leave", "t": lf.killed_at, "node": lf.node, "stage": lf.stage})
        self.log(f"SIGTERM node {lf.node} (stage {lf.stage}): clean leave")

    def watch_leaving(self) -> None:
        for node, (lf, t) in list(self.leaving.items()):
            ev = next(e for e in self.events if e["kind"] == "leave" and e["node"] == node)
            if lf.proc.poll() is not None:
                ev.update(exit_code=lf.proc.returncode, exit_s=round(self.phase.now() - t, 1))
                del self.leaving[node]
                self.log(f"node {node} left: exit code {lf.proc.returncode} after {ev['exit_s']} s")
            elif self.phase.now() - t > LEAVE_WAIT_S:
                kill_group(lf.proc)
                ev.update(
                    exit_code=None, exit_s=None, note=f"still running {LEAVE_WAIT_S:.0f} s after SIGTERM"
                )
                del self.leaving[node]
                self.log(f"node {node} ignored SIGTERM for {LEAVE_WAIT_S:.0f} s: killed")

    def poll_new(self) -> None:
        ph = self.phase
        for lf in ph.current.values():
            if lf.ready_at is None and lf.killed_at is None:
                ready = poll_ready(lf.proc, lf.node, ph.root)
                if ready is not None:
                    lf.ready_at, lf.stage, lf.maddr = ph.now(), ready["stage"], _maddr(ready)
                    ev = next(
                        e for e in reversed(self.events) if e["node"] == lf.node and e["kind"] != "kill"
                    )
                    ev["ready_s"] = round(lf.ready_at - lf.spawned, 1)
                    ev["stage"] = lf.stage
                    self.log(f"node {lf.node} ready on stage {lf.stage} after {ev['ready_s']} s")

    def sample(self) -> dict:
        ph = self.phase
        base = ph.sample()  # chaos's sample: reads every live node's metrics, CPU, tail steps, loss
        rss = _rss_by_group()
        nodes = {
            str(lf.node): node_sample(lf, sum(x.node == lf.node for x in ph.lives) - 1, rss, self.opts.stages)
            for lf in ph.alive()
        }
        losses = [n["loss"] for n in nodes.values() if n["loss"] is not None]
        s = {
            "t": base["t"],
            "loss": sum(losses) / len(losses) if losses else None,
            "tail_steps": base["tail_steps"],
            "dropped": base["dropped"],
            "alive": base["alive"],
            "load1": round(base["load1"], 2),
            "swarm_cpu_s": base["swarm_cpu_s"],
            "nodes": nodes,
        }
        self.samples.append(s)
        return s

    def run(self) -> None:
        ph, opts = self.phase, self.opts
        ev = schedule(opts.minutes, opts.heartbeat, opts.join_at, opts.kill_at, opts.leave_at)
        self.start()
        restarts: list[tuple[float, int]] = []
        done = set()
        next_sample = next_dist = last_print = 0.0
        while True:
            now = ph.now()
            # every event fires, however late: on starved cores one pass of this loop can take a minute
            if now >= ev["end"] and not restarts and done >= set(ev) - {"end"}:
                break
            if "join" not in done and now >= ev["join"]:
                done.add("join")
                self.join_late()
            if "kill" in ev and "kill" not in done and now >= ev["kill"]:
                done.add("kill")
                self.kill(restarts)
            if "leave" not in done and now >= ev["leave"]:
                done.add("leave")
                self.leave()
            for due, node in list(restarts):
                if now >= due:
                    restarts.remove((due, node))
                    self.restart(node)
            self.poll_new()
            self.watch_leaving()
            _check_alive(ph)
            if now >= next_sample:
                s = self.sample()
                next_sample = now + opts.sample
                if now - last_print >= 60:
                    last_print = now
                    rss = " ".join(f"{k}:{n['rss_mb']:.0f}" for k, n in s["nodes"].items() if n["rss_mb"])
                    self.log(
                        f"tail steps {s['tail_steps']} loss {s['loss'] or float('nan'):.3f} "
                        f"alive {s['alive']} dropped {s['dropped']} rss MB {rss}"
                    )
            if now >= next_dist:
                next_dist = now + opts.distance_every
                d = replica_distances(ph)
                if d:
                    self.distances.append({"t": round(now, 1), "stages": d})
            time.sleep(1.0)
        self.distances.append({"t": round(ph.now(), 1), "stages": replica_distances(ph)})
        self.sample()

    def stop(self) -> None:
        ph = self.phase
        live = [lf for lf in ph.current.values() if lf.proc.poll() is None]
        stop_nodes([lf.proc for lf in live], [lf.stage if lf.stage is not None else 0 for lf in live])
        for lf in ph.lives:  # nothing outlives the run, by PID
            if lf.proc.poll() is None:
                kill_group(lf.proc)


# ---------------------------------------------------------------------- report


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ss = doc["samples"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=120, sharex=True)
    ax.plot(
        [s["t"] / 60 for s in ss if s["loss"] is not None],
        [s["loss"] for s in ss if s["loss"] is not None],
        color="k",
        lw=1.4,
        label="tail loss (mean over tail replicas)",
    )
    nodes = sorted({k for s in ss for k in s["nodes"]}, key=int)
    for k in nodes:
        pts = [(s["t"] / 60, s["nodes"][k]["rss_mb"]) for s in ss if s["nodes"].get(k, {}).get("rss_mb")]
        if pts:
            bx.plot(*zip(*pts), lw=1.2, label=f"node {k}")
    style = {
        "join": ("tab:green", "late join"),
        "kill": ("tab:red", "SIGKILL"),
        "restart": ("tab:orange", "restart --resume"),
        "leave": ("tab:purple", "SIGTERM leave"),
    }
    for e in doc["events"]:
        color, label = style[e["kind"]]
        for a in (ax, bx):
            a.axvline(
                e["t"] / 60,
                color=color,
                ls="--",
                lw=1.0,
                label=f"{label} (node {e['node']})" if a is ax else None,
            )
    ax.set_ylabel("loss")
    ax.set_title(
        f"soak: {doc['settings']['model']}, {doc['settings']['stages']} stages, "
        f"--heartbeat {doc['settings']['heartbeat']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    bx.set_ylabel("RSS of the node process (MB)")
    bx.set_xlabel("minutes since the first nodes were ready")
    bx.legend(fontsize=7, ncol=3)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def write_report(out: Path, doc: dict) -> None:
    s, st, sm = doc["settings"], doc["schedule"], doc["summary"]
    hb = s["heartbeat"]
    lines = [
        "# Soak run: an hour of one swarm with short DHT lifetimes, a late joiner, a kill and a leave",
        "",
        "Command (repository root, 2 CPU cores shared with other work, no GPU):",
        "",
        f"    {doc['command']}",
        "",
        f"Model `{s['model']}`, {s['stages']} stages, {s['nodes']} node processes, codec "
        f"`{s['codec'] or 'node default'}`, `--heartbeat {hb}`: stage records live "
        f"{stage_record_ttl(hb):.0f} s, the run record {run_record_ttl(hb):.0f} s, so the run lasted "
        f"{st['end'] / run_record_ttl(hb):.0f} run-record lifetimes. Outer rounds: the node's default "
        f"(`--outer-every` not set). Checkpoint every {s['checkpoint_every']} steps.",
        "",
        "## Schedule",
        "",
        "| event | planned (min) | at (min) | node | stage | detail |",
        "|---|---|---|---|---|---|",
        f"| {s['nodes'] - 1} nodes start | 0 | 0 | 0-{s['nodes'] - 2} | auto | |",
    ]
    for e in doc["events"]:
        detail = {
            "join": f"through {e.get('via', '?')}; ready after {_f(e.get('ready_s'), '.1f')} s "
            f"({e['t'] / run_record_ttl(hb):.0f} run-record lifetimes after the start)",
            "kill": f"SIGKILL of its process group at inner step {e.get('inner_step')}, newest checkpoint "
            f"{e.get('newest_checkpoint')}",
            "restart": f"`join --resume`; ready after {_f(e.get('ready_s'), '.1f')} s",
            "leave": f"SIGTERM; exit code {e.get('exit_code')} after {_f(e.get('exit_s'), '.1f')} s"
            + (f" ({e['note']})" if e.get("note") else ""),
        }[e["kind"]]
        planned = st.get(
            e["kind"], st.get("kill", 0) + s["restart_delay"] if e["kind"] == "restart" else None
        )
        lines.append(
            f"| {e['kind']} | {_f(planned / 60 if planned is not None else None, '.1f')} | {e['t'] / 60:.1f} "
            f"| {e['node']} | {e.get('stage', '-')} | {detail} |"
        )
    j = sm["late_joiner"]
    ev = doc.get("eval") or {}
    lines += [
        f"| end | {st['end'] / 60:.1f} | {doc['samples'][-1]['t'] / 60:.1f} | all | "
        "| SIGTERM stage by stage |",
        "",
        "## Figures",
        "",
        f"* **Loss** (tail stage, mean of the tail replicas' last {LOSS_TAIL} step losses, averaged over "
        f"the first and last {LOSS_WINDOW:.0%} of the run): "
        f"**{_f(sm['loss_start'])} -> {_f(sm['loss_end'])}**; "
        f"tail optimizer steps {doc['samples'][-1]['tail_steps']} (all replicas, all lifetimes).",
    ]
    if ev.get("n"):
        lines.append(
            f"* **Held-out** ({ev['n']} problems never trained on; model exported from the final "
            f"checkpoints): loss {_f(ev.get('loss_before'))} -> {_f(ev.get('loss_after'))}, exact match "
            f"{_f(ev.get('em_before'), '.2f')} -> {_f(ev.get('em_after'), '.2f')}."
        )
    elif ev.get("error"):
        lines.append(f"* Held-out evaluation failed: {ev['error']}")
    lines += [
        f"* **Late joiner** (node {doc['joiner']}): ready (stage claimed) {_f(j['ready_s'], '.1f')} s "
        f"after its start, first microbatch <= {_f(j['first_microbatch_s'], '.0f')} s, "
        "first optimizer step <= "
        f"{_f(j['first_step_s'], '.0f')} s (sampled every {s['sample']:.0f} s).",
        f"* **Outer rounds** (DiLoCo, summed over the live nodes at the end): {sm['outer_committed']} "
        f"committed, {sm['outer_skipped']} skipped or alone.",
        f"* **Dropped microbatches** (all lifetimes): {doc['dropped_total']}.",
    ]
    fin = doc.get("outer_final") or {}
    if fin:
        lines.append(
            "* **Replica distance at the end** (outer models the live nodes saved on SIGTERM, as "
            f"`node swarm` reports it): {_f(fin.get('max_replica_distance'), '.3g')}; outer rounds of the "
            f"live nodes {fin.get('rounds')} committed, {fin.get('skipped')} skipped or alone, "
            f"{fin.get('reanchored')} re-anchored."
        )
    for stage in sorted({k for x in doc["distances"] for k in x["stages"]}):
        reads = [x["stages"][stage] for x in doc["distances"] if stage in x["stages"]]
        # replicas that committed the same outer rounds must hold the same outer model
        same = [d["theta"] for d in reads if "theta" in d and d["outer_steps"][0] == d["outer_steps"][1]]
        last = reads[-1]
        lines.append(
            f"* **Replica distance**, stage {stage}, from the replicas' newest checkpoints "
            f"({len(reads)} reads, every {doc['settings']['distance_every']:.0f} s): outer model theta at "
            "equal outer steps: max "
            f"{_f(max(same) if same else None, '.3g')} over {len(same)} reads; local weights (checkpoints "
            f"up to {doc['settings']['checkpoint_every']} steps apart): max "
            f"{max(d['weights'] for d in reads):.3g}, "
            f"last {last['weights']:.3g} (nodes {last['nodes']}, steps {last['steps']})."
        )
    c = doc.get("checkpoints") or {}
    if c:
        lines.append(
            f"* **Checkpoints** left on disk: {c['loaded']}/{c['checkpoints']} verify and load into a fresh "
            f"stage; failures: {c['failed'] or 'none'}."
        )
    lines += [
        "",
        "RSS per process lifetime (MB; `2.1` is node 2's restart): the node process, in brackets its "
        "process group (node + DHT process + p2pd); *anon*: the node process's anonymous resident memory "
        "(what a leak grows; file-backed pages come and go with the machine's memory pressure).",
        "",
        f"| node | first sample (min) | RSS then | {RSS_SETTLE_S / 60:.0f} min later | last sample (min) "
        "| RSS end | max | growth since settled | anon growth since settled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for node, r in sorted(sm["rss"].items(), key=lambda kv: float(kv[0])):
        lines.append(
            f"| {node} | {r['start_t'] / 60:.1f} | {r['start_mb']:.0f} ({r['group_start_mb']:.0f}) "
            f"| {_f(r.get('settled_mb'), '.0f')} | {r['end_t'] / 60:.1f} | {r['end_mb']:.0f} "
            f"({r['group_end_mb']:.0f}) | {r['max_mb']:.0f} | {_f(r['growth_mb'], '+.0f')} "
            f"| {_f(r.get('anon_growth_mb'), '+.0f')} |"
        )
    lines += [
        "",
        f"Verdict: **{doc['verdict'] or 'passed (loss fell, the late joiner trained)'}**",
        "",
        "![loss and RSS over time](soak.png)",
        "",
    ]
    (out / "soak.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reliability.soak", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--minutes", type=float, default=60.0, help="length of the run after the first nodes are ready"
    )
    p.add_argument("--nodes", type=int, default=5, help="node processes, the late joiner included")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--model", default="tiny:4:256")
    p.add_argument("--codec", default=None, help="pipeline-link codec (default: the node's)")
    p.add_argument(
        "--heartbeat", type=float, default=1.0, help="every node's --heartbeat (sets the DHT lifetimes)"
    )
    p.add_argument("--join-at", type=float, default=None, help="minute of the late join (default: minutes/6)")
    p.add_argument("--kill-at", type=float, default=0.45, help="share of the run for the SIGKILL; 0 = none")
    p.add_argument("--leave-at", type=float, default=2 / 3, help="share of the run for the SIGTERM leave")
    p.add_argument("--restart-delay", type=float, default=10.0, help="seconds the killed node stays down")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--distance-every", type=float, default=60.0, help="seconds between replica-distance reads"
    )
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--eval", type=int, default=40, help="held-out problems scored before and after; 0 = none")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs/soak")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--render", default=None, metavar="JSON", help="only redraw OUT's report from a soak.json")
    opts = p.parse_args(argv)
    if opts.render:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        return render(json.loads(Path(opts.render).read_text()), out)
    if opts.join_at is None:
        opts.join_at = opts.minutes / 6
    command = "python -m bench.reliability.soak " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    if opts.nodes < opts.stages + 2:
        print(
            f"error: --nodes {opts.nodes} is too few: {opts.stages} stages need {opts.stages + 2} "
            "(one per stage, one to leave, one to join late)",
            file=sys.stderr,
        )
        return 2
    try:
        ev = schedule(opts.minutes, opts.heartbeat, opts.join_at, opts.kill_at, opts.leave_at)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(opts.workdir)
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():  # a fresh run; a log the caller redirects into the workdir stays
        if old.suffix != ".log":
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    swarm_args = build_parser().parse_args(
        [
            "swarm",
            "--nodes",
            str(opts.nodes - 1),
            "--stages",
            str(opts.stages),
            "--model",
            opts.model,
            "--lr",
            str(opts.lr),
            "--seed",
            str(opts.seed),
            "--threads-per-node",
            "1",
            "--eval",
            str(opts.eval),
        ]
        + (["--codec", opts.codec] if opts.codec else [])
    )  # --nodes: the head waits for the first nodes only, not for the late joiner

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    soak: Soak | None = None
    held = before = None
    failure = None
    try:
        from node.local.launcher import prepare_eval

        if opts.eval:
            held, before = prepare_eval(swarm_args, root)  # the nodes train on the rest
        soak = Soak(opts, swarm_args, root)
        print(f"[soak] run {soak.phase.run_id}: schedule (s) {ev}", flush=True)
        soak.run()
    except KeyboardInterrupt:
        print("interrupted; every node was stopped", file=sys.stderr)
        return 130
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        if soak is None or not soak.samples:
            return 2
        failure = f"the swarm failed: {str(e).splitlines()[0]}"  # still write what was recorded
    finally:
        if soak is not None:
            soak.stop()
    ph = soak.phase
    for lf in ph.current.values():  # the final metrics every stopped node wrote
        ph.read(lf)
    doc: dict = {
        "command": command,
        "settings": vars(opts),
        "schedule": ev,
        "run_id": ph.run_id,
        "joiner": soak.joiner,
        "events": soak.events,
        "samples": soak.samples,
        "distances": soak.distances,
        "dropped_total": sum(lf.get("dropped_microbatches") for lf in ph.lives),
    }
    doc["failure"] = failure
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(doc, indent=1))  # first: the raw record survives a later bug
    if held and not failure:
        from node.local.launcher import finish_model

        doc["eval"], line = finish_model(swarm_args, root, ph.run_id, held, before)
        print(line, flush=True)
    from node.local.report import outer_summary

    # the demo's own figure: outer models the nodes live at the end saved on SIGTERM
    doc["outer_final"] = outer_summary(
        [lf.metrics for lf in ph.current.values() if lf.metrics and lf.killed_at is None]
    )
    doc["checkpoints"] = verify_checkpoints(ph, swarm_args)
    return render(doc, out)


def render(doc: dict, out: Path) -> int:
    """Summary, verdict, soak.json, soak.png and soak.md from a run's record; the exit status."""
    doc["summary"] = summarize(doc["samples"], doc["events"], doc["joiner"])
    doc["verdict"] = doc.get("failure") or verdict(doc["summary"])
    (out / "soak.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / "soak.png")
    write_report(out, doc)
    sm = doc["summary"]
    print(
        f"[soak] loss {_f(sm['loss_start'])} -> {_f(sm['loss_end'])}; late joiner first step "
        f"{_f(sm['late_joiner']['first_step_s'], '.0f')} s; outer rounds {sm['outer_committed']} committed; "
        f"dropped {doc['dropped_total']}; report {out / 'soak.md'}",
        flush=True,
    )
    if doc["verdict"]:
        print(f"soak failed: {doc['verdict']}", file=sys.stderr)
        return 2 if doc.get("failure") else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
