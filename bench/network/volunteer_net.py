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


@dataclass
class Member:
    name: str
    ns: str
    host: str
    dir: Path
    home: int | None  # None: a public node
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
    return [
        "--model", a.model, "--codec", "dense", "--seq-len", str(a.seq_len),
        "--microbatch", str(a.microbatch),
        "--batch-tokens", str(a.batch_tokens), "--run-id", "vnet", "--threads", "1", "--device", "cpu",
        "--heartbeat", str(a.heartbeat), "--checkpoint-every", "0", "--max-inflight", str(a.max_inflight),
        "--p2pd-timeout", "90", "--join-timeout", "180", "--outer-every", str(a.outer_every),
    ]  # fmt: skip


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


def swarm_tokens(s: dict, last: int) -> int:
    """The tails' trained tokens in a sample (live tails only)."""
    return sum(n["trained_tokens"] for n in s["nodes"].values() if n["stage"] == last)


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
    homes = [Member(f"home{j}", *place(j), out / label / f"home{j}", j) for j in range(a.homes)]
    run.members = [*pubs, *homes]
    t0 = time.monotonic()
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
    relay_killed = bounced = False
    fresh = 0
    while time.monotonic() - start < a.minutes * 60:
        now = time.monotonic()
        if now >= next_churn and homes:
            victim = rng.choice([m for m in homes if m.proc and m.proc.poll() is None] or homes)
            victim.proc.kill()
            victim.proc.wait(10)
            fresh += 1
            stage = (victim.metrics() or {}).get("stage")
            run.events.append(
                {"t": round(now - t0, 1), "kind": "kill", "node": victim.dir.name, "stage": stage}
            )
            victim.dir = out / label / f"{victim.name}-{fresh}"  # a fresh volunteer: new identity
            _spawn(net, victim, join)
            next_churn = now + a.churn_every
        if not relay_killed and len(pubs) > 1 and now - start >= a.relay_kill_at:
            pubs[1].proc.kill()
            relay_killed = True
            run.events.append({"t": round(now - t0, 1), "kind": "relay killed", "node": "pub1"})
        if not bounced and now - start >= a.bounce_at:  # home 0's router, or its own line
            if behind_nat:
                net.bounce_uplink(0)
            else:
                net.bounce_public(a.public)
            bounced = True
            run.events.append({"t": round(now - t0, 1), "kind": "uplink bounced", "node": "home0"})
        sample(run, t0, a.stages)
        time.sleep(a.sample)
    run.final = sample(run, t0, a.stages)
    for m in run.members:
        if m.proc and m.proc.poll() is None:
            m.proc.terminate()
    for m in run.members:
        if m.proc:
            try:
                m.proc.wait(60)
            except subprocess.TimeoutExpired:
                m.proc.kill()
    return run


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


def summarize(run: Run, a, warm_s: float) -> dict:
    """The figures of one run (the module docstring)."""
    last = a.stages - 1
    ss = [s for s in run.samples if s["t"] >= warm_s] or run.samples
    series = []
    prev = None
    for s in run.samples:
        tok = swarm_tokens(s, last)
        if prev is not None and s["t"] > prev[0]:
            series.append((s["t"], max(0.0, (tok - prev[1]) / (s["t"] - prev[0]))))
        prev = (s["t"], tok)
    # tokens/s over the measured window: the sum of positive increments (a killed tail's count resets)
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
        in_flight_to(run, e, a.max_inflight) for e in run.events if e["kind"] in ("kill", "relay killed")
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
        "sent_per_token": sent_per_token(last_seen.values()),
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
        "nodes_seen": len(last_seen),
        "trained_by_node": trained,
        "reachability": {k: n["reachability"] for k, n in sorted(last_seen.items())},
    }


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
    p.add_argument("--join-gap", type=float, default=2.0)
    p.add_argument("--sample", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--model", default="emulate:2048:8:0.94:256:h100")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument("--outer-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("nat", "public"), default=None, help="one of the two runs")
    p.add_argument("--out", default="runs/vnet")
    p.add_argument("--report", default=None, help="write REPORT.json, REPORT.md and REPORT.png")
    a = p.parse_args(argv)
    check_nat_support()
    out = Path(a.out)
    kinds = [a.kinds[j % len(a.kinds)] for j in range(a.homes)]
    results, raw = [], {}
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
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("series", "events")}), flush=True)
    entry = {"args": vars(a), "kinds": kinds, "runs": results}
    for label, run in raw.items():  # every reading, for a second look at what the summary counts
        (out / label / "samples.json").write_text(json.dumps(run.samples) + "\n")
    if a.report:
        rp = Path(a.report)
        rp.with_suffix(".json").write_text(json.dumps(entry, indent=1) + "\n")
        plot(results, rp.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
