"""Chaos benchmark (issue 7): goodput of a swarm under random SIGKILLs against the same swarm without.

    python -m bench.reliability.chaos --nodes 6 --stages 3 --minutes 6 --kill-every 60 --seed 0 \
        [--model tiny:6:256] [--out bench/results] [--workdir runs/chaos]

Two local swarms with identical settings run back to back in one command, for the same wall
time after the same warm-up, so the ratio is measured under the same machine load:

* ``fault-free``: N node processes (the `node swarm` launcher's own ``start_node``), no faults.
* ``chaos``: the same, and every ``--kill-every`` seconds one node, drawn with a seeded RNG among
  the live ones (any stage, the bootstrap node included), loses its whole process group to
  SIGKILL (node, DHT process, p2pd: a machine dying). After ``--restart-delay`` seconds it is
  restarted with ``join --resume`` (same identity and state dir), bootstrapping through any
  live peer; it resumes its newest complete checkpoint and pulls the stage's current weights
  from a live replica. The first restarted incarnation runs with ``VNODE_CKPT_FAULT=written:pause``:
  its next checkpoint write stops between fsync and rename, and the next kill takes that node
  there, so one kill lands in the middle of a checkpoint write.

Goodput is tail-stage optimizer steps (summed over the tail replicas and over each node's
process lifetimes) per second of the measurement window; tail microbatches and head round
trips are reported alongside. After teardown every checkpoint every node left is verified and
loaded with the node's own loader (``load_checkpoint`` + ``StageRuntime.restore`` into a freshly
built stage and AdamW). Writes OUT/chaos.json, OUT/chaos.md and OUT/chaos.png. Every process
started is stopped by its PID (process group) on success, failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from node.argv import config_from_args, config_to_argv
from node.cli import build_parser
from node.config import NodeConfig
from node.local.launcher import (
    SwarmError,
    kill_group,
    poll_ready,
    spawn_node,
    start_node,
    stop_nodes,
)
from node.model.checkpoint import FAULT_ENV, list_checkpoints, load_checkpoint, newest_for_run

SAMPLE_S = 1.0
PRE_KILL_S = 30.0  # window that defines a kill's pre-kill rate
RECOVER_WINDOW_S = 15.0  # a kill is recovered once a window this long after it runs at RECOVER_SHARE
RECOVER_SHARE = 0.9
PAUSED_MARK = "VNODE_CKPT_PAUSED"
NOTES = [
    "* Model: `tiny:6:256` by default (6 random-init Llama layers, hidden 256, 2 layers per stage). Six "
    "node processes (each with its DHT process and p2pd) share 2 CPU cores with other work here; the bundled "
    "SmolLM2-135M would need ~1 GB per node and give a few steps per minute, too few to resolve a "
    "one-minute kill cycle. The compute share above says how much of a node's time is real torch compute.",
    "* Layout: `--stage auto` spreads 6 nodes over 3 stages as 2/2/2, so no stage has a sole replica; a "
    "kill leaves its stage one replica for the restart time. A sole-replica kill would need a second kill "
    "on the surviving replica before the restart serves (the *sole replica* column says if it happened).",
    "* On 2 cores the swarm is CPU-bound: a killed node's CPU share goes to the survivors, so a dead replica "
    "costs less throughput here than it would on separate machines. What a kill costs here is the restart "
    "(Python start-up, imports, DHT join, checkpoint load and weight pull, all competing for the same "
    "cores), the microbatches that were in flight through the victim, and the steps since its last "
    "checkpoint (the restarted node resumes its checkpoint, then pulls the stage's current weights from "
    "the live replica).",
    "* Wall-clock goodput of a CPU-bound swarm on shared cores moves with whatever else runs on the machine "
    "(other benchmarks and tests ran during these runs: see the load average), by more than a kill a minute "
    "costs; the two runs are back to back to share that load as far as possible, and steps per CPU second "
    "of the swarm's own processes is reported as the figure that does not depend on it.",
    "* Goodput counts tail optimizer steps per process lifetime (a resumed node counts from the step it "
    "resumed at), so work a killed tail did after its last checkpoint still counts: its gradients did "
    "reach the other stages' weights, and its own are replaced by the live replica's on rejoin. The strict "
    "ratio also subtracts those steps of killed tail replicas (steps after their newest checkpoint).",
]


@dataclass
class Life:
    """One process lifetime of one node."""

    node: int
    proc: subprocess.Popen
    spawned: float
    spawned_wall: float = 0.0  # time.time() at spawn: older metrics files are not this lifetime's
    stage: int | None = None
    ready_at: float | None = None
    serving_at: float | None = None
    killed_at: float | None = None
    metrics: dict | None = None
    resumed: bool = False
    fault_env: bool = False
    maddr: str | None = None
    cpu: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds, every process of its group

    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    def steps(self) -> int:
        m = self.metrics
        if not m:
            return 0
        return m["inner_step"] - (m.get("resumed_from") or 0)

    def get(self, key: str) -> int:
        return int(self.metrics.get(key, 0)) if self.metrics else 0


@dataclass
class Phase:
    name: str
    root: Path
    run_id: str
    n_stages: int
    lives: list[Life] = field(default_factory=list)
    current: dict[int, Life] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    t_zero: float = 0.0  # monotonic time all nodes were ready
    t0: float = 0.0  # measurement window, seconds since t_zero
    t1: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t_zero

    def alive(self) -> list[Life]:
        return [lf for lf in self.current.values() if lf.killed_at is None and lf.proc.poll() is None]

    def read(self, lf: Life) -> None:
        path = self.root / "nodes" / str(lf.node) / "metrics.json"
        try:
            m = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if m.get("time", 0) < lf.spawned_wall:  # a file the previous lifetime left behind
            return
        lf.metrics = m
        lf.stage = m["stage"]
        if lf.serving_at is None and m["microbatches"] > 0:
            lf.serving_at = self.now()

    def sample(self) -> dict:
        cpu = _cpu_by_group()
        for lf in self.alive():
            self.read(lf)
            for pid, sec in cpu.get(lf.proc.pid, {}).items():
                lf.cpu[pid] = max(lf.cpu.get(pid, 0.0), sec)
        tails = [lf for lf in self.lives if lf.stage == self.n_stages - 1]
        heads = [lf for lf in self.lives if lf.stage == 0]
        live_tails = [lf for lf in self.alive() if lf.stage == self.n_stages - 1 and lf.metrics]
        recent = [x for lf in live_tails for x in lf.metrics["step_losses"][-3:]]
        s = {
            "t": round(self.now(), 2),
            "tail_steps": sum(lf.steps() for lf in tails),
            "tail_microbatches": sum(lf.get("microbatches") for lf in tails),
            "head_microbatches": sum(lf.get("microbatches") for lf in heads),
            "tail_tokens_seen": sum(lf.get("trained_tokens") for lf in live_tails),
            "swarm_cpu_s": round(sum(lf.cpu_s() for lf in self.lives), 2),
            "load1": os.getloadavg()[0],
            "dropped": sum(lf.get("dropped_microbatches") for lf in self.lives),
            "loss": sum(recent) / len(recent) if recent else None,
            "alive": len(self.alive()),
        }
        self.samples.append(s)
        return s


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_by_group() -> dict[int, dict[int, float]]:
    """{process group: {pid: user+system CPU seconds}} from /proc (the nodes lead their own groups)."""
    out: dict[int, dict[int, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pgrp, utime, stime = int(fields[2]), int(fields[11]), int(fields[12])
        out.setdefault(pgrp, {})[int(stat.parent.name)] = (utime + stime) / _TICK
    return out


def _bootstrap(phase: Phase, exclude: int | None = None) -> list[str]:
    return [lf.maddr for lf in phase.alive() if lf.maddr and lf.node != exclude][:3]


def _maddr(ready: dict) -> str:
    addrs = [a for a in ready["maddrs"] if "127.0.0.1" in a] or ready["maddrs"]
    return addrs[0] if "/p2p/" in addrs[0] else f"{addrs[0]}/p2p/{ready['peer_id']}"


def _ckpt_step(phase: Phase, node: int) -> int | None:
    ck = newest_for_run(phase.root / "nodes" / str(node), phase.run_id)
    return None if ck is None else ck.step


def _tmp_dirs(phase: Phase, node: int) -> list[str]:
    root = phase.root / "nodes" / str(node) / "checkpoints" / phase.run_id
    return sorted(str(p.relative_to(phase.root)) for p in root.glob("stage-*/.tmp-*"))


def _paused(phase: Phase, lf: Life) -> bool:
    try:
        return PAUSED_MARK in (phase.root / "nodes" / str(lf.node) / "node.log").read_text()
    except OSError:
        return False


def run_phase(name: str, swarm_args, opts, chaos: bool) -> Phase:
    root = Path(opts.workdir) / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    phase = Phase(name, root, f"chaos-{name}-{uuid.uuid4().hex[:6]}", opts.stages)
    rng = random.Random(opts.seed)
    node_flags = ["--checkpoint-every", str(opts.checkpoint_every)]
    print(f"[{name}] starting {opts.nodes} nodes ({opts.model}, {opts.stages} stages) in {root}", flush=True)
    try:
        for i in range(opts.nodes):
            peers = _bootstrap(phase)
            t_spawn = time.monotonic()
            proc, ready = start_node(swarm_args, i, root, phase.run_id, peers, extra=node_flags)
            lf = Life(i, proc, spawned=0.0, stage=ready["stage"], maddr=_maddr(ready))
            lf.spawned_wall = time.time() - (time.monotonic() - t_spawn)
            phase.lives.append(lf)
            phase.current[i] = lf
            print(f"[{name}]   node {i} -> stage {ready['stage']}", flush=True)
        phase.t_zero = time.monotonic()
        for lf in phase.lives:
            lf.spawned = lf.ready_at = 0.0
        # warm-up: until the tail has stepped, then opts.warmup seconds more
        deadline = phase.now() + 300
        while phase.sample()["tail_steps"] == 0:
            if phase.now() > deadline:
                raise SwarmError("the tail did not take a step within 300 s of the start")
            _check_alive(phase)
            time.sleep(SAMPLE_S)
        phase.t0 = phase.now() + opts.warmup
        phase.t1 = phase.t0 + opts.minutes * 60
        n_kills = int(opts.minutes * 60 // opts.kill_every) if chaos else 0
        kill_at = [phase.t0 + (k + 0.5) * opts.kill_every for k in range(n_kills)]
        restarts: list[tuple[float, int]] = []
        fault_armed = chaos and opts.torn_kill
        print(
            f"[{name}] tail stepping at {phase.now():.0f}s; window {phase.t0:.0f}-{phase.t1:.0f}s, "
            f"{n_kills} kills",
            flush=True,
        )
        last_print = 0.0
        # after the window (not counted): until the last restarted node serves, so every kill has its figures
        while phase.now() < phase.t1 or (
            phase.now() < phase.t1 + opts.grace
            and (restarts or any(lf.serving_at is None for lf in phase.current.values()))
        ):
            tick = time.monotonic()
            s = phase.sample()
            if kill_at and phase.now() >= kill_at[0]:
                kill_at.pop(0)
                _kill(phase, rng, restarts, opts)
            for due, node in list(restarts):
                if phase.now() >= due:
                    restarts.remove((due, node))
                    _restart(phase, swarm_args, node, node_flags, fault_armed)
                    fault_armed = False
            for lf in phase.current.values():
                if lf.ready_at is None and lf.killed_at is None:
                    ready = poll_ready(lf.proc, lf.node, root)
                    if ready is not None:
                        lf.ready_at, lf.stage, lf.maddr = phase.now(), ready["stage"], _maddr(ready)
            _check_alive(phase)
            if phase.now() - last_print > 20:
                print(
                    f"[{name}] t={s['t']:.0f}s tail steps {s['tail_steps']} dropped {s['dropped']} "
                    f"alive {s['alive']}/{opts.nodes} loss {s['loss'] or float('nan'):.3f}",
                    flush=True,
                )
                last_print = phase.now()
            time.sleep(max(0.0, SAMPLE_S - (time.monotonic() - tick)))
    finally:
        live = [lf for lf in phase.current.values() if lf.proc.poll() is None]
        stop_nodes([lf.proc for lf in live], [lf.stage if lf.stage is not None else 0 for lf in live])
        for lf in phase.lives:  # nothing outlives the phase, by PID
            if lf.proc.poll() is None:
                kill_group(lf.proc)
    for lf in phase.current.values():  # the final metrics every stopped node wrote
        phase.read(lf)
    return phase


def _check_alive(phase: Phase) -> None:
    for lf in phase.current.values():
        if lf.killed_at is None and lf.proc.poll() is not None:
            log = phase.root / "nodes" / str(lf.node) / "node.log"
            tail = "\n".join(log.read_text().splitlines()[-8:]) if log.exists() else ""
            raise SwarmError(f"node {lf.node} exited on its own (code {lf.proc.returncode}):\n{tail}")


def _kill(phase: Phase, rng: random.Random, restarts: list, opts) -> None:
    candidates = [lf for lf in phase.alive() if lf.ready_at is not None]
    paused = [lf for lf in candidates if lf.fault_env and _paused(phase, lf)]
    victim = paused[0] if paused else rng.choice(sorted(candidates, key=lambda lf: lf.node))
    stage_mates = [
        lf
        for lf in phase.alive()
        if lf.stage == victim.stage and lf is not victim and lf.ready_at is not None
    ]
    phase.read(victim)  # its last metrics, written at most one heartbeat ago
    pre = [s for s in phase.samples if s["t"] >= phase.now() - PRE_KILL_S]
    t = phase.now()
    kill_group(victim.proc)
    victim.killed_at = t
    kill = {
        "t": round(t, 2),
        "node": victim.node,
        "stage": victim.stage,
        "peer_id": victim.metrics["peer_id"] if victim.metrics else None,
        "sole_replica": not stage_mates,
        "inner_step_at_kill": victim.metrics["inner_step"] if victim.metrics else None,
        "during_checkpoint_write": bool(paused),
        "tmp_dirs_at_kill": _tmp_dirs(phase, victim.node),
        "newest_checkpoint_at_kill": _ckpt_step(phase, victim.node),
        "tail_steps_at_kill": phase.samples[-1]["tail_steps"],
        "pre_kill_rate": (pre[-1]["tail_steps"] - pre[0]["tail_steps"])
        / max(pre[-1]["t"] - pre[0]["t"], 1e-9)
        if len(pre) > 1
        else None,
    }
    phase.kills.append(kill)
    restarts.append((t + opts.restart_delay, victim.node))
    print(
        f"[{phase.name}] t={t:.0f}s SIGKILL node {victim.node} (stage {victim.stage}"
        f"{', sole replica' if not stage_mates else ''}{', mid checkpoint write' if paused else ''}); "
        f"newest checkpoint step {kill['newest_checkpoint_at_kill']}",
        flush=True,
    )


def _restart(phase: Phase, swarm_args, node: int, node_flags: list[str], fault: bool) -> None:
    env = {FAULT_ENV: "written:pause"} if fault else None
    t = phase.now()
    proc = spawn_node(
        swarm_args,
        node,
        phase.root,
        phase.run_id,
        _bootstrap(phase, node),
        extra=node_flags + ["--resume"],
        env=env,
    )
    lf = Life(node, proc, spawned=t, resumed=True, fault_env=fault)
    lf.spawned_wall = time.time()
    phase.lives.append(lf)
    phase.current[node] = lf
    print(
        f"[{phase.name}] t={t:.0f}s restarting node {node} with --resume{' (+ckpt fault)' if fault else ''}"
    )


# ---------------------------------------------------------------------- analysis


def _at(samples: list[dict], t: float, key: str) -> float:
    """The value of ``key`` at the last sample not after ``t``."""
    prior = [s for s in samples if s["t"] <= t]
    return (prior[-1] if prior else samples[0])[key]


def analyse(phase: Phase) -> dict:
    ss = phase.samples
    dur = phase.t1 - phase.t0
    steps = _at(ss, phase.t1, "tail_steps") - _at(ss, phase.t0, "tail_steps")
    tail_mb = _at(ss, phase.t1, "tail_microbatches") - _at(ss, phase.t0, "tail_microbatches")
    head_mb = _at(ss, phase.t1, "head_microbatches") - _at(ss, phase.t0, "head_microbatches")
    in_window = [s for s in ss if phase.t0 <= s["t"] <= phase.t1 and s["loss"] is not None]
    first = [s["loss"] for s in in_window if s["t"] <= phase.t0 + 60]
    last = [s["loss"] for s in in_window if s["t"] >= phase.t1 - 60]
    kills = []
    for k, kill in enumerate(phase.kills):
        t = kill["t"]
        nxt = phase.kills[k + 1]["t"] if k + 1 < len(phase.kills) else phase.t1
        life = next((lf for lf in phase.lives if lf.node == kill["node"] and lf.spawned >= t), None)
        lm = (life.metrics or {}) if life else {}
        progress = next(
            (s["t"] - t for s in ss if s["t"] > t and s["tail_steps"] > kill["tail_steps_at_kill"]), None
        )
        recovered = None
        if kill["pre_kill_rate"]:
            for s in ss:
                if s["t"] < t + RECOVER_WINDOW_S or s["t"] > nxt:
                    continue
                rate = (s["tail_steps"] - _at(ss, s["t"] - RECOVER_WINDOW_S, "tail_steps")) / RECOVER_WINDOW_S
                if rate >= RECOVER_SHARE * kill["pre_kill_rate"]:
                    recovered = s["t"] - t
                    break
        resumed_from = lm.get("resumed_from")
        kills.append(
            {
                **kill,
                "restart_ready_s": None if not life or life.ready_at is None else round(life.ready_at - t, 1),
                "serving_again_s": None
                if not life or life.serving_at is None
                else round(life.serving_at - t, 1),
                "tail_progress_s": progress,
                "rate_recovered_s": recovered,
                "resumed_from": resumed_from,
                "state_pull_bytes": lm.get("state_pull_bytes"),
                "resumed_newest_checkpoint": resumed_from is not None
                and resumed_from == kill["newest_checkpoint_at_kill"],
            }
        )
    return {
        "window_s": dur,
        "tail_steps": steps,
        "goodput_steps_per_s": steps / dur,
        "tail_microbatches": tail_mb,
        "tail_microbatches_per_s": tail_mb / dur,
        "head_round_trips": head_mb,
        "head_round_trips_per_s": head_mb / dur,
        # CPU seconds the swarm's processes (node, DHT process, p2pd; every lifetime) used in the window:
        # other work shares these 2 cores, so steps per swarm CPU second is the load-independent figure
        "swarm_cpu_s": (cpu := _at(ss, phase.t1, "swarm_cpu_s") - _at(ss, phase.t0, "swarm_cpu_s")),
        "swarm_cores": cpu / dur,
        "steps_per_cpu_s": steps / max(cpu, 1e-9),
        "mean_load1": sum(s["load1"] for s in in_window) / max(len(in_window), 1),
        "dropped_microbatches": ss[-1]["dropped"] if ss else 0,
        # share of the nodes' wall time spent in their compute thread (how real the compute is here)
        "compute_share": sum((lf.metrics or {}).get("compute_s", 0.0) for lf in phase.lives)
        / max(
            sum(
                (lf.killed_at if lf.killed_at is not None else ss[-1]["t"]) - lf.spawned for lf in phase.lives
            ),
            1e-9,
        ),
        "dropped_in_window": _at(ss, phase.t1, "dropped") - _at(ss, phase.t0, "dropped"),
        "loss_first_minute": sum(first) / len(first) if first else None,
        "loss_last_minute": sum(last) / len(last) if last else None,
        "kills": kills,
    }


def _final_dropped(phase: Phase) -> int:
    return sum(lf.get("dropped_microbatches") for lf in phase.lives)


def verify_checkpoints(phase: Phase, swarm_args) -> dict:
    """Load every checkpoint every node left with the node's own loader, into a fresh stage + AdamW."""
    import torch

    from node.join import load_run_model, new_run_record
    from node.runtime import StageRuntime

    cfg = config_from_args(swarm_args)
    cfg.run_id = phase.run_id
    source = load_run_model(cfg, None)
    run = new_run_record(cfg, source.skeleton, source.name, "")
    run.model_hash, run.stage_hashes = source.run_hashes(run.stages)  # as the swarm's starter did
    out = {"checkpoints": 0, "loaded": 0, "failed": [], "nodes_without_checkpoint": [], "per_node": {}}
    for node in sorted({lf.node for lf in phase.lives}):
        nodedir = phase.root / "nodes" / str(node)
        final = phase.current[node].metrics or {}
        dirs = sorted((nodedir / "checkpoints" / phase.run_id).glob("stage-*"))
        found = []
        for d in dirs:
            stage_index = int(d.name.split("-")[1])
            for path in list_checkpoints(d):
                out["checkpoints"] += 1
                try:
                    ck = load_checkpoint(path)
                    stage = source.load_stage(run.stages, stage_index, torch.device("cpu"))
                    rt = StageRuntime(
                        cfg, run, stage_index, stage, None, f"verify-{node}", device=torch.device("cpu")
                    )
                    try:
                        rt.restore(ck)  # checks run id, stage and model hash, loads weights and optimizer
                    finally:
                        rt.pool.shutdown(wait=False)
                        rt.ckpt_pool.shutdown(wait=False)
                    if ck.step != ck.counters["inner_step"] or rt.inner_step != ck.step:
                        raise ValueError(f"step {ck.step} != counters {ck.counters['inner_step']}")
                    out["loaded"] += 1
                    found.append({"path": str(path.relative_to(phase.root)), "step": ck.step})
                except Exception as e:
                    out["failed"].append(f"{path.relative_to(phase.root)}: {type(e).__name__}: {e}")
        newest = newest_for_run(nodedir, phase.run_id)
        if newest is None:
            out["nodes_without_checkpoint"].append(node)
        out["per_node"][str(node)] = {
            "checkpoints": found,
            "newest_step": None if newest is None else newest.step,
            "final_inner_step": final.get("inner_step"),
            "final_checkpoint_is_final_step": newest is not None and newest.step == final.get("inner_step"),
            "leftover_tmp_dirs": _tmp_dirs(phase, node),
        }
    return out


