"""Baseline pipeline-link codecs for the comparison tables (DESIGN.md 4.6).

* ``TopKCodec`` ("topk"): per token, the k channels of largest magnitude (values + indices).
* ``QuantCodec`` ("int8", "int4"): blockwise absmax quantisation of every channel.
* ``BottleneckCodec`` ("bottleneck"): a fixed random orthonormal projection H -> k.

Each states its byte count exactly (``bytes_per_token`` equals ``payload_nbytes`` of a frame
divided by the tokens in it) and its error bound in the class docstring. The blockwise
quantisation helpers here are shared with the PCA codec (``compression.pca``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F

from compression.codec import WIRE_DTYPES, LinkCodec, LinkContext, Payload

# --------------------------------------------------------------------------------------------
# Blockwise absmax quantisation (shared with compression.pca)
# --------------------------------------------------------------------------------------------


def _scale_dtype(name: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ValueError(f"scale dtype {name!r} not in {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def _round_scale_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive fp32 scales to ``dtype``, rounding up, so ``|x| / scale <= qmax`` still holds.

    Round-to-nearest could give a stored scale slightly below absmax/qmax; the largest value
    would then clip and its error exceed scale/2. For positive floats the bit pattern is
    monotone, so one step up in the integer view is the next representable value.
    """
    r = s.to(dtype)
    if dtype == torch.float32:
        return r
    if torch.isinf(r).logical_and(torch.isfinite(s)).any():
        raise ValueError(f"block absmax exceeds the {dtype} scale range; use bfloat16 scales")
    low = r.to(torch.float32) < s
    bumped = (r.view(torch.int16) + 1).view(dtype)
    return torch.where(low, bumped, r)


