"""Per-token forward error of each link codec on the untrained model's boundary activations.

    python -m bench.quality.link_error --out bench/results

For each task: PCA bases are fitted exactly as ``bench.quality.quality`` does (128 task examples from
the calibration stream, dense model, step 0); then 64 held-out examples go through the
dense stages and each boundary's activations through encode_forward/decode_forward. The
error of a token is ||D(E(h)) - h|| / ||h||; position 0 (which carries a huge norm, DESIGN §7)
is reported apart from the rest. Writes ``link_error.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.quality.quality_codecs import Metered
from bench.quality.quality_pipeline import Pipeline, batches, calibrate
from bench.quality.quality_tasks import CALIB_EXAMPLES, HIDDEN, RANGES, VARIANTS, held_out, task_stream
from compression.codec import LinkContext
from compression.pca import PcaCodec
from compression.prf import mask_seed
from compression.registry import make_codec
from node.model.loading import load_model

NAMES = ["m95", "m90", "pca29bf16", "pca58i8", "pca96i8", "int4", "topk29"]


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tasks", default="arithmetic,word")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, _ = load_model("bundled")
    pipe = Pipeline(model)
    pad = tok.eos_token_id
    result = {}
    for task in args.tasks.split(","):
        cs = task_stream(task, 7_000_003)
        calib = [next(cs) for _ in range(CALIB_EXAMPLES)]
        evals = held_out(task, 64, set())
        acts = [[] for _ in RANGES[:-1]]
        for ids, _ in batches(evals, tok, pad):
            for b, h in enumerate(pipe.hidden(ids, None)):
                acts[b].append(h)
        result[task] = {}
        for name in NAMES:
            v = VARIANTS[name]
            codecs = [Metered(make_codec(v.codec, **v.settings)) for _ in RANGES[:-1]]
            if v.codec == "pca":
                calibrate(pipe, codecs, calib, tok, pad, 0)
            per_b = []
            for b, hs in enumerate(acts):
                errs0, errs = [], []
                for j, h in enumerate(hs):
                    c = codecs[b].inner
                    seed = mask_seed(0, 0, j, b)
                    ctx = c.link_context(seed) if isinstance(c, PcaCodec) else LinkContext(seed=seed)
                    r = c.decode_forward(c.encode_forward(h, ctx), ctx, tuple(h.shape))
                    e = (r - h).norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-12)
                    errs0.append(e[:, 0])
                    errs.append(e[:, 1:].reshape(-1))
                rest = torch.cat(errs)
                per_b.append(
                    {
                        "boundary": b,
                        "token0_median": float(torch.cat(errs0).median()),
                        "rest_median": float(rest.median()),
                        "rest_p90": float(rest.quantile(0.9)),
                    }
                )
            result[task][name] = {"bytes_per_token": codecs[0].bytes_per_token(HIDDEN), "boundaries": per_b}
            meds = " ".join(f"{p['rest_median']:.3f}" for p in per_b)
            print(f"{task:10s} {name:10s} median error, positions >= 1, per boundary: {meds}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "link_error.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
