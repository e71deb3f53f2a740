"""Quality benchmark for pipeline-link codecs and schedules (issues 3 and 9, DESIGN.md §6-7).

(Over 400 lines: one run is trained, scored and written up field by field in one function,
so the links.json format reads off one place.)

Fine-tunes a model (``bench.quality.quality_tasks.Setup``; the bench's is the bundled SmolLM2-135M-
Instruct in a 4-stage split) inside ONE process, through the node's own parts
(``bench.quality.quality_pipeline``): the stages are ``node.model.stages.build_stage``'s, every boundary's
frames are built, serialised, checked and decoded by the two stages' ``node.stage.linkio.LinkIO``
with the codec ``node.stage.links.Link`` chooses for the step, and held-out loss and exact match
are ``node.model.evaluate``'s ``eval_loss`` and ``exact_match`` (greedy decoding stopped at EOS).

What stays different from a swarm, and why. One process has no p2pd, no peers and no second
copy of a boundary's state: the frame crosses as bytes in memory, the sender's and the
receiver's links share one codec instance (a basis is installed once, not published and
fetched), and the hop is ``compression.codec.apply_link``, an autograd function, so the
gradient reaches the upstream stages by backpropagation instead of a stage's own backward
pass on a received frame. One optimizer over the whole model, with a global grad-norm clip
(the swarm clips per stage, the tied tensor by its own norm) and the tied embedding/lm_head
as one shared parameter (``node.dp.tied`` sums the two copies' gradients across processes).
Warm-up/cool-down dense steps, anchor priors and the diagnostic codecs are the bench's own
(dense-every-K is the node's); generation for the codec-on numbers recomputes the whole
sequence each token (no KV cache), so the link sees every position as in training.

Setup (DESIGN.md §6): batch 16, AdamW lr 1e-4 (weight decay 0, the node's default), global
grad-norm clip 1.0, loss on the answer only; exact match on held-out problems, evaluated
twice: through the codec and dense (the stages, no link); eval loss dense.

One entry per run is appended to ``<out>/links.json`` as soon as the run ends, so a killed
job loses at most the run in progress; runs already present (same variant, task, seed,
steps, eval size) are skipped unless ``--force``.

    python -m bench.quality.quality --variants dense,m95,pca58i8 --task arithmetic --seeds 0 --steps 100

Variants are ``codec+schedule`` names (``--list`` prints them). Anchor priors (``+ap``)
simulate the anchor replica in-process: a dense copy of the model whose weights are a
snapshot refreshed every S = 20 steps computes, every ``anchor_every`` steps, a dense
gradient on its own fresh batch; the targeted matrices' gradients go to
``SpectralFilter.observe`` tagged with the snapshot's step; ``filter_gradients`` runs before
clipping (DESIGN.md 4.2 order).
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.quality.quality_codecs import Metered, build_codec, calibrated, published_bytes, step_wire_bytes
from bench.quality.quality_pipeline import (
    EVAL_STEP_BASE,
    Hops,
    Pipeline,
    calibrate,
    run_record,
    schedule_dense,
    score,
)
from bench.quality.quality_tasks import (
    BUNDLED,
    CLIP,
    LR,
    TASKS,
    VARIANTS,
    Setup,
    Variant,
    held_out,
    step_frames,
    task_stream,
)
from compression.spectral import SpectralFilter, filter_gradients, is_target_matrix
from node.model.adapters import add_adapters
from node.model.data import ByteTokenizer, Example, collate, tokenize
from node.model.loading import load_model
from protocol.frames import pack_labels
from protocol.settings import FinetuneSettings


@dataclass
class Trial:
    """One run: its results-file record, and what it was scored on (tests check these)."""

    record: dict
    model: torch.nn.Module
    pipe: Pipeline
    tok: object
    evals: list[Example]


class Anchor:
    """The anchor replica in-process: a dense copy refreshed every S steps, a packet every ``every``."""

    def __init__(self, variant: Variant, model, setup: Setup, run, vocab: int, task: str, seed: int):
        a = self.settings = variant.anchor
        self.filt = SpectralFilter(
            alpha=a["alpha"], tau=a["tau"], beta=a["beta"], tau_relative=a["tau_relative"], rank=a.get("rank")
        )
        self.model = copy.deepcopy(model)
        self.pipe = Pipeline(self.model, setup.ranges)
        self.hops = Hops(run, vocab, dense_only=True)  # the anchor circuit is dense (node.stage.links)
        self.stream = task_stream(task, seed + 1_000_003)
        self.setup = setup
        self.seconds, self.filter_s, self.packets, self.bytes, self.snapshot_step = 0.0, 0.0, 0, 0, 0

    def step(self, step: int, model, tok, pad: int) -> float:
        """Fold this step's packet (if one arrives) into the filter and filter ``model``'s gradients;
        returns the seconds the anchor's own compute took (it runs on another machine)."""
        a, excluded = self.settings, 0.0
        if step % a["S"] == 0:  # anchor pulls fresh weights from the fast replica
            self.model.load_state_dict(model.state_dict())
            self.snapshot_step = step
        if step % a["every"] == 0:  # a packet arrives: the anchor's dense gradient on fresh data
            ta = time.perf_counter()
            batch = [next(self.stream) for _ in range(self.setup.batch)]
            ids, labels = collate([tokenize(tok, e, self.setup.seq_len) for e in batch], pad)
            self.model.zero_grad(set_to_none=True)
            self.pipe.loss(ids, labels, self.hops(step, 0, labels)).backward()
            grads = {  # no copy: observe() folds each into its own fp32 EMA state
                n: p.grad.detach()
                for n, p in self.model.named_parameters()
                if p.grad is not None and is_target_matrix(n, p)
            }
            excluded = time.perf_counter() - ta
            self.seconds += excluded
            self.packets += 1
            self.bytes += sum(g.numel() * 2 for g in grads.values())  # bf16 full matrices
            tf = time.perf_counter()
            for n, g in grads.items():
                self.filt.observe(n, g, source_step=self.snapshot_step, current_step=step)
            self.filter_s += time.perf_counter() - tf
            del grads
            self.model.zero_grad(set_to_none=True)  # frees the anchor's gradients between packets
        tf = time.perf_counter()
        filter_gradients(self.filt, model.named_parameters())
        self.filter_s += time.perf_counter() - tf
        return excluded


