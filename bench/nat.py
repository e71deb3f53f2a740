"""Tokens/s of one 2-stage run with its tail direct (a public peer) and reversed (behind NAT).

    sudo .venv/bin/python -m bench.nat --seconds 40 --rate 80mbit --out bench/results/nat.json

One ``bench.netns.NatTopology`` (two public peers and a home network behind a masquerading
gateway, every node's link shaped with tbf at ``--rate``), the same run twice: the head on public
peer 0, the tail first on public peer 1 (``--reachability auto`` finds it direct), then behind
the NAT (auto finds it behind NAT: it dials the head, whose streams ride that connection). The
model is emulated (``bench/emulated.py``: real-size activations, compute as sleeps), so the link,
not this machine's CPUs, sets the pace. Tokens/s is the head's trained tokens over ``--seconds``
after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.netns import NatTopology, check_nat_support, parse_rate

REPO = Path(__file__).resolve().parents[1]
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


def run_case(topo: NatTopology, name: str, tail_ns: str, tail_host: str, out: Path, a) -> dict:
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
    ]
    node += ["--max-inflight", str(a.max_inflight), "--p2pd-timeout", "60", "--join-timeout", "120"]
    head_dir, tail_dir = out / name / "head", out / name / "tail"
    procs = [_spawn(topo, topo.public_ns(0), topo.public_addr(0), head_dir, [*run, *node, "--stage", "0"])]
    try:
        _wait(lambda: (head_dir / "ready.json").exists(), 120, "the head")
        peer = json.loads((head_dir / "ready.json").read_text())["peer_id"]
        peers = ["--peers", f"/ip4/{topo.public_addr(0)}/tcp/{PORT}/p2p/{peer}"]
        procs.append(_spawn(topo, tail_ns, tail_host, tail_dir, [*run, *node, "--stage", "1", *peers]))
        _wait(lambda: _metrics(head_dir).get("inner_step", 0) >= 2, 240, f"{name}: the first steps")
        time.sleep(a.warmup)
        m0, t0 = _metrics(head_dir), time.monotonic()
        time.sleep(a.seconds)
        m1, t1 = _metrics(head_dir), time.monotonic()
        tail = _metrics(tail_dir)
        return {
            "tail": name,
            "reachability": tail.get("reachability"),
            "tokens_per_s": round((m1["trained_tokens"] - m0["trained_tokens"]) / (t1 - t0), 1),
            "microbatches": m1["microbatches"] - m0["microbatches"],
            "dropped": m1["dropped_microbatches"] - m0["dropped_microbatches"],
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
    p.add_argument("--out", default="runs/nat", help="node logs (default: %(default)s)")
    p.add_argument("--results", default=None, help="append the figures to this JSON list")
    a = p.parse_args(argv)
    check_nat_support()
    out = Path(a.out)
    topo = NatTopology(n_public=2, rate_bps=parse_rate(a.rate))
    try:
        topo.build()
        rows = [
            run_case(topo, "direct", topo.public_ns(1), topo.public_addr(1), out, a),
            run_case(topo, "reversed", topo.home_ns, topo.home_addr, out, a),
        ]
    finally:
        topo.teardown()
    entry = {"rate": a.rate, "model": a.model, "seq_len": a.seq_len, "microbatch": a.microbatch, "rows": rows}
    print(json.dumps(entry, indent=1))
    if a.results:
        path = Path(a.results)
        prev = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*prev, entry], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
