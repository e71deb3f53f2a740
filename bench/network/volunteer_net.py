"""A swarm on a volunteer internet (``bench.network.vnet``), with churn, against the same swarm all public.

    sudo .venv/bin/python -m bench.network.volunteer_net --homes 13 --public 3 --minutes 20 \\
        --out runs/vnet --report bench/results/volunteer_net

One invocation, two runs with the same nodes, lines and churn schedule: first on the volunteer
internet (``--public`` public nodes, the rest in homes behind NATs of three kinds, cycling eim,
sym, cgnat), then with every node public. The public node 0 starts the run (``--stages``); the
others join with ``--stage auto`` and rebalancing on, as volunteers do. Churn: every
``--churn-every`` seconds a home node is killed (SIGKILL) and a fresh one joins in its home; once
(``--relay-kill-at``) public node 1, a relay, is killed for good; once (``--bounce-at``) a home
router's uplink goes down and up. The model is emulated (``node/model/emulated.py``: real-size
activations, compute as sleeps), so the lines, not this machine's CPUs, should set the pace.

Every ``--sample`` seconds each live node's metrics file is read: the report has the swarm's
tokens/s over time (the tails' trained tokens), microbatches dropped against those that could have
been in flight to killed nodes, outer rounds committed and skipped per stage, connections by kind
and the relayed share of bytes, how long a stage stayed without a node after a kill, CPU seconds
and memory per node. ``--report P`` writes P.json, P.md and P.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.network.nat import _cpu_s
from bench.network.netns import check_nat_support
from bench.network.vnet import KINDS, VolunteerNet

REPO = Path(__file__).resolve().parents[2]
PORT = 31337
SMOOTH = 12  # samples in the plot's moving mean (a minute at the default --sample 5)
HEADER_B = 66  # Ethernet 14 + IPv4 20 + TCP 20 + its timestamp option 12, per packet
TICK_S = 0.5  # how often a kill's stage is looked at until it is served again
RECOVERY_GIVE_UP_S = 180.0


@dataclass
class Member:
    name: str
    ns: str
    host: str
    dir: Path
    home: int | None  # None: a public node
    nat: str | None = None  # the home's NAT kind (vnet.KINDS); None: a public node, or the all-public run
    proc: subprocess.Popen | None = None
    killed_at: float | None = None
    started_at: float = 0.0

    def metrics(self) -> dict:
        try:
            return json.loads((self.dir / "m.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}


@dataclass
class Run:
    label: str
    samples: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)
    final: dict = field(default_factory=dict)
    # incarnation (its directory's name) -> its latest metrics reading, trimmed (``observe``)
    latest: dict[str, dict] = field(default_factory=dict)
    recoveries: list[dict] = field(default_factory=list)  # one per kill (``Recovery``)
    # namespace -> [(tx bytes, packets) at start, at end]
    tx: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    tx_span_s: float = 0.0  # seconds between the two tx readings


COUNTERS = ("trained_tokens", "relay_failures", "relayed_out", "state_pull_bytes")


def _counters(x: dict) -> dict:
    """The cumulative counters of one runtime's reading (a stage move starts a new runtime, whose
    counters start again from 0)."""
    relay = x.get("relay") or {}
    return {
        "stage": x.get("stage"),
        "sent": dict((x.get("sent") or {}).get("bytes", {})),
        "links": {f"{lk['boundary']}/{lk['direction']}": lk for lk in x.get("links", [])},
        "trained_tokens": int(x.get("trained_tokens", 0)),
        "relay_failures": int(relay.get("relay_failures", 0)),
        "relayed_out": int(relay.get("relayed_out", 0)),
        "state_pull_bytes": int(x.get("state_pull_bytes", 0)),
    }


def _bank(bank: dict, cur: dict) -> None:
    """Add a finished runtime's counters ``cur`` to ``bank``."""
    for k, v in cur["sent"].items():
        bank["sent"][k] = bank["sent"].get(k, 0) + int(v)
    for k, lk in cur["links"].items():
        d = bank["links"].setdefault(k, {"frames": 0, "tokens": 0, "bytes": 0})
        for f in d:
            d[f] += int(lk.get(f, 0))
    st = str(cur["stage"])
    bank["tokens_by_stage"][st] = bank["tokens_by_stage"].get(st, 0) + cur["trained_tokens"]
    for k in COUNTERS[1:]:
        bank[k] = bank.get(k, 0) + cur[k]


def totals(n: dict) -> dict:
    """An incarnation's counters over all its runtimes (``observe``'s bank plus the current one)."""
    bank = n["bank"]
    t = {
        "sent": dict(bank["sent"]),
        "links": {k: dict(v) for k, v in bank["links"].items()},
        "tokens_by_stage": dict(bank["tokens_by_stage"]),
        **{k: bank.get(k, 0) for k in COUNTERS[1:]},
    }
    if n["cur"] is not None:
        _bank(t, n["cur"])
    return t