def run(
    variant: Variant,
    task: str,
    seed: int,
    steps: int,
    n_eval: int,
    log_every: int = 10,
    check_greedy: int = 0,
    frame_tokens: int = 0,
    setup: Setup = BUNDLED,
    codec_eval: bool = True,
) -> dict:
    """One run's record for ``links.json`` (``trial`` keeps the trained model too)."""
    return trial(
        variant, task, seed, steps, n_eval, log_every, check_greedy, frame_tokens, setup, codec_eval
    ).record


def trial(
    variant: Variant,
    task: str,
    seed: int,
    steps: int,
    n_eval: int,
    log_every: int = 10,
    check_greedy: int = 0,
    frame_tokens: int = 0,
    setup: Setup = BUNDLED,
    codec_eval: bool = True,
) -> Trial:
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    model, tok, _ = load_model(setup.model)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    tok = tok or ByteTokenizer(vocab)  # as node.model.evaluate scores a model without one
    dense_bpt = 2 * hidden  # dense bf16 wire per token per boundary per direction
    model.train()
    pad = tok.eos_token_id
    pipe = Pipeline(model, setup.ranges)
    finetune = FinetuneSettings(mode=variant.finetune)
    adapters = 0
    if finetune.mode == "lora":  # each stage its own seeded adapters, the base frozen, as a node does
        adapters = sum(add_adapters(st, finetune, seed) for st in pipe.stages)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=variant.lr or LR, weight_decay=0.0, fused=True)
    sized = dict(batch=setup.batch, seq_len=setup.seq_len)

    stream = task_stream(task, seed)
    frames = step_frames(stream, tok, steps, frame_tokens, **sized)
    train = [e for f in frames for e in f]
    calib_stream = task_stream(task, seed + 7_000_003)
    calib = [next(calib_stream) for _ in range(setup.calib_examples)]
    evals = held_out(task, n_eval, {e.prompt for e in train})
    curve_eval = evals[:32]

    boundaries = len(setup.ranges) - 1
    codecs = [Metered(build_codec(variant)) for _ in range(boundaries)]
    run = run_record(setup, hidden, seed, codecs[0].describe(), variant.dense_every, frame_tokens)
    hops = Hops(run, vocab, codecs, dense_at=schedule_dense(variant, steps))
    dense_links = [link.dense for link in hops.links if link.dense is not link.main]
    is_pca = calibrated(codecs[0].inner)  # PCA bases and outlier channel sets alike
    calib_s, basis_version = 0.0, 0
    if is_pca and variant.warmup == 0:
        calib_s = calibrate(pipe, codecs, calib, tok, pad, basis_version, **sized)
    anchor = Anchor(variant, model, setup, run, vocab, task, seed) if variant.anchor else None

    train_curve, eval_curve, step_times = [], [], []
    wire_tokens, wire_bytes, label_bytes = 0, 0.0, 0
    mode_counts = {"codec": 0, "dense": 0}
    for step in range(steps):
        t0 = time.perf_counter()
        if is_pca and variant.warmup and step == variant.warmup:
            calib_s = calibrate(pipe, codecs, calib, tok, pad, basis_version, **sized)
        if is_pca and variant.refresh and step > variant.warmup and step % variant.refresh == 0:
            # the sender refits from the current weights; a new version is published and paid again
            basis_version += 1
            calib_s += calibrate(pipe, codecs, calib, tok, pad, basis_version, **sized)
        dense_now = hops.is_dense(step)  # the node's choice, with the bench's warm-up/cool-down
        mode_counts["dense" if dense_now else "codec"] += 1
        ids, labels = collate([tokenize(tok, e, setup.seq_len) for e in frames[step]], pad)
        loss = pipe.loss(ids, labels, hops(step, 0, labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        n_tok = ids.numel()
        wire_tokens += n_tok
        wire_bytes += step_wire_bytes(codecs[0].inner, n_tok, dense_now, hidden, ids.shape[0])
        # forward frames also carry the labels, in the node's wire layout (protocol.frames)
        label_bytes += sum(t.numel() * t.element_size() for t in pack_labels(labels, vocab).values())
        if anchor is not None and not dense_now:
            t0 += anchor.step(step, model, tok, pad)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        step_times.append(time.perf_counter() - t0)
        train_curve.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step == steps - 1:
            model.eval()
            el, _ = score(pipe, curve_eval, tok, em=False, **sized)
            model.train()
            eval_curve.append([step + 1, el])
            print(
                f"[{variant.name} {task} s{seed}] step {step + 1}/{steps} train {float(loss.detach()):.3f} "
                f"eval(dense,32) {el:.3f} {sum(step_times) / len(step_times):.2f}s/step",
                flush=True,
            )

    # ---- evaluation: node.model.evaluate on the stages, without and with the links
    codec_s = sum(c.seconds for c in codecs) + sum(c.seconds for c in dense_links)  # training's share
    model.eval()
    t_eval = time.perf_counter()
    hops.counting = False
    for c in codecs + dense_links:
        c.counting = False
    link_stats = [c.inner.stats() for c in codecs] if hasattr(codecs[0].inner, "stats") else None
    if is_pca and codecs[0].inner.version is None:  # steps <= warmup: never switched
        calibrate(pipe, codecs, calib, tok, pad, basis_version, **sized)

    def eval_links(n: int):  # the n-th evaluation call's frames: mask seeds never seen in training
        return hops(EVAL_STEP_BASE, microbatch=n)

    el_dense, em_dense = score(pipe, evals, tok, **sized)
    # through the link: generation recomputes every position per token (no KV cache), the larger
    # share of a run's evaluation; a comparison that reads only the dense-run weights skips it
    el_codec, em_codec = None, None
    if codec_eval:
        el_codec, em_codec = score(pipe, evals, tok, links_for=eval_links, **sized)
    greedy = None
    if check_greedy:  # kept for old command lines: exact match is greedy decoding already
        _, em_gc = score(pipe, evals[:check_greedy], tok, links_for=eval_links, **sized)
        greedy = {"em_dense_greedy": em_dense, "n_codec": check_greedy, "em_codec_greedy": em_gc}
        greedy["em_codec_forced"] = None  # the teacher-forced check this replaced
    eval_s = time.perf_counter() - t_eval

    # ---- accounting
    train_s = sum(step_times)
    payload_bpt = wire_bytes / wire_tokens if wire_tokens else codecs[0].bytes_per_token(hidden)
    meters = codecs + dense_links
    counted = {
        d: sum(c.bytes[d] for c in meters) / max(sum(c.tokens[d] for c in meters), 1) for d in ("fwd", "bwd")
    }
    framed = {d: hops.frame_bytes[d] / max(hops.frame_tokens[d], 1) for d in ("fwd", "bwd")}
    if getattr(codecs[0].inner, "entropy", False) or getattr(codecs[0].inner, "repeats", False):
        # lossless stages: frame_bytes is their upper bound, the payloads counted on the wire are exact
        payload_bpt = (counted["fwd"] + counted["bwd"]) / 2
    basis_bytes = published_bytes(codecs[0].inner, hidden) * (basis_version + 1)
    basis_bpt = basis_bytes / max(wire_tokens, 1)
    link_basis = None
    if link_stats is not None:
        # a link-held basis: its updates and first full basis travel inside the frames, so the
        # payload is what was counted on the wire; the basis share is shown separately
        payload_bpt = (counted["fwd"] + counted["bwd"]) / 2
        upd = sum(st[d]["update_bytes"] for st in link_stats for d in st)
        full = sum(st[d]["full_bytes"] for st in link_stats for d in st)
        n_links = 2 * len(link_stats)  # boundaries x directions
        link_basis = {
            "update_bytes_per_token": upd / n_links / max(wire_tokens, 1),
            "full_basis_bytes_per_token": full / n_links / max(wire_tokens, 1),
            "full_basis_bytes_per_link": full / n_links,
            "per_boundary": link_stats,
        }
    rec = {
        "variant": variant.name,
        "codec": variant.codec,
        "codec_settings": codecs[0].describe(),
        "schedule": variant.schedule,
        "task": task,
        "seed": seed,
        "steps": steps,
        "batch": setup.batch,
        "eval_problems": n_eval,
        "em": em_dense,
        "em_user_gets": "dense (the trained weights run whole, without the codec)",
        "em_dense_eval": em_dense,
        "em_codec_eval": em_codec,
        "eval_loss": el_dense,
        "eval_loss_codec": el_codec,
        "bytes_per_token": payload_bpt + basis_bpt,
        "payload_bytes_per_token": payload_bpt,
        # forward only (the backward carries none); not in bytes_per_token, which is the payload's
        "label_bytes_per_token": label_bytes / max(wire_tokens, 1),
        "counted_bytes_per_token": counted,
        # whole frames as the node serialises them (header, payload, labels), per direction
        "frame_bytes_per_token": framed,
        "basis_bytes": basis_bytes,
        "basis_bytes_per_token": basis_bpt,
        "link_basis": link_basis,
        "frame_tokens": frame_tokens,
        "tokens_per_frame": wire_tokens / max(steps, 1),
        "dense_bytes_per_token": dense_bpt,
        "compression_vs_dense": dense_bpt / (payload_bpt + basis_bpt),
        "steps_codec": mode_counts["codec"],
        "steps_dense": mode_counts["dense"],
        "tokens_trained": wire_tokens,
        "codec_time_frac": codec_s / train_s if train_s else 0.0,
        "filter_time_frac": anchor.filter_s / train_s if anchor and train_s else 0.0,
        "step_time_s": train_s / steps if steps else 0.0,
        "calibration_s": calib_s,
        "anchor": None,
        "train_loss_curve": train_curve,
        "eval_loss_curve": eval_curve,
        "eval_s": eval_s,
        "wall_s": time.perf_counter() - t_start,
        "finetune": finetune.mode,
        "lr": variant.lr or LR,
        "trained_params": sum(p.numel() for p in params),
        "adapter_modules": adapters,
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        "em_method": "greedy decoding stopped at EOS (node.model.evaluate.exact_match)",
        "greedy_check": greedy,
    }
    if setup != BUNDLED:
        rec["model"] = setup.model
    if anchor:
        rec["anchor"] = {
            "settings": dict(variant.anchor) | {"max_staleness": anchor.filt.max_staleness},
            "packets": anchor.packets,
            "transport": "full bf16 matrices of all 2-D decoder projections, per packet (sum over 4 stages)",
            "bytes_per_packet": anchor.bytes // max(anchor.packets, 1),
            "anchor_compute_s": anchor.seconds,
        }
        rec["anchor_bytes_per_token"] = anchor.bytes / max(wire_tokens, 1)
    if steps == 0:
        rec["variant"] = "untrained"
    return Trial(rec, model, pipe, tok, evals)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


# ------------------------------------------------------------------------------------------
# Results file
# ------------------------------------------------------------------------------------------


def load_results(path: Path) -> list[dict]:
    if path.exists():
        return json.loads(path.read_text())
    return []


def append_result(path: Path, rec: dict) -> None:
    """Read-modify-write under an exclusive lock, so parallel workers never lose an entry."""
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"bench-quality-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = [r for r in load_results(path) if _key(r) != _key(rec)]
        data.append(rec)
        tmp = path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def _key(r: dict) -> tuple:
    return (r["variant"], r["task"], r["seed"], r["steps"], r["eval_problems"], r.get("frame_tokens", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="dense,m95", help="comma-separated variant names (see --list)")
    ap.add_argument("--task", default="arithmetic", help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (data order + mask seed)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval", type=int, default=100, help="held-out problems for exact match")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--frame-tokens",
        type=int,
        default=0,
        help="one frame of ~T padded tokens per step, packed as the node packs microbatches (0: 16 examples)",
    )
    ap.add_argument(
        "--check-greedy", type=int, default=0, help="also run real greedy generation (N codec-on)"
    )
    ap.add_argument(
        "--codec-eval",
        choices=("on", "off"),
        default="on",
        help="also score the trained weights through the link (off: dense-run weights only, faster)",
    )
    ap.add_argument("--force", action="store_true", help="rerun runs already in links.json")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for v in VARIANTS.values():
            print(f"{v.name:22s} codec={v.codec} {v.settings} schedule={v.schedule}")
        return 0
    if args.frame_tokens < 0:
        print(
            f"--frame-tokens must be >= 0 (0: 16 examples per step), got {args.frame_tokens}", file=sys.stderr
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "links.json"
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    for task in args.task.split(","):
        if task not in TASKS:
            print(f"unknown task {task!r}; known: {', '.join(TASKS)}", file=sys.stderr)
            return 2
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name in names:
                key = (
                    "untrained" if args.steps == 0 else name,
                    task,
                    seed,
                    args.steps,
                    args.eval,
                    args.frame_tokens,
                )
                if not args.force and any(_key(r) == key for r in load_results(path)):
                    print(f"skip {key}: already in {path}", flush=True)
                    continue
                rec = run(
                    VARIANTS[name],
                    task,
                    seed,
                    args.steps,
                    args.eval,
                    check_greedy=args.check_greedy,
                    frame_tokens=args.frame_tokens,
                    codec_eval=args.codec_eval == "on",
                )
                append_result(path, rec)
                em_codec = rec["em_codec_eval"]
                print(
                    f"DONE {rec['variant']} {task} seed {seed}: EM dense {rec['em_dense_eval']:.3f} "
                    f"codec {'-' if em_codec is None else format(em_codec, '.3f')} "
                    f"eval loss {rec['eval_loss']:.3f} "
                    f"B/token {rec['bytes_per_token']:.1f} ({rec['compression_vs_dense']:.1f}x) "
                    f"codec {100 * rec['codec_time_frac']:.1f}% filter {100 * rec['filter_time_frac']:.1f}% "
                    f"wall {rec['wall_s']:.0f}s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
