"""Outer-round bits (issue 50): LoRA replicas averaging every H steps at 32/8/4 bits vs per-step averaging.

    python -m bench.dp.outer_bits [--replicas 2] [--batch 4] [--steps 200] [--h 10 30 100]
                                  [--bits 32 8 4] [--workers 2] [--out bench/results] [--seed 0]
    python -m bench.dp.outer_bits --check      # branching from a snapshot == a run from scratch

In-process simulation with the node's own math: the bundled SmolLM2-135M-Instruct (fp32, CPU)
with LoRA adapters as a node makes them (``node.model.adapters.add_adapters`` on one stage that
holds the whole model, ``FinetuneSettings``' defaults: rank 16, alpha 32, every projection, no
dropout), on the arithmetic task with ``split_heldout``'s held-out problems removed from the
training data. R replicas, each with its own data stream and its own AdamW (lr 1e-3, no weight
decay, clip 1.0: the demo's and the run record's), kept across rounds. Every H inner steps an
outer round as ``node/dp/diloco.py`` takes it: per tensor delta_i = theta_global - theta_i; at 32
bits the mean; at 8/4 bits each replica sends ``outer_quant.with_feedback(delta_i, e_i, bits)``
(its own error-feedback residual per tensor), the mean of what was sent is quantised afresh
(``outer_quant.roundtrip``, as the reducer returns it), then ``OuterNesterov(0.7, 0.9)`` (the node's
defaults; ``--outer-lr 1 --outer-momentum 0`` is plain averaging) and every
replica takes theta_global. A run whose steps are not a multiple of H ends with one shorter round.

Baseline "per-step averaging": one model on the same problems, batch R x b (all replicas'
problems of that step together): data-parallel training with gradients averaged every step.

Bytes per replica per inner step: an all-reduce in a group of k = R moves 2(k-1)/k x the payload
per peer; an outer round's payload is ``outer_quant.wire_nbytes`` of the adapters, once every H
steps; per-step averaging sends fp32 gradients (4 bytes a parameter) every step.

The inner steps before an H's first round are the same for every bits setting: with a large
enough H they run once and the bits settings branch from a snapshot (adapters, AdamW states,
data RNG states); ``--check`` verifies on a tiny run that a branch ends bit-identical to a run
from scratch. Tasks run in ``--workers`` processes (one thread each). Writes outer_bits.json /
.md / .png under ``--out`` (outer_bits_TAG.* with ``--tag TAG``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from compression import outer_quant
from compression.outer import OuterNesterov, param_distance
from compression.powersgd import compressible
from node.model.adapters import add_adapters, moving_parameters
from node.model.data import collate, load_examples, tokenize
from node.model.evaluate import completion_budget, exact_match, split_heldout
from node.model.loading import load_model
from node.model.stages import Stage
from protocol.settings import FinetuneSettings

DATE = "2026-12-07"
SEQ_LEN = 64  # the run record's default; a problem is ~17 tokens
WITHIN = 0.02  # "within 2% of per-step averaging's held-out loss"
_CTX: dict = {}  # per process: the model, its adapters, the data


# ---------------------------------------------------------------------------------------- setup


def context(seed: int, heldout: int) -> dict:
    """The bundled model with seeded LoRA adapters (one stage = the whole model) and the data, once."""
    if _CTX.get("key") == (seed, heldout):
        return _CTX
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tok, _ = load_model("bundled", seed=seed)
    stage = Stage(model, 0, model.config.num_hidden_layers, is_head=True, is_tail=True)
    add_adapters(stage, FinetuneSettings(mode="lora"), seed)  # the layers are the model's: it has them too
    model.eval()  # no dropout anywhere (LoRA dropout 0): the same forward in training
    params = moving_parameters(stage)
    held, train = split_heldout(load_examples("arithmetic", seed=seed), heldout, seed)
    _CTX.clear()
    _CTX.update(
        key=(seed, heldout),
        model=model,
        stage=stage,
        tok=tok,
        params=params,
        init={n: p.detach().clone() for n, p in params.items()},
        held=held,
        train=train,
    )
    return _CTX


def clone(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in d.items()}


@torch.no_grad()
def bind(ctx: dict, theta: dict[str, torch.Tensor]) -> None:
    for n, p in ctx["params"].items():
        p.copy_(theta[n])


def draw(ctx: dict, rng: random.Random, b: int) -> list:
    train = ctx["train"]
    return [train[rng.randrange(len(train))] for _ in range(b)]


def inner_step(ctx: dict, theta: dict, opt: torch.optim.Optimizer, examples: list, clip: float) -> float:
    """One AdamW step of the adapters ``theta`` (updated in place) on ``examples``; the loss."""
    tok, params = ctx["tok"], ctx["params"]
    ids, labels = collate([tokenize(tok, ex, SEQ_LEN) for ex in examples], tok.eos_token_id)
    bind(ctx, theta)
    loss, _ = ctx["stage"].loss(ids, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, p in params.items():
            theta[n].copy_(p)
    return float(loss.detach())


def make_opt(ctx: dict, lr: float) -> torch.optim.Optimizer:
    # one optimizer per replica over the shared Parameter objects: its own state, keyed by them
    return torch.optim.AdamW(list(ctx["params"].values()), lr=lr, weight_decay=0.0)


@torch.no_grad()
def held_loss(ctx: dict, batch: int = 16) -> float:
    """``evaluate.eval_loss`` (token-weighted mean over the held-out problems) through ``Stage.loss``,
    which applies lm_head at the labelled positions only: the same figure, a fraction of the cost."""
    tok, held = ctx["tok"], ctx["held"]
    total, count = 0.0, 0
    for i in range(0, len(held), batch):
        ids, labels = collate([tokenize(tok, ex, SEQ_LEN) for ex in held[i : i + batch]], tok.eos_token_id)
        loss, n = ctx["stage"].loss(ids, labels)
        total += float(loss) * n
        count += n
    return total / max(count, 1)


def score(ctx: dict, theta: dict, em_n: int) -> dict:
    """Held-out loss over every held-out problem; exact match over the first ``em_n`` (0: none)."""
    bind(ctx, theta)
    model, tok, held = ctx["model"], ctx["tok"], ctx["held"]
    out = {"loss": held_loss(ctx)}
    if em_n:
        em_set = held[:em_n]
        out["em"] = exact_match(model, tok, em_set, completion_budget(tok, em_set))[0]
    return out


# ---------------------------------------------------------------------------------------- runs


def run_per_step(a: dict) -> dict:
    """Per-step averaging: one model, batch R x b (every replica's problems of the step), same steps."""
    ctx = context(a["seed"], a["heldout"])
    t0 = time.time()
    before = score(ctx, ctx["init"], a["em"])
    print(
        f"[per-step] before training: held-out loss {before['loss']:.4f}, EM {before['em']:.3f}", flush=True
    )
    theta, opt = clone(ctx["init"]), make_opt(ctx, a["lr"])
    rngs = [random.Random(replica_seed(a["seed"], r)) for r in range(a["replicas"])]
    curve, train_loss = [(0, before["loss"])], []
    for step in range(1, a["steps"] + 1):
        examples = [ex for rng in rngs for ex in draw(ctx, rng, a["batch"])]
        train_loss.append(inner_step(ctx, theta, opt, examples, a["clip"]))
        if step % a["eval_every"] == 0 and step < a["steps"]:
            curve.append((step, score(ctx, theta, 0)["loss"]))
            print(
                f"[per-step] step {step}: held-out loss {curve[-1][1]:.4f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    final = score(ctx, theta, a["em"])
    curve.append((a["steps"], final["loss"]))
    print(
        f"[per-step] done: held-out loss {final['loss']:.4f}, EM {final['em']:.3f} ({time.time() - t0:.0f}s)",
        flush=True,
    )
    return {
        "per-step": {**final, "curve": curve, "train_loss": train_loss, "seconds": time.time() - t0},
        "before": before,
        "numel": {n: t.numel() for n, t in ctx["init"].items()},
        "shapes": {n: list(t.shape) for n, t in ctx["init"].items()},
        "theta": None,
    }


def replica_seed(seed: int, r: int) -> int:
    return 1000 * seed + 100 + r


@torch.no_grad()
def outer_round(
    theta_g: dict, thetas: list[dict], errs: list[dict], outer: OuterNesterov, bits: int
) -> tuple[dict, dict]:
    """One outer round as node/dp/diloco.py takes it; (new theta_global, diagnostics)."""
    out, err_sq, ref_sq, res_sq = {}, 0.0, 0.0, 0.0
    for n, g in theta_g.items():
        deltas = [g - th[n] for th in thetas]
        mean = torch.stack(deltas).mean(0)
        if bits == 32:
            out[n] = mean
        else:
            sent = []
            for i, d in enumerate(deltas):
                s, _, errs[i][n] = outer_quant.with_feedback(d, errs[i].get(n, torch.zeros_like(d)), bits)
                sent.append(s)
                res_sq += float(errs[i][n].double().square().sum())
            out[n] = outer_quant.roundtrip(torch.stack(sent).mean(0), bits)
        err_sq += float((out[n] - mean).double().square().sum())
        ref_sq += float(mean.double().square().sum())
    new = outer.step(theta_g, out)
    for th in thetas:
        for n in th:
            th[n].copy_(new[n])
    return new, {
        "rel_err": math.sqrt(err_sq / ref_sq) if ref_sq else 0.0,  # ||out - mean delta|| / ||mean delta||
        "delta_norm": math.sqrt(ref_sq),
        "residual_norm": math.sqrt(res_sq / len(thetas)),  # error-feedback residual, rms over replicas
    }


def replica_steps(ctx: dict, thetas: list, opts: list, rngs: list, a: dict) -> float:
    """One inner step of every replica on its own next problems; their mean training loss."""
    losses = [
        inner_step(ctx, th, o, draw(ctx, g, a["batch"]), a["clip"]) for th, o, g in zip(thetas, opts, rngs)
    ]
    return sum(losses) / len(losses)


def snapshot(thetas: list[dict], opts: list, rngs: list) -> dict:
    return {
        "thetas": [clone(t) for t in thetas],
        "opts": [copy.deepcopy(o.state_dict()) for o in opts],
        "rngs": [r.getstate() for r in rngs],
    }


def restore(ctx: dict, snap: dict, lr: float) -> tuple[list, list, list]:
    thetas = [clone(t) for t in snap["thetas"]]
    opts = []
    for sd in snap["opts"]:
        o = make_opt(ctx, lr)
        o.load_state_dict(copy.deepcopy(sd))  # load_state_dict keeps the tensors it is given: copies
        opts.append(o)
    rngs = []
    for st in snap["rngs"]:
        r = random.Random()
        r.setstate(st)
        rngs.append(r)
    return thetas, opts, rngs


def run_diloco(a: dict, h: int, bits_list: list[int], keep_theta: bool = False) -> dict:
    """DiLoCo with R replicas, rounds every h steps, for each bits setting (branched after step h)."""
    ctx = context(a["seed"], a["heldout"])
    t0 = time.time()
    R, steps = a["replicas"], a["steps"]
    first = min(h, steps)
    thetas = [clone(ctx["init"]) for _ in range(R)]
    opts = [make_opt(ctx, a["lr"]) for _ in range(R)]
    rngs = [random.Random(replica_seed(a["seed"], r)) for r in range(R)]
    prefix_loss = []
    for _ in range(first):  # identical for every bits setting: once
        prefix_loss.append(replica_steps(ctx, thetas, opts, rngs, a))
    snap = snapshot(thetas, opts, rngs)
    print(f"[H={h}] shared first {first} steps done ({time.time() - t0:.0f}s)", flush=True)
    results = {}
    for bits in bits_list:
        tb = time.time()
        name = f"H={h} {bits}-bit"
        thetas, opts, rngs = restore(ctx, snap, a["lr"])
        theta_g = clone(ctx["init"])
        outer = OuterNesterov(lr=a["outer_lr"], momentum=a["outer_momentum"])
        errs: list[dict] = [{} for _ in range(R)]
        train_loss, rounds, curve = list(prefix_loss), [], []
        next_eval = a["eval_every"]
        for step in range(first, steps + 1):
            if step > first:
                train_loss.append(replica_steps(ctx, thetas, opts, rngs, a))
            if step % h and step != steps:
                continue
            spread = max(param_distance(thetas[0], th) for th in thetas)
            theta_g, diag = outer_round(theta_g, thetas, errs, outer, bits)
            span = step - (rounds[-1]["step"] if rounds else 0)
            rounds.append({"step": step, "span": span, "replica_spread": spread, **diag})
            line = (
                f"[{name}] step {step}/{steps} round {len(rounds)}: train loss "
                f"{sum(train_loss[-span:]) / span:.4f}, |mean delta| {diag['delta_norm']:.4f}, "
                f"sent error {diag['rel_err']:.4f}, replica spread {spread:.4f}"
            )
            if step >= next_eval and step < steps:
                curve.append((step, score(ctx, theta_g, 0)["loss"]))
                line += f", held-out loss {curve[-1][1]:.4f}"
                while next_eval <= step:
                    next_eval += a["eval_every"]
            print(f"{line} ({time.time() - t0:.0f}s)", flush=True)
        final = score(ctx, theta_g, a["em"])
        curve.append((steps, final["loss"]))
        print(
            f"[{name}] done: held-out loss {final['loss']:.4f}, EM {final.get('em', float('nan')):.3f} "
            f"({time.time() - tb:.0f}s this branch)",
            flush=True,
        )
        results[name] = {
            **final,
            "h": h,
            "bits": bits,
            "curve": curve,
            "train_loss": train_loss,
            "rounds": rounds,
            "seconds_branch": time.time() - tb,
        }
        if keep_theta:
            results[name]["theta"] = clone(theta_g)
    return results


def task(spec: tuple, a: dict) -> dict:
    return run_per_step(a) if spec[0] == "per-step" else run_diloco(a, spec[1], spec[2])


# ---------------------------------------------------------------------------------------- bytes


def allreduce_factor(k: int) -> float:
    return 2 * (k - 1) / k


def bytes_per_step(numel: dict[str, int], bits: int, h: int, k: int) -> float:
    """Per replica per inner step: 2(k-1)/k x the round's payload (per tensor, as sent), every h steps."""
    return allreduce_factor(k) * sum(outer_quant.wire_nbytes(n, bits) for n in numel.values()) / h


# ---------------------------------------------------------------------------------------- check


def check(a: dict) -> None:
    """A branch from the snapshot ends bit-identical to the same bits setting run from scratch."""
    small = {**a, "steps": 6, "em": 0, "eval_every": 10**9}
    t0 = time.time()
    branched = run_diloco(small, 2, [32, 8, 4], keep_theta=True)
    for bits in (8, 4):
        alone = run_diloco(small, 2, [bits], keep_theta=True)[f"H=2 {bits}-bit"]
        mine = branched[f"H=2 {bits}-bit"]
        same = all(torch.equal(alone["theta"][n], mine["theta"][n]) for n in alone["theta"])
        print(
            f"check {bits}-bit: branched from the step-2 snapshot (after the 32-bit branch) vs from scratch: "
            f"{'bit-identical' if same else 'DIFFERENT'}; "
            f"held-out loss {mine['loss']:.6f} vs {alone['loss']:.6f}",
            flush=True,
        )
        if not same:
            sys.exit(1)
    print(f"check passed ({time.time() - t0:.0f}s)")


# ---------------------------------------------------------------------------------------- report


def command_line(a: argparse.Namespace) -> str:
    parts = ["python -m bench.dp.outer_bits"]
    for k in (
        "replicas",
        "batch",
        "steps",
        "h",
        "bits",
        "outer_lr",
        "outer_momentum",
        "workers",
        "seed",
        "out",
        "tag",
    ):
        v = getattr(a, k)
        if k == "tag" and not v:
            continue
        parts.append(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(parts)


def fmt_bytes(x: float) -> str:
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def write_report(a: argparse.Namespace, res: dict, per: dict, out: Path, wall: float) -> str:
    k, base = a.replicas, res["per-step"]
    stem = "outer_bits" + (f"_{a.tag}" if a.tag else "")
    numel = per["numel"]
    n = sum(numel.values())
    base_bytes = allreduce_factor(k) * 4 * n
    rows = [
        {
            "config": "per-step averaging (fp32 gradients)",
            "loss": base["loss"],
            "em": base["em"],
            "bytes": base_bytes,
        }
    ]
    for name, r in res.items():
        if name == "per-step":
            continue
        rows.append(
            {
                "config": f"DiLoCo {name}",
                "loss": r["loss"],
                "em": r["em"],
                "bytes": bytes_per_step(numel, r["bits"], r["h"], k),
                "run_bytes": allreduce_factor(k)
                * len(r["rounds"])
                * sum(outer_quant.wire_nbytes(v, r["bits"]) for v in numel.values())
                / a.steps,
            }
        )
    for row in rows:
        row["loss_ratio"] = row["loss"] / base["loss"]
        row["bytes_ratio"] = base_bytes / row["bytes"]
        row["within"] = row["loss_ratio"] <= 1 + WITHIN
    ok = [r for r in rows[1:] if r["within"]]
    best = min(ok, key=lambda r: r["bytes"]) if ok else None

    lines = [
        "| config | held-out loss | / per-step's | EM | bytes per inner step per replica | "
        "fewer bytes than per-step | within 2% |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['loss']:.4f} | {r['loss_ratio']:.3f} | {r['em']:.3f} | "
            f"{fmt_bytes(r['bytes'])} | {r['bytes_ratio']:,.1f}x | {'yes' if r['within'] else 'no'} |"
        )
    table = "\n".join(lines)
    answer = (
        f"**{best['config']}: {fmt_bytes(best['bytes'])} per inner step per replica, "
        f"{best['bytes_ratio']:,.0f}x fewer than per-step averaging's {fmt_bytes(base_bytes)}** "
        f"(held-out loss {best['loss']:.4f}, {best['loss_ratio']:.3f}x per-step's)."
        if best
        else "**None**: no DiLoCo setting came within 2% of per-step averaging's held-out loss."
    )
    n_t = len(numel)
    n_ps = sum(compressible(s, 16) for s in per["shapes"].values())
    partial = [h for h in a.h if a.steps % h]
    curves = sorted({r["h"] for r in res.values() if "h" in r})
    rounds_note = ", ".join(
        f"H={h}: {len(next(r for r in res.values() if r.get('h') == h)['rounds'])}" for h in curves
    )
    round_diag = []
    for name, r in res.items():
        if name == "per-step" or r["bits"] == 32:
            continue
        errs = [x["rel_err"] for x in r["rounds"]]
        round_diag.append(f"{name} {min(errs):.3f}-{max(errs):.3f}")
    md = f"""# Outer-round bits: 32, 8 and 4-bit DiLoCo deltas against per-step averaging (issue 50)

Date: {DATE}. Command: `{command_line(a)}` ({wall / 60:.0f} min wall on 2 shared CPU cores,
{a.workers} worker processes of one thread each, beside another engineer's network bench).

## Setup

* Model: the bundled SmolLM2-135M-Instruct, fp32 on the CPU, with LoRA adapters as a node makes them
  (`node.model.adapters.add_adapters`, `FinetuneSettings` defaults: rank 16, alpha 32, dropout 0, every
  projection q/k/v/o/gate/up/down): {n_t} adapter tensors, **n = {n:,} parameters**, the only ones
  trained and averaged.
* Task: the demo's arithmetic (2-digit addition). {a.heldout} held-out problems (`split_heldout`, seed
  {a.seed}; every copy of them removed from the training data): held-out loss over all {a.heldout}, exact
  match (greedy) over the first {a.em}.
* Inner optimizer: AdamW lr {a.lr} (the demo's), weight decay 0, gradient clip {a.clip} (the run
  record's defaults), batch b = {a.batch} problems per replica per step, {a.steps} inner steps.
* DiLoCo: R = {a.replicas} replicas in one group, each with its own data stream (its own RNG seed) and
  its own AdamW state kept across rounds. Every H steps an outer round: per tensor
  delta_i = theta_global - theta_i; 32 bits: the mean; 8/4 bits: each replica sends
  `outer_quant.with_feedback(delta_i, e_i, bits)` (blocks of {outer_quant.BLOCK}, bf16 scales, its own
  error-feedback residual per tensor, kept across rounds), and the mean of what was sent is
  quantised again (`outer_quant.roundtrip`) as the reducer returns it. Then
  `OuterNesterov({a.outer_lr}, {a.outer_momentum})`
  and every replica takes theta_global. theta_global is what is scored, after the last round.
  Rounds: {rounds_note}.{
        f" {a.steps} is not a multiple of H={', '.join(map(str, partial))}: that run ends with one shorter"
        " round at the last step (its bytes in the table are the steady rate, one payload every H steps;"
        " the JSON's `run_bytes` counts the extra round)."
        if partial
        else ""
    }
* No PowerSGD: a LoRA matrix is 16 x d or d x 16, and PowerSGD at the default rank 16 compresses
  a matrix only when 2 x rank < min(m, n) (`compression.powersgd.compressible`): {n_ps} of {n_t}
  adapter tensors qualify, so an outer round carries every adapter densely (at 32, 8 or 4 bits).
* Per-step averaging (the baseline): one model trained on all R x b problems of each step together
  (the same problems the replicas see, the mean loss over them): data-parallel training with the
  gradient averaged every step, at equal tokens and steps.
* Bytes, per replica per inner step: an all-reduce in a group of k = {k} moves 2(k-1)/k x the payload
  per peer ({allreduce_factor(k):.2f}x here). Per-step averaging: fp32 gradients, 2(k-1)/k x 4n =
  {fmt_bytes(base_bytes)} every step. DiLoCo: 2(k-1)/k x `outer_quant.wire_nbytes` (4n at 32 bits;
  n + 2 n/64 at 8; n/2 + 2 n/64 at 4) once every H steps.

## Results

Before training: held-out loss {per["before"]["loss"]:.4f}, EM {per["before"]["em"]:.3f}.

{table}

Smallest bytes per inner step within 2% of per-step averaging's held-out loss: {answer}

Sent-average error per round, ||what the round applied - mean delta|| / ||mean delta||
(min-max over rounds; 32 bits: 0): {"; ".join(round_diag) if round_diag else "-"}.

![held-out loss against bytes, and curves]({stem}.png)

Left: final held-out loss against bytes per inner step per replica (log x); the dashed line is per-step
averaging's loss + 2%. Right: held-out loss of theta_global (per-step: of the model) along the run,
scored at the first outer round at or after every {a.eval_every} steps.

## What this does not show

* One seed, one data order, {a.heldout} held-out problems: no spread across seeds is measured, so
  a difference between two rows may be one that another seed moves. "Within 2%" is one run's
  answer, not a confidence interval.
* {a.replicas} replicas only, one group, no failures, no stragglers, no joiners; a simulation in one
  process, not the node's wire (no timing, no encode/decode on a socket: the bytes are counted with
  `wire_nbytes`).
* {a.steps} steps is short: with H={max(a.h)} there are {math.ceil(a.steps / max(a.h))} outer rounds,
  which say little about a long run, and error feedback's residual has few rounds to build up.
* Only the adapters move (LoRA rank 16): full fine-tuning or pretraining deltas, where PowerSGD
  compresses most tensors and its factors would be quantised too, are not measured here.
"""
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(
        json.dumps(
            {
                "date": DATE,
                "args": vars(a),
                "command": command_line(a),
                "wall_s": wall,
                "adapter_params": n,
                "adapter_tensors": n_t,
                "powersgd_rank16_compressible_tensors": n_ps,
                "before": per["before"],
                "table": rows,
                "smallest_within_2pct": best,
                "runs": res,
            },
            indent=1,
        )
    )
    plot(res, rows, base, numel, out / f"{stem}.png", a)
    return table + "\n\nsmallest within 2%: " + answer


def plot(res: dict, rows: list[dict], base: dict, numel: dict, path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    colors = {32: "tab:blue", 8: "tab:orange", 4: "tab:green"}
    markers = {10: "o", 30: "s", 100: "^"}
    ax.scatter([rows[0]["bytes"]], [rows[0]["loss"]], c="black", marker="*", s=120, label="per-step fp32")
    for name, r in res.items():
        if name == "per-step":
            continue
        x = bytes_per_step(numel, r["bits"], r["h"], a.replicas)
        ax.scatter([x], [r["loss"]], c=colors.get(r["bits"], "grey"), marker=markers.get(r["h"], "D"), s=50)
        ax.annotate(name, (x, r["loss"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(base["loss"] * (1 + WITHIN), ls="--", c="grey", lw=1, label="per-step + 2%")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per inner step per replica (log)")
    ax.set_ylabel("final held-out loss")
    ax.set_title(f"{a.replicas} replicas, LoRA r16, {a.steps} steps; colour = bits, marker = H", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    styles = {32: "-", 8: "--", 4: ":"}
    for name, r in res.items():
        xs, ys = zip(*r["curve"])
        if name == "per-step":
            bx.plot(xs, ys, c="black", lw=2, label="per-step")
        else:
            c = {10: "tab:red", 30: "tab:purple", 100: "tab:cyan"}.get(r["h"], "grey")
            bx.plot(xs, ys, c=c, ls=styles.get(r["bits"], "-"), marker=".", label=name)
    bx.set_yscale("log")
    bx.set_xlabel(f"inner step (replicas: batch {a.batch}; per-step: {a.batch * a.replicas})")
    bx.set_ylabel("held-out loss (log)")
    bx.legend(fontsize=6, ncol=2)
    bx.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="problems per replica per inner step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--h", type=int, nargs="+", default=[10, 30, 100])
    ap.add_argument("--bits", type=int, nargs="+", default=[32, 8, 4])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--heldout", type=int, default=64, help="held-out problems (loss over all)")
    ap.add_argument("--em", type=int, default=40, help="of them, scored for exact match")
    ap.add_argument("--eval-every", type=int, default=50, help="held-out loss along the run, every N steps")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="OuterNesterov lr (the node's default)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="OuterNesterov momentum (the node's)")
    ap.add_argument("--tag", default="", help="write outer_bits_TAG.* instead of outer_bits.*")
    ap.add_argument("--workers", type=int, default=2, help="processes (one thread each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--check", action="store_true", help="only check branching against runs from scratch")
    a = ap.parse_args()
    if a.replicas < 2:
        ap.error("--replicas must be at least 2 (one replica averages with nobody)")
    for b in a.bits:
        outer_quant.check_bits(b)
    d = vars(a)
    if a.check:
        check(d)
        return
    t0 = time.time()
    # a shared prefix worth a serial task: H at least 10% of the run; shorter ones run one task per bits
    # setting, in parallel (their few shared steps are run again)
    tasks: list[tuple] = []
    for h in sorted(a.h, reverse=True):
        if a.workers > 1 and h < 0.1 * a.steps:
            tasks += [("diloco", h, (b,)) for b in a.bits]
        else:
            tasks.append(("diloco", h, tuple(a.bits)))
    tasks.append(("per-step",))

    def cost(t: tuple) -> float:  # in replica-steps of batch b; a per-step step of R x b costs ~0.8 R of them
        if t[0] == "per-step":
            return 0.8 * a.steps * a.replicas
        first = min(t[1], a.steps)
        return (first + (a.steps - first) * len(t[2])) * a.replicas

    tasks.sort(key=cost, reverse=True)  # longest first
    print(f"{len(tasks)} tasks on {a.workers} workers: {tasks}", flush=True)
    if a.workers > 1:
        with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
            outs = list(pool.map(task, tasks, [d] * len(tasks)))
    else:
        outs = [task(t, d) for t in tasks]
    res, per = {}, None
    for t, o in zip(tasks, outs):
        if t[0] == "per-step":
            per = o
            res["per-step"] = o["per-step"]
    for h in a.h:
        for b in a.bits:
            for t, o in zip(tasks, outs):
                if t[0] == "diloco" and f"H={h} {b}-bit" in o:
                    res[f"H={h} {b}-bit"] = o[f"H={h} {b}-bit"]
    assert per is not None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(write_report(a, res, per, out, time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
