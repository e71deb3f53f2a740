"""Quality benchmark for pipeline-link codecs and schedules (issues 3 and 9, DESIGN.md §6-7).

Fine-tunes the bundled SmolLM2-135M-Instruct through a 4-stage split (layer ranges
[[0,8],[8,16],[16,23],[23,30]], i.e. boundaries after layers 7, 15 and 22) inside ONE
process. At each boundary the activations pass through ``compression.codec.apply_link``
with the configured codec: the same encode/decode, forward and backward, that a two-process
hop computes. Mask seeds come from ``compression.prf.mask_seed(run_seed, step, microbatch,
boundary)`` as in the frame header.

Setup (DESIGN.md §6): batch 16, AdamW lr 1e-4 (weight decay 0, the node's default), global
grad-norm clip 1.0, loss on the answer only; greedy exact match on held-out problems,
evaluated twice: through the codec and dense (whole model, no link); eval loss dense.

One entry per run is appended to ``<out>/links.json`` as soon as the run ends, so a killed
job loses at most the run in progress; runs already present (same variant, task, seed,
steps, eval size) are skipped unless ``--force``.

    python -m bench.quality --variants dense,m95,pca58i8 --task arithmetic --seeds 0 --steps 100

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
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from compression.codec import DenseCodec, LinkCodec, LinkContext, Payload, apply_link, payload_nbytes
from compression.lowrank import LowRankCodec
from compression.mask import is_dense_step
from compression.outlier import OutlierMaskCodec, fit_outlier_channels
from compression.pca import PcaCodec, fit_basis, fit_joint_basis
from compression.prf import mask_seed
from compression.registry import make_codec
from compression.spectral import SpectralFilter, filter_gradients, is_target_matrix
from compression.tiered import TieredCodec, fit_rotation
from node.model.data import Example, arithmetic_example, collate, frame_full, ordering_example, tokenize
from node.model.loading import load_model
from node.model.stages import IGNORE_INDEX, Stage, build_stage
from node.stage.links import loss_rows
from protocol.frames import pack_labels

RANGES = [[0, 8], [8, 16], [16, 23], [23, 30]]
HIDDEN = 576
VOCAB = 49152  # SmolLM2's vocabulary: labels travel in 2 bytes
DENSE_BPT = 2 * HIDDEN  # dense bf16 wire: 1152 B per token per boundary per direction
BATCH = 16
LR = 1e-4
CLIP = 1.0
SEQ_LEN = 96
EVAL_STEP_BASE = 1 << 40  # mask seeds used by codec-on evaluation never collide with training
CALIB_EXAMPLES = 128  # PCA calibration: 8 batches of the task's examples through the dense model

# ------------------------------------------------------------------------------------------
# Tasks: deterministic generators, nothing downloaded
# ------------------------------------------------------------------------------------------

_NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Nora", "Max", "Ella"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "shells", "marbles", "stamps", "eggs", "toys"]
_ADD = ["buys {b} more", "finds {b} more", "gets {b} more", "is given {b} more"]
_SUB = ["gives away {b}", "loses {b}", "sells {b}", "uses {b}"]


def word_example(rng: random.Random) -> Example:
    """One-step word problem: add or subtract, chosen by the verb; 2-digit numbers, answer >= 1."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        verb, ans = rng.choice(_ADD).format(b=b), a + b
    else:
        a = rng.randint(20, 99)
        b = rng.randint(10, a - 1)
        verb, ans = rng.choice(_SUB).format(b=b), a - b
    prompt = f"Q: {name} has {a} {item} and {verb}. How many {item} now?\nA:"
    return Example(prompt=prompt, completion=f" {ans}")


TASKS = {"arithmetic": arithmetic_example, "word": word_example, "ordering": ordering_example}


def task_stream(task: str, seed: int):
    rng = random.Random(seed)
    gen = TASKS[task]
    while True:
        yield gen(rng)


def held_out(task: str, n: int, exclude: set[str]) -> list[Example]:
    """n distinct problems from a separate stream, none of them seen in training."""
    out, seen = [], set(exclude)
    for ex in task_stream(task, 987_654_321):
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
            if len(out) == n:
                return out
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------
# Variants: codec + schedule
# ------------------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    codec: str  # registry name
    settings: dict = field(default_factory=dict)
    dense_every: int = 0  # is_dense_step(step, dense_every): a dense bf16 step
    warmup: int = 0  # first `warmup` steps dense, then the codec (PCA calibrated at the switch)
    cooldown: int = 0  # last `cooldown` steps dense
    refresh: int = 0  # basis codecs: refit and republish the basis every `refresh` steps
    lr: float = 0.0  # AdamW learning rate; 0: the bench's LR
    anchor: dict | None = None  # anchor priors: SpectralFilter settings + schedule
    note: str = ""

    @property
    def schedule(self) -> str:
        parts = []
        if self.dense_every:
            parts.append(f"dense-every-{self.dense_every}")
        if self.warmup:
            parts.append(f"dense-warmup-{self.warmup}")
        if self.cooldown:
            parts.append(f"dense-cooldown-{self.cooldown}")
        if self.refresh:
            parts.append(f"basis-refresh-{self.refresh}")
        if self.lr:
            parts.append(f"lr-{self.lr:g}")
        if self.anchor:
            a = self.anchor
            tau = f"tau={a['tau']}" + ("*s1" if a.get("tau_relative") else "")
            rank = f",rank={a['rank']}" if a.get("rank") else ""
            parts.append(
                f"anchor-priors(alpha={a['alpha']},{tau},beta={a['beta']},S={a['S']},every={a['every']}{rank})"
            )
        return "+".join(parts) or "none"


