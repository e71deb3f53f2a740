"""The bandwidth-capped swarm harness (issue 5): one network namespace per node, every link shaped.

    python -m bench.network.harness --nodes 6 --stages 3 --rate 80mbit --codec mask --mask-rate 0.95 \\
        --mode emulated --seconds 60 --out runs/harness
    python -m bench.network.harness --compare --codecs dense,m90,m95,m95+anchors --sweep 10,400 ...

Each node runs `python -m node join` inside its own namespace (ns address, fixed port); node 0
starts the swarm, the others bootstrap from node 0's namespace address. Every node's veth is
shaped with tc tbf at --rate on both ends (upload and download; netem is not in this kernel).
The harness polls each node's --metrics-file, measures a steady window of --seconds after the
first microbatch completes, builds report.json with node.local.report.build_report, appends one
entry per run to bench/results/harness.json, and always tears everything down (processes,
namespaces, veths, bridge) on success, failure, Ctrl-C and SIGTERM.

Without root or namespace support it prints one line and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.network.netns import NetnsUnavailable, Topology, check_support, leftover_namespaces, parse_rate
from node.argv import config_to_argv
from node.config import NodeConfig
from node.stage.links import lowrank_layout, pinned_layout_flags

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PORT = 31337
EXIT_UNSUPPORTED = 3
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 15.0


class HarnessError(RuntimeError):
    pass


@dataclass(frozen=True)
class Variant:
    label: str
    codec: str
    mask_rate: float = 0.0
    anchors: int = 0  # anchor nodes per stage (own namespaces, own capped links)


VARIANTS = {
    "dense": Variant("dense", "dense"),
    "m90": Variant("M90", "mask", 0.90),
    "m95": Variant("M95", "mask", 0.95),
    "m95+anchors": Variant("M95+anchors", "mask", 0.95, anchors=1),
    "pca": Variant("pca", "pca"),  # the default codec until lowrank replaced it (bench/results/quality.md)
    "lowrank": Variant("lowrank", "lowrank"),  # the node's default codec (node/config.py)
}


# --outer-sweep: how the stages' replicas run their outer rounds (flags added to every node)
OUTER_MODES = {
    "off": "--outer-every 0",
    "rounds": "--outer-every {every}",  # the compute thread waits for each round (the default)
    "overlap": "--outer-every {every} --outer-overlap",
    "overlap8": "--outer-every {every} --outer-overlap --outer-bits 8",
}


def outer_overrides(mode: str, a) -> dict:
    """The run overrides of one --outer-sweep mode: its flags after --node-args, and its name."""
    if mode not in OUTER_MODES:
        raise ValueError(f"unknown outer mode {mode!r}; choose from {', '.join(OUTER_MODES)}")
    flags = OUTER_MODES[mode].format(every=a.outer_every)
    return {"node_args": f"{a.node_args} {flags}".strip(), "outer": mode}


def variant_from_args(a) -> Variant:
    if a.codec == "dense":
        return Variant("dense", "dense", anchors=a.anchors)
    if a.codec == "mask":
        label = f"M{round(a.mask_rate * 100)}" + ("+anchors" if a.anchors else "")
        return Variant(label, "mask", a.mask_rate, a.anchors)
    return Variant(a.codec, a.codec, anchors=a.anchors)


# ---------------------------------------------------------------------------------------------- data
_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or has had "
    "one first new two their after also its been but who not they time year city part when there world "
    "between during other into more only over state school three most many some before being under war "
    "river family name later used since where national known while then team season these both album"
).split()


def write_text_data(path: Path, seq_len: int, chars_per_token: float, n: int = 256, seed: int = 0) -> None:
    """Paragraphs long enough that every sequence fills seq_len tokens (no padding: fixed shapes)."""
    rng = random.Random(seed)
    need = int(seq_len * chars_per_token) + 64
    paras = []
    for _ in range(n):
        words: list[str] = []
        length = 0
        while length < need:
            w = rng.choice(_WORDS)
            words.append(w)
            length += len(w) + 1
        paras.append(" ".join(words))
    path.write_text("\n\n".join(paras) + "\n")


# ---------------------------------------------------------------------------------------------- nodes
def model_spec(a) -> str:
    if a.mode == "real":
        return a.model or "bundled"
    return a.model or f"emulate:{a.hidden}:{a.layers}:{a.us_per_token_layer:g}:256:{a.gpu}"


def layout(a) -> dict:
    return lowrank_layout(a.microbatch * a.seq_len, emulated=a.mode == "emulated")


def join_command(
    a,
    v: Variant,
    topo: Topology,
    ns_index: int,
    stage: int,
    circuit: str,
    nodedir: Path,
    run_id: str,
    data: Path,
    peers: list[str],
    wait_peers: int,
) -> list[str]:
    # behind a delay proxy the node listens on its namespace's loopback and announces the proxy
    host = "127.0.0.1" if a.delay_ms > 0 else topo.addr(ns_index)
    announce = [f"/ip4/{topo.addr(ns_index)}/tcp/{PORT}"] if a.delay_ms > 0 else []
    cfg = NodeConfig(
        host=host,
        announce_maddrs=announce,
        port=PORT,
        run_id=run_id,
        stage=str(stage),
        circuit=circuit,
        state_dir=str(nodedir),
        metrics_file=str(nodedir / "metrics.json"),
        ready_file=str(nodedir / "ready.json"),
        threads=1,
        device="cpu",
        data=str(data),
        max_inflight=a.max_inflight,
        hop_timeout=a.hop_timeout,
        heartbeat_s=a.heartbeat,
        wait_peers=wait_peers,
        join_timeout=120,
        p2pd_timeout=60,
        # run settings: every node gets them, node 0 publishes them, the rest verify the model
        model=model_spec(a),
        stages=a.stages,
        codec=v.codec,
        mask_rate=v.mask_rate or 0.95,
        wire_dtype=a.wire_dtype,
        seq_len=a.seq_len,
        microbatch=a.microbatch,
        batch_tokens=a.batch_tokens,
        seed=a.seed,
        lr=a.lr,
        # the lowrank layout a GPU starter's frames get (these nodes run on a CPU, which would
        # resolve the short-frame one; emulated links send the tiered one); another codec ignores
        # it, and a node refuses it there
        **(layout(a) if v.codec == "lowrank" else {}),
    )
    pinned = ("model", "stages", "codec", "mask_rate", "wire_dtype", "seq_len", "microbatch", "batch_tokens")
    pinned += pinned_layout_flags(cfg)
    cmd = [sys.executable, "-m", "node", "join", *config_to_argv(cfg, always=(*pinned, "seed", "lr"))]
    cmd += shlex.split(a.node_args or "")
    if peers:
        cmd += ["--peers", *peers]
    return topo.exec_prefix(ns_index) + cmd


def _tail(path: Path, n: int = 6) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


def proxy_queue_bytes(rate_bps: float, delay_ms: float) -> int:
    """Twice what the link carries in one delay (its one-way bandwidth-delay product), >= 64 KiB:
    room for the proxy to keep the link full, not a place for seconds of traffic to wait."""
    return max(64 * 1024, int(2 * rate_bps / 8 * delay_ms / 1000))


def start_proxy(
    topo: Topology, i: int, delay_ms: float, port: int = PORT, max_queue: int = 0, lean: int = 0
) -> subprocess.Popen:
    """The delay proxy in front of node i: peers connect to it (ns address), it connects to the
    node on the namespace's loopback, same port; ``max_queue``: bytes a direction may hold
    (0: unbounded). Returns once it listens."""
    addr = topo.addr(i)
    cmd = topo.exec_prefix(i) + [
        sys.executable, "-m", "bench.network.delayproxy", "--listen", f"{addr}:{port}",
        "--to", f"127.0.0.1:{port}", "--delay-ms", f"{delay_ms:g}", "--max-queue", str(max_queue),
        "--lean", str(lean),
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True
    )
    line = p.stdout.readline().strip()  # "ready" once it listens
    if line != "ready":
        if p.poll() is None:
            p.kill()
        raise HarnessError(f"the delay proxy of node {i} did not start: {line or p.wait()}")
    return p


class Swarm:
    """The node processes of one run, inside an existing topology."""

    def __init__(self, a, v: Variant, topo: Topology, rundir: Path, data: Path):
        self.a, self.v, self.topo, self.rundir, self.data = a, v, topo, rundir, data
        self.run_id = f"harness-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen] = []
        self.proxies: dict[int, subprocess.Popen] = {}  # node index -> its delay proxy
        self.roles: list[tuple[int, str]] = []  # (stage, circuit) per node
        self.n_fast = a.nodes
        self.n_total = a.nodes + v.anchors * a.stages

    def nodedir(self, i: int) -> Path:
        return self.rundir / "nodes" / str(i)

    def _proxy(self, i: int) -> None:
        self.proxies[i] = start_proxy(self.topo, i, self.a.delay_ms)

    def _spawn(self, i: int, stage: int, circuit: str, peers: list[str]) -> None:
        d = self.nodedir(i)
        d.mkdir(parents=True, exist_ok=True)
        if self.a.delay_ms > 0:
            self._proxy(i)
        for stale in ("ready.json", "metrics.json"):
            (d / stale).unlink(missing_ok=True)
        cmd = join_command(
            self.a, self.v, self.topo, i, stage, circuit, d, self.run_id, self.data, peers, self.n_total
        )
        (d / "command.txt").write_text(shlex.join(cmd) + "\n")
        log = open(d / "node.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.procs.append(
            subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        )
        self.roles.append((stage, circuit))

    def _wait_ready(self, idx: list[int]) -> dict[int, dict]:
        out: dict[int, dict] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(out) < len(idx):
            for i in idx:
                if i in out:
                    continue
                f = self.nodedir(i) / "ready.json"
                if f.exists():
                    out[i] = json.loads(f.read_text())
                elif self.procs[i].poll() is not None:
                    raise HarnessError(
                        f"node {i} exited with code {self.procs[i].returncode} before claiming "
                        f"a stage:\n{_tail(self.nodedir(i) / 'node.log')}"
                    )
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"nodes {sorted(set(idx) - set(out))} did not claim a stage within "
                    f"{READY_TIMEOUT_S:.0f}s; see {self.rundir}/nodes/*/node.log"
                )
            time.sleep(0.2)
        return out

    def start(self) -> None:
        a = self.a
        # node 0 starts the swarm (stage 0); the rest claim explicit stages round-robin, all at once
        self._spawn(0, 0, "fast", [])
        ready = self._wait_ready([0])[0]
        addr = next((m for m in ready["maddrs"] if f"/ip4/{self.topo.addr(0)}/" in m), ready["maddrs"][0])
        peers = [addr if "/p2p/" in addr else f"{addr}/p2p/{ready['peer_id']}"]
        for i in range(1, self.n_fast):
            self._spawn(i, i % a.stages, "fast", peers)
        for j in range(self.v.anchors * a.stages):
            self._spawn(self.n_fast + j, j % a.stages, "anchor", peers)
        self._wait_ready(list(range(1, self.n_total)))

    def roots(self) -> dict[int, list[int]]:
        """The pids started for each node: the node and, with --delay-ms, its proxy."""
        out = {i: [p.pid] for i, p in enumerate(self.procs)}
        for i, p in self.proxies.items():
            out.setdefault(i, []).append(p.pid)
        return out

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise HarnessError(
                    f"node {i} exited early (code {p.returncode}):\n{_tail(self.nodedir(i) / 'node.log')}"
                )

    def read_metrics(self) -> dict[int, dict]:
        out = {}
        for i in range(len(self.procs)):
            try:
                out[i] = json.loads((self.nodedir(i) / "metrics.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
        return out

    def stop(self) -> None:
        """SIGTERM heads first, then the rest; whatever is left in the namespaces is killed."""
        for stage in sorted({s for s, _ in self.roles}):
            for p, (s, _) in zip(self.procs, self.roles):
                if s == stage and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait(timeout=10)
        for p in self.proxies.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        self.topo.kill_all_processes()  # DHT processes and p2pd daemons left behind, if any


# ---------------------------------------------------------------------------------------------- measure
def _egress_bytes(m: dict) -> int:
    """Frame bytes a node wrote: its forward frames downstream and its backward replies upstream."""
    return sum(lk["bytes"] for lk in m["links"])


def _is_fast(m: dict) -> bool:
    return m.get("circuit", "fast") == "fast"


def outer_rounds(metrics: list[dict]) -> dict:
    """The whole run's outer rounds over all nodes: committed, skipped, and the seconds a committed
    one took (a waiting round holds its stage's steps that long; an overlapped one does not)."""
    rounds = [r for m in metrics for r in m.get("outer_rounds", [])]
    done = [r for r in rounds if not r["skipped"]]
    return {
        "committed": len(done),
        "skipped": len(rounds) - len(done),
        "overlapped": sum(1 for r in rounds if r.get("overlapped")),
        "mean_seconds": round(sum(r["seconds"] for r in done) / len(done), 2) if done else None,
        "bytes_sent": sum(r["bytes_sent"] for r in rounds),
    }


def summarise(snaps: list[dict], a, v: Variant, topo: Topology, t_first: float) -> dict:
    """Rates over the window [first snapshot at/after t_first, last snapshot]."""
    window = [s for s in snaps if s["t"] >= t_first]
    if len(window) < 2:
        raise HarnessError("the measurement window holds fewer than two metric snapshots")
    s0, s1 = window[0], window[-1]
    cap_bytes = topo.rate_bps / 8
    tokens_per_mb = a.microbatch * a.seq_len
    tok_rate = 0.0
    tokens = 0
    egress, spans = {}, {}
    for i, m1 in s1["metrics"].items():
        m0 = s0["metrics"].get(i)
        if m0 is None or not _is_fast(m1):
            continue
        dt = max(m1["time"] - m0["time"], 1e-9)
        if m1["stage"] == 0:  # completed microbatches at the head: forward and backward done end to end
            d = (m1["microbatches"] - m0["microbatches"]) * tokens_per_mb
            tokens += d
            tok_rate += d / dt
        egress[i] = (_egress_bytes(m1) - _egress_bytes(m0)) / dt
        spans[i] = dt  # the node's own span between its two metric writes: what its rate covers
    dtw = max(s1["t"] - s0["t"], 1e-9)
    wire = {}
    for i in sorted(s1["counters"]):  # every node of the run, anchors included
        c0, c1 = s0["counters"].get(i), s1["counters"].get(i)
        if c0 and c1 and i in s1["metrics"]:
            wire[i] = {d: (c1[d] - c0[d]) / dtw for d in ("up", "down")}
    busiest = max(egress, key=egress.get) if egress else None
    fast_wire = [(i, d) for i in wire if i < a.nodes for d in ("up", "down")]  # the fast circuit's links
    wire_busiest = max(fast_wire, key=lambda k: wire[k[0]][k[1]], default=None)
    return {
        "tokens_per_s": tok_rate,
        "window_tokens": tokens,
        "window_s": dtw,
        "link_utilisation": egress[busiest] / cap_bytes if busiest is not None else None,
        "busiest_node": busiest,
        "busiest_node_stage": s1["metrics"][busiest]["stage"] if busiest is not None else None,
        "egress_frame_bytes_per_s": {str(i): round(b) for i, b in sorted(egress.items())},
        "egress_window_s": {str(i): round(dt, 2) for i, dt in sorted(spans.items())},
        "wire_utilisation": (wire[wire_busiest[0]][wire_busiest[1]] / cap_bytes) if wire_busiest else None,
        "wire_busiest": f"node {wire_busiest[0]} {wire_busiest[1]}" if wire_busiest else None,
        "wire_bytes_per_s": {str(i): {d: round(x) for d, x in w.items()} for i, w in sorted(wire.items())},
    }


def link_table(report: dict) -> list[dict]:
    return [
        {
            "boundary": lk["boundary"],
            "direction": lk["direction"],
            "bytes_per_token": lk["bytes_per_token"],
            "frames": lk["frames"],
        }
        for lk in report["links"]
        if lk["bytes_per_token"]
    ]


def ceilings(a, links: list[dict], rate_bps: float, hidden: int) -> dict:
    """Token-rate ceilings: the per-link 10^7/(bytes per token) and the topology's (which node saturates)."""
    cap = rate_bps / 8
    bpt = {(lk["boundary"], lk["direction"]): lk["bytes_per_token"] for lk in links}
    worst = max(bpt.values()) if bpt else None
    per_stage = a.nodes // a.stages
    topo_ceiling = None
    if bpt:
        limits = []
        for s in range(a.stages):
            up = bpt.get((s, "forward"), 0) + bpt.get((s - 1, "backward"), 0)  # what stage s uploads
            down = bpt.get((s - 1, "forward"), 0) + bpt.get((s, "backward"), 0)  # what it downloads
            limits.append(per_stage * cap / max(up, down, 1e-9))
        topo_ceiling = min(limits)
    compute = None
    if a.mode == "emulated":
        # the stage with the most layers bounds it: each replica computes one microbatch at a time
        from node.model.emulated import parse_spec

        _, layers, us, _, _ = parse_spec(model_spec(a))
        most = -(-layers // a.stages)
        compute = per_stage / (most * us * 1e-6) if us > 0 else None
    return {
        "bytes_per_token": worst,
        "ceiling_tokens_per_s": cap / worst if worst else None,
        "topology_ceiling_tokens_per_s": topo_ceiling,
        "compute_ceiling_tokens_per_s": compute,
    }


def hidden_size(a) -> int:
    if a.mode == "emulated":
        from node.model.emulated import parse_spec

        return parse_spec(model_spec(a))[0]
    try:
        from node.model.loading import bundled_dir

        path = bundled_dir() if model_spec(a) == "bundled" else Path(model_spec(a))
        return int(json.loads((path / "config.json").read_text())["hidden_size"])
    except (OSError, KeyError, ValueError):
        return 0


def _cores(cpu: dict) -> float | None:
    if "s1" not in cpu:
        return None
    return round((sum(cpu["s1"].values()) - sum(cpu["s0"].values())) / (cpu["t1"] - cpu["t0"]), 2)


def _cores_by_command(cpu: dict) -> dict[str, float]:
    if "s1" not in cpu:
        return {}
    dt = cpu["t1"] - cpu["t0"]
    return {k: round((v - cpu["s0"].get(k, 0.0)) / dt, 3) for k, v in sorted(cpu["s1"].items())}


def _dp_bytes_per_token(a) -> float:
    from bench.network.harness_report import dp_bytes_per_token

    return dp_bytes_per_token(stages=a.stages, batch_tokens=a.batch_tokens)


def _node_cores(cpu: dict, proxies: dict[int, int]) -> tuple[dict[str, float], dict[str, float]]:
    """Per node: the cores its namespace's processes used over the window, and its proxy's."""
    if "n1" not in cpu:
        return {}, {}
    dt = cpu["t1"] - cpu["t0"]
    nodes, prox = {}, {}
    for i, pids in sorted(cpu["n1"].items()):
        before = cpu["n0"].get(i, {})
        used = {pid: s - before.get(pid, 0.0) for pid, s in pids.items()}
        px = proxies.get(i)
        nodes[str(i)] = round(sum(u for pid, u in used.items() if pid != px) / dt, 3)
        if px is not None:
            prox[str(i)] = round(used.get(px, 0.0) / dt, 3)
    return nodes, prox


class LinkCut:
    """The link-cut fault: node ``node``'s link goes down ``at`` s into the window for ``seconds``.

    ``summary`` says what it cost: the heads' microbatch rate before, during and after the cut, the
    microbatches dropped meanwhile, and how long after the link came back the node served again.
    """

    def __init__(self, topo: Topology, node: int, at: float, seconds: float):
        if not 0 <= node < topo.n:
            raise HarnessError(f"--cut-node {node} is not a node of this run (0..{topo.n - 1})")
        self.topo, self.node, self.at, self.seconds = topo, node, at, seconds
        self.down_at: float | None = None
        self.up_at: float | None = None

    def step(self, snap: dict, t_first: float) -> None:
        t = snap["t"] - t_first
        if self.down_at is None and t >= self.at:
            self.topo.set_link(self.node, False)
            self.down_at = snap["t"]
            print(f"  link of node {self.node} cut at {t:.0f}s for {self.seconds:g}s", flush=True)
        elif self.down_at is not None and self.up_at is None and snap["t"] - self.down_at >= self.seconds:
            self.topo.set_link(self.node, True)
            self.up_at = snap["t"]
            print(f"  link of node {self.node} restored at {t:.0f}s", flush=True)

    def summary(self, snaps: list[dict], stages: int) -> dict:
        def done(s):  # microbatches the heads completed end to end (forward and backward)
            return sum(m["microbatches"] for m in s["metrics"].values() if m["stage"] == 0 and _is_fast(m))

        def dropped(s):
            return sum(m["dropped_microbatches"] for m in s["metrics"].values())

        def served(s):
            m = s["metrics"].get(self.node)
            return m["microbatches"] if m else 0

        def rate(t0, t1):
            inside = [s for s in snaps if t0 <= s["t"] <= t1]
            if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
                return None
            return round((done(inside[-1]) - done(inside[0])) / (inside[-1]["t"] - inside[0]["t"]), 3)

        if self.down_at is None or self.up_at is None:
            return {"node": self.node, "completed": False}
        at_up = next(s for s in snaps if s["t"] >= self.up_at)
        back = next((s["t"] for s in snaps if s["t"] > self.up_at and served(s) > served(at_up)), None)
        at_down = next(s for s in snaps if s["t"] >= self.down_at)
        return {
            "node": self.node,
            "stage": snaps[-1]["metrics"].get(self.node, {}).get("stage"),
            "completed": True,
            "seconds_down": round(self.up_at - self.down_at, 1),
            "microbatches_per_s_before": rate(self.down_at - self.at, self.down_at),
            "microbatches_per_s_during": rate(self.down_at, self.up_at),
            "microbatches_per_s_after": rate(self.up_at, snaps[-1]["t"]),
            "dropped_during": dropped(at_up) - dropped(at_down),
            "node_served_again_after_s": None if back is None else round(back - self.up_at, 1),
        }


def run_one(a, v: Variant, topo: Topology, out: Path, data: Path, command: str) -> dict:
    from node.local.report import build_report

    rundir = out / (
        f"{v.label}-{round(topo.rate_bps / 1e6)}mbit-{a.mode}-rtt{round(2 * a.delay_ms)}-if{a.max_inflight}"
    )
    rundir.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(a, v, topo, rundir, data)
    snaps: list[dict] = []
    t_start = time.monotonic()
    t_first = None
    cpu = {}
    status = "ok"
    print(
        f"[{v.label} @ {topo.rate_bps / 1e6:g} Mbit/s, {a.mode}] starting {swarm.n_total} nodes "
        f"(logs: {rundir}/nodes)",
        flush=True,
    )
    cut = LinkCut(topo, a.cut_node, a.cut_at, a.cut_seconds) if a.cut_node >= 0 else None
    try:
        swarm.start()
        print(f"  all {swarm.n_total} nodes ready after {time.monotonic() - t_start:.0f}s", flush=True)
        last_print = 0.0
        while True:
            time.sleep(1.0)
            swarm.check_alive()
            snap = {"t": time.monotonic(), "metrics": swarm.read_metrics(), "counters": topo.counters()}
            snaps.append(snap)
            heads = [m for m in snap["metrics"].values() if m["stage"] == 0 and _is_fast(m)]
            done = sum(m["microbatches"] for m in heads)
            if t_first is None and done > 0:
                t_first = snap["t"] + a.warmup
                print(
                    f"  first microbatch done after {snap['t'] - t_start:.0f}s; warm-up {a.warmup:g}s, "
                    f"then measuring {a.seconds:g}s",
                    flush=True,
                )
            tail_steps = max(
                (
                    m["inner_step"]
                    for m in snap["metrics"].values()
                    if m["stage"] == a.stages - 1 and _is_fast(m)
                ),
                default=0,
            )
            if snap["t"] - last_print > 10:
                el = snap["t"] - (t_first or snap["t"])  # negative during the warm-up
                print(f"  {el:5.0f}s  microbatches {done}  tail steps {tail_steps}", flush=True)
                last_print = snap["t"]
            if t_first is not None and a.cut_node >= 0:
                cut.step(snap, t_first)
            if t_first is not None and snap["t"] >= t_first and "t0" not in cpu:
                cpu.update(
                    t0=time.monotonic(),
                    s0=topo.cpu_seconds(swarm.roots()),
                    n0=topo.cpu_by_node(swarm.roots()),
                )
            if t_first is not None and (
                snap["t"] - t_first >= a.seconds or (a.steps and tail_steps >= a.steps)
            ):
                cpu.update(
                    t1=time.monotonic(),
                    s1=topo.cpu_seconds(swarm.roots()),
                    n1=topo.cpu_by_node(swarm.roots()),
                )
                break
            if snap["t"] - t_start > a.timeout:
                raise HarnessError(f"no result within --timeout {a.timeout:.0f}s")
    except HarnessError as e:
        status = f"error: {e}"
        print(f"  {status}", file=sys.stderr, flush=True)
    finally:
        if cut is not None and cut.down_at is not None and cut.up_at is None:
            topo.set_link(cut.node, True)  # never leave a link down behind a failed run
        swarm.stop()
    if t_first is None or status != "ok":
        raise HarnessError(status if status != "ok" else "no microbatch completed")
    final = snaps[-1]["metrics"]
    metrics = [final[i] for i in sorted(final)]
    rep = build_report(
        metrics,
        a.stages,
        run_id=swarm.run_id,
        model=model_spec(a),
        codec=v.codec,
        elapsed_s=snaps[-1]["t"] - t_start,
    )
    (rundir / "report.json").write_text(json.dumps(rep, indent=1))
    s = summarise(snaps, a, v, topo, t_first)
    links = link_table(rep)
    hidden = hidden_size(a)
    node_cpu, proxy_cpu = _node_cores(cpu, {i: p.pid for i, p in swarm.proxies.items()})
    entry = {
        "label": v.label + (f" outer:{a.outer}" if getattr(a, "outer", None) else ""),
        "outer": getattr(a, "outer", None),
        "outer_rounds": outer_rounds(metrics),
        "codec": v.codec,
        "mask_rate": v.mask_rate if v.codec == "mask" else None,
        "anchors": v.anchors,
        "dp": a.dp,
        "rate_mbit": topo.rate_bps / 1e6,
        "mode": a.mode,
        "model": model_spec(a),
        "hidden": hidden,
        "nodes": a.nodes,
        "stages": a.stages,
        "seq_len": a.seq_len,
        "microbatch": a.microbatch,
        "batch_tokens": a.batch_tokens,
        "max_inflight": a.max_inflight,
        "wire_dtype": a.wire_dtype,
        "tokens_per_s": round(s["tokens_per_s"], 1),
        **{
            k: (round(x, 2) if isinstance(x, float) else x)
            for k, x in ceilings(a, links, topo.rate_bps, hidden).items()
        },
        "bytes_per_token_links": links,
        "link_utilisation": round(s["link_utilisation"], 4) if s["link_utilisation"] is not None else None,
        "busiest_node_stage": s["busiest_node_stage"],
        "wire_utilisation": round(s["wire_utilisation"], 4) if s["wire_utilisation"] is not None else None,
        "wire_busiest": s["wire_busiest"],
        "egress_frame_bytes_per_s": s["egress_frame_bytes_per_s"],
        "egress_window_s": s["egress_window_s"],
        "wire_bytes_per_s": s["wire_bytes_per_s"],
        "steps": max(
            (m["inner_step"] for m in metrics if m["stage"] == a.stages - 1 and _is_fast(m)), default=0
        ),
        "seconds": round(s["window_s"], 1),
        "window_tokens": s["window_tokens"],
        "dropped_microbatches": rep["dropped_microbatches"],
        "expired_but_alive": rep.get("expired_but_alive", 0),
        # CPU cores the swarm's processes (nodes, DHT processes, p2pd) used during the window
        "swarm_cpu_cores": _cores(cpu),
        # each node's namespace (node, its DHT process, its p2pd; not its delay proxy), in cores
        "cpu_util": node_cpu,
        "cpu_util_max": max(node_cpu.values(), default=None),
        "proxy_cpu_util": proxy_cpu,
        "delay_ms": a.delay_ms,
        "rtt_ms": 2 * a.delay_ms,
        "gpu": a.gpu if a.mode == "emulated" else None,
        "swarm_cpu_cores_by_command": _cores_by_command(cpu),
        "host_cpus": os.cpu_count(),
        "anchor_bytes": rep.get("anchor_bytes", 0),
        "basis_bytes": rep.get("basis_bytes", 0),
        "run_tokens": rep.get("tokens", 0),
        # DiLoCo + PowerSGD factors of a 1B-class stage at this run's cadence (not sent: the
        # emulated layers hold one weight each; bench/network/harness_report.py derives it)
        "dp_bytes_per_token": round(_dp_bytes_per_token(a), 2),
        "tcp_check_mbit": getattr(a, "_tcp_check_mbit", None),
        "command": command,
        "report": str(rundir / "report.json"),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if cut is not None:
        entry["link_cut"] = cut.summary(snaps, a.stages)
        print(f"  link cut: {json.dumps(entry['link_cut'])}", flush=True)
    e = entry
    print(
        f"  -> {e['tokens_per_s']:.0f} tokens/s  (ceiling {e['ceiling_tokens_per_s'] or 0:.0f}), "
        f"{e['bytes_per_token'] or 0:.1f} B/token, busiest link {e['link_utilisation'] or 0:.0%} "
        f"of the cap (wire {e['wire_utilisation'] or 0:.0%}), {e['dropped_microbatches']} dropped, "
        f"swarm used {e['swarm_cpu_cores']} of {e['host_cpus']} cores (load {e['loadavg_1m']}), "
        f"busiest node {e['cpu_util_max']} cores",
        flush=True,
    )
    return entry


def append_results(entries: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        old = []
    path.write_text(json.dumps(old + entries, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.network.harness", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nodes", type=int, default=6, help="fast nodes, one namespace each (default: %(default)s)"
    )
    p.add_argument("--stages", type=int, default=3, help="pipeline stages (default: %(default)s)")
    p.add_argument("--rate", default="80mbit", help="tbf rate of every node's link, both directions")
    p.add_argument(
        "--codec", default="mask", choices=["dense", "mask", "pca", "lowrank", "topk", "int8", "int4"]
    )
    p.add_argument("--mask-rate", type=float, default=0.95)
    p.add_argument("--anchors", type=int, default=0, help="anchor nodes per stage (default: %(default)s)")
    p.add_argument(
        "--dp",
        default="none",
        choices=["none"],
        help="data-parallel compression between replicas (only 'none': no DP flags on join yet)",
    )
    p.add_argument("--mode", default="emulated", choices=["emulated", "real"])
    p.add_argument(
        "--model", default=None, help="override the model spec (default: emulate:HIDDEN:LAYERS:US or bundled)"
    )
    p.add_argument("--hidden", type=int, default=2048, help="emulated hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=16, help="emulated decoder layers (default: %(default)s)")
    p.add_argument(
        "--gpu",
        default="h100",
        choices=["h100", "h200", "rtx4090"],
        help="emulated mode: the GPU the compute and codec sleeps are derived for (default: %(default)s)",
    )
    p.add_argument(
        "--us-per-token-layer",
        type=float,
        default=None,
        help="emulated compute, microseconds per token per layer, forward+backward "
        "(default: a Llama-3.2-1B layer on --gpu at 40%% MFU, see node/model/emulated.py)",
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=262144, help="tokens per node per optimizer step")
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument(
        "--delay-ms",
        type=float,
        default=20.0,
        help="one-way latency added by a userspace proxy in front of every node (each connection "
        "crosses one: RTT = 2 x this; 0: no proxy; default: %(default)s ms, RTT 40 ms)",
    )
    p.add_argument("--hop-timeout", type=float, default=180.0)
    p.add_argument(
        "--heartbeat",
        type=float,
        default=2.0,
        help="node heartbeat and metrics period; stage records expire after 6 s, so keep it <= 2 "
        "(1 s costs an idle 6-node swarm ~0.4 cores; default: %(default)s)",
    )
    p.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--node-args", default="", help="extra flags for every `node join` (quoted string)")
    p.add_argument(
        "--steps", type=int, default=0, help="stop once the tail took this many inner steps (0: off)"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds after the first completed microbatch before the window opens (the start-up "
        "burst synchronises the microbatches; default: %(default)s)",
    )
    p.add_argument("--seconds", type=float, default=120.0, help="measurement window after the warm-up")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a run after this many seconds")
    p.add_argument("--compare", action="store_true", help="run --codecs side by side at the same settings")
    p.add_argument(
        "--codecs",
        default="dense,m95",
        help=f"variants for --compare, from {','.join(VARIANTS)}; NAME@N runs it at --max-inflight N "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sweep", default="", help="also run --sweep-codecs at these rates in Mbit/s (same other settings)"
    )
    p.add_argument(
        "--sweep-codecs",
        default="dense,m95",
        help="variants of --sweep and --rtt-sweep, NAME or NAME@INFLIGHT (default: %(default)s)",
    )
    p.add_argument(
        "--rtt-sweep", default="", help="also run --sweep-codecs at these round-trip times in ms (e.g. 0,100)"
    )
    p.add_argument(
        "--inflight-sweep", default="", help="also run --inflight-codec at these --max-inflight values"
    )
    p.add_argument(
        "--inflight-codec", default="m95", help="variant of --inflight-sweep (default: %(default)s)"
    )
    p.add_argument(
        "--cut-node",
        type=int,
        default=-1,
        help="link-cut fault: take this node's link down during the window (-1: off)",
    )
    p.add_argument("--cut-at", type=float, default=30.0, help="seconds into the window the cut starts")
    p.add_argument("--cut-seconds", type=float, default=30.0, help="how long the link stays down")
    p.add_argument(
        "--outer-sweep",
        default="",
        help=f"also run --codec with the replicas' outer rounds set each of these ways, from "
        f"{','.join(OUTER_MODES)} (e.g. off,rounds,overlap)",
    )
    p.add_argument(
        "--outer-every",
        type=int,
        default=5,
        help="--outer-sweep: inner steps between rounds (default: %(default)s)",
    )
    p.add_argument("--skip-tcp-check", action="store_true", help="skip the raw TCP rate check")
    p.add_argument("--out", default="runs/harness", help="run directories (node logs, report.json)")
    p.add_argument("--results", default=str(RESULTS / "harness.json"), help="append entries here")
    p.add_argument(
        "--plot", action="store_true", help="after the runs, redraw bench/results/*.png from --results"
    )
    p.add_argument(
        "--plot-only", action="store_true", help="only redraw the plots from --results, run nothing"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="after the runs, redraw the plots and rewrite bench/results/harness.md from --results",
    )
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    command = "python -m bench.network.harness " + shlex.join(sys.argv[1:] if argv is None else argv)
    if a.plot_only:
        from bench.network.harness_plots import plot_all

        for path in plot_all(Path(a.results), RESULTS):
            print(path)
        return 0
    if a.us_per_token_layer is None:
        from node.model.emulated import GPUS, layer_us_per_token

        a.us_per_token_layer = round(layer_us_per_token(tflops=GPUS[a.gpu].bf16_tflops), 2)
    if a.nodes < a.stages:
        print(f"error: --nodes {a.nodes} cannot serve --stages {a.stages}", file=sys.stderr)
        return 2
    try:
        check_support()
    except NetnsUnavailable as e:
        print(f"bench.network.harness: cannot build the capped network here: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    try:
        plan = build_plan(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = plan[0][0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.txt"
    write_text_data(data, a.seq_len, chars_per_token=1.0 if a.mode == "emulated" else 8.0, seed=a.seed)
    n_ns = a.nodes + max(v.anchors for _, v, _ in plan) * a.stages
    topo = Topology(n_ns, rate)
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    entries: list[dict] = []
    status = 0
    try:
        topo.build()
        print(
            f"built {n_ns} namespaces on a bridge, tbf {rate / 1e6:g} Mbit/s each way per node "
            f"({topo.bridge_ns}, {topo.ns(0)}..)",
            flush=True,
        )
        if not a.skip_tcp_check:
            mbit = topo.tcp_rate_check(0, 1) / 1e6
            a._tcp_check_mbit = round(mbit, 2)
            print(f"raw TCP {topo.ns(1)} -> {topo.ns(0)}: {mbit:.1f} Mbit/s (cap {rate / 1e6:g})", flush=True)
        for r, v, over in plan:
            if r != topo.rate_bps:
                topo.shape(r)
                if not a.skip_tcp_check:
                    a._tcp_check_mbit = round(topo.tcp_rate_check(0, 1) / 1e6, 2)
            try:
                entries.append(
                    run_one(argparse.Namespace(**{**vars(a), **over}), v, topo, out, data, command)
                )
            except HarnessError as e:
                print(f"run {v.label} @ {r / 1e6:g} Mbit/s failed: {e}", file=sys.stderr, flush=True)
                status = 1
    except KeyboardInterrupt:
        print("interrupted; tearing down", file=sys.stderr, flush=True)
        status = 130
    finally:
        topo.teardown()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        left = [n for n in leftover_namespaces() if n.startswith(topo.bridge_ns[:-3])]
        if left:
            print(f"warning: namespaces left behind: {left}", file=sys.stderr)
    if entries and a.results:
        append_results(entries, Path(a.results))
    if entries:
        print_table(entries)
    if a.compare and entries:
        main = [e for e in entries if e["rate_mbit"] == rate / 1e6 and e["rtt_ms"] == 2 * a.delay_ms]
        base = [e for e in main if e["label"] == "dense"]
        for e in main:
            if base and e["label"] != "dense" and base[0]["tokens_per_s"]:
                print(
                    f"{e['label']} / dense tokens/s at {rate / 1e6:g} Mbit/s, RTT {e['rtt_ms']:g} ms: "
                    f"{e['tokens_per_s'] / base[0]['tokens_per_s']:.1f}x",
                    flush=True,
                )
    if (a.plot or a.report) and entries:
        from bench.network.harness_plots import plot_all

        for path in plot_all(Path(a.results), RESULTS):
            print(f"plot: {path}")
    if a.report and entries:
        from bench.network.harness_report import write

        print(f"report: {write(Path(a.results))}")
    return status


def _variant(name: str) -> tuple[Variant, dict]:
    """'m95' or 'dense@4' (its own --max-inflight) -> (variant, overrides)."""
    key, _, inflight = name.strip().lower().partition("@")
    if key not in VARIANTS:
        raise ValueError(
            f"unknown variant {name!r}; choose from {', '.join(VARIANTS)} (NAME@INFLIGHT allowed)"
        )
    if inflight and not inflight.isdigit():
        raise ValueError(f"{name!r}: the part after @ is a --max-inflight, an integer")
    return VARIANTS[key], ({"max_inflight": int(inflight)} if inflight else {})


def build_plan(a) -> list[tuple[float, Variant, dict]]:
    """(rate in bit/s, variant, overrides of the run's settings) for every run of this command."""
    rate = parse_rate(a.rate)
    if a.compare:
        plan = [(rate, *_variant(n)) for n in a.codecs.split(",") if n.strip()]
    elif a.outer_sweep:  # the sweep's runs are the --codec run, once per outer mode
        plan = []
    else:
        plan = [(rate, variant_from_args(a), {})]
    sweep = [_variant(n) for n in a.sweep_codecs.split(",") if n.strip()]
    for r in (x for x in a.sweep.split(",") if x.strip()):
        plan += [(float(r) * 1e6, v, over) for v, over in sweep]
    for rtt in (x for x in a.rtt_sweep.split(",") if x.strip()):
        plan += [(rate, v, {**over, "delay_ms": float(rtt) / 2}) for v, over in sweep]
    for mode in (x.strip() for x in a.outer_sweep.split(",") if x.strip()):
        plan.append((rate, variant_from_args(a), outer_overrides(mode, a)))
    inflight_variant, _ = _variant(a.inflight_codec)
    for n in (x for x in a.inflight_sweep.split(",") if x.strip()):
        plan.append((rate, inflight_variant, {"max_inflight": int(n)}))
    return plan


def print_table(entries: list[dict]) -> None:
    print(
        f"{'variant':<13}{'Mbit/s':>7}{'RTT':>5}{'infl':>5}{'tok/s':>9}{'ceiling':>9}{'B/token':>9}"
        f"{'link':>6}{'wire':>6}{'drop':>5}{'node CPU':>9}"
    )
    for e in entries:
        print(
            f"{e['label']:<13}{e['rate_mbit']:>7g}{e['rtt_ms']:>5g}{e['max_inflight']:>5}"
            f"{e['tokens_per_s']:>9.0f}{e['ceiling_tokens_per_s'] or 0:>9.0f}"
            f"{e['bytes_per_token'] or 0:>9.1f}"
            f"{e['link_utilisation'] or 0:>6.0%}{e['wire_utilisation'] or 0:>6.0%}"
            f"{e['dropped_microbatches']:>5}{e['cpu_util_max'] or 0:>9.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