def observe(run: Run, m: Member, x: dict, rounds_only: bool = False) -> None:
    """Keep ``m``'s latest reading ``x`` (for a killed node, the one read right after the kill).
    A stage move starts a new runtime whose counters and round list start empty: when the stage
    changed or the bytes sent went down, the previous runtime's counters are banked. Every outer round
    seen for the first time (by its start time) is tagged with the stage the node served then and how
    it reached each neighbour then (``connections``: peer id -> direct/reversed/punched/relayed).
    ``rounds_only``: a reading after the node exited (it writes one last file), for the rounds."""
    if not x:
        return
    n = run.latest.setdefault(
        m.dir.name,
        {"member": m.name, "ns": m.ns, "nat": m.nat, "peer_id": x.get("peer_id"), "rounds": [], "seen": set(),
         "cur": None, "moves": 0, "bank": {"sent": {}, "links": {}, "tokens_by_stage": {}}},
    )  # fmt: skip
    conns = x.get("connections", {}) or {}
    for r in x.get("outer_rounds", []):
        key = (r.get("round"), r.get("started"))
        if key in n["seen"]:
            continue
        n["seen"].add(key)
        n["rounds"].append(
            {
                "stage": x.get("stage"),
                "skipped": bool(r.get("skipped")),
                "group": r.get("group", ""),
                "group_size": r.get("group_size", 1),
                "seconds": r.get("seconds", 0.0),
                "conns": dict(conns),
            }
        )
    if rounds_only:
        return
    cur = _counters(x)
    prev = n["cur"]
    if prev is not None and (
        prev["stage"] != cur["stage"] or sum(cur["sent"].values()) < sum(prev["sent"].values())
    ):
        _bank(n["bank"], prev)
        n["moves"] += 1
    n["cur"], n["stage"] = cur, cur["stage"]
    n["sent"] = totals(n)["sent"]


@dataclass
class Recovery:
    """How long after a kill its stage was served again by a live node: ``reported_s``, until a live
    node's metrics file named that stage (0: another replica served it all along); ``computed_s``,
    until a live node computed a microbatch in it. Polled every ``TICK_S``; a metrics file is
    rewritten every heartbeat, so each figure is late by up to one heartbeat."""

    t: float  # the kill, seconds into the run
    node: str
    stage: int | None
    t_mono: float
    base: dict[str, int] = field(default_factory=dict)  # live node -> microbatches when first seen in it
    reported_s: float | None = None
    computed_s: float | None = None
    by: str | None = None  # the live node that reported the stage first (a replica, a mover, a joiner)
    restarted: bool = False  # ``by`` took the stage emptied, its training lost (restarted_empty_stage)

    def poll(self, members: list[Member], now: float) -> bool:
        """One look at the live members; True once both figures are known."""
        for m in members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            x = m.metrics()
            if not x or x.get("stage") != self.stage:
                continue
            if self.reported_s is None:
                self.reported_s = round(now - self.t_mono, 1)
                self.by = m.dir.name
            # a heartbeat or two after it reported the stage, its metrics say how it started
            self.restarted = self.restarted or (
                m.dir.name == self.by and bool(x.get("restarted_empty_stage"))
            )
            mb = int(x.get("microbatches", 0))
            if mb > self.base.setdefault(m.dir.name, mb) and self.computed_s is None:
                self.computed_s = round(now - self.t_mono, 1)
        return self.reported_s is not None and self.computed_s is not None

    def as_dict(self, heartbeat: float) -> dict:
        beats = lambda s: None if s is None else round(s / heartbeat, 2)  # noqa: E731
        return {
            "t": self.t, "node": self.node, "stage": self.stage,
            "reported_s": self.reported_s, "reported_beats": beats(self.reported_s),
            "computed_s": self.computed_s, "computed_beats": beats(self.computed_s), "by": self.by,
            "restarted": self.restarted,
        }  # fmt: skip


