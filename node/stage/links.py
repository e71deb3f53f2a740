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


# The lowrank link a new run gets (``--link``, for the lowrank flags its starter leaves unset).
# stepped, the default at long frames (a GPU starter's 2048 tokens): 112 forward / 128 backward
# directions, every coefficient at one uniform step (1.0x the k-th direction's RMS) and entropy
# coded so each direction gets bits by its energy, the int8 basis quantised no finer than that step
# needs, the sink position apart and its gradient gained 8x, repeated rows sent once. 20-24x below
# dense bf16 per direction at the bundled model's 2048-token frames and 0.95-1.00x dense's held-out
# exact match on all five bench tasks, three seeds each (bench/results/quality.md, 19th section:
# ``lowrankq112-128s1v1g8a+er``). Its cost: the entropy stage runs in each end's compute thread,
# ~20-30 ms per frame for the two ends together on loaded CPU cores (bench/results/entropy.md).
# tiered, the default until then (10.5x, 0.93x dense on word): 112 directions in two tiers (24 at 8
# bits, 88 at 4), the sink apart, no lossless stage. plain, the default at short frames (a CPU
# starter's --microbatch examples, ~136 tokens in `make demo`): 80 directions at 8 bits, position 0
# in the shared code; there a 112-direction basis and the sinks' own code cost more per token than
# they save, and entropy coding's per-frame cost buys little.
LONG_FRAME_TOKENS = 2048
LINKS = ("auto", "stepped", "tiered", "plain")
_PLAIN = {
    "codec_k": 0,
    "lowrank_k_backward": 0,
    "lowrank_step": 0.0,
    "lowrank_basis_step": 0.0,
    "lowrank_first_gain": 0.0,
    "lowrank_tiers": "",
    "lowrank_first": "shared",
    "lowrank_entropy": "off",
    "lowrank_repeats": "off",
}
LINK_LAYOUTS: dict[str, dict[str, object]] = {
    "plain": _PLAIN,
    "tiered": {**_PLAIN, "lowrank_tiers": "24x8,88x4", "lowrank_first": "apart"},
    "stepped": {
        **_PLAIN,
        "codec_k": 112,
        "lowrank_k_backward": 128,
        "lowrank_step": 1.0,
        "lowrank_basis_step": 1.0,
        "lowrank_first_gain": 8.0,
        "lowrank_first": "apart",
        "lowrank_entropy": "on",
        "lowrank_repeats": "on",
    },
}
LAYOUT_FLAGS = tuple(_PLAIN)  # the flags a link sets: a launcher passes them to its nodes as resolved


def pick_link(link: str, microbatch_tokens: int, given: dict[str, object], emulated: bool = False) -> str:
    """The link layout for ``--link link`` at ``microbatch_tokens``-token frames, where ``given``
    holds the lowrank flags the user set. ``auto`` picks by the frames, then bows to flags that only
    another layout honours: tiers mean tiers; the stepped link's codes need its entropy stage and its
    step, so turning either off, or asking for fixed-bit backward codes, means a plain k. An
    ``emulated`` model's links (node.stage.emulated) send the tiered link: entropy-coded sizes depend
    on values the emulation never computes."""
    if link != "auto":
        return link
    if microbatch_tokens < LONG_FRAME_TOKENS:
        return "plain"
    if emulated:
        return "tiered"
    if given.get("lowrank_tiers") or given.get("pca_dtype", "int8") != "int8":
        return "tiered"  # the steps are int8 codes
    if given.get("lowrank_basis", "int8") != "int8" and "lowrank_step" not in given:
        return "tiered"  # the stepped basis is an int8 one
    if given.get("lowrank_entropy") == "off" and "lowrank_step" not in given:
        return "tiered"
    if given.get("lowrank_step") == 0 or "lowrank_backward_bits" in given:
        return "plain"
    return "stepped"


def lowrank_layout(
    microbatch_tokens: int, link: str = "auto", given: dict[str, object] | None = None, emulated: bool = False
) -> dict:
    """The lowrank flags' values, ``link`` resolved to its layout's name among them, for a run whose
    microbatches are packed to ``microbatch_tokens`` (0: a fixed number of examples, i.e. short
    frames); the flags in ``given`` keep their value."""
    given = given or {}
    name = pick_link(link, microbatch_tokens, given, emulated)
    return {"link": name, **{n: v for n, v in LINK_LAYOUTS[name].items() if n not in given}}


def pinned_layout_flags(cfg: NodeConfig) -> tuple[str, ...]:
    """The lowrank flags a launcher writes on each node's command line, so that the node resolves
    nothing anew: the link by name, the flags with no dataclass default, and every flag whose value
    is not its link's (a flag given at its dataclass default, ``--lowrank-first shared`` at long
    frames, would otherwise be left out and resolved back to the layout's)."""
    if cfg.codec != "lowrank" or cfg.link not in LINK_LAYOUTS:
        return ()
    layout = LINK_LAYOUTS[cfg.link]
    own = ("lowrank_tiers", "lowrank_first", "lowrank_entropy", "lowrank_repeats")
    return ("link", *own, *(n for n, v in layout.items() if n not in own and getattr(cfg, n) != v))


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
