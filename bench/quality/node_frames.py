"""The node itself at a GPU starter's frames: does a real swarm learn what the one-process bench says?

    python -m bench.quality.node_frames --task word --seed 0 --link default --out bench/results \
        --workdir runs/nf
    python -m bench.quality.node_frames --task word --seed 0 --link dense --out bench/results \
        --workdir runs/nf

``bench.quality.quality`` simulates the pipeline in one process; this runs ``python -m node swarm`` (one
node per stage, real p2pd, the node's links, codecs and optimizer) in the bench's setting and
scores what comes out:

* the bench's model and split: the bundled SmolLM2-135M in 4 stages at the bench's layer ranges
  (``--stage-layers``), full fine-tuning, AdamW lr 1e-4 (weight decay 0), clip 1.0, sequences of
  at most 96 tokens;
* the bench's frames: ``--microbatch-tokens 2048`` (packed as the bench packs them), one
  microbatch per inner step (``--batch-tokens 1``) and one in flight (``--max-inflight 1``), so
  every step's gradient comes from one frame through weights that are not stale, as in the bench;
  100 inner steps;
* the bench's data: the training file is the examples the bench trains seed ``--seed`` on, in
  the bench's order (the node draws them in its own shuffled order, the same for every link of
  one seed); one replica per stage, so no outer round runs (nobody to average with).

Scored twice: the swarm's own ``--eval`` (200 problems held out of the training file, before
and after, the export scored by ``node.model.evaluate``), and the export (after only) on the
bench's held-out set of that seed (``bench.quality.quality_tasks.held_out``, the problems the bench's
records are scored on). Bytes per token per boundary and direction come from the nodes' own link
counters. One run per invocation (a swarm of 4 full fine-tuning nodes at 2,048-token frames holds ~10 GB); the
record is appended to ``OUT/node_frames.json``. A benchmark, not a test: ~30-40 min on a CPU.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.quality.quality_tasks import RANGES, SEQ_LEN, held_out, step_frames, task_stream

LINKS = {
    "dense": ["--codec", "dense", "--wire-dtype", "bfloat16"],
    # the node's default at 2048-token frames (node.stage.links.lowrank_layout): nothing to pass
    "default": ["--codec", "lowrank"],
}
FRAME_TOKENS = 2048


def training_examples(task: str, seed: int, steps: int, tok) -> list:
    """The examples ``bench.quality.quality`` trains seed ``seed`` on at 2048-token frames, in its order."""
    frames = step_frames(task_stream(task, seed), tok, steps, FRAME_TOKENS, seq_len=SEQ_LEN)
    return [e for f in frames for e in f]


def swarm_command(data: Path, report: Path, link: str, seed: int, steps: int, n_eval: int) -> list[str]:
    layers = ",".join(f"{a}-{b}" for a, b in RANGES)
    return [
        sys.executable, "-m", "node", "swarm",
        "--nodes", str(len(RANGES)), "--stages", str(len(RANGES)), "--stage-layers", layers,
        "--steps", str(steps), "--seed", str(seed), "--data", str(data),
        "--microbatch-tokens", str(FRAME_TOKENS), "--batch-tokens", "1", "--max-inflight", "1",
        "--seq-len", str(SEQ_LEN), "--lr", "1e-4", "--clip", "1.0", "--weight-decay", "0",
        "--finetune", "full", "--device", "cpu", "--threads-per-node", "1",
        "--hop-timeout", "120", "--timeout", "7200", "--no-rebalance",
        "--eval", str(n_eval), "--export", str(report / "model"), "--report", str(report),
        *LINKS[link],
    ]  # fmt: skip


def link_bytes(report: dict) -> dict:
    """Bytes per token per direction, summed over the boundaries, from the nodes' counters."""
    out: dict[str, list[int]] = {}
    for lk in report["links"]:  # node.local.report.sum_links: one row per (boundary, direction)
        b, t = out.setdefault(lk["direction"], [0, 0])
        out[lk["direction"]] = [b + lk["bytes"], t + lk["tokens"]]
    return {d: b / t if t else None for d, (b, t) in out.items()}


