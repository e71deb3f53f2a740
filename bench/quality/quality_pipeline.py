"""The quality benchmark's one-process pipeline, made of the node's own parts.

* stages: ``node.model.stages.build_stage`` over the setup's ranges, sharing the model's modules
  (the tied embedding/lm_head stays one tensor, as ``node.dp.tied`` keeps it across processes);
  the training loss is the tail stage's own ``Stage.loss``;
* links: one ``node.stage.linkio.LinkIO`` per stage, ``Hops``: each boundary's forward frame is
  built by the sender's ``forward_frame`` (the codec the node's ``Link.for_step`` chooses, its mask
  seed, basis version, loss rows and packed labels), serialised with ``protocol.frames``,
  parsed, checked and decoded by the receiver's ``LinkIO``; the gradient goes back as the
  receiver's ``reply`` frame, decoded by the sender's ``decode_gradient``. ``FrameHop`` runs
  that inside ``compression.codec.apply_link``, the autograd function of an in-graph link;
* evaluation: ``node.model.evaluate`` (``eval_loss``, ``exact_match``) on ``PipelineLM``, the
  stages (and, for codec-on numbers, the links) seen as a causal LM.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch import nn

from bench.quality.quality_codecs import Metered, fit_boundary, needs_grads
from bench.quality.quality_tasks import BATCH, RANGES, SEQ_LEN
from compression.codec import DenseCodec, LinkCodec, LinkContext, Payload, apply_link
from node.model.data import Example, collate, tokenize
from node.model.evaluate import completion_budget, eval_loss, exact_match
from node.model.stages import IGNORE_INDEX, Stage, build_stage
from node.stage.linkio import LinkIO
from node.stage.links import Link
from protocol.frames import decode_frame, encode_frame
from protocol.records import RunRecord

EVAL_STEP_BASE = 1 << 40  # mask seeds used by codec-on evaluation never collide with training


class Pipeline:
    """The stages of ``ranges``, sharing the model's modules (the whole model stays usable)."""

    def __init__(self, model, ranges=RANGES):
        ranges = [list(r) for r in ranges]
        layers = model.model.layers
        self.stages: list[Stage] = []
        for i in range(len(ranges)):
            model.model.layers = layers
            self.stages.append(build_stage(model, ranges, i))
        model.model.layers = layers
        self.tail = self.stages[-1]
        self.lm_head = self.tail.lm_head

    def _through(self, ids: torch.Tensor, links) -> torch.Tensor:
        """The tail's input: ids through every stage but the tail, each boundary through ``links``."""
        h = ids
        for i, st in enumerate(self.stages[:-1]):
            h = st(h)
            h = links(i, h) if links is not None else h
        return h

    def hidden(self, ids: torch.Tensor, links) -> list[torch.Tensor]:
        """Boundary activations (sender side) for calibration."""
        outs, h = [], ids
        for i, st in enumerate(self.stages[:-1]):
            h = st(h)
            outs.append(h.detach())
            h = links(i, h) if links else h
        return outs

    def logits(self, ids: torch.Tensor, links) -> torch.Tensor:
        """Full (B, T, V) logits through the tail stage."""
        return self.tail(self._through(ids, links))

    def loss(self, ids: torch.Tensor, labels: torch.Tensor, links) -> torch.Tensor:
        """The mean answer loss, as the node's tail computes it (``Stage.loss``)."""
        return self.tail.loss(self._through(ids, links), labels)[0]

    def answer_logits(self, ids: torch.Tensor, labels: torch.Tensor, links):
        """Logits at the labelled positions only, their targets and the selection (the tail's
        ``Stage.loss`` computes its loss from exactly these)."""
        h = self.tail.layers_forward(self._through(ids, links))[:, :-1]
        tgt = labels[:, 1:]
        sel = tgt != IGNORE_INDEX
        return self.tail.lm_head(self.tail.norm(h[sel])), tgt[sel], sel


def answer_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), tgt, reduction="mean")


class PipelineLM(nn.Module):
    """The pipeline as a causal LM ``node.model.evaluate`` scores: ``model(input_ids=...).logits``.

    No KV cache: ``cache`` is the ids so far and every call recomputes every position, so a
    link sees the whole sequence as in training. ``links_for(n)`` gives the links of the n-th
    call (None: no link, the stages alone)."""

    def __init__(self, pipe: Pipeline, links_for=None):
        super().__init__()
        self.pipe, self.links_for, self.calls = pipe, links_for, 0
        self.stages = nn.ModuleList(pipe.stages)

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False):
        ids = input_ids if cache is None else torch.cat([cache, input_ids], dim=1)
        links = self.links_for(self.calls) if self.links_for is not None else None
        self.calls += 1
        return SimpleNamespace(logits=self.pipe.logits(ids, links), cache=ids if use_cache else None)


def score(pipe: Pipeline, examples, tok, links_for=None, em: bool = True, batch=BATCH, seq_len=SEQ_LEN):
    """(eval loss, exact match or None) of ``examples`` by ``node.model.evaluate``'s own functions:
    the token-weighted answer loss, and greedy decoding (stopped at EOS) compared with the answer."""
    lm = PipelineLM(pipe, links_for)
    loss = eval_loss(lm, tok, examples, seq_len=seq_len, batch=batch)
    return loss, exact_match(lm, tok, examples, completion_budget(tok, examples))[0] if em else None


