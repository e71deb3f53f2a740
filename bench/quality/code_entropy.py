"""How many of the default link's bytes are redundancy a lossless coder could remove.

The default long-frame link (``lowrank``, tiers 24x8 + 88x4, the first position apart) codes the
bundled model's boundary activations (forward) and the loss's gradient at that boundary
(backward) for real word-task frames of ~2,048 tokens. For every payload field this prints its
bytes as sent, its order-0 empirical entropy (int8 codes as bytes, int4 codes as nibbles: what an
arithmetic coder with a per-frame table would approach, table not counted) and what two real
lossless coders give on the same bytes (zlib level 9, lzma preset 9). Decoded tensors would be
bit-identical, so the learning of the link is unchanged by construction: this bounds what entropy
coding alone buys before any change to what the link keeps (issue 35).

    python -m bench.quality.code_entropy --frames 4 --out bench/results/code_entropy.json

``--mode coder`` runs the real lossless stage instead (``compression.entropy``, the codec's
``entropy=True``): the same frames through the codec with and without it, every decoded tensor
checked bit-identical, the bytes of the payloads as sent, the time the codec and the stage take
per frame (``--reps`` timings, the fastest kept: the CPU is shared), and two probes of what is
left: rows a forward frame repeats exactly, and how much of each frame's basis the previous
frame's basis predicts (bench/results/entropy.md).

    python -m bench.quality.code_entropy --mode coder --frames 8 --out bench/results/entropy.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import statistics
import time
import zlib
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench.quality.quality_tasks import SEQ_LEN, step_frames, task_stream
from compression.baselines import dequantize_blockwise, unpack_int4
from compression.codec import LinkContext, payload_nbytes
from compression.registry import make_codec
from node.model.data import collate, tokenize
from node.model.loading import load_model
from node.model.stages import build_stage, default_stage_ranges
from node.stage.links import LINK_LAYOUTS, loss_rows, parse_tiers


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


def default_codec(entropy: bool = False, repeats: bool = False):
    """The tiered link (node.stage.links: LINK_LAYOUTS["tiered"], a GPU starter's default when this
    was measured), with the lossless stages (entropy coding, repeated rows once) on or off."""
    tiered = LINK_LAYOUTS["tiered"]
    tiers = parse_tiers(tiered["lowrank_tiers"])
    return make_codec(
        "lowrank",
        k=sum(n for n, _ in tiers),
        coeff_dtype="int8",
        basis_dtype="int8",
        basis_block=32,
        tiers=tiers,
        backward_tiers=tiers,
        first_apart=tiered["lowrank_first"] == "apart",
        entropy=entropy,
        repeats=repeats,
    )


def boundary_frames(frames: int, frame_tokens: int):
    """(token ids, boundary activations, their loss gradient, link context) of ``frames`` word-task
    frames through the bundled model split as a 2-stage swarm splits it; and the boundary."""
    model, tok, _ = load_model("bundled")
    ranges = default_stage_ranges(model, 2)  # the split a 2-stage swarm uses
    head = build_stage(model, ranges, 0, keep_model=True)
    tail = build_stage(model, ranges, 1)
    out = []
    for frame in step_frames(task_stream("word", 0), tok, frames, frame_tokens):
        ids, labels = collate([tokenize(tok, ex, SEQ_LEN) for ex in frame], tok.eos_token_id)
        x = head(ids).detach().requires_grad_(True)
        tail.loss(x, labels)[0].backward()
        out.append((ids, x.detach(), x.grad.detach(), LinkContext(loss_rows=loss_rows(labels))))
        tail.zero_grad(set_to_none=True)
    return out, ranges[0][1]


def measure(frames: int, frame_tokens: int) -> dict:
    data, boundary = boundary_frames(frames, frame_tokens)
    codec = default_codec()
    rows = {"forward": Counter(), "backward": Counter()}
    tokens = 0
    for ids, xd, grad, ctx in data:
        tokens += ids.numel()
        for direction, t in (("forward", xd), ("backward", grad)):
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
    out = {"frames": frames, "tokens": tokens, "boundary": boundary}
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


def _fastest(fn, reps: int) -> tuple[object, float]:
    """``fn()``'s result and its fastest wall time of ``reps`` calls (others share these cores)."""
    best, out = math.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