def append(path: Path, record: dict) -> None:
    with open(Path(tempfile.gettempdir()) / "bench-node-frames.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = json.loads(path.read_text()) if path.exists() else []
        rows.append(record)
        path.write_text(json.dumps(rows, indent=1) + "\n")


BENCH_VARIANT = {"dense": "dense", "default": "lowrankt24-88a"}  # the bench's name for each link


def plot(records: list[dict], bench_runs: list[dict], path: Path) -> Path:
    """Training loss per step: each swarm run beside the one-process bench's run of the same link,
    task and seed (``links.json``), smoothed over 5 steps (one frame per step is noisy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs: list[float], k: int = 5) -> list[float]:
        return [
            sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))
        ]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for i, rec in enumerate(r for r in records if r.get("loss")):
        colour = f"C{i}"
        label = f"{rec['task']} s{rec['seed']} {rec['link']}"
        ax.plot(range(1, len(rec["loss"]) + 1), smooth(rec["loss"]), color=colour, label=f"swarm, {label}")
        for b in bench_runs:
            same = (b["task"], b["seed"], b.get("frame_tokens")) == (rec["task"], rec["seed"], FRAME_TOKENS)
            if same and b["variant"] == BENCH_VARIANT[rec["link"]] and b["steps"] == len(rec["loss"]) - 1:
                curve = b["train_loss_curve"]
                ax.plot(
                    range(1, len(curve) + 1), smooth(curve), color=colour, ls="--", label=f"bench, {label}"
                )
    ax.set_yscale("log")
    ax.set_xlabel("inner step (one 2,048-token frame each)")
    ax.set_ylabel("training loss (answer tokens), 5-step mean")
    ax.set_title("the node's swarm against the one-process bench, same examples", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.quality.node_frames", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--task", default="word")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--link", choices=sorted(LINKS), default="default")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--workdir", default="runs/node_frames")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (checkpoints, export)")
    ap.add_argument("--plot", action="store_true", help="only redraw OUT/node_frames.png from the records")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.plot:
        records = json.loads((out / "node_frames.json").read_text())
        bench = json.loads((out / "links.json").read_text()) if (out / "links.json").exists() else []
        print(plot(records, bench, out / "node_frames.png"))
        return 0

    from node.model.evaluate import completion_budget, evaluate, load_for_eval, write_jsonl
    from node.model.loading import open_model

    tok = open_model("bundled").tokenizer()  # the config and tokenizer only, no weights
    train = training_examples(args.task, args.seed, args.steps, tok)
    bench_held = held_out(args.task, args.eval, {e.prompt for e in train})
    run = Path(args.workdir) / f"{args.task}-s{args.seed}-{args.link}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    write_jsonl(train, run / "train.jsonl")
    report = run / "report"
    cmd = swarm_command(run / "train.jsonl", report, args.link, args.seed, args.steps, args.eval)
    print(" ".join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    wall = time.monotonic() - t0
    if rc != 0:
        print(f"node_frames: the swarm exited {rc}; its logs are in {report}/nodes", file=sys.stderr)
        return 2
    rep = json.loads((report / "report.json").read_text())
    model, tok = load_for_eval(str(report / "model"), "cpu")
    after = evaluate(model, tok, bench_held, completion_budget(tok, bench_held))
    rec = {
        "task": args.task,
        "seed": args.seed,
        "link": args.link,
        "steps": len(rep["loss"]),
        "frame_tokens": FRAME_TOKENS,
        "stages": [list(r) for r in RANGES],
        "trained_tokens": rep["tokens"],
        "dropped_microbatches": rep["dropped_microbatches"],
        "bytes_per_token": link_bytes(rep),
        "swarm_eval": rep.get("eval"),  # the node's own held-out split of the training file
        # the export on the bench's held-out problems of this seed (before training: the swarm's own
        # eval above, on problems of the same task; scoring the untrained model twice costs minutes)
        "bench_eval": {
            "n": len(bench_held),
            "em_after": after["em"],
            "loss_after": after["loss"],
        },
        "loss": rep["loss"],  # the tail's training loss per inner step
        "wall_s": round(wall),
        "command": " ".join(["python -m bench.quality.node_frames", *(argv or sys.argv[1:])]),
    }
    out.mkdir(parents=True, exist_ok=True)
    append(out / "node_frames.json", rec)
    print(json.dumps(rec, indent=1), flush=True)
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
