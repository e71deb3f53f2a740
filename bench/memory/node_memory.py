"""Whole nodes against their memory estimate: stage 2 of 4 of a ~1.3 GB Llama, replicated, training.

    python -m bench.memory.node_memory --out bench/results

Writes a random-init Llama checkpoint (hidden 1024, 20 layers, MLP 4096, vocab 32000: 1.27 GB in
fp32 shards), then for full fine-tuning and for LoRA starts five real ``node join`` processes on
loopback, stages [0, 1, 2, 2, 3] (``--stage`` pinned, so stage 2 has a replica to average with),
DiLoCo rounds every 5 inner steps, and lets them train until both replicas of stage 2 have
committed 2 outer rounds together. Every 2 s it samples each node's process tree (node, DHT
process, p2pd, averager helper) as PSS (``node.local.memory``); at the end it reads each node's
own estimate from its metrics (what it printed at start and checked ``--max-memory`` against:
device + host, one RAM on a CPU). Appends a table to ``stage_memory.md`` and writes
``node_memory.json``.

``--codec dense`` keeps the starter from calibrating link bases through the whole model (a
start-up cost the estimate does not count; ``demo.md`` measures it with the default link).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.memory.stage_memory import big_config, write_random_checkpoint
from node.local.memory import PeakMemory
from node.model.devices import AVERAGER_BYTES_PER_PARAM

STAGES = [0, 1, 2, 2, 3]
GB = 1e9


def _join(
    ckpt: Path, d: Path, stage: int, run_id: str, peers: list[str], extra: list[str]
) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "node", "join", "--model", str(ckpt), "--stages", "4", "--stage", str(stage)]
    cmd += ["--run-id", run_id, "--state-dir", str(d), "--metrics-file", str(d / "metrics.json")]
    cmd += ["--ready-file", str(d / "ready.json"), "--threads", "1", "--heartbeat", "1", "--codec", "dense"]
    cmd += ["--wait-peers", str(len(STAGES)), "--outer-every", "5", "--checkpoint-every", "5", *extra]
    cmd += ["--outer-timeout", "45"]  # five nodes of a 1.6 GB model share 2 cores: rounds are slow
    cmd += ["--peers", *peers] if peers else []
    log = open(d / "node.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _committed(m: dict) -> int:
    return len([r for r in m.get("outer_rounds", []) if not r["skipped"] and r["group_size"] == 2])


def write_long_text(path: Path, n: int = 2000, seed: int = 0) -> None:
    """Plain-text examples longer than the run's 64-token sequences: every microbatch fills its
    8 x 64 padded tokens, the frame the estimate sizes activations by. Examples of plain text are
    paragraphs (node.model.data.load_examples): one per blank-line-separated block. (Written one per
    line until 12/4, the file was a single example, and every microbatch held 1 x 64 tokens.)"""
    import random

    rng = random.Random(seed)
    words = ["node", "stage", "swarm", "peer", "round", "token", "layer", "link", "home", "gpu"]
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(n)) + "\n")


def run_mode(ckpt: Path, work: Path, mode: str, timeout: float, data: list[str]) -> list[dict]:
    extra = (["--finetune", "lora", "--lr", "1e-3"] if mode == "lora" else []) + data
    run_id = f"mem-{mode}-{int(time.time())}"
    dirs = [work / mode / str(i) for i in range(len(STAGES))]
    procs: list[subprocess.Popen] = []
    memory = PeakMemory()
    t0 = time.monotonic()
    try:
        procs.append(_join(ckpt, dirs[0], STAGES[0], run_id, [], extra))
        while (ready := _read(dirs[0] / "ready.json")) is None:
            if procs[0].poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the first node did not start: see {dirs[0] / 'node.log'}")
            time.sleep(1)
        addr = [a for a in ready["maddrs"] if "127.0.0.1" in a][0]
        peer = addr if "/p2p/" in addr else f"{addr}/p2p/{ready['peer_id']}"
        procs += [_join(ckpt, d, s, run_id, [peer], extra) for d, s in zip(dirs[1:], STAGES[1:])]
        while True:
            memory.sample([p.pid if p.poll() is None else None for p in procs])
            metrics = [_read(d / "metrics.json") for d in dirs]
            replicas = [m for m, s in zip(metrics, STAGES) if s == 2 and m]
            done = len(replicas) == 2 and min(_committed(m) for m in replicas) >= 2
            steps = max((m.get("inner_step", 0) for m in metrics if m), default=0)
            print(f"  {mode}: {time.monotonic() - t0:.0f}s  tail step {steps}  "
                  f"stage-2 rounds {[_committed(m) for m in replicas]}", flush=True)  # fmt: skip
            if done:
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a node died: see the node.log files under {work / mode}")
            if time.monotonic() - t0 > timeout:  # measured all the same; the rounds column says
                print(
                    f"  {mode}: stage 2's replicas did not commit 2 rounds within {timeout:.0f}s", flush=True
                )
                break
            time.sleep(1)
    finally:
        for p in procs:  # the head first, so no node loses the peers its in-flight work needs
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    rows = []
    peaks = memory.as_dict()["peak_pss_per_node"]
    for i, (d, s) in enumerate(zip(dirs, STAGES)):
        m = _read(d / "metrics.json") or {}
        mem = m.get("memory", {})
        est = mem.get("estimate") or {}
        # a lone replica holds no outer state until a partner comes (node.dp.deferred); its estimate
        # counts it all the same, as what it needs then: without it, a checkpoint's 12 B / parameter
        trained = est.get("trainable", 0)
        lone = est.get("total", 0) + 12 * trained + est.get("runtime", 0) - AVERAGER_BYTES_PER_PARAM * trained
        seen = mem.get("estimate_at_peak") or est
        fewer = est.get("total", 0) - seen.get("total", 0)  # activations of the microbatches never held
        whole = lone if STAGES.count(s) == 1 else est.get("total", 0) + est.get("host", 0)
        rows.append({
            "mode": mode, "node": i, "stage": s, "replica": STAGES.count(s) > 1,
            "estimate": est.get("total", 0) + est.get("host", 0), "device_estimate": est.get("total", 0),
            "host_estimate": est.get("host", 0), "measured_pss": peaks[i] if i < len(peaks) else 0,
            "estimate_alone": lone if STAGES.count(s) == 1 else None,
            "peak_inflight": mem.get("peak_inflight"), "cap_inflight": est.get("inflight"),
            "peak_held": mem.get("peak_held"),
            "estimate_at_peak": whole - fewer,
            "peak_rss_node_process": mem.get("peak_rss", 0),
            "pss_by_process_at_peak": memory.at_peak.get(i, {}),
            "committed_rounds": _committed(m), "inner_step": m.get("inner_step", 0),
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--max-inflight", type=int, default=4, help="every node's --max-inflight")
    p.add_argument(
        "--data",
        choices=["full-frames", "arithmetic"],
        default="full-frames",
        help="full-frames: long text, every microbatch at its padded 512 tokens (the estimate's case); "
        "arithmetic: the built-in task's ~136-token microbatches",
    )
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="node-memory-"))
    try:
        size = write_random_checkpoint(work / "ckpt", big_config(a.layers), seed=0)
        print(f"checkpoint: {size / GB:.2f} GB in {work / 'ckpt'}", flush=True)
        data = []
        if a.data == "full-frames":
            write_long_text(work / "long.txt")
            data = ["--data", str(work / "long.txt")]
        data += ["--max-inflight", str(a.max_inflight)]
        rows = [r for mode in a.modes for r in run_mode(work / "ckpt", work, mode, a.timeout, data)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(a.out)
    (out / "node_memory.json").write_text(json.dumps({"checkpoint_bytes": size, "rows": rows}, indent=1))
    lines = [
        "",
        f"## Whole nodes against their estimate: a {size / GB:.2f} GB Llama in 4 stages, stage 2 replicated"
        f" ({a.data} data)",
        "",
        f"`python -m bench.memory.node_memory --data {a.data} --out bench/results` (issue 32; 2-core CPU",
        "machine, fp32, `--codec dense`, DiLoCo (`--outer-timeout 45`) and a checkpoint every 5 steps,",
        "until stage 2's two replicas committed 2 rounds together). Estimate = what the node printed at",
        "start (device + host: one RAM on a CPU); alone = the same without the outer state a lone stage",
        "builds only when a partner comes; measured = the peak PSS of the node's process tree (node, DHT",
        "process, p2pd, averager helper), sampled every 1 s. In flight = the most microbatches the node's",
        "gate held at once, of its `--max-inflight` cap; held = the most whose activations (forward",
        "graphs) it held at once; at that count = the estimate made for the held count (alone for a lone",
        "stage; `node.model.devices.with_inflight`, reported in the node's metrics).",
        "",
        "| fine-tuning | node | stage | estimate GB | alone GB | measured GB | measured / estimate | rounds |"
        " steps | in flight | held | at that count GB | measured / at that count |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["measured_pss"] / r["estimate"] if r["estimate"] else float("nan")
        alone = "-" if r["estimate_alone"] is None else f"{r['estimate_alone'] / GB:.2f}"
        lines.append(
            f"| {r['mode']} | {r['node']} | {r['stage']}{' (replica)' if r['replica'] else ''} | "
            f"{r['estimate'] / GB:.2f} | {alone} | "
            f"{r['measured_pss'] / GB:.2f} | {ratio:.2f} | "
            f"{r['committed_rounds']} | {r['inner_step']} | {r['peak_inflight']} of {r['cap_inflight']} | "
            f"{r['peak_held']} | "
            f"{r['estimate_at_peak'] / GB:.2f} | {r['measured_pss'] / r['estimate_at_peak']:.2f} |"
        )
    kinds = sorted({k for r in rows for k in r["pss_by_process_at_peak"]}, key=lambda k: (k != "node", k))
    lines += [
        "",
        "Each tree at its peak, by process (PSS GB; p2pd and the node's forks: the DHT process,",
        "then the averager helper where a replica has a partner):",
        "",
        "| fine-tuning | node | stage | " + " | ".join(kinds) + " |",
        "|---|---|---|" + "---|" * len(kinds),
    ]
    for r in rows:
        at = r["pss_by_process_at_peak"]
        cells = [f"{at[k] / GB:.2f}" if k in at else "-" for k in kinds]
        lines.append(f"| {r['mode']} | {r['node']} | {r['stage']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out / "stage_memory.md", "a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
