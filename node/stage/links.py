"""Which codec each pipeline boundary uses, per step, and the settings a run publishes.

A node has up to two links: its input boundary (stage-1 -> stage) and its output boundary
(stage -> stage+1). Each gets its own codec instances, because basis codecs (PCA) hold a
different basis per boundary. A run may also schedule a dense step every K steps (the
periodic clean step baseline); both ends then expect either codec, named in the frame.
"""

from __future__ import annotations

import torch

from compression.codec import DenseCodec, LinkCodec, LinkContext
from compression.mask import is_dense_step
from compression.registry import make_codec
from compression.tiered import check_tiers
from node.config import NodeConfig
from node.model.stages import IGNORE_INDEX
from protocol.records import RunRecord

# --codec-k 0: each codec's own k. lowrank 80: the most directions whose per-frame basis keeps
# each direction >= 10x below dense bf16 at a GPU starter's 2048-token microbatches (110.5 B/token
# at H = 576), and the first k that reached 0.9x dense on the word task there (0.740 vs 0.820;
# k = 64, 13.2x: 0.645; bench/results/quality.md); pca 96: the fixed basis's measured default.
DEFAULT_K = {"lowrank": 80, "pca": 96, "topk": 96, "bottleneck": 96}


# The lowrank layout a new run gets for the frames its starter sends (the flags it leaves unset).
# Long frames (a GPU starter's 2048 tokens): 112 directions in two tiers (24 at 8 bits, 88 at 4)
# and each sequence's first position (the attention sink) coded apart, at 109.8 B/token per
# direction on the bundled model (10.5x below dense bf16): the best learner measured at >= 10x
# (word 0.765 / 0.735 EM on two seeds against the plain k = 80's 0.740 / 0.700; arithmetic and
# ordering: bench/results/quality.md, tenth section). The loss-share fit stays off: it lowered the
# first step's answer KL by a third but learnt the word task worse (0.690 / 0.680). Short frames (a
# CPU starter's --microbatch examples, ~136 tokens in `make demo`): 80 directions at 8 bits and
# position 0 in the shared code, since there a 112-direction basis and the sinks' own code cost
# more per token than they save.
# The lossless entropy stage (--lowrank-entropy) stays off in both: on the bundled model's 2048-token
# frames it sends 7.0% fewer bytes forward and 12.7% backward (110.0 -> 102.3 / 96.1 B/token, the
# decoded tensors bit-identical), but it runs in each end's compute thread, serially with the
# stage's math: ~20 / ~30 ms per frame for the two ends together (loaded CPU cores) to save ~1.6 /
# ~2.8 ms of wire time at 80 Mbit/s; serially it pays below ~6-7 Mbit/s, and on a link-bound run
# only where the compute thread has that time to spare (bench/results/entropy.md). A one-word
# change here turns it on. Repeated rows sent once (--lowrank-repeats) are cheap (~2.5 ms per
# frame) and lossless, 8.2% fewer bytes forward on word frames (their prompts share first tokens),
# but off: the benchmarks and tests/test_links_swarm.py count a frame's bytes as ``frame_bytes`` of
# its shape, which the references make an upper bound (bench/results/entropy.md).
LONG_FRAME_TOKENS = 2048
LONG_FRAME_LAYOUT = {
    "lowrank_tiers": "24x8,88x4",
    "lowrank_first": "apart",
    "lowrank_entropy": "off",
    "lowrank_repeats": "off",
}
SHORT_FRAME_LAYOUT = {
    "lowrank_tiers": "",
    "lowrank_first": "shared",
    "lowrank_entropy": "off",
    "lowrank_repeats": "off",
}


def lowrank_layout(microbatch_tokens: int) -> dict[str, str]:
    """The lowrank flags' defaults for a run whose microbatches are packed to ``microbatch_tokens``
    (0: a fixed number of examples, i.e. short frames)."""
    return dict(LONG_FRAME_LAYOUT if microbatch_tokens >= LONG_FRAME_TOKENS else SHORT_FRAME_LAYOUT)