class BenchLink(Link):
    """``node.stage.links.Link`` (the run's codec, dense every K steps) with the bench's codecs
    in it and the bench-only schedules: ``dense_at(step)`` (warm-up, cool-down), and evaluation
    steps always through the codec."""

    def __init__(self, run: RunRecord, boundary: int, dense_only: bool, dense_at=None):
        super().__init__(run, boundary, dense_only)
        self.dense_at = dense_at

    def for_step(self, step: int) -> LinkCodec:
        if step >= EVAL_STEP_BASE:
            return self.main
        if self.dense_at is not None and self.dense_at(step):
            return self.dense
        return super().for_step(step)

    def by_id(self, codec_id: str) -> LinkCodec | None:
        found = super().by_id(codec_id)
        return found if found is not None or codec_id != "dense" else self.dense


class Hops:
    """The boundaries of a one-process pipeline as the node runs them: a ``LinkIO`` per stage,
    the sender's output link and the receiver's input link one ``BenchLink`` (one codec instance:
    a basis published and fetched in the swarm is installed once here)."""

    def __init__(self, run: RunRecord, vocab: int, codecs=None, dense_at=None, dense_only=False):
        n = len(run.stages)
        self.ios = [LinkIO(run, i, vocab, f"stage-{i}", dense_only) for i in range(n)]
        self.links: list[BenchLink] = []
        for b in range(n - 1):
            link = BenchLink(run, b, dense_only, dense_at)
            if codecs is not None:  # the bench's instances (metered, diagnostic codecs) in the node's link
                link.main = codecs[b]
                link.dense = link.main if link.main.codec_id == "dense" else Metered(DenseCodec("bfloat16"))
            self.ios[b].link_out = self.ios[b + 1].link_in = link
            self.links.append(link)
        self.counting = True
        self.frame_bytes = {"fwd": 0, "bwd": 0}
        self.frame_tokens = {"fwd": 0, "bwd": 0}

    def is_dense(self, step: int) -> bool:
        """Whether ``step`` crosses the links dense where the run's codec is not (the node's choice)."""
        link = self.links[0]
        return link.main.codec_id != "dense" and link.for_step(step) is link.dense

    def __call__(self, step: int, microbatch: int = 0, labels: torch.Tensor | None = None):
        """The links of one frame; ``labels`` None: none travel (as in generation), so the sender
        knows no loss rows."""

        def link(b: int, h: torch.Tensor) -> torch.Tensor:
            lab = labels if labels is not None else torch.full(h.shape[:2], IGNORE_INDEX, dtype=torch.long)
            return apply_link(h, FrameHop(self, b, step, microbatch, lab), LinkContext())

        return link

    def count(self, key: str, data: bytes, tokens: int) -> None:
        if self.counting:
            self.frame_bytes[key] += len(data)
            self.frame_tokens[key] += tokens


class FrameHop(LinkCodec):
    """One frame across boundary ``b``, both ways, through the two stages' ``LinkIO`` and real frame
    bytes. ``apply_link``'s context is unused: the sender's ``forward_frame`` makes the frame's."""

    codec_id = "frame-hop"

    def __init__(self, hops: Hops, b: int, step: int, microbatch: int, labels: torch.Tensor):
        self.hops, self.send, self.recv = hops, hops.ios[b], hops.ios[b + 1]
        self.step, self.microbatch, self.labels = step, microbatch, labels

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        self.sent = self.send.forward_frame(self.step, self.microbatch, [], h, self.labels, None)
        self.data = encode_frame(self.sent)
        self.hops.count("fwd", self.data, h.shape[0] * h.shape[1])
        return {}

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        self.got = self.recv.parse(self.data)
        self.recv.check_forward(self.got)
        return self.recv.decode_input(self.got)[0]

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        self.data = encode_frame(self.recv.reply(self.got, g, {}))
        self.hops.count("bwd", self.data, g.shape[0] * g.shape[1])
        return {}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return self.send.decode_gradient(self.sent, decode_frame(self.data, run_id=self.send.run.run_id))

    def bytes_per_token(self, hidden: int) -> float:
        return self.send.link_out.main.bytes_per_token(hidden)


def run_record(setup, hidden: int, seed: int, codec: dict, dense_every: int, frame_tokens: int) -> RunRecord:
    """The run record a swarm of this setup would publish (what the node's links are built from)."""
    return RunRecord(
        run_id="bench-quality",
        model_name=setup.model,
        model_hash="-",
        num_layers=setup.ranges[-1][1],
        hidden=hidden,
        stages=[list(r) for r in setup.ranges],
        codec=codec,
        dense_every=dense_every,
        seed=seed,
        seq_len=2 * setup.seq_len,  # room for greedy decoding past a training sequence
        microbatch=setup.batch,
        # packed frames: the training frame's budget, and room for the evaluation's setup.batch rows
        microbatch_tokens=max(frame_tokens, 2 * setup.batch * setup.seq_len) if frame_tokens else 0,
    )


def schedule_dense(variant, steps: int):
    """The bench-only dense steps of ``variant`` (warm-up, cool-down); dense-every-K is the node's."""
    return lambda step: step < variant.warmup or step >= steps - variant.cooldown


def batches(examples: list[Example], tok, pad: int, batch: int = BATCH, seq_len: int = SEQ_LEN):
    for i in range(0, len(examples), batch):
        yield collate([tokenize(tok, e, seq_len) for e in examples[i : i + batch]], pad)


def calibrate(
    pipe: Pipeline,
    codecs: list[Metered],
    calib: list[Example],
    tok,
    pad,
    version: int,
    batch=BATCH,
    seq_len=SEQ_LEN,
) -> float:
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

    for ids, labels in batches(calib, tok, pad, batch, seq_len):
        if grad_k:
            pipe.loss(ids, labels, tap).backward()
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