class _Timed:
    """Time spent in the codec's entropy stage itself (both ends), per call, fastest of the reps."""

    def __init__(self, codec):
        self.calls: dict[str, list[float]] = {"encode": [], "decode": []}
        for what, name in (("encode", "_entropy_code"), ("decode", "_entropy_decode")):
            setattr(codec, name, self._wrap(getattr(codec, name), what))

    def _wrap(self, fn, what: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.calls[what].append(time.perf_counter() - t0)
            return out

        return timed

    def take(self, what: str) -> float:
        best, self.calls[what] = min(self.calls[what]), []
        return best


def duplicate_rows(x: torch.Tensor) -> int:
    """Rows of a forward frame (after each sequence's first position, coded apart) that repeat an
    earlier row exactly: the same token prefix gives the same activations (a shared prompt)."""
    rows = x[:, 1:].reshape(-1, x.shape[-1])
    return rows.shape[0] - torch.unique(rows, dim=0).shape[0]


def _entropy_bits(a: np.ndarray) -> float:
    _, c = np.unique(a, return_counts=True)
    return float(-(c * np.log2(c / c.sum())).sum())


def basis_probe(prev: dict, new: dict, block: int) -> dict:
    """How much of ``new``'s int8 basis (``vq``, ``vscale``) the previous frame's predicts.

    Overlap: the share of each new direction's energy inside the previous basis' span (1: the
    span did not move). Lossless prediction: each new direction takes the previous direction it is
    most aligned with (index and sign, 1 byte), the codes are sent as the difference from that
    direction rounded onto the new block scales; order-0 entropy of those differences against that
    of the codes themselves (tables and indices counted)."""
    vp = dequantize_blockwise(prev["vq"], prev["vscale"], block)
    vn = dequantize_blockwise(new["vq"], new["vscale"], block)
    proj = vn @ vp.T  # (k_new, k_prev): cosines, rows are unit vectors up to rounding
    inside = proj.pow(2).sum(dim=1) / vn.pow(2).sum(dim=1)
    best = proj.abs().argmax(dim=1)
    cos = proj.gather(1, best[:, None]).squeeze(1)
    pred = vp[best] * torch.sign(cos)[:, None]
    sn = new["vscale"].float().repeat_interleave(block, dim=1)[:, : vn.shape[1]]
    guess = torch.round(pred / torch.where(sn > 0, sn, 1.0)).clamp(-127, 127)
    diff = (new["vq"].to(torch.int64) - guess.to(torch.int64)).numpy()
    table = 2 + 256  # a per-frame table as compression.entropy sends it
    k, hidden = vn.shape
    # a direction almost inside the previous span could travel as its k coordinates there (int8 in
    # blocks of 32, as the basis) instead of its H entries: the bytes that would save per frame
    inside_999 = int((inside >= 0.999).sum())
    per_dir = (hidden + 2 * math.ceil(hidden / block)) - (k + 2 * math.ceil(k / block))
    return {
        "span_overlap_per_rank": [round(float(v), 4) for v in inside],
        "directions_inside_999": inside_999,
        "coordinate_saving_bytes": inside_999 * per_dir,
        "span_overlap_mean": float(inside.mean()),
        "span_overlap_top16": float(inside[:16].mean()),
        "span_overlap_last32": float(inside[-32:].mean()),
        "matched_abs_cos_mean": float(cos.abs().mean()),
        "codes_bytes_order0": _entropy_bits(new["vq"].numpy()) / 8 + table,
        "diff_bytes_order0": _entropy_bits(diff) / 8 + 2 * table + k,  # wider alphabet, indices
        "raw_bytes": new["vq"].numel(),
    }


def _cdf(z: np.ndarray, family: str) -> np.ndarray:
    """The standard Laplace (scale 1) or Gaussian CDF at ``z``."""
    if family == "laplace":
        return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0)), 1 - 0.5 * np.exp(-np.maximum(z, 0)))
    return 0.5 * (1 + torch.special.erf(torch.from_numpy(z / math.sqrt(2))).numpy())