def _spawn(net: VolunteerNet, m: Member, args: list[str]) -> None:
    m.dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "node", "join", "--host", m.host, "--port", str(PORT), *args]
    cmd += [
        "--state-dir",
        str(m.dir),
        "--metrics-file",
        str(m.dir / "m.json"),
        "--ready-file",
        str(m.dir / "ready.json"),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    log = open(m.dir / "log", "a")
    m.proc = subprocess.Popen(
        net.exec_prefix(m.ns) + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
    )
    m.started_at = time.monotonic()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out ({timeout:.0f}s) waiting for {what}")
        time.sleep(0.5)


def node_args(a) -> list[str]:
    args = [
        "--model", a.model, "--codec", a.codec, "--seq-len", str(a.seq_len),
        "--microbatch", str(a.microbatch),
        "--batch-tokens", str(a.batch_tokens), "--run-id", "vnet", "--threads", "1", "--device", "cpu",
        "--heartbeat", str(a.heartbeat), "--max-inflight", str(a.max_inflight),
        "--p2pd-timeout", "90", "--join-timeout", "180", "--outer-every", str(a.outer_every),
        "--data", a.data,
    ]  # fmt: skip
    args += ["--finetune", a.finetune] if a.finetune else []
    args += ["--lr", str(a.lr)] if a.lr is not None else []
    args += ["--outer-bits", str(a.outer_bits)] if a.outer_bits else []
    # a learning run (--eval) exports from the checkpoint each node writes when it is stopped
    # (SIGTERM): only that one, never one mid-run (the lines, not the disk, should set the pace)
    return args + ["--checkpoint-every", "1000000" if a.eval else "0"]


def sample(run: Run, t0: float, stages: int) -> dict:
    """One reading of every live member's metrics."""
    now = time.monotonic() - t0
    nodes = {}
    for m in run.members:
        if m.proc is None or m.proc.poll() is not None:
            continue
        x = m.metrics()
        if not x:
            continue
        observe(run, m, x)
        rounds = x.get("outer_rounds", [])
        nodes[m.dir.name] = {  # one incarnation: a replacement is a new volunteer
            "stage": x.get("stage"),
            "ready": bool(x.get("inner_step", 0) > 0 or x.get("microbatches", 0) > 0),
            "trained_tokens": x.get("trained_tokens", 0),
            "dropped": x.get("dropped_microbatches", 0),
            "held": x.get("held_microbatches", 0),
            "sent": (x.get("sent") or {}).get("bytes", {}),
            "microbatches": x.get("microbatches", 0),
            "committed": sum(1 for r in rounds if not r.get("skipped")),
            "skipped": sum(1 for r in rounds if r.get("skipped")),
            "alone": x.get("outer_alone", 0),
            "connections": x.get("connections", {}),
            "relayed_bytes": (x.get("relay") or {}).get("relayed_bytes", 0),
            "link_bytes": sum(int(lk.get("bytes", 0)) for lk in x.get("links", [])),
            "reachability": x.get("reachability"),
            "rss": (x.get("memory") or {}).get("rss", 0),
            "cpu_s": _cpu_s(m.proc.pid),
        }
    served = sorted({n["stage"] for n in nodes.values() if n["stage"] is not None})
    s = {
        "t": round(now, 1),
        "nodes": nodes,
        "served": served,
        "unserved": [i for i in range(stages) if i not in served],
    }
    run.samples.append(s)
    return s


def run_swarm(label: str, net: VolunteerNet, out: Path, a) -> Run:
    """One run: ``a.public`` public nodes, and ``a.homes`` home nodes, behind their NATs when
    ``net`` has homes, else on the public nodes after the first ``a.public`` (the comparison)."""
    run = Run(label)
    rng = random.Random(a.seed)
    base = node_args(a)
    behind_nat = bool(net.kinds)
    pubs = [
        Member(f"pub{i}", net.public_ns(i), net.public_addr(i), out / label / f"pub{i}", None)
        for i in range(a.public)
    ]
    place = (lambda j: (net.home_ns(j), net.home_addr(j))) if behind_nat else (
        lambda j: (net.public_ns(a.public + j), net.public_addr(a.public + j))
    )  # fmt: skip
    homes = [
        Member(f"home{j}", *place(j), out / label / f"home{j}", j, net.kinds[j] if behind_nat else None)
        for j in range(a.homes)
    ]
    run.members = [*pubs, *homes]
    t0 = time.monotonic()
    run.tx = {m.ns: [net.tx_counters(m.ns)] for m in run.members}
    _spawn(net, pubs[0], [*base, "--stages", str(a.stages), "--stage", "0"])
    _wait(lambda: (pubs[0].dir / "ready.json").exists(), 180, "the organiser")
    peer = json.loads((pubs[0].dir / "ready.json").read_text())["peer_id"]
    join = [*base, "--peers", f"/ip4/{pubs[0].host}/tcp/{PORT}/p2p/{peer}"]
    for m in [*pubs[1:], *homes]:  # joined one by one, a few seconds apart, as volunteers arrive
        _spawn(net, m, join)
        time.sleep(a.join_gap)
    run.events.append({"t": round(time.monotonic() - t0, 1), "kind": "all started"})
    start = time.monotonic()
    next_churn = start + a.churn_every
    relay_killed = bounced = emptied = False
    fresh = 0
    pending: list[Recovery] = []
    next_sample = time.monotonic()

    def killed(m: Member, now: float, kind: str) -> None:
        m.proc.kill()
        m.proc.wait(10)
        x = m.metrics()  # its last heartbeat's reading: what it had sent and the rounds it was in
        observe(run, m, x)
        ev = {"t": round(now - t0, 1), "kind": kind, "node": m.dir.name, "stage": x.get("stage")}
        run.events.append(ev)
        if x.get("stage") is None:  # it had not taken a stage yet: nothing to serve again
            return
        rec = Recovery(ev["t"], m.dir.name, x.get("stage"), now)
        rec.poll(run.members, now)  # another replica of the stage: served all along
        pending.append(rec)
        run.recoveries.append(rec)

    while time.monotonic() - start < a.minutes * 60:
        now = time.monotonic()
        if now >= next_churn and homes:
            victim = rng.choice([m for m in homes if m.proc and m.proc.poll() is None] or homes)
            killed(victim, now, "kill")
            fresh += 1
            victim.dir = out / label / f"{victim.name}-{fresh}"  # a fresh volunteer: new identity
            _spawn(net, victim, join)
            next_churn = now + a.churn_every
        if not relay_killed and len(pubs) > 1 and now - start >= a.relay_kill_at:
            killed(pubs[1], now, "relay killed")
            relay_killed = True
        if not emptied and now - start >= a.empty_stage_at:
            emptied = True
            victims = lone_stage(run.members)
            for victim in victims:  # all down before any is looked at: none serves the stage for another
                victim.proc.kill()
            for victim in victims:
                victim.proc.wait(10)
            for victim in victims:  # then a fresh volunteer in each of their homes
                killed(victim, now, "stage emptied")
                fresh += 1
                victim.dir = out / label / f"{victim.name}-{fresh}"
                _spawn(net, victim, join)
        if not bounced and now - start >= a.bounce_at:  # home 0's router, or its own line
            if behind_nat:
                net.bounce_uplink(0)
            else:
                net.bounce_public(a.public)
            bounced = True
            run.events.append({"t": round(now - t0, 1), "kind": "uplink bounced", "node": "home0"})
        pending = [r for r in pending if not r.poll(run.members, now) and now - r.t_mono < RECOVERY_GIVE_UP_S]
        if now >= next_sample:
            sample(run, t0, a.stages)
            next_sample = now + a.sample
        time.sleep(TICK_S if pending else max(0.0, min(TICK_S * 4, next_sample - time.monotonic())))
    run.final = sample(run, t0, a.stages)
    for ns, tx in run.tx.items():
        tx.append(net.tx_counters(ns))
    run.tx_span_s = time.monotonic() - t0
    for m in run.members:
        if m.proc and m.proc.poll() is None:
            m.proc.terminate()
    for m in run.members:
        if m.proc:
            try:
                m.proc.wait(60)
            except subprocess.TimeoutExpired:
                m.proc.kill()
        observe(run, m, m.metrics(), rounds_only=True)  # its last file, written on the way out
    return run


def lone_stage(members: list[Member]) -> list[Member]:
    """The live nodes of the stage served by the fewest nodes, all of them homes (a public node is
    the organiser or a relay, killed on its own schedule): killing them empties the stage. Empty
    when every stage has a public node."""
    by_stage: dict[int, list[Member]] = {}
    for m in members:
        if m.proc and m.proc.poll() is None and (st := m.metrics().get("stage")) is not None:
            by_stage.setdefault(st, []).append(m)
    homes_only = [ms for ms in by_stage.values() if all(m.home is not None for m in ms)]
    return min(homes_only, key=len, default=[])


def sent_per_token(nodes) -> dict[str, float]:
    """Bytes the last-seen nodes sent, by kind and in total, per token the tails trained."""
    from node.stage.metrics import bytes_per_token

    kinds: dict[str, int] = {}
    for n in nodes:
        for k, v in n.get("sent", {}).items():
            kinds[k] = kinds.get(k, 0) + v
    tails = [n for n in nodes if n.get("stage") == max((m.get("stage") or 0) for m in nodes)]
    per = bytes_per_token(kinds, sum(n["trained_tokens"] for n in tails))
    return {k: round(v, 1) for k, v in per.items()}


def dropped_in(run: Run, warm_s: float) -> int:
    """Microbatches dropped after ``warm_s`` (the swarm formed): each node's count at its last
    reading less its count at its first reading after ``warm_s``."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in run.samples:
        for name, n in s["nodes"].items():
            if s["t"] >= warm_s:
                first.setdefault(name, n["dropped"])
            last[name] = n["dropped"]
    return sum(max(0, d - first.get(name, 0)) for name, d in last.items())


def in_flight_to(run: Run, event: dict, max_inflight: int) -> int:
    """The most microbatches that can have been in flight through a killed node: every node of
    the stage before it holds up to ``max_inflight`` (a head's own when it was a head), read from
    the last sample before the kill."""
    before = [s for s in run.samples if s["t"] <= event["t"]]
    if not before:
        return max_inflight
    nodes = before[-1]["nodes"]
    stage = nodes.get(event.get("node"), {}).get("stage", event.get("stage"))
    if stage is None or stage == 0:
        return max_inflight
    upstream = sum(1 for n in nodes.values() if n["stage"] == stage - 1)
    return max_inflight * max(1, upstream)


def groups_by_stage(run: Run) -> dict[str, dict]:
    """The committed outer rounds, one per group: every member of a committed round's group reports
    the same ``group`` id (node/dp/diloco.py RoundStats), so the members' readings put together give
    each round's membership (a member killed within a heartbeat of the round, or one that never wrote
    it, leaves its group short of ``group_size``: ``unseen``, and such a group is not called
    all-NAT). Per stage: groups committed, by member count; those of NAT'd members
    only, and of them those with a member behind a symmetric NAT (``sym``) or a carrier NAT
    (``cgnat``); how those all-NAT groups' members reached each other (each member's ``connections``
    entry for each other member when the round was first seen; ``unlisted``: not a neighbour it
    tracks); the rounds' gathering time (``seconds``, median and max) and the member-rounds whose
    group had a member this bench never saw report it (``unseen``)."""
    groups: dict[str, dict] = {}
    for name, n in run.latest.items():
        for r in n["rounds"]:
            if r["skipped"] or not r["group"]:
                continue
            g = groups.setdefault(r["group"], {"stage": r["stage"], "size": r["group_size"], "members": []})
            g["members"].append((name, n, r))
    out: dict[str, dict] = {}
    for g in groups.values():
        st = out.setdefault(
            str(g["stage"]),
            {"committed": 0, "by_members": {}, "all_nat": 0, "all_nat_sym": 0, "all_nat_cgnat": 0,
             "all_nat_pairs": {}, "unseen": 0, "seconds": []},
        )  # fmt: skip
        st["committed"] += 1
        k = str(len(g["members"]))
        st["by_members"][k] = st["by_members"].get(k, 0) + 1
        st["unseen"] += int(len(g["members"]) < g["size"])
        st["seconds"] += [r["seconds"] for _, _, r in g["members"]]
        nats = [n["nat"] for _, n, _ in g["members"]]
        if all(nats) and len(nats) >= g["size"]:  # every member seen, every one NAT'd
            st["all_nat"] += 1
            st["all_nat_sym"] += int("sym" in nats)
            st["all_nat_cgnat"] += int("cgnat" in nats)
            for _, n, r in g["members"]:
                for _, o, _ in g["members"]:
                    if o is not n:
                        kind = r["conns"].get(o["peer_id"], "unlisted")
                        st["all_nat_pairs"][kind] = st["all_nat_pairs"].get(kind, 0) + 1
    for st in out.values():
        secs = sorted(st.pop("seconds"))
        st["seconds_median"] = round(secs[len(secs) // 2], 1) if secs else None
        st["seconds_max"] = round(secs[-1], 1) if secs else None
    return dict(sorted(out.items()))


def unaccounted(run: Run, heartbeat: float) -> dict[str, dict]:
    """Per node namespace (a public node's, or a home's, shared by its successive volunteers): the
    bytes its interface transmitted over the run less the bytes its nodes counted as sent (the last
    reading of each; ``node.stage.metrics.sent_bytes``), per heartbeat: DHT, libp2p and TCP/IP
    overhead (and retransmissions on the lossy lines), plus what a killed node sent after its last
    heartbeat's reading, and what it served a joiner of its stage as hivemind's outer-state download
    (counted by neither side; ``link_ledger``). ``headers_per_beat``: the packets' Ethernet, IPv4 and
    TCP headers (``HEADER_B`` each, pure ACKs included); ``beyond_headers_per_beat``: the rest of the
    unaccounted bytes (retransmissions, libp2p's framing and encryption, DHT, matchmaking, state
    downloads)."""
    beats = max(1.0, run.tx_span_s / heartbeat)
    counted: dict[str, int] = {}
    label: dict[str, str] = {}
    for n in run.latest.values():
        # (an incarnation first read in the file it wrote as it stopped has no counters: rounds only)
        counted[n["ns"]] = counted.get(n["ns"], 0) + sum(int(v) for v in n.get("sent", {}).values())
        label[n["ns"]] = n["member"] + (f" ({n['nat']})" if n["nat"] else "")
    out = {}
    for ns, tx in run.tx.items():
        if len(tx) < 2:
            continue
        sent, packets = tx[1][0] - tx[0][0], tx[1][1] - tx[0][1]
        c = counted.get(ns, 0)
        out[label.get(ns, ns)] = {
            "tx_per_beat": round(sent / beats),
            "counted_per_beat": round(c / beats),
            "unaccounted_per_beat": round((sent - c) / beats),
            "headers_per_beat": round(packets * HEADER_B / beats),
            "beyond_headers_per_beat": round((sent - c - packets * HEADER_B) / beats),
        }
    return out


def link_ledger(run: Run, last: int) -> dict:
    """Where the link bytes go (the swarm's sums over every incarnation's runtimes, killed ones and
    those before a stage move included): per boundary and direction, frames, tokens and bytes (a
    forward frame with no backward reply across the same boundary was retried or lost on the way);
    the tokens trained per stage, the tails' being ``sent_per_token``'s divisor; the relay counters
    (streams sent through a relay, relays that could not be reached); the stage moves; the bytes
    joiners pulled as weights (``state_pull_bytes``; hivemind's outer-state download to a joiner
    is counted by neither side)."""
    ledger: dict[str, dict[str, int]] = {}
    tokens: dict[str, int] = {}
    extra = dict.fromkeys(COUNTERS[1:], 0)
    for n in run.latest.values():
        if n["cur"] is None:
            continue
        t = totals(n)
        for key, lk in t["links"].items():
            d = ledger.setdefault(key, {"frames": 0, "tokens": 0, "bytes": 0})
            for k in d:
                d[k] += lk[k]
        for st, v in t["tokens_by_stage"].items():
            tokens[st] = tokens.get(st, 0) + v
        for k in extra:
            extra[k] += t[k]
    return {
        "links": dict(sorted(ledger.items())),
        "tokens_by_stage": dict(sorted(tokens.items())),
        "tail_trained_tokens": tokens.get(str(last), 0),
        "moves": sum(n["moves"] for n in run.latest.values()),
        **extra,
    }


def sent_per_token_all(run: Run, last: int) -> dict[str, float]:
    """``sent_per_token`` over every incarnation's runtimes (stage moves banked, ``observe``)."""
    from node.stage.metrics import bytes_per_token

    kinds: dict[str, int] = {}
    tokens = 0
    for n in run.latest.values():
        if n["cur"] is None:
            continue
        t = totals(n)
        for k, v in t["sent"].items():
            kinds[k] = kinds.get(k, 0) + v
        tokens += t["tokens_by_stage"].get(str(last), 0)
    return {k: round(v, 1) for k, v in bytes_per_token(kinds, tokens).items()}


