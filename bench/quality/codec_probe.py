"""How much task ability survives each link codec, with the training taken out of the picture.

Fine-tunes the bundled model dense (``bench.quality.quality``'s 4-stage split, batch, LR, clip) for
``--steps`` on one task, then evaluates the trained weights through several link codecs at
inference only (EM and answer loss on the 200 held-out problems). If a codec keeps a model
that already knows the task near its dense score, the codec's forward pass carries what the
task needs, and a failure to *learn* through that codec lies in training (its backward, or
the upstream stages' updates), not in the forward information loss.

Variants (forward only, fitted on 128 calibration examples through the trained model):
``pca<K>`` a PCA basis of K directions (int8 block-32 or float coefficients), and
``tok<K>`` the same after removing a token-conditioned part: x ≈ [E0[tok], 1] A (least
squares on the pretrained input embedding E0, which every peer holds) with PCA on the
rest, so token identity needs no coefficients (2 B/token of ids on the wire).

    python -m bench.quality.codec_probe --task word --steps 40 --out bench/results/codec_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.quality.quality_pipeline import Pipeline, answer_loss, batches, score
from bench.quality.quality_tasks import BATCH, CALIB_EXAMPLES, CLIP, LR, SEQ_LEN, held_out, task_stream
from compression.baselines import dequantize_blockwise, quantize_blockwise
from compression.pca import fit_basis
from node.model.data import collate, tokenize
from node.model.loading import load_model

VARIANTS = [("pca", 96, 8), ("pca", 96, None), ("pca", 192, 4), ("pca", 192, None), ("tok", 96, 8),
            ("pca", 58, 8), ("tok", 58, 8)]  # fmt: skip


def train_dense(model, tok, task: str, steps: int, seed: int) -> None:
    pad = tok.eos_token_id
    pipe = Pipeline(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    stream = task_stream(task, seed)
    for step in range(steps):
        batch = [next(stream) for _ in range(BATCH)]
        ids, labels = collate([tokenize(tok, e, SEQ_LEN) for e in batch], pad)
        loss = answer_loss(*pipe.answer_logits(ids, labels, None)[:2])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"  dense step {step + 1}/{steps} loss {float(loss.detach()):.3f}", flush=True)


@torch.no_grad()
def boundary_activations(pipe: Pipeline, calib, tok, pad: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token ids (N,) and each boundary's activations (N, H) over the calibration examples."""
    acts: list[list[torch.Tensor]] = [[] for _ in range(3)]
    toks = []
    for ids, _ in batches(calib, tok, pad):
        toks.append(ids.reshape(-1))
        for b, h in enumerate(pipe.hidden(ids, None)):
            acts[b].append(h.reshape(-1, h.shape[-1]).float())
    return torch.cat(toks), [torch.cat(a) for a in acts]


def quantize(c: torch.Tensor, bits: int | None) -> torch.Tensor:
    if bits is None:
        return c
    q, s = quantize_blockwise(c, 32, bits, torch.bfloat16)
    return dequantize_blockwise(q, s, 32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="word", choices=["arithmetic", "word"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--basis-from",
        default="trained",
        choices=["trained", "pretrained"],
        help="fit the bases on the fine-tuned weights' activations, or on the pretrained model's "
        "(what a basis fitted once at the start of a run is)",
    )
    p.add_argument("--out", default="bench/results/codec_probe.json")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    model, tok, _ = load_model("bundled")
    e0 = model.model.embed_tokens.weight.detach().float().clone()  # pretrained: every peer has it
    pad = tok.eos_token_id
    cs = task_stream(args.task, args.seed + 7_000_003)
    calib = [next(cs) for _ in range(CALIB_EXAMPLES)]
    evals = held_out(args.task, 200, set())
    t0 = time.perf_counter()
    if args.basis_from == "pretrained":
        tok_ids, x_all = boundary_activations(Pipeline(model), calib, tok, pad)
    model.train()
    train_dense(model, tok, args.task, args.steps, args.seed)
    model.eval()
    pipe = Pipeline(model)
    if args.basis_from == "trained":
        tok_ids, x_all = boundary_activations(pipe, calib, tok, pad)
    z_cal = torch.cat([e0[tok_ids], torch.ones(len(tok_ids), 1)], 1)
    fits = {}
    for k in sorted({v[1] for v in VARIANTS}):
        for b, x in enumerate(x_all):
            a = torch.linalg.lstsq(z_cal, x, driver="gelsd").solution
            fits[k, b] = (*fit_basis(x, k), a, *fit_basis(x - z_cal @ a, k))
    eval_batches = list(batches(evals, tok, pad))

    def links_for(mode: str, k: int, bits: int | None):
        def per_batch(j: int):
            ids = eval_batches[j][0].reshape(-1)

            def link(b: int, h: torch.Tensor) -> torch.Tensor:
                mean, v, a, mean_r, v_r = fits[k, b]
                x = h.reshape(-1, h.shape[-1]).float()
                if mode == "pca":
                    y = mean + quantize((x - mean) @ v, bits) @ v.T
                else:
                    base = torch.cat([e0[ids], torch.ones(len(ids), 1)], 1) @ a
                    y = base + mean_r + quantize((x - base - mean_r) @ v_r, bits) @ v_r.T
                return y.reshape(h.shape).to(h.dtype)

            return link

        return per_batch

    loss, em = score(pipe, evals, tok)
    rows = [{"variant": "dense", "k": None, "bits": 16, "eval_loss": loss, "em": em}]
    print(f"dense: loss {loss:.3f} EM {em:.3f}", flush=True)
    for mode, k, bits in VARIANTS:
        # loss only: the token-conditioned link reads the teacher-forced batch j's ids, which greedy
        # decoding (node.model.evaluate.exact_match) does not feed it
        loss, em = score(pipe, evals, tok, links_for(mode, k, bits), em=False)
        rows.append({"variant": f"{mode}{k}", "k": k, "bits": bits, "eval_loss": loss, "em": em})
        coeff = "float" if bits is None else f"int{bits}"
        print(f"{mode}{k} {coeff}: loss {loss:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else []
    results.append({"task": args.task, "steps": args.steps, "seed": args.seed, "basis_from": args.basis_from,
                    "rows": rows,
                    "wall_s": time.perf_counter() - t0})  # fmt: skip
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
