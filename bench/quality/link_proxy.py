"""What a link codec does to one training step, before any training: two minute-scale proxies.

    python -m bench.quality.link_proxy --task word --seed 11 --variants lowrank80i8b8k32,lowrankt24-88m
    python -m bench.quality.link_proxy --dense-steps 20 --variants tiered24-88-128   # after 20 dense steps
    python -m bench.quality.link_proxy --fields --variants lowrankq128-96s1v1g8a+er   # bytes field by field

One node-packed frame (``--frame-tokens``, default 2048) through the bundled model in the quality
benchmark's four stages. Per variant (``bench.quality.quality`` names; calibrated codecs are fitted on the
benchmark's calibration examples first, at step 0):

* forward: the codec on every boundary's activations only, KL(dense || codec) of the answer
  logits (nats per answer token);
* backward: the codec on every boundary's gradients only (activations exact), each stage's
  parameter gradient against the dense one: relative error and cosine. Errors compound upstream:
  stage 0's gradient has passed three lossy links.

``--dense-steps N`` first trains N dense steps (AdamW, the benchmark's lr and clip) on the task's
frames, so a codec whose state is fitted at step 0 (a calibrated basis or rotation) can be checked
for staleness: it is compared as it was fitted, and (``--refit``) fitted again at step N.
Proxies, not learning: bench/results/quality.md says where they agreed with 100-step runs and
where they did not.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.quality.quality_codecs import Metered, build_codec, calibrated
from bench.quality.quality_pipeline import Pipeline, answer_loss, calibrate
from bench.quality.quality_tasks import CALIB_EXAMPLES, CLIP, LR, SEQ_LEN, VARIANTS, step_frames, task_stream
from compression.codec import LinkCodec, LinkContext, payload_nbytes
from node.model.data import collate, tokenize
from node.model.loading import load_model
from node.stage.links import loss_rows


class _Probe(torch.autograd.Function):
    """A link that applies the codec in one direction only, and records its bytes per token."""

    @staticmethod
    def forward(ctx, h, codec: LinkCodec, link: LinkContext, forward: bool, meter: dict):
        ctx.codec, ctx.link, ctx.backward_on, ctx.meter = codec, link, not forward, meter
        if not forward:
            return h.clone()
        x = h.float()  # the frame's own (sequences, positions, H) shape, as a hop sends it
        p = codec.encode_forward(x, link)
        meter["fwd"] = payload_nbytes(p) / x[..., 0].numel()
        _fields(meter, "fwd", p, x[..., 0].numel())
        y = codec.decode_forward(p, link, tuple(x.shape))
        if x.dim() == 3:  # per-row error past position 0 (the sink), the median over the frame
            rows = (y - x)[:, 1:].norm(dim=-1) / x[:, 1:].norm(dim=-1).clamp_min(1e-12)
            meter.setdefault("row_err", []).append(float(rows.median()))
        return y.to(h.dtype)

    @staticmethod
    def backward(ctx, g):
        if not ctx.backward_on:
            return g, None, None, None, None
        rows = g.float()  # the frame's own shape, as a node's reply codes it
        p = ctx.codec.encode_backward(rows, ctx.link)
        ctx.meter["bwd"] = payload_nbytes(p) / rows[..., 0].numel()
        _fields(ctx.meter, "bwd", p, rows[..., 0].numel())
        out = ctx.codec.decode_backward(p, ctx.link, tuple(rows.shape))
        return out.reshape(g.shape).to(g.dtype), None, None, None, None


def _fields(meter: dict, direction: str, payload: dict, tokens: int) -> None:
    """Each payload field's bytes per token, summed over the boundaries (``--fields``)."""
    into = meter.setdefault(f"fields_{direction}", {})
    into["boundaries"] = into.get("boundaries", 0) + 1
    for name, t in payload.items():
        into[name] = into.get(name, 0.0) + t.numel() * t.element_size() / tokens


def _field_line(fields: dict) -> str:
    """'name B/token' per field, the mean over the boundaries, largest first."""
    n = fields["boundaries"]
    named = sorted(((k, v) for k, v in fields.items() if k != "boundaries"), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v / n:.2f}" for k, v in named)