# Anchor schedule: weights snapshot refreshed every S = 20 steps (the paper's bound); a packet
# (one dense gradient on a fresh batch) every 10 fast steps, so staleness 0-19 at arrival. Every
# 10 and not every step because each packet costs ~210 SVDs (~30 s on one CPU thread here).
_AP = {"alpha": 0.3, "tau": 1e-3, "beta": 0.95, "S": 20, "every": 10, "tau_relative": False}

# tiers 24x8 + 88x4 both ways, each sequence's first position apart: the node's long-frame default
_T24_88A = {
    "tiers": ((24, 8), (88, 4)),
    "backward_tiers": ((24, 8), (88, 4)),
    "first_apart": True,
    "basis_dtype": "int8",
    "basis_block": 32,
}

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("dense", "dense", {"wire_dtype": "bfloat16"}),
        Variant("m95", "mask", {"rate": 0.95}),
        Variant("m95r", "mask", {"rate": 0.95, "rescale": True}),
        Variant("m90", "mask", {"rate": 0.90}),
        Variant("m95+ap", "mask", {"rate": 0.95}, anchor=dict(_AP)),
        Variant("m95+ap5", "mask", {"rate": 0.95}, anchor=dict(_AP, every=5)),
        # Labelled deviation: filter keeps the top-32 singular triplets (DESIGN 4.2 allows top-r
        # factor transport; the filter only uses the leading subspace). The full-rank filter's
        # apply step cost 85% of step time here (5-7 s per step on one CPU thread).
        Variant("m95+ap-r32", "mask", {"rate": 0.95}, anchor=dict(_AP, rank=32)),
        Variant("m95+ap-taurel", "mask", {"rate": 0.95}, anchor=dict(_AP, tau_relative=True)),
        Variant("m95+dense5", "mask", {"rate": 0.95}, dense_every=5),
        Variant("m95+dense10", "mask", {"rate": 0.95}, dense_every=10),
        Variant("pca58i8", "pca", {"k": 58, "coeff_dtype": "int8"}),
        Variant("pca29bf16", "pca", {"k": 29, "coeff_dtype": "bfloat16"}),
        Variant("pca96i8", "pca", {"k": 96, "coeff_dtype": "int8"}),
        Variant("pca96g32i8", "pca", {"k": 96, "coeff_dtype": "int8", "grad_k": 32}),
        Variant("pca64g32i8", "pca", {"k": 64, "coeff_dtype": "int8", "grad_k": 32}),
        Variant("pca96g48i8", "pca", {"k": 96, "coeff_dtype": "int8", "grad_k": 48}),
        # issue 9's pca+mask: top-48 of a 192-direction basis always, 48 more PRF-chosen per token
        Variant("pcamask-t48r48p192i8", "pcamask", {"k": 192, "k_top": 48, "k_rand": 48}),
        # issue 9's outlier-mask: 16 fixed high-|h| channels + M95 on the other 560 (28 kept)
        Variant("outlier16-m95", "outliermask", {"n_outlier": 16, "rate": 0.95}),
        Variant("pca58i8+warmup10", "pca", {"k": 58, "coeff_dtype": "int8"}, warmup=10),
        Variant("pca58i8+cooldown4", "pca", {"k": 58, "coeff_dtype": "int8"}, cooldown=4),
        Variant("int4", "int4", {}),
        Variant("topk29", "topk", {"k": 29, "value_dtype": "bfloat16"}),
        Variant("bottleneck29", "bottleneck", {"k": 29, "wire_dtype": "bfloat16"}),
        # diagnostics: which direction of PCA-96 int8 stops the word task from learning
        Variant("pca96i8-fwd-only", "pca-oneway", {"direction": "forward", "k": 96, "coeff_dtype": "int8"}),
        Variant("pca96i8-bwd-only", "pca-oneway", {"direction": "backward", "k": 96, "coeff_dtype": "int8"}),
        Variant("pca96bf16", "pca", {"k": 96, "coeff_dtype": "bfloat16"}),
        Variant("pca96i8-2bases", "pca-2bases", {"k": 96, "coeff_dtype": "int8"}),
        Variant("pca96i8+refresh10", "pca", {"k": 96, "coeff_dtype": "int8"}, refresh=10),
        Variant("pca96i8+warmup10", "pca", {"k": 96, "coeff_dtype": "int8"}, warmup=10),
        # per-microbatch basis sent with the data (compression/lowrank.py): follows fine-tuning
        Variant("lowrank64i8", "lowrank", {"k": 64, "coeff_dtype": "int8"}),
        Variant("lowrank32i8", "lowrank", {"k": 32, "coeff_dtype": "int8"}),
        Variant("lowrank64i8b8", "lowrank", {"k": 64, "coeff_dtype": "int8", "basis_dtype": "int8"}),
        Variant(
            "pca96i8-fwd+lowrank64-bwd",
            "pca-lowrank",
            {"lowrank_dir": "backward", "k": 96, "coeff_dtype": "int8"},
        ),
        Variant(
            "lowrank64-fwd+pca96i8-bwd",
            "pca-lowrank",
            {"lowrank_dir": "forward", "k": 96, "coeff_dtype": "int8"},
        ),
        Variant("lowrank48i8b8", "lowrank", {"k": 48, "coeff_dtype": "int8", "basis_dtype": "int8"}),
        Variant("lowrank64i8b8k32", "lowrank", {"k": 64, "basis_dtype": "int8", "basis_block": 32}),
        Variant("lowrank48i8b8k32", "lowrank", {"k": 48, "basis_dtype": "int8", "basis_block": 32}),
        # k = 80: the largest k still >= 10x below dense at 2048-token frames (110.5 B/token, H = 576)
        Variant("lowrank80i8b8k32", "lowrank", {"k": 80, "basis_dtype": "int8", "basis_block": 32}),
        # diagnostics: which direction of the default link holds back the word task
        Variant(
            "lowrank80-fwd-only",
            "lowrank-oneway",
            {"direction": "forward", "k": 80, "basis_dtype": "int8", "basis_block": 32},
        ),
        Variant(
            "lowrank80-bwd-only",
            "lowrank-oneway",
            {"direction": "backward", "k": 80, "basis_dtype": "int8", "basis_block": 32},
        ),
        # forward k = 64 at 8 bits, backward k = 128 at 4 bits with a scale per direction: each
        # direction >= 10x below dense at 2048-token frames (87.7 and 110.4 B/token)
        Variant(
            "lowrank64f128b4",
            "lowrank",
            {"k": 64, "k_backward": 128, "backward_bits": 4, "basis_dtype": "int8", "basis_block": 32},
        ),
        # the default link with the first position of every sequence (the attention sink) coded
        # apart: its own mean and 4 directions, so the basis and the mean fit the other rows
        Variant(
            "lowrank80a",
            "lowrank",
            {"k": 80, "basis_dtype": "int8", "basis_block": 32, "first_apart": True},
        ),
        # both: lowrankt24-88m's tiers in each direction, the first positions apart (mean centre)
        Variant("lowrankt24-88a", "lowrank", _T24_88A),
        # lowrankt24-88a with the forward basis fitted by loss share: the rows the loss reads (the
        # answer) weigh as much, together, as all the others (same bytes; sender-side only)
        Variant("lowrankt24-88as", "lowrank", {**_T24_88A, "loss_share": True}),
        # a fixed full rotation per direction (activations: median-centred; gradients: their own),
        # the top directions of each frame coded at 8 / 4 / 2 bits (compression/tiered.py): 110 B of
        # codes per token, no per-frame basis
        Variant("tiered24-88-128", "tiered", {"tiers": ((24, 8), (88, 4), (128, 2))}),
        # the per-frame basis with k = 112 directions in two tiers (24 at 8 bits, 88 at 4, each
        # direction scaled by its RMS first) in both directions, and the forward centred by the
        # median: the same 110 B/token as lowrank80i8b8k32 at 2048-token frames
        Variant(
            "lowrankt24-88m",
            "lowrank",
            {
                "tiers": ((24, 8), (88, 4)),
                "backward_tiers": ((24, 8), (88, 4)),
                "centre": "median",
                "basis_dtype": "int8",
                "basis_block": 32,
            },
        ),
        # a basis held by both ends of the link, updated by the sender (compression/linkbasis.py):
        # up to r new directions when the captured energy of recent frames drops below 0.99
        Variant("linkbasis64r8", "linkbasis", {"k": 64, "rank": 8}),
        Variant("linkbasis64r16", "linkbasis", {"k": 64, "rank": 16}),
        Variant("linkbasis64r8b0", "linkbasis", {"k": 64, "rank": 8, "beta": 0.0}),  # this frame only
        Variant("linkbasis48r8", "linkbasis", {"k": 48, "rank": 8}),
        # threshold 1.0: an update whenever a direction outside the basis beats a held one (at
        # 0.99 the forward basis almost never changed in the word run: fixed-basis behaviour)
        Variant("linkbasis64r8t1", "linkbasis", {"k": 64, "rank": 8, "threshold": 1.0}),
        Variant("linkbasis64r16t1", "linkbasis", {"k": 64, "rank": 16, "threshold": 1.0}),
        # the paper's recipe as its authors' notes state it (issue 13): a dense warm-up, then M95,
        # with anchor priors refreshed every K = 20 steps, at lr 2e-5; and the same without anchors.
        # Labelled deviations: warm-up 10 steps (unstated), filter rank 32, a packet every 10 steps.
        Variant("paper-m95+ap", "mask", {"rate": 0.95}, warmup=10, lr=2e-5, anchor=dict(_AP, rank=32)),
        Variant("paper-m95", "mask", {"rate": 0.95}, warmup=10, lr=2e-5),
        # their reference: dense at the same lr 2e-5 from the first step (the warm-up never ends)
        Variant("paper-dense", "dense", {"wire_dtype": "bfloat16"}, lr=2e-5),
    ]
}