# ---------------------------------------------------------------------- report


def plot(phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    colors = {"fault-free": "tab:blue", "chaos": "tab:red"}
    for ph in phases:
        base = _at(ph.samples, ph.t0, "tail_steps")
        xs = [s["t"] - ph.t0 for s in ph.samples]
        ys = [s["tail_steps"] - base for s in ph.samples]
        ax.plot(xs, ys, label=ph.name, color=colors.get(ph.name), lw=1.5)
        for k, kill in enumerate(ph.kills):
            ax.axvline(kill["t"] - ph.t0, color="k", ls=":", lw=0.9, label="SIGKILL" if k == 0 else None)
        back = [lf.serving_at for lf in ph.lives if lf.resumed and lf.serving_at is not None]
        if back:
            ys_back = [_at(ph.samples, t, "tail_steps") - base for t in back]
            ax.plot(
                [t - ph.t0 for t in back],
                ys_back,
                "^",
                color="tab:green",
                ms=6,
                label="restarted node serves",
            )
    ax.axvspan(
        phases[0].t1 - phases[0].t0,
        max(s["t"] - ph.t0 for ph in phases for s in ph.samples),
        color="grey",
        alpha=0.1,
    )
    ax.axvline(0, color="grey", lw=0.6)
    ax.set_xlabel("seconds since the end of warm-up (shaded: after the window, not counted)")
    ax.set_ylabel("tail optimizer steps (all replicas)")
    ax.set_title("steps over time: fault-free vs one SIGKILL per kill interval", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def write_report(out: Path, opts, command: str, phases: list[Phase], res: dict) -> None:
    ff, ch = res["fault-free"], res["chaos"]
    lines = [
        "# Chaos benchmark: random SIGKILLs and restarts against a fault-free run",
        "",
        "Command (run from the repository root, 2 shared CPU cores, no GPU):",
        "",
        f"    {command}",
        "",
        f"Settings: {opts.nodes} nodes, {opts.stages} stages, model `{opts.model}`, codec `{opts.codec}`, "
        f"{opts.minutes} min "
        f"measurement window after {opts.warmup:.0f} s warm-up (from the tail's first step), one SIGKILL "
        f"every {opts.kill_every:.0f} s (first at {opts.kill_every / 2:.0f} s), restart after "
        f"{opts.restart_delay:.0f} s with `join --resume`, checkpoint every {opts.checkpoint_every} steps, "
        f"hop timeout {opts.hop_timeout:.0f} s, seed {opts.seed}, 1 torch thread per node. Both runs start "
        "from scratch with identical settings, one after the other.",
        "",
        "## Goodput",
        "",
        "| run | tail steps | steps/s | tail microbatches/s | head round trips/s | dropped (window) | "
        "loss 1st min -> last min | swarm CPU (cores) | steps per CPU s | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("fault-free", ff), ("chaos", ch)):
        lines.append(
            f"| {name} | {r['tail_steps']} | {r['goodput_steps_per_s']:.3f} "
            f"| {r['tail_microbatches_per_s']:.3f} "
            f"| {r['head_round_trips_per_s']:.3f} | {r['dropped_in_window']} | "
            f"{_f(r['loss_first_minute'], '.3f')} -> {_f(r['loss_last_minute'], '.3f')} "
            f"| {r['swarm_cores']:.2f} | {r['steps_per_cpu_s']:.3f} | {r['mean_load1']:.1f} |"
        )
    lines += [
        "",
        f"**Goodput ratio chaos / fault-free: {res['ratio']:.3f}** (tail optimizer steps per second; "
        f"{res['ratio_microbatches']:.3f} in tail microbatches, {res['ratio_round_trips']:.3f} in head round "
        f"trips; strict {res['ratio_strict']:.3f}, without the "
        f"{res['tail_steps_lost_with_killed_tails']} steps killed tail replicas had taken "
        "after their newest checkpoint). "
        f"Target >= 0.70: **{'met' if res['ratio'] >= 0.7 else 'not met'}**.",
        "",
        f"Per CPU second of the swarm's own processes (node, DHT process, p2pd, every lifetime; the load-"
        f"independent figure, since other work shares these cores): ratio **{res['ratio_per_cpu']:.3f}**.",
        "",
        f"Share of the nodes' wall time spent in their compute thread: fault-free {ff['compute_share']:.0%}, "
        f"chaos {ch['compute_share']:.0%}.",
        "",
        f"Dropped microbatches over the whole run (all process lifetimes, from the nodes' metrics): "
        f"fault-free {res['dropped_total']['fault-free']}, chaos {res['dropped_total']['chaos']}. "
        "Microbatches in flight inside a head that is killed die with it and are not counted as dropped.",
        "",
        "## Kills",
        "",
        "Times in seconds after the kill. *ready*: the restarted process claimed its stage; *serving*: it "
        "handled its first microbatch; *tail step*: the swarm's tail step counter advanced; *rate*: the "
        f"first {RECOVER_WINDOW_S:.0f} s window after the kill that ran at >= {RECOVER_SHARE:.0%} of the "
        f"{PRE_KILL_S:.0f} s pre-kill rate ('-': not before the next kill).",
        "",
        "| t (s) | node | stage | sole replica | note | newest ckpt at kill | resumed from | ready | "
        "serving | tail step | rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in ch["kills"]:
        note = "mid checkpoint write" if k["during_checkpoint_write"] else ""
        lines.append(
            f"| {k['t'] - phases[1].t0:.0f} | {k['node']} | {k['stage']} "
            f"| {'yes' if k['sole_replica'] else 'no'} "
            f"| {note} | {_f(k['newest_checkpoint_at_kill'], 'd')} | {_f(k['resumed_from'], 'd')} "
            f"| {_f(k['restart_ready_s'])} | {_f(k['serving_again_s'])} | {_f(k['tail_progress_s'])} "
            f"| {_f(k['rate_recovered_s'])} |"
        )
    v = res["checkpoints"]
    lines += [
        "",
        "## Checkpoints",
        "",
        "Every checkpoint directory every node left (both runs) was verified (manifest digest, every file's "
        "size and sha256) and loaded with "
        "`node.model.checkpoint.load_checkpoint` + `StageRuntime.restore` into a "
        "freshly built stage and AdamW (checks run id, stage and model hash).",
        "",
    ]
    for name in ("fault-free", "chaos"):
        c = v[name]
        lines.append(
            f"* {name}: {c['loaded']}/{c['checkpoints']} checkpoints load; "
            f"failures: {c['failed'] or 'none'}; "
            f"nodes without a checkpoint: {c['nodes_without_checkpoint'] or 'none'}; final checkpoint at the "
            f"final step on {sum(n['final_checkpoint_is_final_step'] for n in c['per_node'].values())}"
            f"/{len(c['per_node'])} nodes."
        )
    resumed_ok = [k["resumed_newest_checkpoint"] for k in ch["kills"]]
    lines += [
        f"* every restart resumed the newest complete checkpoint on disk at its kill: "
        f"{sum(resumed_ok)}/{len(resumed_ok)}.",
    ]
    torn = [k for k in ch["kills"] if k["during_checkpoint_write"]]
    for k in torn:
        lines.append(
            f"* kill mid checkpoint write (node {k['node']}): "
            f"temporary dirs at the kill {k['tmp_dirs_at_kill']}; "
            f"newest complete checkpoint step {k['newest_checkpoint_at_kill']}; the restart resumed from "
            f"{k['resumed_from']}."
        )
    lines += ["", "![steps over time](chaos.png)", ""]
    lines += ["## Notes", "", *NOTES, ""]
    (out / "chaos.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.reliability.chaos", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--minutes", type=float, default=6.0, help="measurement window per run")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--restart-delay", type=float, default=5.0, help="seconds a killed node stays down")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds after the tail's first step")
    p.add_argument("--seed", type=int, default=0, help="victim choice and run seed")
    p.add_argument("--model", default="tiny:6:256")
    p.add_argument("--codec", default="dense", help="pipeline-link codec (pinned: the node's default moves)")
    p.add_argument("--grace", type=float, default=120.0, help="max seconds after the window for restarts")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--hop-timeout", type=float, default=10.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--no-torn-kill", dest="torn_kill", action="store_false", help="no kill mid checkpoint write"
    )
    p.add_argument("--workdir", default="runs/chaos")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--only", choices=["fault-free", "chaos"], default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    command = "python -m bench.reliability.chaos " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    # the swarm's run flags and --hop-timeout are join's: written from a config (codec pinned)
    node = NodeConfig(
        stages=opts.stages,
        model=opts.model,
        codec=opts.codec,
        lr=opts.lr,
        seed=opts.seed,
        hop_timeout=opts.hop_timeout,
    )
    swarm_args = build_parser().parse_args(
        ["swarm", "--nodes", str(opts.nodes), "--threads-per-node", "1"]
        + config_to_argv(node, always=("stages", "model", "codec", "lr", "seed", "hop_timeout"))
    )

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    phases: list[Phase] = []
    try:
        for name, chaos in (("fault-free", False), ("chaos", True)):
            if opts.only and opts.only != name:
                continue
            phases.append(run_phase(name, swarm_args, opts, chaos))
    except KeyboardInterrupt:
        print("interrupted; every node was stopped", file=sys.stderr)
        return 130
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(phases) < 2:
        for ph in phases:
            print(json.dumps(analyse(ph), indent=1))
        return 0
    by = {ph.name: ph for ph in phases}
    res = {name: analyse(ph) for name, ph in by.items()}
    ff, ch = res["fault-free"], res["chaos"]
    res["ratio"] = ch["goodput_steps_per_s"] / ff["goodput_steps_per_s"]
    res["ratio_microbatches"] = ch["tail_microbatches_per_s"] / ff["tail_microbatches_per_s"]
    res["ratio_round_trips"] = ch["head_round_trips_per_s"] / max(ff["head_round_trips_per_s"], 1e-9)
    res["ratio_per_cpu"] = ch["steps_per_cpu_s"] / ff["steps_per_cpu_s"]
    lost = sum(
        k["inner_step_at_kill"] - (k["newest_checkpoint_at_kill"] or 0)
        for k in ch["kills"]
        if k["stage"] == opts.stages - 1 and k["inner_step_at_kill"] is not None
    )
    res["tail_steps_lost_with_killed_tails"] = lost
    res["ratio_strict"] = (ch["tail_steps"] - lost) / ch["window_s"] / ff["goodput_steps_per_s"]
    res["dropped_total"] = {name: _final_dropped(ph) for name, ph in by.items()}
    res["checkpoints"] = {name: verify_checkpoints(ph, swarm_args) for name, ph in by.items()}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(phases, out / "chaos.png")
    doc = {
        "command": command,
        "settings": vars(opts),
        **res,
        "samples": {ph.name: ph.samples for ph in phases},
        "windows": {ph.name: [ph.t0, ph.t1] for ph in phases},
        "lives": {
            ph.name: [
                {
                    "node": lf.node,
                    "stage": lf.stage,
                    "spawned": lf.spawned,
                    "ready_at": lf.ready_at,
                    "serving_at": lf.serving_at,
                    "killed_at": lf.killed_at,
                    "resumed_from": (lf.metrics or {}).get("resumed_from"),
                    "inner_step": (lf.metrics or {}).get("inner_step"),
                    "dropped": lf.get("dropped_microbatches"),
                }
                for lf in ph.lives
            ]
            for ph in phases
        },
    }
    (out / "chaos.json").write_text(json.dumps(doc, indent=1))
    write_report(out, opts, command, phases, res)
    print(
        f"goodput ratio {res['ratio']:.3f} (fault-free {ff['goodput_steps_per_s']:.3f}, chaos "
        f"{ch['goodput_steps_per_s']:.3f} steps/s); kills {len(ch['kills'])}; "
        f"dropped {res['dropped_total']}; checkpoints {res['checkpoints']['chaos']['loaded']}"
        f"/{res['checkpoints']['chaos']['checkpoints']} load",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
