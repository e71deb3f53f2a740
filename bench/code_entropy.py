"""How many of the default link's bytes are redundancy a lossless coder could remove.

The default long-frame link (``lowrank``, tiers 24x8 + 88x4, the first position apart) codes the
bundled model's boundary activations (forward) and the loss's gradient at that boundary
(backward) for real word-task frames of ~2,048 tokens. For every payload field this prints its
bytes as sent, its order-0 empirical entropy (int8 codes as bytes, int4 codes as nibbles: what an
arithmetic coder with a per-frame table would approach, table not counted) and what two real
lossless coders give on the same bytes (zlib level 9, lzma preset 9). Decoded tensors would be
bit-identical, so the learning of the link is unchanged by construction: this bounds what entropy
coding alone buys before any change to what the link keeps (issue 35).

    python -m bench.code_entropy --frames 4 --out bench/results/code_entropy.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import zlib
from collections import Counter
from pathlib import Path

import torch

from bench.quality_tasks import SEQ_LEN, step_frames, task_stream
from compression.codec import LinkContext
from compression.registry import make_codec
from node.model.data import collate, tokenize
from node.model.loading import load_model
from node.model.stages import build_stage, default_stage_ranges
from node.stage.links import LONG_FRAME_LAYOUT, loss_rows, parse_tiers


def entropy_bytes(symbols: list[int]) -> float:
    """Order-0 entropy of ``symbols`` in bytes (n * H / 8)."""
    n = len(symbols)
    return -sum(c * math.log2(c / n) for c in Counter(symbols).values()) / 8 if n else 0.0


def field_symbols(name: str, t: torch.Tensor) -> list[int] | None:
    """The integer fields as symbols: int8 ones (the 8-bit tier's codes and the int8 basis) as bytes,
    packed int4 codes as nibbles; None for scales, medians and other float fields (counted as sent)."""
    if t.dtype == torch.int8:
        return t.flatten().tolist()
    if t.dtype == torch.uint8 and name.startswith("q"):
        b = t.flatten().to(torch.int64)
        return torch.stack([b & 15, b >> 4], dim=-1).flatten().tolist()
    return None


def default_codec():
    """The codec a GPU starter's run publishes (node.stage.links: LONG_FRAME_LAYOUT)."""
    tiers = parse_tiers(LONG_FRAME_LAYOUT["lowrank_tiers"])
    return make_codec(
        "lowrank",
        k=sum(n for n, _ in tiers),
        coeff_dtype="int8",
        basis_dtype="int8",
        basis_block=32,
        tiers=tiers,
        backward_tiers=tiers,
        first_apart=LONG_FRAME_LAYOUT["lowrank_first"] == "apart",
    )


def measure(frames: int, frame_tokens: int) -> dict:
    model, tok, _ = load_model("bundled")
    ranges = default_stage_ranges(model, 2)  # the split a 2-stage swarm uses
    head = build_stage(model, ranges, 0, keep_model=True)
    tail = build_stage(model, ranges, 1)
    pad = tok.eos_token_id
    codec = default_codec()
    rows = {"forward": Counter(), "backward": Counter()}
    tokens = 0
    for frame in step_frames(task_stream("word", 0), tok, frames, frame_tokens):
        ids, labels = collate([tokenize(tok, ex, SEQ_LEN) for ex in frame], pad)
        x = head(ids).detach().requires_grad_(True)
        tail.loss(x, labels)[0].backward()
        ctx = LinkContext(loss_rows=loss_rows(labels))
        tokens += ids.numel()
        for direction, t in (("forward", x.detach()), ("backward", x.grad)):
            enc = codec.encode_forward if direction == "forward" else codec.encode_backward
            c = rows[direction]
            for name, v in enc(t, ctx).items():
                raw = v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b""
                c[f"{name}:sent"] += len(raw)
                sym = field_symbols(name, v)
                if sym is not None:
                    c["codes:sent"] += len(raw)
                    c["codes:entropy"] += entropy_bytes(sym)
                    c["codes:zlib"] += len(zlib.compress(raw, 9))
                    c["codes:lzma"] += len(lzma.compress(raw, preset=9))
                c["all:sent"] += len(raw)
        tail.zero_grad(set_to_none=True)
    out = {"frames": frames, "tokens": tokens, "boundary": ranges[0][1]}
    for direction, c in rows.items():
        per = {k: v / tokens for k, v in c.items()}
        out[direction] = {
            "bytes_per_token_sent": per["all:sent"],
            "codes_per_token_sent": per["codes:sent"],
            "codes_per_token_entropy": per["codes:entropy"],
            "codes_per_token_zlib": per["codes:zlib"],
            "codes_per_token_lzma": per["codes:lzma"],
            "all_per_token_if_entropy_coded": per["all:sent"] - per["codes:sent"] + per["codes:entropy"],
            "fields": {k.split(":")[0]: v for k, v in per.items() if k.endswith(":sent") and ":" in k},
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--frame-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    rec = measure(a.frames, a.frame_tokens)
    for d in ("forward", "backward"):
        r = rec[d]
        print(
            f"{d}: {r['bytes_per_token_sent']:.1f} B/token sent, int fields {r['codes_per_token_sent']:.1f}: "
            f"entropy {r['codes_per_token_entropy']:.1f}, zlib {r['codes_per_token_zlib']:.1f}, "
            f"lzma {r['codes_per_token_lzma']:.1f}; all bytes if the codes were entropy coded "
            f"{r['all_per_token_if_entropy_coded']:.1f}"
        )
    if a.out:
        a.out.write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