def codec_settings(cfg: NodeConfig, model=None) -> dict:
    """The codec description a new run publishes (what ``describe()`` of the codec returns).

    ``subspace`` needs the model's vocabulary and hidden size: U and T are rebuilt from the run
    seed by every peer, so the description carries (k, seed, vocab, hidden), never the tensors.
    """
    name = cfg.codec
    if name == "subspace":
        if model is None:
            raise ValueError("the subspace codec's settings need the model (vocab, hidden)")
        kw = {
            "k": cfg.subspace_rank,
            "seed": cfg.seed,
            "vocab": model.config.vocab_size,
            "hidden": model.config.hidden_size,
            "wire_dtype": cfg.wire_dtype,
        }
        return make_codec(name, **kw).describe()
    k = cfg.codec_k or DEFAULT_K.get(name, 0)
    if name == "dense":
        kw = {"wire_dtype": cfg.wire_dtype}
    elif name == "mask":
        kw = {"rate": cfg.mask_rate, "wire_dtype": cfg.wire_dtype, "rescale": cfg.mask_rescale}
    elif name == "pca":
        if model is not None:  # the default k = 96 on a model narrower than that: keep every direction
            k = min(k, model.config.hidden_size)
        kw = {"k": k, "coeff_dtype": cfg.pca_dtype}
    elif name == "lowrank":
        k = k if model is None else min(k, model.config.hidden_size)
        kw = {"k": k, "coeff_dtype": cfg.pca_dtype, "basis_dtype": cfg.lowrank_basis}
        if cfg.lowrank_basis == "int8":
            kw["basis_block"] = 32  # one scale per direction loses the small entries (quality.md)
        if cfg.lowrank_k_backward:
            kw["k_backward"] = (
                cfg.lowrank_k_backward
                if model is None
                else min(cfg.lowrank_k_backward, model.config.hidden_size)
            )
        if cfg.lowrank_backward_bits != 8:
            kw["backward_bits"] = cfg.lowrank_backward_bits
        if cfg.lowrank_tiers:
            kw["tiers"] = kw["backward_tiers"] = parse_tiers(cfg.lowrank_tiers)
        if cfg.lowrank_backward_tiers:
            kw["backward_tiers"] = parse_tiers(cfg.lowrank_backward_tiers, "--lowrank-backward-tiers")
        if cfg.lowrank_step:  # one step in both directions, the backward's own if given
            kw["step"] = kw["backward_step"] = cfg.lowrank_step
            if cfg.lowrank_backward_step:
                kw["backward_step"] = cfg.lowrank_backward_step
            if cfg.lowrank_basis_step:
                kw["basis_step"] = cfg.lowrank_basis_step
        if cfg.lowrank_first_gain:
            kw["first_gain"] = cfg.lowrank_first_gain
        if cfg.lowrank_centre != "mean":
            kw["centre"] = cfg.lowrank_centre
        if cfg.lowrank_first == "apart":
            kw["first_apart"] = True
        if cfg.lowrank_fit == "loss-share":
            kw["loss_share"] = True
        if cfg.lowrank_entropy == "on":
            kw["entropy"] = True
        if cfg.lowrank_repeats == "on":
            kw["repeats"] = True
    elif name in ("topk", "bottleneck"):
        kw = {"k": k}
    else:
        kw = {}
    return make_codec(name, **kw).describe()


def loss_rows(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose output the loss reads (bool, labels' shape): those whose next token is
    labelled (a causal LM's output at t predicts t + 1). A forward frame's labels travel with it,
    so every hop knows these rows without a byte more (``LinkContext.loss_rows``)."""
    rows = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    rows[..., :-1] = labels[..., 1:] != IGNORE_INDEX
    return rows


def parse_tiers(text: str, flag: str = "--lowrank-tiers") -> tuple[tuple[int, int], ...]:
    """``24x8,88x4`` -> ((24, 8), (88, 4)): directions and bits per tier, falling precision."""
    try:
        parts = [part.split("x") for part in text.split(",")]
        if any(len(p) != 2 for p in parts):
            raise ValueError(text)
        return check_tiers(tuple((int(n), int(b)) for n, b in parts))
    except ValueError:
        raise ValueError(
            f"{flag} {text!r}: expected DIRSxBITS pairs such as 24x8,88x4 (bits 8, 4 or 2)"
        ) from None


def build_codec(desc: dict) -> LinkCodec:
    return make_codec(desc["codec"], **{k: v for k, v in desc.items() if k != "codec"})


def forward_frame_tensors(desc: dict) -> int:
    """How many tensors a forward frame of this codec carries, its labels' two included: a receiver
    refuses a frame of more than ``protocol.frames.MAX_TENSORS``, so a run whose frames would hold
    more can never train. Counted on a small random frame (4 sequences, hidden wider than the
    codec's directions), since which fields a codec writes depends on many of its settings."""
    codec = build_codec(desc)
    dirs = [n for tiers in (desc.get("tiers"), desc.get("backward_tiers")) if tiers for n, _ in tiers]
    hidden = max(sum(dirs), desc.get("k", 0), desc.get("k_backward", 0)) + 16
    x = torch.randn(4, 8, hidden, generator=torch.Generator().manual_seed(0))
    return len(codec.encode_forward(x, LinkContext())) + 2  # + pack_labels' sparse layout


class Link:
    """The codecs of one boundary: the run's codec and, if scheduled, the dense one."""

    def __init__(self, run: RunRecord, boundary: int, dense_only: bool = False):
        self.boundary = boundary
        wire = run.codec.get("wire_dtype", "bfloat16")
        # the anchor circuit is dense by definition, whatever codec the fast circuit uses
        self.main = DenseCodec(wire) if dense_only else build_codec(run.codec)
        self.dense_every = 0 if dense_only else run.dense_every
        self.dense = self.main if self.main.codec_id == "dense" else DenseCodec(wire)

    @property
    def needs_basis(self) -> bool:
        return self.main.needs_basis

    def for_step(self, step: int) -> LinkCodec:
        return self.dense if self.dense_every and is_dense_step(step, self.dense_every) else self.main

    def by_id(self, codec_id: str) -> LinkCodec | None:
        """The codec a received frame names, or None if this run does not use it on this link."""
        if codec_id == self.main.codec_id:
            return self.main
        if codec_id == "dense" and self.dense_every:
            return self.dense
        return None
