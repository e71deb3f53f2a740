"""Pretraining from scratch on CPU: Subspace Networks at a 2-stage boundary, and SCAPE sparse DP.

Part A (DESIGN.md 4.4): a small Llama-style byte-level model trained from scratch, dense
against the subspace-constrained model (``node.model.subspace``) with k = H/4, H/8, H/16.
The pipeline boundary after layer L/2 runs in-graph through the codec (``apply_link``):
dense bf16 for the dense model, ``SubspaceCodec`` (bf16 coefficients + 2-byte ids) for the
subspace models. Same init seed, same batches in the same order, same optimizer (AdamW) and
schedule for every variant (nothing tuned per variant).

Part B (DESIGN.md 4.5): the dense model trained with N simulated data-parallel replicas
(``compression.scape.ScapeReplicaSim``), each on its own batch per step: dense per-step DP
(density 1, i.e. AdamS on the mean gradient) against SCAPE at densities 0.1 and 0.01 (error
feedback on unmasked coordinates), and 0.1 with the unmasked gradient dropped.

Data: the docstrings of a fixed list of Python standard-library modules, read from the
running interpreter's own source files (ships offline with Python; nothing downloaded),
as UTF-8 bytes, vocabulary 256. The last 5% is held out for evaluation. The corpus
differs slightly between Python versions; its size and hash are in the report.

Run (CPU, one thread; see the report for the exact command and its CPU time):
    nice -n 10 .venv/bin/python -m bench.dp.subspace_scape
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from compression.codec import DenseCodec, LinkContext, apply_link
from compression.scape import ScapeReplicaSim
from compression.subspace import SubspaceCodec
from node.model.data import STDLIB_MODULES as MODULES
from node.model.data import stdlib_docstrings
from node.model.subspace import build_subspace_model

CTX = LinkContext(seed=0)
# part B variants: key -> (label, density, policy for unmasked coordinates, per-tensor quotas)
SCAPE_VARIANTS = {
    "dense": ("dense DP (density 1)", 1.0, "error_feedback", False),
    "ef:0.1": ("SCAPE d=0.1, error feedback, global mask", 0.1, "error_feedback", False),
    "ef:0.01": ("SCAPE d=0.01, error feedback, global mask", 0.01, "error_feedback", False),
    "drop:0.1": ("SCAPE d=0.1, unmasked dropped, global mask", 0.1, "drop", False),
    "ef-t:0.1": ("SCAPE d=0.1, error feedback, per-tensor mask", 0.1, "error_feedback", True),
    "ef-t:0.01": ("SCAPE d=0.01, error feedback, per-tensor mask", 0.01, "error_feedback", True),
    "local-t:0.1": ("SCAPE d=0.1, unmasked local, per-tensor mask", 0.1, "local", True),
}
NOTES_MARKER = "<!-- notes: kept when the script rewrites this file -->"


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


class Batches:
    """Fixed random windows: train batch (step, replica) and the eval batches are the same for
    every variant."""

    def __init__(self, data: bytes, batch: int, seq: int, seed: int = 0):
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(ids) * 0.95)
        self.train, self.eval_ids = ids[:cut], ids[cut:]
        self.batch, self.seq, self.seed = batch, seq, seed

    def _windows(self, src: torch.Tensor, gen: torch.Generator, n: int) -> torch.Tensor:
        starts = torch.randint(0, len(src) - self.seq, (n,), generator=gen)
        return torch.stack([src[s : s + self.seq] for s in starts.tolist()])

    def train_batch(self, step: int, replica: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + replica)
        return self._windows(self.train, gen, self.batch)

    def eval_batches(self, n: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + 7)
        return [self._windows(self.eval_ids, gen, self.batch) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def make_config(hidden: int, layers: int, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def dense_model(config, seed: int):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float()


class Boundary:
    """The 2-stage boundary after layer ``after``: every forward passes through ``codec``."""

    def __init__(self, model, after: int, codec):
        self.codec, self.tokens = codec, None
        model.model.layers[after - 1].register_forward_hook(self._hook)

    def _hook(self, _mod, _inp, out):
        if isinstance(self.codec, SubspaceCodec):
            self.codec.set_tokens(self.tokens)
        if isinstance(out, tuple):
            return (apply_link(out[0], self.codec, CTX), *out[1:])
        return apply_link(out, self.codec, CTX)

    def loss(self, model, ids: torch.Tensor) -> torch.Tensor:
        self.tokens = ids
        return model(input_ids=ids, labels=ids).loss


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def eval_loss(model, loss_fn, batches) -> float:
    model.eval()
    out = sum(float(loss_fn(model, b)) for b in batches) / len(batches)
    model.train()
    return out


# --------------------------------------------------------------------------------------------
# part A: subspace
# --------------------------------------------------------------------------------------------


def run_subspace(args, data: Batches, evals) -> list[dict]:
    config = make_config(args.hidden, args.layers, args.seq)
    after = args.layers // 2
    variants = [("dense", None)] + [(f"subspace k=H/{d}", args.hidden // d) for d in (4, 8, 16)]
    results = []
    for name, k in variants:
        t0 = time.process_time()
        if k is None:
            model, codec = dense_model(config, args.seed), DenseCodec("bfloat16")
            fwd, bwd = codec.bytes_per_token(args.hidden), codec.bytes_per_token(args.hidden)
        else:
            model = build_subspace_model(config, k=k, seed=args.seed).float()
            codec = SubspaceCodec(k=k, seed=args.seed, vocab=256, hidden=args.hidden)
            fwd, bwd = codec.bytes_per_token(args.hidden), codec.backward_bytes_per_token()
        boundary = Boundary(model, after, codec)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        curve = [(0, eval_loss(model, boundary.loss, evals))]
        train = []
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            loss = boundary.loss(model, data.train_batch(step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            train.append(float(loss.detach()))
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curve.append((step + 1, eval_loss(model, boundary.loss, evals)))
        cpu = time.process_time() - t0
        print(f"[A] {name}: eval {curve[-1][1]:.3f}, {cpu:.0f} s CPU", flush=True)
        results.append(
            {
                "name": name,
                "k": k,
                "fwd_bytes_per_token": fwd,
                "bwd_bytes_per_token": bwd,
                "trainable_params": trainable,
                "eval": curve,
                "train": train,
                "cpu_s": cpu,
            }
        )
    return results


# --------------------------------------------------------------------------------------------
# part B: SCAPE
# --------------------------------------------------------------------------------------------


def run_scape(args, data: Batches, evals) -> list[dict]:
    config = make_config(args.hidden, args.layers, args.seq)
    results = []
    tokens_per_replica_step = args.batch * args.seq
    for key in args.scape_variants.split(","):
        name, density, policy, per_tensor = SCAPE_VARIANTS[key]
        t0 = time.process_time()
        model = dense_model(config, args.seed)
        params = list(model.parameters())
        sim = ScapeReplicaSim(
            parameters_to_vector(params).detach(),
            world=args.replicas,
            density=density,
            lr=args.scape_lr,
            betas=(0.9, 0.95),
            unmasked=policy,
            segments=[p.numel() for p in params] if per_tensor else None,
        )

        def loss_fn(m, ids):
            return m(input_ids=ids, labels=ids).loss

        curve = [(0, eval_loss(model, loss_fn, evals))]
        train, dp_bytes, dense_bytes, steady = [], 0.0, 0.0, {}
        for step in range(args.scape_steps):
            grads, losses = [], []
            for r in range(args.replicas):
                vector_to_parameters(sim.params[r], params)
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model, data.train_batch(step, r))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                grads.append(parameters_to_vector([p.grad for p in params]).detach().clone())
                losses.append(float(loss.detach()))
            rec = sim.step(grads, lr=lr_at(step, args.scape_steps, args.scape_lr, args.warmup))
            dp_bytes += rec["total"]
            if step == 1 or args.scape_steps == 1:
                steady = {k: rec[k] for k in ("values", "exchange", "total", "dense")}
            dense_bytes += rec["dense"]
            train.append(sum(losses) / len(losses))
            if (step + 1) % args.eval_every == 0 or step + 1 == args.scape_steps:
                vector_to_parameters(sim.params[0], params)
                curve.append((step + 1, eval_loss(model, loss_fn, evals)))
        cpu = time.process_time() - t0
        steps = args.scape_steps
        print(f"[B] {name}: eval {curve[-1][1]:.3f}, {cpu:.0f} s CPU", flush=True)
        results.append(
            {
                "key": key,
                "name": name,
                "density": density,
                "unmasked": policy,
                "replicas": args.replicas,
                "numel": sim.numel,
                "dp_bytes_per_replica_step": dp_bytes / steps,
                "dense_bytes_per_replica_step": dense_bytes / steps,
                "dp_bytes_per_token": dp_bytes / (steps * tokens_per_replica_step),
                "steady_bytes": steady,
                "replica_distance": sim.replica_distance(),
                "eval": curve,
                "train": train,
                "cpu_s": cpu,
            }
        )
    return results


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, loss in curve if loss <= target), None)


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        tr = torch.tensor(r["train"])
        w = min(10, len(tr))
        smooth = tr.unfold(0, w, 1).mean(1) if len(tr) >= w else tr
        ax[0].plot(range(w, w + len(smooth)), smooth.tolist(), label=r["name"])
        ax[1].plot([s for s, _ in r["eval"]], [v for _, v in r["eval"]], marker="o", ms=3, label=r["name"])
    ax[0].set_title(f"{title}: train loss (10-step mean)")
    ax[1].set_title(f"{title}: eval loss")
    for a in ax:
        a.set_xlabel("step")
        a.set_ylabel("loss (nats/byte)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args, meta: dict, sub: list[dict], sc: list[dict], out: Path) -> None:
    md = out / "subspace_scape.md"
    notes = ""
    if md.exists() and NOTES_MARKER in md.read_text():
        notes = md.read_text().split(NOTES_MARKER, 1)[1]
    lines = [
        "# Subspace Networks and SCAPE: pretraining from scratch on CPU",
        "",
        "Commands (in this order; `--only` runs reuse the earlier results in `subspace_scape.json`):",
        "",
        *[f"    {c}" for c in meta["commands"]],
        "",
        f"Machine: CPU, 1 torch thread, `nice -n 10`, shared with other jobs; Python {meta['python']}, "
        f"torch {meta['torch']}. CPU time: {meta['cpu_s']:.0f} s in all.",
        "",
        f"Data: docstrings of {len(MODULES)} standard-library modules of this Python, "
        f"{meta['corpus_bytes']:,} bytes (sha256 {meta['corpus_sha']}), byte-level (vocabulary 256), "
        "last 5% held out. Model: Llama-style, "
        f"hidden {args.hidden}, {args.layers} layers, 4 heads, MLP {meta['intermediate']}, untied head, "
        f"context {args.seq}; batch {args.batch} x {args.seq} = {args.batch * args.seq} tokens per step "
        "(per replica in part B). Eval: mean loss on "
        f"{args.eval_batches} fixed held-out batches every {args.eval_every} steps. "
        "Loss is in nats per byte.",
        "",
        "These are short runs (a few hundred steps on a model of about a million parameters), "
        "sized to a small CPU budget: they show the direction and rough size of each effect, not "
        "converged figures.",
        "",
        "## A. Dense vs Subspace Networks at a 2-stage boundary",
        "",
        f"Boundary after layer {args.layers // 2} of {args.layers}, in-graph (forward and backward) through "
        "the codec: dense bf16, or `SubspaceCodec` (bf16 coefficients + 2-byte token ids forward, k bf16 "
        "numbers backward). Every block is constrained (no unconstrained last block). AdamW, "
        f"peak lr {args.lr}, {args.warmup} warmup steps, cosine to 10%, clip 1.0, {args.steps} steps, "
        "same batches for every variant.",
        "",
    ]
    dense_curve = sub[0]["eval"]
    half = dense_curve[len(dense_curve) // 2]
    quarter = dense_curve[len(dense_curve) // 4]
    lines += [
        f"Targets: T1 = dense eval loss at step {quarter[0]} ({quarter[1]:.3f}), "
        f"T2 = dense eval loss at step {half[0]} ({half[1]:.3f}), T3 = dense final eval loss "
        f"({dense_curve[-1][1]:.3f}). Steps are eval points, so they are multiples of {args.eval_every}.",
        "",
        "| variant | trainable params | boundary bytes/token fwd | bwd | dense / this | "
        "final eval loss | steps to T1 | steps to T2 | steps to T3 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dense_b = sub[0]["fwd_bytes_per_token"] + sub[0]["bwd_bytes_per_token"]
    for r in sub:
        b = r["fwd_bytes_per_token"] + r["bwd_bytes_per_token"]
        reached = [steps_to(r["eval"], t) for t in (quarter[1], half[1], dense_curve[-1][1])]
        lines.append(
            f"| {r['name']} | {r['trainable_params']:,} | {r['fwd_bytes_per_token']:.0f} | "
            f"{r['bwd_bytes_per_token']:.0f} | {dense_b / b:.1f}x | {r['eval'][-1][1]:.3f} | "
            + " | ".join(str(x) if x is not None else "not reached" for x in reached)
            + " |"
        )
    lines += [
        "",
        "![subspace loss curves](subspace_loss.png)",
        "",
        "## B. SCAPE vs dense per-step DP",
        "",
        f"{args.replicas} simulated replicas, each on its own batch every step (the same batches for every "
        f"variant), gradients clipped to 1.0 per replica, AdamS (beta 0.9/0.95) peak lr {args.scape_lr}, "
        f"same schedule, {args.scape_steps} steps. Step 0 of SCAPE is a dense sync (no first moments yet). "
        "DP bytes: what one replica contributes per step (masked values in bf16 + its share of the "
        "mask-partition exchange), the all-reduce factor 2(N-1)/N left out for dense and sparse alike; "
        "'steady' is a step after step 0, 'mean' includes the dense step 0.",
        "",
        "| variant | DP bytes/replica/step, steady | of which mask exchange | DP bytes/token, steady | "
        "dense / this (steady) | DP bytes/token, mean | final eval loss | steps to dense-DP T2 | "
        "replica distance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dcurve = sc[0]["eval"]
    t2b = dcurve[len(dcurve) // 2]
    for r in sc:
        steady = r["steady_bytes"]
        tok = args.batch * args.seq
        t2 = steps_to(r["eval"], t2b[1])
        lines.append(
            f"| {r['name']} | {steady['total']:,.0f} | {steady['exchange']:,.0f} | "
            f"{steady['total'] / tok:,.1f} | {steady['dense'] / steady['total']:.1f}x | "
            f"{r['dp_bytes_per_token']:,.1f} | {r['eval'][-1][1]:.3f} | "
            f"{t2 if t2 is not None else 'not reached'} | {r['replica_distance']:.1e} |"
        )
    lines += [
        "",
        f"T2 here = dense-DP eval loss at step {t2b[0]} ({t2b[1]:.3f}). Parameters: {sc[0]['numel']:,}.",
        "",
        "![SCAPE loss curves](scape_loss.png)",
        "",
        NOTES_MARKER,
    ]
    md.write_text("\n".join(lines) + (notes if notes else "\n"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--scape-steps", type=int, default=200)
    ap.add_argument("--scape-lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("subspace", "scape"), default=None)
    ap.add_argument(
        "--scape-variants",
        default=",".join(SCAPE_VARIANTS),
        help="comma list of part-B variants to run; with --only scape, the others are kept from the last run",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.process_time()
    corpus = stdlib_docstrings()
    data = Batches(corpus, args.batch, args.seq, args.seed)
    evals = data.eval_batches(args.eval_batches)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "subspace_scape.json"
    prev = json.loads(raw.read_text()) if raw.exists() else {}
    sub = run_subspace(args, data, evals) if args.only != "scape" else prev.get("subspace", [])
    sc = run_scape(args, data, evals) if args.only != "subspace" else prev.get("scape", [])
    if args.only == "scape":  # merge with the kept variants, in the canonical order
        fresh = {r["key"]: r for r in sc}
        kept = {r.get("key"): r for r in prev.get("scape", [])}
        sc = [fresh.get(k) or kept[k] for k in SCAPE_VARIANTS if k in fresh or k in kept]
    command = "nice -n 10 .venv/bin/python -m bench.dp.subspace_scape " + " ".join(sys.argv[1:])
    meta = {
        "commands": (prev.get("meta", {}).get("commands", []) if args.only else []) + [command.strip()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus_bytes": len(corpus),
        "corpus_sha": hashlib.sha256(corpus).hexdigest()[:16],
        "intermediate": make_config(args.hidden, args.layers, args.seq).intermediate_size,
        "cpu_s": time.process_time() - t0 + (prev.get("meta", {}).get("cpu_s", 0.0) if args.only else 0.0),
    }
    settings = vars(args) | {"out": str(args.out)}
    raw.write_text(json.dumps({"meta": meta, "args": settings, "subspace": sub, "scape": sc}))
    if sub:
        plot(sub, "dense vs subspace", args.out / "subspace_loss.png")
    if sc:
        plot(sc, "SCAPE vs dense DP", args.out / "scape_loss.png")
    if sub and sc:
        write_report(args, meta, sub, sc, args.out)
    print(f"done: {meta['cpu_s']:.0f} s CPU", flush=True)


if __name__ == "__main__":
    main()