def _quantized_bits(counts: np.ndarray, values: np.ndarray, family: str) -> float:
    """Bits of symbols with ``counts`` at integer ``values`` under the best single-scale zero-mean
    quantized Laplace or Gaussian (a grid of scales; its 2-byte parameter counted by the caller)."""
    best = math.inf
    for scale in np.geomspace(0.3, 200.0, 160):
        prob = np.maximum(_cdf((values + 0.5) / scale, family) - _cdf((values - 0.5) / scale, family), 1e-12)
        best = min(best, float(-(counts * np.log2(prob / prob.sum())).sum()))
    return best


def model_probe(payload: dict, fields: list[tuple[str, str, int, int, int]]) -> dict:
    """Bytes of each integer field of an uncoded payload under the candidate models of
    ``compression.entropy`` (codes in zero-scale blocks left out, as the stage leaves them out):
    order-0 with its table (what the stage sends), the best quantized Laplace / Gaussian, and one
    table per column (entropy alone, a lower bound, plus the tables it would need)."""
    out = {}
    for name, sname, bits, cols, block in fields:
        raw = payload[name]
        q = unpack_int4(raw, cols) if bits == 4 else raw
        live = (payload[sname] != 0).repeat_interleave(block, dim=1)[:, :cols]
        col = torch.arange(cols).expand_as(q)[live].numpy()
        sym = q[live].to(torch.int64).numpy()
        values, counts = np.unique(sym, return_counts=True)
        table = 2 + len(values)
        out[name] = {
            "raw": raw.numel() * raw.element_size(),
            "order0": _entropy_bits(sym) / 8 + table,
            "laplace": _quantized_bits(counts, values, "laplace") / 8 + 2,
            "gaussian": _quantized_bits(counts, values, "gaussian") / 8 + 2,
            "per_column": sum(_entropy_bits(sym[col == c]) / 8 + table for c in range(cols)),
        }
    return out


# the lossless settings compared: each decodes bit-identically to "plain" (checked per frame)
VARIANTS = {
    "plain": {},
    "entropy": {"entropy": True},
    "repeats": {"repeats": True},
    "repeats+entropy": {"repeats": True, "entropy": True},
}