def quantize_blockwise(
    x: torch.Tensor, block: int, bits: int, scale_dtype: torch.dtype, floor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of each row of ``x`` (T, n) in blocks of ``block`` values.

    Returns ``q`` (T, n) int8 in [-qmax, qmax] with qmax = 2**(bits-1) - 1, and ``scale``
    (T, ceil(n/block)) in ``scale_dtype``. The last block is zero-padded for the absmax only;
    the padding is not part of ``q``. Guarantee: ``|x - q*scale| <= scale/2`` per value (up to
    fp32 rounding), because the stored scale is rounded up, never down. ``floor`` (T,): the
    smallest step of each row's blocks (a coarser quantiser where the row matters less).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    t, n = x.shape
    nb = math.ceil(n / block)
    qmax = 2 ** (bits - 1) - 1
    xp = F.pad(x.to(torch.float32), (0, nb * block - n)).view(t, nb, block)
    s = xp.abs().amax(dim=-1) / qmax
    if floor is not None:
        s = torch.maximum(s, floor.to(torch.float32).unsqueeze(-1))
    scale = _round_scale_up(s, scale_dtype)
    sf = scale.to(torch.float32)
    div = torch.where(sf > 0, sf, torch.ones_like(sf))  # all-zero block: q = 0, scale = 0
    q = torch.round(xp / div.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(t, nb * block)[:, :n].contiguous(), scale.contiguous()


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: (T, n) fp32 from int8 ``q`` and per-block ``scale``.

    ``scale`` must be exactly (T, ceil(n/block)): a received one of another shape would broadcast
    or crop into a silently wrong tensor (a fuzz finding), so it is refused."""
    if q.dim() != 2:
        raise ValueError(f"quantized values must be 2-D, got shape {tuple(q.shape)}")
    t, n = q.shape
    nb = math.ceil(n / block)
    if tuple(scale.shape) != (t, nb):
        raise ValueError(f"block scales have shape {tuple(scale.shape)}, expected {(t, nb)}")
    qp = F.pad(q.to(torch.float32), (0, nb * block - n)).view(t, nb, block)
    return (qp * scale.to(torch.float32).unsqueeze(-1)).view(t, nb * block)[:, :n]


def encode_coeffs(c: torch.Tensor, coeff_dtype: str, block: int, scale_dtype: torch.dtype) -> Payload:
    """Basis coefficients as sent: int8 in blocks of ``block`` with scales, or in a wire dtype."""
    if coeff_dtype == "int8":
        q, scale = quantize_blockwise(c, block, 8, scale_dtype)
        return {"q": q, "scale": scale}
    return {"c": c.to(WIRE_DTYPES[coeff_dtype]).contiguous()}


def decode_coeffs(payload: Payload, coeff_dtype: str, block: int) -> torch.Tensor:
    """The fp32 coefficients of ``encode_coeffs``' payload."""
    if coeff_dtype == "int8":
        return dequantize_blockwise(payload["q"], payload["scale"], block)
    return payload["c"].to(torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 values in [-7, 7] (T, n) two per byte: (T, ceil(n/2)) uint8.

    Each value is stored offset by 8 (so 0..15); element 2j goes in the low nibble of byte j,
    element 2j+1 in the high nibble. An odd n is padded with a zero value (nibble 8).
    """
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = F.pad(u, (0, 1), value=8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_int4``: (T, n) int8 in [-8, 7]."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).view(packed.shape[0], -1)[:, :n]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., H) -> (T, H): every codec works per token."""
    return x.detach().reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------


def _index_dtype(hidden: int) -> torch.dtype:
    return torch.int16 if hidden <= 32767 else torch.int32


class TopKCodec(LinkCodec):
    """Per token, the ``k`` channels of largest |h| (values + indices); zeros elsewhere.

    Payload per direction: ``v`` (T, k) values in ``value_dtype`` and ``i`` (T, k) indices,
    int16 when H <= 32767 else int32. Bytes per token = k * (value bytes + index bytes).

    Error bound (forward): kept channels are exact up to the value dtype's rounding (2**-9
    relative for bf16); every dropped channel has |h| <= the smallest kept |h|, and the
    dropped energy is at most (H - k) / H of the token's energy (they are the H - k smallest).

    Backward, ``backward="same"`` (default): the exact adjoint of the selection, i.e. the
    gradient at the forward's indices, which is what autograd through ``h * mask`` gives. The
    receiver learns the indices in ``decode_forward`` and keeps them, keyed by the frame's
    LinkContext, until ``encode_backward`` for the same context takes them; so each in-flight
    microbatch needs its own ``ctx`` (the node's per-microbatch seed does this). At most
    ``max_pending`` forwards without a backward (e.g. eval passes) are kept, oldest dropped.
    The sender remembers nothing: the backward payload carries the indices again (counted).
    ``backward="topk"``: stateless, the top-k of the gradient itself (not the adjoint).
    """

    codec_id = "topk"

    def __init__(self, k: int, value_dtype: str = "bfloat16", backward: str = "same", max_pending: int = 256):
        if k < 1:
            raise ValueError(f"k must be >= 1, not {k}")
        if value_dtype not in WIRE_DTYPES:
            raise ValueError(f"value dtype {value_dtype!r} not in {sorted(WIRE_DTYPES)}")
        if backward not in ("same", "topk"):
            raise ValueError(f"backward must be 'same' or 'topk', not {backward!r}")
        self.k, self.value_dtype, self.backward = k, value_dtype, backward
        self._dtype = WIRE_DTYPES[value_dtype]
        self.max_pending = max_pending
        self._pending: OrderedDict[LinkContext, torch.Tensor] = OrderedDict()

    def _select(self, x: torch.Tensor) -> Payload:
        rows = _rows(x)
        if self.k > rows.shape[-1]:
            raise ValueError(f"k = {self.k} exceeds hidden size {rows.shape[-1]}")
        idx = rows.abs().topk(self.k, dim=-1, sorted=False).indices
        return self._at(rows, idx)

    def _at(self, rows: torch.Tensor, idx: torch.Tensor) -> Payload:
        vals = rows.gather(-1, idx.long())
        return {
            "v": vals.to(self._dtype).contiguous(),
            "i": idx.to(_index_dtype(rows.shape[-1])).contiguous(),
        }

    @staticmethod
    def _scatter(payload: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        v = payload["v"]
        out = torch.zeros(v.shape[0], shape[-1], dtype=torch.float32, device=v.device)
        out.scatter_(-1, payload["i"].long(), v.to(torch.float32))
        return out.reshape(shape)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._select(h)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        if self.backward == "same":
            self._pending[ctx] = payload["i"]
            self._pending.move_to_end(ctx)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
        return self._scatter(payload, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        if self.backward == "topk":
            return self._select(g)
        idx = self._pending.pop(ctx, None)
        if idx is None:
            raise ValueError(f"topk backward: no forward indices pending for {ctx}")
        rows = _rows(g)
        if idx.shape[0] != rows.shape[0]:
            raise ValueError(f"topk backward: {rows.shape[0]} tokens, forward had {idx.shape[0]}")
        return self._at(rows, idx.to(rows.device))

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._scatter(payload, shape)

    def bytes_per_token(self, hidden: int) -> float:
        return float(self.k * (self._dtype.itemsize + _index_dtype(hidden).itemsize))

    def describe(self) -> dict:
        return {
            "codec": self.codec_id,
            "k": self.k,
            "value_dtype": self.value_dtype,
            "backward": self.backward,
        }


# --------------------------------------------------------------------------------------------
# Blockwise int8 / int4
# --------------------------------------------------------------------------------------------


class QuantCodec(LinkCodec):
    """Blockwise symmetric absmax quantisation of all H channels, both directions.

    Each token's channels are split into ceil(H/block) blocks; a block stores one scale
    (absmax / qmax, rounded *up* to ``scale_dtype``) and its values as round(x / scale) with
    qmax = 127 (int8) or 7 (int4). int4 values are packed two per byte.

    Payload per direction: ``q`` (T, H) int8, or (T, ceil(H/2)) uint8 for int4, and
    ``scale`` (T, ceil(H/block)). Bytes per token = H (int8) or ceil(H/2) (int4)
    + ceil(H/block) * scale bytes.

    Error bound: |x - x̂| <= scale/2 per value, scale being the value's stored block scale
    (<= absmax/qmax * (1 + 2**-7) for bf16 scales). The backward is the same quantiser applied
    to the gradient, not an adjoint of the forward (the forward is not linear).
    Default block 64: at H = 576 int4 costs 306 B/token, the 153 bf16-equivalents of DESIGN §7.
    """

    def __init__(self, bits: int = 8, block: int = 64, scale_dtype: str = "bfloat16"):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {bits}")
        if block < 1:
            raise ValueError(f"block must be >= 1, not {block}")
        self.bits, self.block, self.scale_dtype = bits, block, scale_dtype
        self._sdtype = _scale_dtype(scale_dtype)
        self.codec_id = f"int{bits}"

    def _encode(self, x: torch.Tensor) -> Payload:
        q, scale = quantize_blockwise(_rows(x), self.block, self.bits, self._sdtype)
        return {"q": pack_int4(q) if self.bits == 4 else q, "scale": scale}

    def _decode(self, payload: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        q = payload["q"]
        if self.bits == 4:
            q = unpack_int4(q, shape[-1])
        return dequantize_blockwise(q, payload["scale"], self.block).reshape(shape)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._encode(h)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode(payload, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._encode(g)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode(payload, shape)

    def bytes_per_token(self, hidden: int) -> float:
        values = hidden if self.bits == 8 else math.ceil(hidden / 2)
        return float(values + math.ceil(hidden / self.block) * self._sdtype.itemsize)

    def describe(self) -> dict:
        return {"codec": self.codec_id, "block": self.block, "scale_dtype": self.scale_dtype}


# --------------------------------------------------------------------------------------------
# Fixed random bottleneck
# --------------------------------------------------------------------------------------------


def random_orthonormal(hidden: int, k: int, seed: int) -> torch.Tensor:
    """(hidden, k) fp32 with orthonormal columns, from ``seed`` alone (explicit generator).

    QR of a Gaussian matrix in fp64 on the CPU, signs fixed so R has a positive diagonal
    (which makes Q unique). Both ends rebuild it from the seed; different LAPACK builds can
    differ in the last fp64 bits, which the fp32 cast almost always hides.
    """
    if not 1 <= k <= hidden:
        raise ValueError(f"need 1 <= k <= hidden, got k = {k}, hidden = {hidden}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(hidden, k, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(torch.float32).contiguous()


class BottleneckCodec(LinkCodec):
    """A fixed random orthonormal projection P (H, k): forward sends c = h P, the receiver
    rebuilds c Pᵀ; backward sends g P and the sender rebuilds (g P) Pᵀ, the exact adjoint.

    P comes from the constructor's ``seed`` (not the frame's mask seed, not torch's global
    RNG), so it is the same function at every step. With fp32 coefficients the pipeline is
    exactly f(h P Pᵀ). Payload per direction: ``c`` (T, k) in ``wire_dtype``; bytes per
    token = k * wire bytes. Error bound: x is the orthogonal projection of h onto span(P), so
    ||h - x|| <= ||h||, x ⟂ (h - x), and h in span(P) comes back exactly (plus wire rounding).
    """

    codec_id = "bottleneck"

    def __init__(self, k: int, seed: int = 0, wire_dtype: str = "bfloat16"):
        if k < 1:
            raise ValueError(f"k must be >= 1, not {k}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} not in {sorted(WIRE_DTYPES)}")
        self.k, self.seed, self.wire_dtype = k, seed, wire_dtype
        self._dtype = WIRE_DTYPES[wire_dtype]
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def projection(self, hidden: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """P (hidden, k) fp32 on ``device``; built once per hidden size and device."""
        key = (hidden, torch.device(device))
        if key not in self._cache:
            cpu = self._cache.get((hidden, torch.device("cpu")))
            if cpu is None:
                cpu = random_orthonormal(hidden, self.k, self.seed)
                self._cache[(hidden, torch.device("cpu"))] = cpu
            self._cache[key] = cpu.to(device)
        return self._cache[key]

    def _down(self, x: torch.Tensor) -> Payload:
        rows = _rows(x).to(torch.float32)
        p = self.projection(rows.shape[-1], rows.device)
        return {"c": (rows @ p).to(self._dtype).contiguous()}

    def _up(self, payload: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        c = payload["c"].to(torch.float32)
        return (c @ self.projection(shape[-1], c.device).T).reshape(shape)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._down(h)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._up(payload, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._down(g)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._up(payload, shape)

    def bytes_per_token(self, hidden: int) -> float:
        return float(self.k * self._dtype.itemsize)

    def describe(self) -> dict:
        return {"codec": self.codec_id, "k": self.k, "seed": self.seed, "wire_dtype": self.wire_dtype}
