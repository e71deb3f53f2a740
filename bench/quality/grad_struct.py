"""How low-rank are the boundary activations and gradients of one fine-tuning batch?

    python -m bench.quality.grad_struct --task word --seed 5
    python -m bench.quality.grad_struct --task word --seed 11 --frame-tokens 2048   # one node-packed frame

The bundled model through the quality benchmark's 4-stage split, one batch of 16 problems,
dense: prints, per boundary, the share of the gradient's energy at the loss positions, in the
top-m rows by norm, and in the top-k singular directions (gradients, and centred activations).
Explains why the per-frame low-rank codec needs k >= 64 (bench/results/quality.md). Then the
relative error each lowrank setting leaves on that frame's activations and gradients, through the
codec itself (quantisation included), beside its bytes per token.
"""

from __future__ import annotations

import argparse

import torch

from bench.quality.quality_pipeline import Pipeline, answer_loss
from bench.quality.quality_tasks import BATCH, HIDDEN, SEQ_LEN, step_frames, task_stream
from compression.codec import LinkContext
from compression.registry import make_codec
from node.model.data import collate, tokenize
from node.model.loading import load_model
from node.model.stages import IGNORE_INDEX


def energy_at(values: torch.Tensor, ks: tuple[int, ...]) -> dict[int, float]:
    """Cumulative share of ``values`` (sorted descending) in the first k, for each k."""
    c = values.sort(descending=True).values.cumsum(0) / values.sum()
    return {k: round(float(c[min(k, len(c)) - 1]), 3) for k in ks}


# (label, settings): the lowrank settings whose error is printed
LOWRANK = (
    ("k64", {"k": 64}),
    ("k80", {"k": 80}),
    ("k64/b128x4bit", {"k": 64, "k_backward": 128, "backward_bits": 4}),
)


def codec_errors(x: torch.Tensor, g: torch.Tensor) -> list[str]:
    """Relative Frobenius error of each LOWRANK setting (int8 basis in blocks of 32) on one frame."""
    out, ctx, shape = [], LinkContext(), tuple(x.shape)
    for label, kw in LOWRANK:
        c = make_codec("lowrank", basis_dtype="int8", basis_block=32, **kw)
        xf, gf = x.float(), g.float()
        fx = c.decode_forward(c.encode_forward(xf, ctx), ctx, shape)
        bg = c.decode_backward(c.encode_backward(gf, ctx), ctx, shape)
        t = x.shape[0]
        fb, bb = c.frame_bytes(t, x.shape[1], "forward") / t, c.frame_bytes(t, x.shape[1], "backward") / t
        xc = xf - xf.mean(0)
        out.append(
            f"{label}: fwd {float((fx - xf).norm() / xc.norm()):.3f} ({fb:.0f} B), "
            f"bwd {float((bg - gf).norm() / gf.norm()):.3f} ({bb:.0f} B)"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="word", choices=["arithmetic", "word"])
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--frame-tokens", type=int, default=0, help="one node-packed frame (0: 16 problems)")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok, _ = load_model("bundled")
    model.train()
    pipe = Pipeline(model)
    stream = task_stream(a.task, a.seed)
    frame = (
        step_frames(stream, tok, 1, a.frame_tokens)[0]
        if a.frame_tokens
        else [next(stream) for _ in range(BATCH)]
    )
    ids, labels = collate([tokenize(tok, e, SEQ_LEN) for e in frame], tok.eos_token_id)
    acts: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}

    def tap(b: int, h: torch.Tensor) -> torch.Tensor:
        acts[b] = h.detach()
        h.register_hook(lambda g: grads.__setitem__(b, g.detach()))
        return h

    answer_loss(*pipe.answer_logits(ids, labels, tap)[:2]).backward()
    at_loss = torch.zeros(ids.shape, dtype=torch.bool)
    at_loss[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # positions whose output is scored
    at_loss = at_loss.reshape(-1)
    print(f"{a.task}: {ids.numel()} tokens, {int(at_loss.sum())} loss positions")
    for b in sorted(grads):
        g = grads[b].reshape(-1, HIDDEN).double()
        x = acts[b].reshape(-1, HIDDEN).double()
        rows = g.norm(dim=1) ** 2
        share = float(rows[at_loss].sum() / rows.sum())
        print(f"boundary {b}: gradient energy at the loss positions {share:.3f}")
        print(f"  in the top-m rows          {energy_at(rows, (16, 32, 64, 128))}")
        print(f"  in the top-k directions    {energy_at(torch.linalg.svdvals(g) ** 2, (16, 32, 48, 64, 96))}")
        xc = x - x.mean(0)
        print(f"  activations, top-k         {energy_at(torch.linalg.svdvals(xc) ** 2, (16, 32, 64, 96))}")
        for line in codec_errors(x, g):
            print(f"  lowrank {line}")


if __name__ == "__main__":
    main()