# ------------------------------------------------------------------------------------------
# Timing + byte-counting wrapper: delegates to the real codec, so apply_link runs its code
# ------------------------------------------------------------------------------------------


class Metered(LinkCodec):
    def __init__(self, inner: LinkCodec):
        self.inner = inner
        self.codec_id = inner.codec_id
        self.seconds = 0.0
        self.bytes = {"fwd": 0, "bwd": 0}
        self.tokens = {"fwd": 0, "bwd": 0}
        self.counting = True

    def _timed(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t
        return out

    def _count(self, key: str, payload: Payload, n_tokens: int) -> None:
        if self.counting:
            self.bytes[key] += payload_nbytes(payload)
            self.tokens[key] += n_tokens

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        p = self._timed(self.inner.encode_forward, h, ctx)
        self._count("fwd", p, h.numel() // h.shape[-1])
        return p

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return self._timed(self.inner.decode_forward, payload, ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        p = self._timed(self.inner.encode_backward, g, ctx)
        self._count("bwd", p, g.numel() // g.shape[-1])
        return p

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return self._timed(self.inner.decode_backward, payload, ctx, shape)

    def bytes_per_token(self, hidden: int) -> float:
        return self.inner.bytes_per_token(hidden)

    def describe(self) -> dict:
        return self.inner.describe()


# ------------------------------------------------------------------------------------------
# The in-process pipeline
# ------------------------------------------------------------------------------------------


class Pipeline:
    """Four stages sharing the model's modules (so the tied embedding/lm_head stays tied, as
    in the whole model), plus a body-only copy of the tail for last-position generation."""

    # One shared tied tensor trained on the sum of its embedding and lm_head gradients is what the
    # swarm reproduces across processes (node.dp.tied: the head and the tail add each other's gradient
    # every step, run record ``tied: true``). The clip differs: global here; per stage in the swarm,
    # the tied tensor by its own norm.

    def __init__(self, model):
        layers = model.model.layers
        self.stages: list[Stage] = []
        for i in range(len(RANGES)):
            model.model.layers = layers
            self.stages.append(build_stage(model, RANGES, i))
        model.model.layers = layers
        s, e = RANGES[-1]
        self.tail_body = Stage(model, s, e, is_head=False, is_tail=False)
        self.norm, self.lm_head = model.model.norm, model.lm_head

    def hidden(self, ids: torch.Tensor, links) -> list[torch.Tensor]:
        """Boundary activations (sender side) for calibration, dense."""
        outs, h = [], ids
        for i, st in enumerate(self.stages[:-1]):
            h = st(h)
            outs.append(h.detach())
            h = links(i, h) if links else h
        return outs

    def logits(self, ids: torch.Tensor, links) -> torch.Tensor:
        """Full (B, T, V) logits through the real tail stage (used to check ``answer_loss``)."""
        h = ids
        for i, st in enumerate(self.stages):
            h = st(h)
            if i < len(self.stages) - 1 and links is not None:
                h = links(i, h)
        return h

    def final_hidden(self, ids: torch.Tensor, links) -> torch.Tensor:
        """The tail's last hidden state, before its norm + lm_head (applied where needed)."""
        h = ids
        bodies = self.stages[:-1] + [self.tail_body]
        for i, st in enumerate(bodies):
            h = st(h)
            if i < len(bodies) - 1 and links is not None:
                h = links(i, h)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def answer_logits(self, ids: torch.Tensor, labels: torch.Tensor, links):
        """Logits at the labelled positions only, and their targets.

        Same value as ``causal_lm_loss(tail(x), labels)``: the tail's lm_head is applied only
        where a next-token label exists (the answer and its EOS), which saves ~20% of a step's
        compute (49k-row lm_head on every prompt position).
        """
        h = self.final_hidden(ids, links)
        tgt = labels[:, 1:]
        sel = tgt != IGNORE_INDEX
        return self.head(h[:, :-1][sel]), tgt[sel], sel

    def last_logits(self, ids: torch.Tensor, links) -> torch.Tensor:
        return self.head(self.final_hidden(ids, links)[:, -1])


def answer_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="mean")


def make_links(
    codecs: list[LinkCodec], run_seed: int, step: int, microbatch: int = 0, labels: torch.Tensor | None = None
):
    """The links of one frame; with ``labels`` each link knows the rows the loss reads, as a node's
    does from the labels its forward frames carry (evaluation passes none, as generation would)."""
    rows = None if labels is None else loss_rows(labels)

    def link(b: int, h: torch.Tensor) -> torch.Tensor:
        c = codecs[b]
        seed = mask_seed(run_seed, step, microbatch, b)
        inner = c.inner if isinstance(c, Metered) else c
        ctx = inner.link_context(seed) if calibrated(inner) else LinkContext(seed=seed)
        return apply_link(h, c, replace(ctx, loss_rows=rows))

    return link


def batches(examples: list[Example], tok, pad: int):
    for i in range(0, len(examples), BATCH):
        yield collate([tokenize(tok, e, SEQ_LEN) for e in examples[i : i + BATCH]], pad)


@torch.no_grad()
def evaluate(pipe: Pipeline, examples, tok, pad, links_for=None, stop_ids: set[int] | None = None):
    """(eval loss on the answers, exact match) from one teacher-forced pass.

    Greedy decoding reproduces the answer exactly iff, given the gold prefix, the argmax at
    every answer position is the gold token and the argmax after it ends the answer (EOS or
    a newline): so EM over greedy generations equals this per-position check (up to
    non-canonical tokenisations of the same string), at the cost of one forward pass.
    ``--check-greedy`` runs real generation to confirm it.
    """
    tot, n, hits = 0.0, 0, 0
    stop = torch.tensor(sorted(stop_ids or {tok.eos_token_id}))
    for j, (ids, labels) in enumerate(batches(examples, tok, pad)):
        links = links_for(j) if links_for else None
        logits, tgt, sel = pipe.answer_logits(ids, labels, links)
        tot += float(torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="sum"))
        n += tgt.numel()
        pred = logits.argmax(-1)
        ok = (pred == tgt) | ((tgt == tok.eos_token_id) & torch.isin(pred, stop))
        per_pos = torch.ones_like(sel)
        per_pos[sel] = ok
        hits += int(per_pos.all(dim=1).sum())
    return tot / max(n, 1), hits / len(examples)


@torch.no_grad()
def exact_match(pipe: Pipeline, examples, tok, links_for=None, max_new: int = 6) -> tuple[float, list[str]]:
    """Greedy decoding (full recompute per token, so the codec sees every position as in
    training); the continuation is cut at EOS or newline, stripped, compared with the answer."""
    eos = tok.eos_token_id
    nl = set(tok("\n", add_special_tokens=False)["input_ids"])
    groups: dict[int, list[int]] = {}
    enc = [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    for i, ids in enumerate(enc):
        groups.setdefault(len(ids), []).append(i)
    outs = [""] * len(examples)
    for gi, (_, idx) in enumerate(sorted(groups.items())):
        for j in range(0, len(idx), 64):
            part = idx[j : j + 64]
            ids = torch.tensor([enc[i] for i in part])
            gen = [[] for _ in part]
            done = [False] * len(part)
            for t in range(max_new):
                links = links_for(gi * 1000 + j, t) if links_for else None
                nxt = pipe.last_logits(ids, links).argmax(-1)
                for r, tok_id in enumerate(nxt.tolist()):
                    if not done[r]:
                        if tok_id == eos or tok_id in nl:
                            done[r] = True
                        else:
                            gen[r].append(tok_id)
                if all(done):
                    break
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            for r, i in enumerate(part):
                outs[i] = tok.decode(gen[r]).strip()
    hits = sum(o == e.completion.strip() for o, e in zip(outs, examples))
    return hits / len(examples), outs


class PcaLowrank(PcaCodec):
    """Diagnostic: the fixed PCA basis on one direction, a per-frame low-rank basis
    (``compression.lowrank``) on the other. Says which direction needs the basis that follows
    the data: lowrank on both learns the word task like dense, PCA on both does not."""

    def __init__(self, lowrank_dir: str, lowrank_k: int = 64, **kw):
        if lowrank_dir not in ("forward", "backward"):
            raise ValueError(f"lowrank_dir must be forward or backward, not {lowrank_dir!r}")
        super().__init__(**kw)
        self.lowrank_dir, self.lowrank = lowrank_dir, LowRankCodec(k=lowrank_k)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.lowrank_dir == "forward":
            return self.lowrank.encode_forward(h, ctx)
        return super().encode_forward(h, ctx)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.lowrank_dir == "forward":
            return self.lowrank.decode_forward(payload, ctx, shape)
        return super().decode_forward(payload, ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.lowrank_dir == "backward":
            return self.lowrank.encode_backward(g, ctx)
        return super().encode_backward(g, ctx)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.lowrank_dir == "backward":
            return self.lowrank.decode_backward(payload, ctx, shape)
        return super().decode_backward(payload, ctx, shape)

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> float:
        if direction == self.lowrank_dir:
            return self.lowrank.frame_bytes(tokens, hidden, direction, sequences)
        return tokens * super().bytes_per_token(hidden)


class OneWay:
    """Diagnostic mixin, not a codec to ship: the codec it is mixed into on one ``direction``,
    dense bf16 on the other. ``forward`` compresses the activations and sends the gradient dense
    (straight-through: the sender applies the receiver's dense gradient as if the link were the
    identity); ``backward`` sends exact activations and compresses only the gradient."""

    def __init__(self, direction: str, **kw):
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be forward or backward, not {direction!r}")
        super().__init__(**kw)
        self.direction = direction

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.direction == "forward":
            return super().encode_forward(h, ctx)
        return {"h": h.detach().to(torch.bfloat16)}

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.direction == "forward":
            return super().decode_forward(payload, ctx, shape)
        return payload["h"].to(torch.float32).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.direction == "backward":
            return super().encode_backward(g, ctx)
        return {"g": g.detach().to(torch.bfloat16)}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.direction == "backward":
            return super().decode_backward(payload, ctx, shape)
        return payload["g"].to(torch.float32).reshape(shape)


class PcaOneWay(OneWay, PcaCodec):
    """PCA on one direction, dense bf16 on the other: where learning through PCA fails."""

    def bytes_per_token(self, hidden: int) -> float:
        """Mean of the two directions (one PCA, one dense bf16)."""
        return (super().bytes_per_token(hidden) + 2 * hidden) / 2


class LowRankOneWay(OneWay, LowRankCodec):
    """The default link on one direction, dense bf16 on the other: whether the forward or the
    backward keeps it from learning like dense."""

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> int:
        if direction == self.direction:
            return super().frame_bytes(tokens, hidden, direction, sequences)
        return tokens * 2 * hidden


class PcaTwoBases(PcaCodec):
    """Candidate: the forward in the activations' PCA basis, the backward in the gradients' own.

    The activation basis keeps the forward near exact but only 13-25% of the boundary
    gradient's energy, and the one-direction diagnostics locate the word task's failure in the
    backward. Gradients have their own low-rank structure (a 96-direction basis of calibration
    gradients keeps 91-94% of their energy), so the backward sends Q(g V_g) and the sender
    applies (g V_g) V_gᵀ to h as if the link were the identity (straight-through: the forward
    is close to it). Not an exact adjoint of the forward any more; bases are fitted once.
    """

    def set_grad_basis(self, v_g: torch.Tensor) -> None:
        self._v_g = v_g.to(torch.float32).contiguous()

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = g.detach().reshape(-1, g.shape[-1]).to(torch.float32)
        return self._pack(rows @ self._v_g)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return (self._unpack(payload) @ self._v_g.T).reshape(shape)


def grad_basis(grads: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k uncentred directions of the gradients (energy, not variance)."""
    g = grads.detach().to(torch.float64)
    _, vecs = torch.linalg.eigh(g.T @ g)
    return vecs[:, -k:].flip(-1).to(torch.float32)


def step_wire_bytes(codec: LinkCodec, n_tok: int, dense_now: bool, sequences: int = 0) -> float:
    """Payload bytes per boundary per direction of one step (mean of the two directions)."""
    if dense_now:
        return n_tok * DENSE_BPT
    if hasattr(codec, "frame_bytes"):  # a per-frame basis: charged with every frame
        return (
            codec.frame_bytes(n_tok, HIDDEN, "forward", sequences=sequences)
            + codec.frame_bytes(n_tok, HIDDEN, "backward", sequences=sequences)
        ) / 2
    return n_tok * codec.bytes_per_token(HIDDEN)


def build_codec(variant: Variant) -> LinkCodec:
    if variant.codec == "pca-oneway":
        return PcaOneWay(**variant.settings)
    if variant.codec == "pca-lowrank":
        return PcaLowrank(**variant.settings)
    if variant.codec == "lowrank-oneway":
        return LowRankOneWay(**variant.settings)
    if variant.codec == "pca-2bases":
        return PcaTwoBases(**variant.settings)
    return make_codec(variant.codec, **variant.settings)


def calibrated(codec: LinkCodec) -> bool:
    """Codecs holding per-boundary state fitted from the dense model (a PCA basis, including
    pcamask's pool, or outliermask's channel set), published once and named by version."""
    return isinstance(codec, (PcaCodec, OutlierMaskCodec, TieredCodec))


def published_bytes(codec: LinkCodec) -> int:
    """Bytes of one published version of a calibrated codec's state (0: it publishes none)."""
    if isinstance(codec, TieredCodec):  # one rotation per direction; bytes are per direction
        return codec.rotation_nbytes(HIDDEN)
    return codec.basis_nbytes(HIDDEN) if calibrated(codec) else 0


def needs_grads(codec: LinkCodec) -> bool:
    """Calibration must also take the boundary gradients of the answer loss."""
    return bool(getattr(codec, "grad_k", 0)) or isinstance(codec, (PcaTwoBases, TieredCodec))


def fit_boundary(codec: LinkCodec, acts: torch.Tensor, grads: torch.Tensor | None, version: int) -> None:
    """Install one boundary's fitted state from its calibration activations (and gradients)."""
    if isinstance(codec, TieredCodec):
        codec.set_rotations(fit_rotation(acts, centre=True), fit_rotation(grads, centre=False), version)
    elif isinstance(codec, OutlierMaskCodec):
        codec.set_channels(fit_outlier_channels(acts, codec.n_outlier), acts.shape[-1], version)
    elif isinstance(codec, PcaTwoBases):
        codec.set_basis(*fit_basis(acts, codec.k), version)
        codec.set_grad_basis(grad_basis(grads, codec.k))
    elif grads is not None:
        codec.set_basis(*fit_joint_basis(acts, grads, codec.k, codec.grad_k), version)
    else:
        codec.set_basis(*fit_basis(acts, codec.k), version)


def calibrate(pipe: Pipeline, codecs: list[Metered], calib: list[Example], tok, pad, version: int) -> float:
    """Fit each boundary's codec state (``fit_boundary``) from the dense model's activations on
    task examples (and, for ``grad_k`` > 0, the gradients of the answer loss at each boundary)."""
    t = time.perf_counter()
    grad_k = needs_grads(codecs[0].inner)
    acts: list[list[torch.Tensor]] = [[] for _ in codecs]
    grads: list[list[torch.Tensor]] = [[] for _ in codecs]

    def tap(b: int, h: torch.Tensor) -> torch.Tensor:
        acts[b].append(h.detach().reshape(-1, h.shape[-1]))
        if h.requires_grad:
            h.register_hook(lambda g: grads[b].append(g.detach().reshape(-1, g.shape[-1])))
        return h

    for ids, labels in batches(calib, tok, pad):
        if grad_k:
            loss = answer_loss(*pipe.answer_logits(ids, labels, tap)[:2])
            loss.backward()
            for p in pipe.lm_head.parameters():  # calibration must not leave gradients behind
                p.grad = None
            for st in pipe.stages:
                st.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for b, h in enumerate(pipe.hidden(ids, None)):
                    tap(b, h)
    for b, c in enumerate(codecs):
        fit_boundary(c.inner, torch.cat(acts[b]), torch.cat(grads[b]) if grad_k else None, version)
    return time.perf_counter() - t


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


# ------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------


def step_frames(stream, tok, steps: int, frame_tokens: int) -> list[list[Example]]:
    """Each step's examples: BATCH of them, or with ``frame_tokens`` T one frame as the node
    sends it (``node.model.data.microbatches``: whole examples cut to the sequence length, right-padded
    to the longest), as many examples as fit in T padded tokens (at least one)."""
    if not frame_tokens:
        return [[next(stream) for _ in range(BATCH)] for _ in range(steps)]
    out, pending = [], next(stream)
    for _ in range(steps):
        frame, longest = [], 0
        while True:
            n = len(tokenize(tok, pending, SEQ_LEN)[0])
            if frame_full(len(frame), longest, n, frame_tokens):
                break
            frame.append(pending)
            longest = max(longest, n)
            pending = next(stream)
        out.append(frame)
    return out


def run(
    variant: Variant,
    task: str,
    seed: int,
    steps: int,
    n_eval: int,
    log_every: int = 10,
    check_greedy: int = 0,
    frame_tokens: int = 0,
) -> dict:
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    model, tok, _ = load_model("bundled")
    model.train()
    pad = tok.eos_token_id
    stop_ids = {tok.eos_token_id, *tok("\n", add_special_tokens=False)["input_ids"]}
    pipe = Pipeline(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=variant.lr or LR, weight_decay=0.0, fused=True)

    stream = task_stream(task, seed)
    frames = step_frames(stream, tok, steps, frame_tokens)
    train = [e for f in frames for e in f]
    calib_stream = task_stream(task, seed + 7_000_003)
    calib = [next(calib_stream) for _ in range(CALIB_EXAMPLES)]
    evals = held_out(task, n_eval, {e.prompt for e in train})
    curve_eval = evals[:32]

    codecs = [Metered(build_codec(variant)) for _ in RANGES[:-1]]
    dense_links = [Metered(DenseCodec("bfloat16")) for _ in RANGES[:-1]]
    is_pca = calibrated(codecs[0].inner)  # PCA bases and outlier channel sets alike
    calib_s, basis_version = 0.0, 0
    if is_pca and variant.warmup == 0:
        calib_s = calibrate(pipe, codecs, calib, tok, pad, basis_version)

    # anchor replica: a dense copy whose weights are a snapshot at most S steps old
    filt, anchor, anchor_pipe, anchor_stream = None, None, None, None
    anchor_s, filter_s, anchor_packets, anchor_bytes, snapshot_step = 0.0, 0.0, 0, 0, 0
    if variant.anchor:
        a = variant.anchor
        filt = SpectralFilter(
            alpha=a["alpha"], tau=a["tau"], beta=a["beta"], tau_relative=a["tau_relative"], rank=a.get("rank")
        )
        anchor = copy.deepcopy(model)
        anchor_pipe = Pipeline(anchor)
        anchor_stream = task_stream(task, seed + 1_000_003)
        anchor_links = [DenseCodec("bfloat16") for _ in RANGES[:-1]]

    train_curve, eval_curve, step_times = [], [], []
    wire_tokens, wire_bytes, label_bytes = 0, 0.0, 0
    mode_counts = {"codec": 0, "dense": 0}
    for step in range(steps):
        t0 = time.perf_counter()
        in_cooldown = step >= steps - variant.cooldown
        dense_now = is_dense_step(step, variant.dense_every) or step < variant.warmup or in_cooldown
        if is_pca and variant.warmup and step == variant.warmup:
            calib_s = calibrate(pipe, codecs, calib, tok, pad, basis_version)
        if is_pca and variant.refresh and step > variant.warmup and step % variant.refresh == 0:
            # the sender refits from the current weights; a new version is published and paid again
            basis_version += 1
            calib_s += calibrate(pipe, codecs, calib, tok, pad, basis_version)
        if variant.codec == "dense":
            dense_now = False  # the codec is the dense link itself
        links_used = dense_links if dense_now else codecs
        mode_counts["dense" if dense_now else "codec"] += 1
        ids, labels = collate([tokenize(tok, e, SEQ_LEN) for e in frames[step]], pad)
        links = make_links(links_used, seed, step, labels=labels)
        loss = answer_loss(*pipe.answer_logits(ids, labels, links)[:2])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        n_tok = ids.numel()
        wire_tokens += n_tok
        wire_bytes += step_wire_bytes(codecs[0].inner, n_tok, dense_now, ids.shape[0])
        # forward frames also carry the labels, in the node's wire layout (protocol.frames)
        label_bytes += sum(t.numel() * t.element_size() for t in pack_labels(labels, VOCAB).values())

        if filt is not None and not dense_now:
            a = variant.anchor
            if step % a["S"] == 0:  # anchor pulls fresh weights from the fast replica
                anchor.load_state_dict(model.state_dict())
                snapshot_step = step
            if step % a["every"] == 0:  # a packet arrives: the anchor's dense gradient on fresh data
                ta = time.perf_counter()
                a_batch = [next(anchor_stream) for _ in range(BATCH)]
                a_ids, a_labels = collate([tokenize(tok, e, SEQ_LEN) for e in a_batch], pad)
                anchor.zero_grad(set_to_none=True)
                a_out = anchor_pipe.answer_logits(a_ids, a_labels, make_links(anchor_links, seed, step))
                a_loss = answer_loss(*a_out[:2])
                a_loss.backward()
                grads = {  # no copy: observe() folds each into its own fp32 EMA state
                    n: p.grad.detach()
                    for n, p in anchor.named_parameters()
                    if p.grad is not None and is_target_matrix(n, p)
                }
                anchor_s += time.perf_counter() - ta
                anchor_packets += 1
                anchor_bytes += sum(g.numel() * 2 for g in grads.values())  # bf16 full matrices
                t_excl = time.perf_counter() - ta  # the anchor's own compute runs on another machine
                t0 += t_excl
                tf = time.perf_counter()
                for n, g in grads.items():
                    filt.observe(n, g, source_step=snapshot_step, current_step=step)
                filter_s += time.perf_counter() - tf
                del grads
                anchor.zero_grad(set_to_none=True)  # frees the anchor's gradients between packets
            tf = time.perf_counter()
            filter_gradients(filt, model.named_parameters())
            filter_s += time.perf_counter() - tf

        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        step_times.append(time.perf_counter() - t0)
        train_curve.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step == steps - 1:
            model.eval()
            el, _ = evaluate(pipe, curve_eval, tok, pad, stop_ids=stop_ids)
            model.train()
            eval_curve.append([step + 1, el])
            print(
                f"[{variant.name} {task} s{seed}] step {step + 1}/{steps} train {float(loss.detach()):.3f} "
                f"eval(dense,32) {el:.3f} {sum(step_times) / len(step_times):.2f}s/step",
                flush=True,
            )

    # ---- evaluation
    model.eval()
    t_eval = time.perf_counter()
    for c in codecs:
        c.counting = False
    link_stats = [c.inner.stats() for c in codecs] if hasattr(codecs[0].inner, "stats") else None
    if is_pca and codecs[0].inner.version is None:  # steps <= warmup: never switched
        calibrate(pipe, codecs, calib, tok, pad, basis_version)

    def eval_links(j, t=0):
        return make_links(codecs, seed, EVAL_STEP_BASE + t, microbatch=j)

    el_dense, em_dense = evaluate(pipe, evals, tok, pad, stop_ids=stop_ids)
    el_codec, em_codec = evaluate(pipe, evals, tok, pad, links_for=eval_links, stop_ids=stop_ids)
    greedy = None
    if check_greedy:
        em_g, outs_dense = exact_match(pipe, evals, tok)
        em_gc, outs_codec = exact_match(pipe, evals[:check_greedy], tok, links_for=eval_links)
        _, em_fc = evaluate(pipe, evals[:check_greedy], tok, pad, links_for=eval_links, stop_ids=stop_ids)
        greedy = {
            "em_dense_greedy": em_g,
            "n_codec": check_greedy,
            "em_codec_greedy": em_gc,
            "em_codec_forced": em_fc,
        }
    eval_s = time.perf_counter() - t_eval

    # ---- accounting
    train_s = sum(step_times)
    codec_s = sum(c.seconds for c in codecs) + sum(c.seconds for c in dense_links)
    payload_bpt = wire_bytes / wire_tokens if wire_tokens else codecs[0].bytes_per_token(HIDDEN)
    meters = codecs + dense_links
    counted = {
        d: sum(c.bytes[d] for c in meters) / max(sum(c.tokens[d] for c in meters), 1) for d in ("fwd", "bwd")
    }
    basis_bytes = published_bytes(codecs[0].inner) * (basis_version + 1)
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
        "batch": BATCH,
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
        "basis_bytes": basis_bytes,
        "basis_bytes_per_token": basis_bpt,
        "link_basis": link_basis,
        "frame_tokens": frame_tokens,
        "tokens_per_frame": wire_tokens / max(steps, 1),
        "dense_bytes_per_token": DENSE_BPT,
        "compression_vs_dense": DENSE_BPT / (payload_bpt + basis_bpt),
        "steps_codec": mode_counts["codec"],
        "steps_dense": mode_counts["dense"],
        "tokens_trained": wire_tokens,
        "codec_time_frac": codec_s / train_s if train_s else 0.0,
        "filter_time_frac": filter_s / train_s if filt and train_s else 0.0,
        "step_time_s": train_s / steps if steps else 0.0,
        "calibration_s": calib_s,
        "anchor": None,
        "train_loss_curve": train_curve,
        "eval_loss_curve": eval_curve,
        "eval_s": eval_s,
        "wall_s": time.perf_counter() - t_start,
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        "em_method": "teacher-forced greedy check (see evaluate())",
        "greedy_check": greedy,
    }
    if filt:
        rec["anchor"] = {
            "settings": dict(variant.anchor) | {"max_staleness": filt.max_staleness},
            "packets": anchor_packets,
            "transport": "full bf16 matrices of all 2-D decoder projections, per packet (sum over 4 stages)",
            "bytes_per_packet": anchor_bytes // max(anchor_packets, 1),
            "anchor_compute_s": anchor_s,
        }
        rec["anchor_bytes_per_token"] = anchor_bytes / max(wire_tokens, 1)
    if steps == 0:
        rec["variant"] = "untrained"
    return rec


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
                )
                append_result(path, rec)
                print(
                    f"DONE {rec['variant']} {task} seed {seed}: EM dense {rec['em_dense_eval']:.3f} "
                    f"codec {rec['em_codec_eval']:.3f} eval loss {rec['eval_loss']:.3f} "
                    f"B/token {rec['bytes_per_token']:.1f} ({rec['compression_vs_dense']:.1f}x) "
                    f"codec {100 * rec['codec_time_frac']:.1f}% filter {100 * rec['filter_time_frac']:.1f}% "
                    f"wall {rec['wall_s']:.0f}s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
