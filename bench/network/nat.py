"""Tokens/s of one 2-stage run whose head reaches its tail direct, reversed, punched and relayed.

    sudo .venv/bin/python -m bench.network.nat --seconds 40 --rate 80mbit --results bench/results/nat.json

One ``bench.network.netns.NatTopology`` (three public peers; three home networks, each behind a gateway
doing nftables masquerade whose forward chain admits only what the home side opened; home 2's
gateway randomises ports, a symmetric NAT), every node's link shaped with tbf at ``--rate``. The
same run four times, the tail (stage 1) and the measured head (stage 0) placed so:

* direct: head on public peer 1, tail on public peer 2;
* reversed: head on public peer 1, tail behind NAT (home 0; it dials the head);
* punched: head behind NAT (home 1), tail behind NAT (home 0): both routers keep ports, the head
  punches a direct connection (``node.net.punch``);
* relayed: head behind the symmetric NAT (home 2), tail behind NAT (home 0): no punch gets
  through, public peer 0 relays every frame (``node.net.relay``).

Public peer 0 serves stage 0 in every case (the bootstrap, and the relay the NAT'd pairs need),
with one microbatch in flight (``--relay-head-inflight``) so that it costs the tail's line little;
it is there in all four cases, so they compare like for like. The model is emulated
(``node/model/emulated.py``: real-size activations, compute as sleeps), so the link, not this machine's
CPUs, sets the pace. Tokens/s is the measured head's trained tokens over ``--seconds`` after a
warm-up; the relay's bytes and CPU seconds are counted over the same window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.network.netns import NatTopology, check_nat_support, parse_rate

REPO = Path(__file__).resolve().parents[2]
PORT = 31337


def _metrics(d: Path) -> dict:
    try:
        return json.loads((d / "m.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _spawn(topo: NatTopology, ns: str, host: str, d: Path, args: list[str]) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "node", "join", "--host", host, "--port", str(PORT), *args]
    cmd += ["--state-dir", str(d), "--metrics-file", str(d / "m.json"), "--ready-file", str(d / "ready.json")]
    (d / "command.txt").write_text(" ".join(topo.exec_prefix(ns) + cmd) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    log = open(d / "log", "w")
    return subprocess.Popen(
        topo.exec_prefix(ns) + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
    )


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children so far (utime + stime, /proc), 0 if gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (OSError, IndexError, ValueError):
            continue
        todo += [int(k) for k in kids]
    return total


def run_case(
    topo: NatTopology, name: str, head: tuple[str, str], tail: tuple[str, str], out: Path, a
) -> dict:
    run = ["--model", a.model, "--codec", "dense", "--run-id", f"nat-{name}", "--seq-len", str(a.seq_len)]
    run += ["--microbatch", str(a.microbatch), "--batch-tokens", str(a.batch_tokens)]
    node = [
        "--threads",
        "1",
        "--device",
        "cpu",
        "--heartbeat",
        "2",
        "--checkpoint-every",
        "0",
        "--no-rebalance",
        "--p2pd-timeout",
        "60",
        "--join-timeout",
        "120",
    ]
    inflight = ["--max-inflight", str(a.max_inflight)]
    relay_dir, head_dir, tail_dir = out / name / "relay", out / name / "head", out / name / "tail"
    relay_args = [*run, *node, "--stage", "0", "--max-inflight", str(a.relay_head_inflight), "--stages", "2"]
    relay_args += ["--relay-rate", str(a.relay_rate)] if a.relay_rate else []
    relay = _spawn(topo, topo.public_ns(0), topo.public_addr(0), relay_dir, relay_args)
    procs = [relay]
    try:
        _wait(lambda: (relay_dir / "ready.json").exists(), 120, "the relay")
        peer = json.loads((relay_dir / "ready.json").read_text())["peer_id"]
        peers = ["--peers", f"/ip4/{topo.public_addr(0)}/tcp/{PORT}/p2p/{peer}"]
        joiner = [*run, *node, *inflight, *peers]
        procs.append(_spawn(topo, *tail, tail_dir, [*joiner, "--stage", "1"]))
        _wait(lambda: _metrics(tail_dir).get("inner_step", 0) >= 1, 240, f"{name}: the tail's first steps")
        procs.append(_spawn(topo, *head, head_dir, [*joiner, "--stage", "0"]))
        _wait(lambda: _metrics(head_dir).get("inner_step", 0) >= 2, 240, f"{name}: the head's first steps")
        time.sleep(a.warmup)
        m0, r0, c0, t0 = _metrics(head_dir), _metrics(relay_dir), _cpu_s(relay.pid), time.monotonic()
        time.sleep(a.seconds)
        m1, r1, c1, t1 = _metrics(head_dir), _metrics(relay_dir), _cpu_s(relay.pid), time.monotonic()
        tail_m = _metrics(tail_dir)
        return {
            "case": name,
            "connection": m1.get("connections", {}).get(tail_m.get("peer_id"), "?"),
            "head_reachability": m1.get("reachability"),
            "tail_reachability": tail_m.get("reachability"),
            "tokens_per_s": round((m1["trained_tokens"] - m0["trained_tokens"]) / (t1 - t0), 1),
            "microbatches": m1["microbatches"] - m0["microbatches"],
            "dropped": m1["dropped_microbatches"] - m0["dropped_microbatches"],
            "relay_node_tokens_per_s": round((r1["trained_tokens"] - r0["trained_tokens"]) / (t1 - t0), 1),
            "relayed_mb": round((r1["relay"]["relayed_bytes"] - r0["relay"]["relayed_bytes"]) / 1e6, 2),
            "relay_cpu_s": round(c1 - c0, 1),
            "seconds": round(t1 - t0, 1),
        }
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="80mbit", help="tbf rate of every node's link (default: %(default)s)")
    p.add_argument(
        "--seconds", type=float, default=40.0, help="measured window per case (default: %(default)s)"
    )
    p.add_argument(
        "--warmup", type=float, default=10.0, help="seconds after the first steps (default: %(default)s)"
    )
    p.add_argument("--model", default="emulate:2048:2:0.94:256:h100", help="(default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--max-inflight", type=int, default=4)
    p.add_argument(
        "--relay-head-inflight", type=int, default=1, help="public peer 0's (default: %(default)s)"
    )
    p.add_argument("--cases", nargs="+", default=["direct", "reversed", "punched", "relayed"])
    p.add_argument(
        "--relay-rate", type=float, default=0.0, help="public peer 0's --relay-rate (Mbit/s; 0: none)"
    )
    p.add_argument("--out", default="runs/nat", help="node logs (default: %(default)s)")
    p.add_argument("--results", default=None, help="append the figures to this JSON list")
    a = p.parse_args(argv)
    check_nat_support()
    out = Path(a.out)
    topo = NatTopology(n_public=3, n_homes=3, random_ports=(2,), rate_bps=parse_rate(a.rate))
    pub = lambda i: (topo.public_ns(i), topo.public_addr(i))  # noqa: E731
    home = lambda j: (topo.home_ns_of(j), topo.home_addr_of(j))  # noqa: E731
    cases = {"direct": (pub(1), pub(2)), "reversed": (pub(1), home(0)), "punched": (home(1), home(0))}
    cases["relayed"] = (home(2), home(0))
    try:
        topo.build()
        rows = [run_case(topo, name, h, t, out, a) for name, (h, t) in cases.items() if name in a.cases]
    finally:
        topo.teardown()
    entry = {"rate": a.rate, "model": a.model, "seq_len": a.seq_len, "microbatch": a.microbatch, "rows": rows}
    entry["relay_rate_mbit"] = a.relay_rate
    print(json.dumps(entry, indent=1))
    if a.results:
        path = Path(a.results)
        prev = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*prev, entry], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
