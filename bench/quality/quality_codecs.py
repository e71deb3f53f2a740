"""The quality benchmark's codec building: the diagnostic codecs, calibration fits, the meter.

``build_codec`` turns a ``bench.quality.quality_tasks.Variant`` into a link codec: the registry's
(``compression.registry.make_codec``, what a node builds from the run record) or one of the
diagnostic codecs below, which no node ships. ``Metered`` times a codec and counts its payload
bytes while delegating every call, so the node's link code runs the real codec through it.
"""

from __future__ import annotations

import time

import torch

from bench.quality.quality_tasks import Variant
from compression.codec import LinkCodec, LinkContext, Payload, payload_nbytes
from compression.lowrank import LowRankCodec
from compression.outlier import OutlierMaskCodec, fit_outlier_channels
from compression.pca import PcaCodec, fit_basis, fit_joint_basis
from compression.registry import make_codec
from compression.tiered import TieredCodec, fit_rotation

# ------------------------------------------------------------------------------------------
# Timing + byte-counting wrapper: delegates to the real codec, so the node's link code runs it
# ------------------------------------------------------------------------------------------


class Metered(LinkCodec):
    def __init__(self, inner: LinkCodec):
        self.inner = inner
        self.codec_id = inner.codec_id
        self.seconds = 0.0
        self.bytes = {"fwd": 0, "bwd": 0}
        self.tokens = {"fwd": 0, "bwd": 0}
        self.counting = True
        # what the node's links ask of a codec (node.stage.linkio): the real codec's answers
        self.needs_basis = inner.needs_basis
        self.carries_tokens = inner.carries_tokens

    def _timed(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t
        return out

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def versions(self) -> tuple[int, ...]:
        return self.inner.versions

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        return self.inner.payload_dtypes()

    def _count(self, key: str, payload: Payload, n_tokens: int) -> None:
        if self.counting:
            self.bytes[key] += payload_nbytes(payload)
            self.tokens[key] += n_tokens

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        p = self._timed(self.inner.encode_forward, h, ctx)
        self._count("fwd", p, h.numel() // h.shape[-1])
        return p

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return self._timed(self.inner.decode_forward, payload, ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        p = self._timed(self.inner.encode_backward, g, ctx)
        self._count("bwd", p, g.numel() // g.shape[-1])
        return p

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return self._timed(self.inner.decode_backward, payload, ctx, shape)

    def bytes_per_token(self, hidden: int) -> float:
        return self.inner.bytes_per_token(hidden)

    def describe(self) -> dict:
        return self.inner.describe()


class PcaLowrank(PcaCodec):
    """Diagnostic: the fixed PCA basis on one direction, a per-frame low-rank basis
    (``compression.lowrank``) on the other. Says which direction needs the basis that follows
    the data: lowrank on both learns the word task like dense, PCA on both does not."""

    def __init__(self, lowrank_dir: str, lowrank_k: int = 64, **kw):
        if lowrank_dir not in ("forward", "backward"):
            raise ValueError(f"lowrank_dir must be forward or backward, not {lowrank_dir!r}")
        super().__init__(**kw)
        self.lowrank_dir, self.lowrank = lowrank_dir, LowRankCodec(k=lowrank_k)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.lowrank_dir == "forward":
            return self.lowrank.encode_forward(h, ctx)
        return super().encode_forward(h, ctx)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.lowrank_dir == "forward":
            return self.lowrank.decode_forward(payload, ctx, shape)
        return super().decode_forward(payload, ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.lowrank_dir == "backward":
            return self.lowrank.encode_backward(g, ctx)
        return super().encode_backward(g, ctx)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.lowrank_dir == "backward":
            return self.lowrank.decode_backward(payload, ctx, shape)
        return super().decode_backward(payload, ctx, shape)

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> float:
        if direction == self.lowrank_dir:
            return self.lowrank.frame_bytes(tokens, hidden, direction, sequences)
        return tokens * super().bytes_per_token(hidden)


class OneWay:
    """Diagnostic mixin, not a codec to ship: the codec it is mixed into on one ``direction``,
    dense bf16 on the other. ``forward`` compresses the activations and sends the gradient dense
    (straight-through: the sender applies the receiver's dense gradient as if the link were the
    identity); ``backward`` sends exact activations and compresses only the gradient."""

    def __init__(self, direction: str, **kw):
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be forward or backward, not {direction!r}")
        super().__init__(**kw)
        self.direction = direction

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.direction == "forward":
            return super().encode_forward(h, ctx)
        return {"h": h.detach().to(torch.bfloat16)}

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.direction == "forward":
            return super().decode_forward(payload, ctx, shape)
        return payload["h"].to(torch.float32).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.direction == "backward":
            return super().encode_backward(g, ctx)
        return {"g": g.detach().to(torch.bfloat16)}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        if self.direction == "backward":
            return super().decode_backward(payload, ctx, shape)
        return payload["g"].to(torch.float32).reshape(shape)


class PcaOneWay(OneWay, PcaCodec):
    """PCA on one direction, dense bf16 on the other: where learning through PCA fails."""

    def bytes_per_token(self, hidden: int) -> float:
        """Mean of the two directions (one PCA, one dense bf16)."""
        return (super().bytes_per_token(hidden) + 2 * hidden) / 2


class LowRankOneWay(OneWay, LowRankCodec):
    """The default link on one direction, dense bf16 on the other: whether the forward or the
    backward keeps it from learning like dense."""

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> int:
        if direction == self.direction:
            return super().frame_bytes(tokens, hidden, direction, sequences)
        return tokens * 2 * hidden


class PcaTwoBases(PcaCodec):
    """Candidate: the forward in the activations' PCA basis, the backward in the gradients' own.

    The activation basis keeps the forward near exact but only 13-25% of the boundary
    gradient's energy, and the one-direction diagnostics locate the word task's failure in the
    backward. Gradients have their own low-rank structure (a 96-direction basis of calibration
    gradients keeps 91-94% of their energy), so the backward sends Q(g V_g) and the sender
    applies (g V_g) V_gᵀ to h as if the link were the identity (straight-through: the forward
    is close to it). Not an exact adjoint of the forward any more; bases are fitted once.
    """

    def set_grad_basis(self, v_g: torch.Tensor) -> None:
        self._v_g = v_g.to(torch.float32).contiguous()

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = g.detach().reshape(-1, g.shape[-1]).to(torch.float32)
        return self._pack(rows @ self._v_g)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape) -> torch.Tensor:
        return (self._unpack(payload) @ self._v_g.T).reshape(shape)


def grad_basis(grads: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k uncentred directions of the gradients (energy, not variance)."""
    g = grads.detach().to(torch.float64)
    _, vecs = torch.linalg.eigh(g.T @ g)
    return vecs[:, -k:].flip(-1).to(torch.float32)


def step_wire_bytes(codec: LinkCodec, n_tok: int, dense_now: bool, hidden: int, sequences: int = 0) -> float:
    """Payload bytes per boundary per direction of one step (mean of the two directions)."""
    if dense_now:
        return n_tok * 2 * hidden  # dense bf16
    if hasattr(codec, "frame_bytes"):  # a per-frame basis: charged with every frame
        return (
            codec.frame_bytes(n_tok, hidden, "forward", sequences=sequences)
            + codec.frame_bytes(n_tok, hidden, "backward", sequences=sequences)
        ) / 2
    return n_tok * codec.bytes_per_token(hidden)


def build_codec(variant: Variant) -> LinkCodec:
    if variant.codec == "pca-oneway":
        return PcaOneWay(**variant.settings)
    if variant.codec == "pca-lowrank":
        return PcaLowrank(**variant.settings)
    if variant.codec == "lowrank-oneway":
        return LowRankOneWay(**variant.settings)
    if variant.codec == "pca-2bases":
        return PcaTwoBases(**variant.settings)
    return make_codec(variant.codec, **variant.settings)


def calibrated(codec: LinkCodec) -> bool:
    """Codecs holding per-boundary state fitted from the dense model (a PCA basis, including
    pcamask's pool, or outliermask's channel set), published once and named by version."""
    return isinstance(codec, (PcaCodec, OutlierMaskCodec, TieredCodec))


def published_bytes(codec: LinkCodec, hidden: int) -> int:
    """Bytes of one published version of a calibrated codec's state (0: it publishes none)."""
    if isinstance(codec, TieredCodec):  # one rotation per direction; bytes are per direction
        return codec.rotation_nbytes(hidden)
    return codec.basis_nbytes(hidden) if calibrated(codec) else 0


def needs_grads(codec: LinkCodec) -> bool:
    """Calibration must also take the boundary gradients of the answer loss."""
    return bool(getattr(codec, "grad_k", 0)) or isinstance(codec, (PcaTwoBases, TieredCodec))


def fit_boundary(codec: LinkCodec, acts: torch.Tensor, grads: torch.Tensor | None, version: int) -> None:
    """Install one boundary's fitted state from its calibration activations (and gradients)."""
    if isinstance(codec, TieredCodec):
        codec.set_rotations(fit_rotation(acts, centre=True), fit_rotation(grads, centre=False), version)
    elif isinstance(codec, OutlierMaskCodec):
        codec.set_channels(fit_outlier_channels(acts, codec.n_outlier), acts.shape[-1], version)
    elif isinstance(codec, PcaTwoBases):
        codec.set_basis(*fit_basis(acts, codec.k), version)
        codec.set_grad_basis(grad_basis(grads, codec.k))
    elif grads is not None:
        codec.set_basis(*fit_joint_basis(acts, grads, codec.k, codec.grad_k), version)
    else:
        codec.set_basis(*fit_basis(acts, codec.k), version)
