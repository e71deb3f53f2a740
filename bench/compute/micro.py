"""Micro-benchmarks of the compression math, on CPU or CUDA, against one decoder layer's compute.

    python -m bench.compute.micro [--device cpu|cuda] [--hidden 576 2048] [--tokens 1024] [--out FILE]

For each hidden size it times: mask generation and the mask codec's four calls, the PCA
codec's (int8), the spectral filter's refresh (EMA + SVD on an anchor packet) and apply,
PowerSGD's three phases on an MLP matrix, and, as the yardstick, forward+backward of one
Llama decoder layer on the same tokens. Ratios are printed side by side from one run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from compression.codec import LinkContext
from compression.mask import MaskCodec
from compression.pca import PcaCodec, fit_basis
from compression.powersgd import PowerSGD
from compression.prf import k_for_rate, select_channels
from compression.spectral import SpectralFilter


def timed(fn, device: torch.device, repeat: int = 5) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def layer_time(hidden: int, tokens: int, device: torch.device) -> float:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    heads = max(1, hidden // 64)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        attn_implementation="sdpa",
    )
    layer = LlamaDecoderLayer(cfg, 0).to(device)
    rope = LlamaRotaryEmbedding(cfg).to(device)
    seq = 128
    x = torch.randn(tokens // seq, seq, hidden, device=device, requires_grad=True)
    pos = torch.arange(seq, device=device).unsqueeze(0)

    def step():
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope(x, pos))
        y.sum().backward()

    return timed(step, device, repeat=3)


def bench(hidden: int, tokens: int, device: torch.device) -> dict:
    h = torch.randn(tokens, hidden, device=device)
    g = torch.randn(tokens, hidden, device=device)
    ctx = LinkContext(seed=12345)
    out: dict[str, float] = {}

    k = k_for_rate(hidden, 0.95)
    out["mask_select_s"] = timed(lambda: select_channels(ctx.seed, tokens, hidden, k, device=device), device)
    mask = MaskCodec(0.95)
    shape = tuple(h.shape)
    out["mask_codec_s"] = timed(
        lambda: (
            mask.decode_forward(mask.encode_forward(h, ctx), ctx, shape),
            mask.decode_backward(mask.encode_backward(g, ctx), ctx, shape),
        ),
        device,
    )

    pca = PcaCodec(k=58 if hidden == 576 else 2 * k, coeff_dtype="int8")
    mean, v = fit_basis(h[:2048].float().cpu(), pca.k)
    pca.set_basis(mean.to(device), v.to(device), 1)
    pctx = pca.link_context()
    out["pca_codec_s"] = timed(
        lambda: (
            pca.decode_forward(pca.encode_forward(h, pctx), pctx, shape),
            pca.decode_backward(pca.encode_backward(g, pctx), pctx, shape),
        ),
        device,
    )

    m, n = hidden, int(hidden * 8 / 3) // 64 * 64
    filt = SpectralFilter()
    packet = torch.randn(m, n, device=device)
    grad = torch.randn(m, n, device=device)
    step = [0]

    def refresh():
        step[0] += 1
        filt.observe("layers.0.mlp.up_proj.weight", packet, step[0], step[0])

    out["filter_refresh_s"] = timed(refresh, device, repeat=3)
    out["filter_apply_s"] = timed(lambda: filt.apply("layers.0.mlp.up_proj.weight", grad), device)

    psgd = PowerSGD(rank=16, seed=0)
    delta = torch.randn(m, n, device=device)

    def round_():
        p = psgd.phase1("w", delta)
        q = psgd.phase2("w", p)
        psgd.finish("w", q)

    out["powersgd_round_s"] = timed(round_, device)
    out["layer_fwd_bwd_s"] = layer_time(hidden, tokens, device)
    base = out["layer_fwd_bwd_s"]
    out.update(
        {
            f"{key[:-2]}_per_layer": out[key] / base
            for key in list(out)
            if key.endswith("_s") and key != "layer_fwd_bwd_s"
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, nargs="+", default=[576, 2048])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    results = {
        "device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "tokens": a.tokens,
        "threads": torch.get_num_threads(),
        "runs": {},
    }
    for hidden in a.hidden:
        r = bench(hidden, a.tokens, device)
        results["runs"][str(hidden)] = r
        print(f"hidden {hidden}, {a.tokens} tokens on {results['device']}:")
        for key, val in r.items():
            unit = "x one layer" if key.endswith("_per_layer") else "s"
            print(f"  {key:28s} {val:10.4f} {unit}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