def summarize(run: Run, a, warm_s: float) -> dict:
    """The figures of one run (the module docstring)."""
    last = a.stages - 1
    ss = [s for s in run.samples if s["t"] >= warm_s] or run.samples
    series = []
    prev = None
    for s in run.samples:
        if prev is not None and s["t"] > prev["t"]:  # each tail's own increment: a node that left the
            gained = sum(  # tail (killed, moved) takes its count away, and must not cancel the others'
                max(0, n["trained_tokens"] - prev["nodes"][name]["trained_tokens"])
                for name, n in s["nodes"].items()
                if n["stage"] == last and prev["nodes"].get(name, {}).get("stage") == last
            )
            series.append((s["t"], gained / (s["t"] - prev["t"])))
        prev = s
    # tokens/s over the measured window: the mean of the samples' rates
    window = [r for t, r in series if t >= warm_s]
    tps = sum(window) / len(window) if window else 0.0
    kinds: dict[str, int] = {}
    for n in run.final.get("nodes", {}).values():
        for k in n["connections"].values():
            kinds[k] = kinds.get(k, 0) + 1
    # a stage without a node after a kill: the longest run of samples in which it was unserved
    gaps: dict[int, float] = {}
    for i in range(a.stages):
        start = None
        for s in ss:
            if i in s["unserved"] and start is None:
                start = s["t"]
            elif i not in s["unserved"] and start is not None:
                gaps[i] = max(gaps.get(i, 0.0), s["t"] - start)
                start = None
        if start is not None:
            gaps[i] = max(gaps.get(i, 0.0), ss[-1]["t"] - start)
    # outer rounds per stage, from the members' last readings (killed ones included)
    last_seen: dict[str, dict] = {}
    for s in run.samples:
        last_seen.update(s["nodes"])
    rounds: dict[int, dict] = {}
    for n in last_seen.values():
        r = rounds.setdefault(n["stage"], {"committed": 0, "skipped": 0, "alone": 0})
        for k in ("committed", "skipped", "alone"):
            r[k] += n[k]
    trained: dict[str, int] = {}  # microbatches each member computed (a replacement keeps the name)
    for s in run.samples:
        for name, n in s["nodes"].items():
            trained[name] = max(trained.get(name, 0), n["microbatches"])
    relayed = sum(n["relayed_bytes"] for n in last_seen.values())
    link = sum(n["link_bytes"] for n in last_seen.values())
    bound = sum(
        in_flight_to(run, e, a.max_inflight)
        for e in run.events
        if e["kind"] in ("kill", "relay killed", "stage emptied")
    )
    return {
        "label": run.label,
        "tokens_per_s": round(tps, 1),
        "series": [[round(t, 1), round(r, 1)] for t, r in series],
        "dropped": dropped_in(run, warm_s),
        "dropped_all": sum(n["dropped"] for n in last_seen.values()),
        # tries of a microbatch that waited for an empty next stage instead of being dropped
        "held_all": sum(n.get("held", 0) for n in last_seen.values()),
        # bytes every node sent, by kind (node.stage.metrics.sent_bytes), per token the tails trained
        "sent_per_token": sent_per_token_all(run, last),
        "sent_per_token_last_readings": sent_per_token(last_seen.values()),  # as the first two sections
        "in_flight_bound": bound,
        "outer_rounds": {
            str(k): v for k, v in sorted(rounds.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        },
        "connections": kinds,
        "relayed_share": round(relayed / link, 4) if link else 0.0,
        "relayed_mb": round(relayed / 1e6, 1),
        "longest_unserved_s": {str(k): round(v, 1) for k, v in gaps.items()},
        "cpu_s_per_node_per_beat": round(
            sum(n["cpu_s"] for n in last_seen.values())
            / max(1, len(last_seen))
            / max(1.0, ss[-1]["t"] / a.heartbeat),
            3,
        ),
        "rss_mb_per_node": round(
            sum(n["rss"] for n in last_seen.values()) / max(1, len(last_seen)) / 2**20, 1
        ),
        "events": run.events,
        # per kill: seconds (and heartbeats) until a live node reported / computed in its stage
        "recoveries": [r.as_dict(a.heartbeat) for r in run.recoveries],
        "groups": groups_by_stage(run),
        "unaccounted": unaccounted(run, a.heartbeat),
        "link_ledger": link_ledger(run, last),
        "nodes_seen": len(last_seen),
        "trained_by_node": trained,
        "reachability": {k: n["reachability"] for k, n in sorted(last_seen.items())},
    }


def _eval_cell(r: dict) -> str:
    ev = r.get("eval") or {}
    if "em_after" not in ev:
        return ev.get("error", "-")
    from node.local.launcher import _em  # swarm --eval's own wording ("n/a": no completions to match)

    return (
        f"{_em(ev['em_before'])} -> {_em(ev['em_after'])} on {ev['n']} "
        f"({ev['loss_before']:.3f} -> {ev['loss_after']:.3f})"
    )


def report_md(entry: dict) -> str:
    """The figures the acceptance asks for, one table, every run a column (REPORT.md)."""
    runs = entry["runs"]
    base = next((r for r in runs if r["label"] == "public"), None)
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, f) -> None:
        rows.append((name, [str(f(r)) for r in runs]))

    def ratio(r: dict) -> str:
        return f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)" if base and base["tokens_per_s"] else ""

    def kill(x: dict) -> str:
        return (
            f"{x['node']}@{x['t']:.0f}s st{x['stage']}: {x['reported_s']} ({x['reported_beats']}) / "
            f"{x['computed_s']} ({x['computed_beats']})"
            + (
                f" by {x['by']}{', its training lost' if x.get('restarted') else ''}"
                if x.get("reported_s")
                else ""
            )
        )

    row("tokens/s (tails, mean)", lambda r: f"{r['tokens_per_s']}{ratio(r)}")
    row("dropped after forming (in-flight bound)", lambda r: f"{r['dropped']} ({r['in_flight_bound']})")
    row("held for an empty stage", lambda r: r["held_all"])
    stages = sorted({k for r in runs for k in r["groups"]} | {k for r in runs for k in r["outer_rounds"]})
    for k in stages:

        def g(r: dict, key: str, k: str = k):
            return r["groups"].get(k, {}).get(key, 0)

        def rounds(r: dict, k: str = k) -> str:
            return "/".join(
                str(r["outer_rounds"].get(k, {}).get(x, 0)) for x in ("committed", "skipped", "alone")
            )

        row(f"stage {k}: member-rounds committed/skipped/alone", rounds)
        row(
            f"stage {k}: groups committed (by members)", lambda r: f"{g(r, 'committed')} {g(r, 'by_members')}"
        )
        row(
            f"stage {k}: all-NAT groups (with sym / cgnat)",
            lambda r: f"{g(r, 'all_nat')} ({g(r, 'all_nat_sym')} / {g(r, 'all_nat_cgnat')})",
        )
        row(f"stage {k}: all-NAT pairs reached as", lambda r: g(r, "all_nat_pairs"))
        row(
            f"stage {k}: gathering s (median/max)",
            lambda r: f"{g(r, 'seconds_median')}/{g(r, 'seconds_max')}",
        )
    row(
        "kills: stage served again, s (beats), reported / computed",
        lambda r: "; ".join(map(kill, r["recoveries"])),
    )
    row("connections at the end", lambda r: r["connections"])
    row("relayed share (MB)", lambda r: f"{r['relayed_share']} ({r['relayed_mb']})")
    row("sent per trained token", lambda r: r["sent_per_token"])
    row("link ledger", lambda r: r["link_ledger"])
    row(
        "unaccounted B/heartbeat per namespace (beyond headers)",
        lambda r: {
            k: f"{v['unaccounted_per_beat']} ({v.get('beyond_headers_per_beat')})"
            for k, v in r["unaccounted"].items()
        },
    )
    if any("eval" in r for r in runs):
        row("held-out exact match before -> after (loss)", _eval_cell)
    row("CPU s per node per heartbeat", lambda r: r["cpu_s_per_node_per_beat"])
    row("RSS MB per node", lambda r: r["rss_mb_per_node"])
    lines = ["| figure | " + " | ".join(r["label"] for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(v.replace("|", "/") for v in vals) + " |" for name, vals in rows]
    return "\n".join(lines) + "\n"


def _eval_args(a, data: str):
    from types import SimpleNamespace

    return SimpleNamespace(
        mode="finetune", data=data, eval=a.eval, seed=a.seed, model=a.model, device="cpu", export=None
    )


def _prepare_eval(a, out: Path) -> tuple[list, dict]:
    """Hold out ``a.eval`` problems (out/data/heldout.jsonl), point ``a.data`` at the rest, score
    the base model: node.local.launcher's, as ``swarm --eval`` does."""
    from node.local.launcher import SwarmError, prepare_eval

    ns = _eval_args(a, a.data)
    try:
        held, before = prepare_eval(ns, out)
    except SwarmError as e:
        raise SystemExit(f"error: {e}") from None
    a.data = ns.data
    return held, before


def _score(a, run_dir: Path, held: list, before: dict) -> dict:
    """The model exported from the final checkpoints under ``run_dir`` (every node writes one when
    it is stopped; a killed node's is missing, a replica's stands in), scored on ``held``."""
    from node.local.launcher import finish_model

    result, line = finish_model(_eval_args(a, a.data), run_dir, "vnet", held, before, dirs=[run_dir])
    print(f"[{run_dir.name}] {line}", flush=True)
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ts = [x[0] for x in r["series"]]
        raw = [x[1] for x in r["series"]]
        # a tail's count moves an inner step (a batch of tokens) at a time: a minute's mean reads better
        smooth = [
            sum(raw[max(0, i - SMOOTH + 1) : i + 1]) / len(raw[max(0, i - SMOOTH + 1) : i + 1])
            for i in range(len(raw))
        ]
        ax.plot(ts, smooth, label=f"{r['label']} ({r['tokens_per_s']:.0f} tok/s, {SMOOTH}-sample mean)")
        for e in r["events"]:
            if e["kind"] != "all started":
                ax.axvline(e["t"], color="grey", alpha=0.2, lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s (tails)")
    ax.legend()
    ax.set_title("volunteer internet vs the same swarm all public (grey: kills, bounce)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--public", type=int, default=3)
    p.add_argument("--homes", type=int, default=13)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), help="home NAT kinds, cycled (default: all)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds after the last join not measured")
    p.add_argument("--churn-every", type=float, default=180.0)
    p.add_argument("--relay-kill-at", type=float, default=300.0)
    p.add_argument("--bounce-at", type=float, default=420.0)
    p.add_argument(
        "--empty-stage-at",
        type=float,
        default=1e9,
        help="seconds in: kill every node of the least-served stage only homes serve, so it is empty "
        "(a fresh volunteer joins in each of their homes); default never",
    )
    p.add_argument("--join-gap", type=float, default=2.0)
    p.add_argument("--sample", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument(
        "--model",
        default="emulate:2048:8:0.94:256:h100",
        help="emulate:... (real-size activations, compute as sleeps: throughput) or a real model, "
        "'bundled' with --finetune lora --eval N for learning (default: %(default)s)",
    )
    p.add_argument("--codec", default="dense", help="the links' codec, as node join --codec")
    p.add_argument("--finetune", choices=("full", "lora"), default=None, help="as node join --finetune")
    p.add_argument("--lr", type=float, default=None, help="inner learning rate (node join --lr)")
    p.add_argument("--data", default="arithmetic", help="the head's data (node join --data)")
    p.add_argument(
        "--eval",
        type=int,
        default=0,
        help="hold out N problems of --data, score the base model on them, and after each run the "
        "model exported from the nodes' final checkpoints (as swarm --eval); a real model only",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument("--outer-every", type=int, default=20)
    p.add_argument(
        "--outer-bits", type=int, choices=(32, 8, 4), default=None, help="as node join --outer-bits"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("nat", "public"), default=None, help="one of the two runs")
    p.add_argument("--out", default="runs/vnet")
    p.add_argument("--report", default=None, help="write REPORT.json, REPORT.md and REPORT.png")
    a = p.parse_args(argv)
    if a.eval and a.model.startswith("emulate"):
        p.error("--eval scores a real model: an emulated one computes nothing (pass --model bundled)")
    check_nat_support()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = [a.kinds[j % len(a.kinds)] for j in range(a.homes)]
    results, raw = [], {}
    held = before = None
    if a.eval:
        held, before = _prepare_eval(a, out)  # a.data: now the training split
    for label in ("nat", "public"):
        if a.only and a.only != label:
            continue
        net = VolunteerNet(a.public, kinds, seed=a.seed)
        if label == "public":  # the same lines, every node public: each home's node on a public node
            lines = [net.public_line] * a.public + list(net.lines or [])
            net = VolunteerNet(a.public + a.homes, [], seed=a.seed, public_lines=lines)
        try:
            net.build()
            run = run_swarm(label, net, out, a)
        finally:
            net.teardown()
        warm = a.join_gap * (a.public + a.homes) + a.warmup
        raw[label] = run
        results.append(summarize(run, a, warm))
        if held:
            try:
                results[-1]["eval"] = _score(a, out / label, held, before)
            except Exception as e:  # the run's figures above are kept: the report says why no score
                results[-1]["eval"] = {"error": f"scoring failed: {type(e).__name__}: {e}"}
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("series", "events")}), flush=True)
    entry = {"args": vars(a), "kinds": kinds, "runs": results}
    for label, run in raw.items():  # every reading, for a second look at what the summary counts
        (out / label / "samples.json").write_text(json.dumps(run.samples) + "\n")
    if a.report:
        rp = Path(a.report)
        rp.with_suffix(".json").write_text(json.dumps(entry, indent=1) + "\n")
        rp.with_suffix(".md").write_text(report_md(entry))
        plot(results, rp.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