def _step(model, pipe, ids, labels, codecs, forward: bool, meter: dict):
    """Answer logits and each stage's flattened parameter gradient, the codecs on one direction."""
    model.zero_grad(set_to_none=True)

    rows = loss_rows(labels)

    def link(b: int, h: torch.Tensor) -> torch.Tensor:
        c = codecs[b]
        ctx = c.link_context() if calibrated(c) else LinkContext()
        return _Probe.apply(h, c, replace(ctx, loss_rows=rows), forward, meter)

    logits, tgt = pipe.answer_logits(ids, labels, link if codecs else None)[:2]
    answer_loss(logits, tgt).backward()
    grads = [
        torch.cat([p.grad.reshape(-1).double() for p in st.parameters() if p.grad is not None])
        for st in pipe.stages
    ]
    model.zero_grad(set_to_none=True)
    return logits.detach().float(), grads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="word")
    p.add_argument("--seed", type=int, default=11, help="the probed frame's stream seed")
    p.add_argument("--frame-tokens", type=int, default=2048)
    p.add_argument("--variants", default="lowrank80i8b8k32")
    p.add_argument("--dense-steps", type=int, default=0)
    p.add_argument("--refit", action="store_true", help="with --dense-steps: also refit at step N")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fields", action="store_true", help="also each payload field's B/token, per direction")
    a = p.parse_args(argv)
    names = [n for n in a.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; see python -m bench.quality.quality --list")
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model, tok, _ = load_model("bundled")
    model.train()
    pad = tok.eos_token_id
    pipe = Pipeline(model)
    cs = task_stream(a.task, 7_000_003)  # the benchmark's calibration examples (seed 0)
    calib = [next(cs) for _ in range(CALIB_EXAMPLES)]

    def codecs_of(name: str) -> list[LinkCodec]:
        ms = [Metered(build_codec(VARIANTS[name])) for _ in range(len(pipe.stages) - 1)]
        if calibrated(ms[0].inner):
            calibrate(pipe, ms, calib, tok, pad, 0)
        return [m.inner for m in ms]

    probes = {n: codecs_of(n) for n in names}  # fitted at step 0
    if a.dense_steps:
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        for i, frame in enumerate(step_frames(task_stream(a.task, 0), tok, a.dense_steps, a.frame_tokens)):
            ids, labels = collate([tokenize(tok, e, SEQ_LEN) for e in frame], pad)
            loss = answer_loss(*pipe.answer_logits(ids, labels, None)[:2])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            print(f"dense step {i + 1}/{a.dense_steps}: loss {float(loss.detach()):.3f}", flush=True)
        opt.zero_grad(set_to_none=True)
        del opt
        if a.refit:
            probes.update({f"{n} (refit at step {a.dense_steps})": codecs_of(n) for n in names})
    frame = step_frames(task_stream(a.task, a.seed), tok, 1, a.frame_tokens)[0]
    ids, labels = collate([tokenize(tok, e, SEQ_LEN) for e in frame], pad)
    ref, true = _step(model, pipe, ids, labels, None, True, {})
    logp = F.log_softmax(ref, -1)
    print(f"{a.task} frame of {ids.numel()} tokens, after {a.dense_steps} dense steps")
    print(
        "variant | fwd B/token | KL(dense||codec) | per-row fwd error past position 0, by boundary "
        "| bwd B/token | per stage: param-grad rel. err / cos"
    )
    for name, codecs in probes.items():
        meter: dict = {}
        logits, _ = _step(model, pipe, ids, labels, codecs, True, meter)
        kl = float(F.kl_div(F.log_softmax(logits, -1), logp, log_target=True, reduction="batchmean"))
        _, grads = _step(model, pipe, ids, labels, codecs, False, meter)
        stages = " ".join(
            f"{float((g - t).norm() / t.norm()):.3f}/{float(g @ t / g.norm() / t.norm()):.4f}"
            for g, t in zip(grads, true)
        )
        rows = " ".join(f"{e:.3f}" for e in meter.get("row_err", []))
        print(f"{name} | {meter['fwd']:.1f} | {kl:.4f} | {rows} | {meter['bwd']:.1f} | {stages}", flush=True)
        if a.fields:  # the mean over the boundaries: the fwd column above is the last boundary's
            for d in ("fwd", "bwd"):
                print(f"    {d} fields, B/token: {_field_line(meter[f'fields_{d}'])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