class _TimedRepeats:
    """Time spent dropping and restoring repeated rows (compression.repeats as lowrank calls it)."""

    def __init__(self):
        import compression.lowrank as lowrank

        self.calls: dict[str, list[float]] = {"drop_repeats": [], "restore_repeats": []}
        for name in self.calls:
            setattr(lowrank, name, self._wrap(getattr(lowrank, name), name))

    def _wrap(self, fn, name: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.calls[name].append(time.perf_counter() - t0)
            return out

        return timed

    def take(self) -> tuple[float, float]:
        out = tuple(min(self.calls[n]) for n in ("drop_repeats", "restore_repeats"))
        self.calls = {n: [] for n in self.calls}
        return out


def measure_coder(frames: int, frame_tokens: int, reps: int) -> dict:
    """The real lossless stages on the default long-frame link: bytes and times, both directions."""
    data, boundary = boundary_frames(frames, frame_tokens)
    codecs = {name: default_codec(**kw) for name, kw in VARIANTS.items()}
    coded = codecs["entropy"]
    timer, rep_timer = _Timed(coded), _TimedRepeats()
    per = {d: [] for d in ("forward", "backward")}
    probes = {d: [] for d in ("forward", "backward")}
    models = {d: [] for d in ("forward", "backward")}
    prev_basis: dict[str, dict] = {}
    dups, tokens = 0, 0
    for ids, xd, grad, ctx in data:
        tokens += ids.numel()
        dups += duplicate_rows(xd)
        for direction, t in (("forward", xd), ("backward", grad)):
            fwd = direction == "forward"
            rec = {"tokens": ids.numel(), "sequences": ids.shape[0]}
            for name, codec in codecs.items():
                enc = codec.encode_forward if fwd else codec.encode_backward
                dec = codec.decode_forward if fwd else codec.decode_backward
                payload, rec[f"{name}_encode_s"] = _fastest(partial(enc, t, ctx), reps)
                decoded, rec[f"{name}_decode_s"] = _fastest(partial(dec, payload, ctx, tuple(t.shape)), reps)
                rec[f"{name}_bytes"] = payload_nbytes(payload)
                rec[f"{name}_fields"] = {n: v.numel() * v.element_size() for n, v in payload.items()}
                rec[f"{name}_decoded"] = decoded
                if name == "entropy":
                    rec["coded_fields"] = sorted(n for n in payload if n.startswith("e"))
                elif name == "repeats":
                    rec["repeated_rows"] = int(payload["rep"].shape[0])
                    rec["repeats_drop_s"], rec["repeats_restore_s"] = rep_timer.take()
                elif name == "plain":
                    models[direction].append(model_probe(payload, coded._int_fields(direction, t.shape[-1])))
                    basis = {"vq": payload["vq"], "vscale": payload["vscale"]}
                    if direction in prev_basis:
                        probes[direction].append(basis_probe(prev_basis[direction], basis, coded.basis_block))
                    prev_basis[direction] = basis
            ref = rec.pop("plain_decoded")
            for name in list(VARIANTS)[1:]:
                if not torch.equal(rec.pop(f"{name}_decoded"), ref):
                    raise AssertionError(f"{direction}: the {name} link decoded differently")
            rep_timer.calls = {n: [] for n in rep_timer.calls}  # the repeats+entropy codec's calls
            rec["stage_encode_s"], rec["stage_decode_s"] = timer.take("encode"), timer.take("decode")
            per[direction].append(rec)
    out = {
        "frames": frames,
        "frame_tokens": frame_tokens,
        "tokens": tokens,
        "boundary": boundary,
        "reps": reps,
        "codec": codecs["repeats+entropy"].describe(),
        "duplicate_rows": dups,
        "per_frame": per,
        "basis_probe": probes,
    }
    hidden = data[0][1].shape[-1]
    for direction, recs in per.items():
        tok = sum(r["tokens"] for r in recs)
        before = sum(r["plain_bytes"] for r in recs) / tok
        after = sum(r["entropy_bytes"] for r in recs) / tok
        med = {k: statistics.median(r[k] for r in recs) for k in recs[0] if k.endswith("_s")}
        codec_s = med["plain_encode_s"] + med["plain_decode_s"]
        stage_s = med["stage_encode_s"] + med["stage_decode_s"]
        out[direction] = {
            "bytes_per_token_before": before,
            "bytes_per_token_after": after,
            "x_below_dense_bf16_before": 2 * hidden / before,
            "x_below_dense_bf16_after": 2 * hidden / after,
            "saved_share": 1 - after / before,
            "median_s": med,
            "stage_share_of_codec": stage_s / codec_s,
            "models_per_token": {
                f: {m: sum(p[f][m] for p in models[direction]) / tok for m in models[direction][0][f]}
                for f in models[direction][0]
            },
            "variants": {
                name: {
                    "bytes_per_token": sum(r[f"{name}_bytes"] for r in recs) / tok,
                    "x_below_dense_bf16": 2 * hidden * tok / sum(r[f"{name}_bytes"] for r in recs),
                    "saved_share": 1
                    - sum(r[f"{name}_bytes"] for r in recs) / sum(r["plain_bytes"] for r in recs),
                    "codec_encode_s": med[f"{name}_encode_s"],
                    "codec_decode_s": med[f"{name}_decode_s"],
                }
                for name in VARIANTS
            },
            "repeated_rows": sum(r["repeated_rows"] for r in recs),
            "fields_per_token": {
                name: {
                    f: sum(r[f"{name}_fields"].get(f, 0) for r in recs) / tok
                    for f in recs[-1][f"{name}_fields"]
                }
                for name in VARIANTS
            },
        }
    return out


def plot_coder(rec: dict, path: Path) -> None:
    """Bytes before/after per direction, and how much of each basis direction (by rank) lies in
    the previous frame's span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    dirs = ("forward", "backward")
    names = list(rec["forward"]["variants"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [rec[d]["variants"][name]["bytes_per_token"] for d in dirs]
        bars = a.bar([j + width * i for j in range(2)], vals, width, label=name)
        a.bar_label(bars, fmt="%.1f", fontsize=7)
    a.set_xticks([width * (len(names) - 1) / 2 + j for j in range(2)], dirs)
    a.set_ylabel("B/token per boundary")
    a.set_title(f"{rec['frame_tokens']}-token word frames, H = 576 (dense bf16: 1152)", fontsize=9)
    a.legend(fontsize=7, loc="lower right")
    for d in dirs:
        probes = rec["basis_probe"][d]
        k = len(probes[0]["span_overlap_per_rank"])
        mean = [statistics.mean(p["span_overlap_per_rank"][j] for p in probes) for j in range(k)]
        b.plot(range(k), mean, label=d)
    b.set_xlabel("basis direction (rank)")
    b.set_ylabel("energy inside the previous frame's span")
    b.set_title("per-frame basis against the previous frame's", fontsize=9)
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("fields", "coder"), default="fields")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="coder mode: timings per frame, fastest kept")
    ap.add_argument("--frame-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--plot", type=Path, default=None, help="coder mode: a PNG of the bytes and the basis probe"
    )
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # timings on a shared 2-core machine: one thread, as a loaded node
    if a.mode == "coder":
        rec = measure_coder(a.frames, a.frame_tokens, a.reps)
        for d in ("forward", "backward"):
            r = rec[d]
            m = r["median_s"]
            print(
                f"{d}: {r['bytes_per_token_before']:.1f} -> {r['bytes_per_token_after']:.1f} B/token "
                f"({100 * r['saved_share']:.1f}% fewer; {r['x_below_dense_bf16_before']:.2f}x -> "
                f"{r['x_below_dense_bf16_after']:.2f}x below dense bf16); per frame: codec "
                f"{1e3 * m['plain_encode_s']:.0f} + {1e3 * m['plain_decode_s']:.0f} ms, entropy stage "
                f"{1e3 * m['stage_encode_s']:.1f} + {1e3 * m['stage_decode_s']:.1f} ms "
                f"({100 * r['stage_share_of_codec']:.0f}% of the codec's)"
            )
        for d in ("forward", "backward"):
            v = rec[d]["variants"]
            print(
                f"{d}: "
                + ", ".join(f"{n} {v[n]['bytes_per_token']:.1f}" for n in VARIANTS)
                + f" B/token; rows sent once: {rec[d]['repeated_rows']}, dropping them "
                f"{1e3 * rec[d]['median_s']['repeats_drop_s']:.1f} ms, restoring "
                f"{1e3 * rec[d]['median_s']['repeats_restore_s']:.1f} ms per frame"
            )
        dup = rec["duplicate_rows"]
        print(f"forward rows repeating an earlier row exactly: {dup} of {rec['tokens']} tokens")
        if a.out:
            a.out.write_text(json.dumps(rec, indent=1))
        if a.plot:
            plot_coder(rec, a.plot)
        return 0
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
