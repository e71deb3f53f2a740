"""Tiered transform codec: a fixed full rotation per direction, bits spent where this frame's
energy is.

Why: at ~110 B/token a per-frame low-rank basis (``compression.lowrank``, k = 80) pays a quarter
of its bytes for the basis and keeps only 80 of H = 576 directions; a fixed PCA basis keeps few
directions and cuts the ones fine-tuning moves into. Here both ends hold a full orthonormal
rotation R (H×H) per direction, fitted once at calibration, so no frame pays for a basis; each
frame ranks the H rotated directions by *its own* energy and codes the top ones in tiers of
falling precision (default 24 at 8 bits, 88 at 4 bits, 128 at 2 bits). A direction that
fine-tuning makes loud climbs the ranking in the next frame; nothing is cut for good.

Two facts of a pretrained LM's boundary shape the details (bench/results/quality.md, eighth
section):
* A few "sink" rows per sequence carry ~100× the norm of the others (SmolLM2: 24,000 against a
  median of 170; the top 70 rows of a 2048-token frame hold 99.9% of the energy). The mean of
  such a frame is pulled towards them, an offset every other row then carries; the forward is
  therefore centred by the frame's per-channel **median**, and the rotation fitted on
  median-centred rows (``fit_rotation``; around the mean the same tiers leave 2.6× the KL on the
  answer logits). Each token gets its own scale per tier, so a sink row does not crush the
  others' levels.
* Gradients live in other directions than activations: coded in the activations' rotation the
  upstream stage's gradient comes out at cosine 0.72-0.93, in the gradients' own at 0.97-0.99.
  So the backward has its own rotation, fitted on calibration gradients (uncentred: energy).

Per frame of T tokens and direction, with n = Σ tier sizes directions kept:
``med`` (forward only) bf16 (H,); ``idx`` int16 (n,) the kept directions in tier order;
``cs`` bf16 (n,) each kept direction's RMS over the frame; per tier i, codes ``q{i}`` and a bf16
scale per token and block ``s{i}``. Coefficients are divided by their direction's RMS first, so
within a tier every direction uses the whole range. 8 and 4 bits: symmetric absmax in blocks of
``block`` (int8, or int4 packed two per byte); 2 bits: four levels (±0.5, ±1.5)·Δ·σ_t with σ_t
the token's RMS in the tier and Δ = 0.996 (the uniform 4-level quantiser of a unit Gaussian),
packed four per byte.

Bytes per frame (``frame_bytes``): 2H (median, forward) + 4n (idx, cs) + T·Σ_i(n_i·b_i/8 +
2⌈n_i/block⌉) (2-bit tiers: one scale per token). Once per boundary the rotations
(``basis_nbytes``). Error: per tier, each coefficient within half a level of its value (8/4 bits;
2 bits clips at ±2Δσ_t), and the directions past the tiers are dropped; no frame decodes with a
rotation version the receiver does not hold (``BasisVersionError``).
"""

from __future__ import annotations

import math

import torch

from compression.baselines import dequantize_blockwise, pack_int4, quantize_blockwise, unpack_int4
from compression.codec import LinkCodec, LinkContext, Payload
from compression.linkbasis import orthonormal
from compression.pca import BasisVersionError, VersionedState

Tier = tuple[int, int]  # (directions, bits)
TIERS: tuple[Tier, ...] = ((24, 8), (88, 4), (128, 2))  # 110 B/token of codes: 10.4x below bf16 at H = 576
BITS = (8, 4, 2)
_DELTA2 = 0.996  # step of the MSE-optimal uniform 4-level quantiser of a unit Gaussian
_ORTHO_TOL = 1e-3
ROT_BLOCK = 32  # a published rotation: int8 with a bf16 scale per 32 entries


def fit_rotation(rows: torch.Tensor, centre: bool) -> torch.Tensor:
    """R (H, H): orthonormal directions as rows, by falling energy of ``rows`` (N, H), signs fixed.

    ``centre``: subtract the per-channel median first (activations; see the module docstring),
    else uncentred (gradients). fp64 eigensolver; each row's largest-magnitude entry positive,
    so the same samples give the same R."""
    x = rows.detach().to(torch.float64)
    if centre:
        x = x - x.median(dim=0).values
    _, vecs = torch.linalg.eigh(x.T @ x)
    r = vecs.flip(-1).T
    pivot = r.abs().argmax(dim=1)
    sign = torch.sign(r[torch.arange(r.shape[0]), pivot])
    sign[sign == 0] = 1.0
    return (r * sign.unsqueeze(1)).to(torch.float32).contiguous()


def pack_int2(u: torch.Tensor) -> torch.Tensor:
    """Codes in 0..3 (T, n) four per byte: (T, ceil(n/4)) uint8, element 4j+i in bits 2i..2i+1."""
    u = u.to(torch.uint8)
    pad = (-u.shape[-1]) % 4
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(u.shape[0], -1, 4)
    return (u[..., 0] | (u[..., 1] << 2) | (u[..., 2] << 4) | (u[..., 3] << 6)).contiguous()


def unpack_int2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_int2``: (T, n) int64 codes in 0..3."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != math.ceil(n / 4):
        raise ValueError(f"2-bit codes must be (T, {math.ceil(n / 4)}) uint8, got {tuple(packed.shape)}")
    p = packed.to(torch.int64)
    u = torch.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
    return u.reshape(p.shape[0], -1)[:, :n]


def tiers_fit(tiers, k: int) -> list[Tier]:
    """``tiers`` cut to at most ``k`` directions in all (a narrow model keeps fewer)."""
    out, left = [], k
    for n, b in tiers:
        if left <= 0:
            break
        out.append((min(int(n), left), int(b)))
        left -= int(n)
    return out


def check_tiers(tiers) -> tuple[Tier, ...]:
    out = tuple((int(n), int(b)) for n, b in tiers)
    if not out or any(n < 1 or b not in BITS for n, b in out):
        raise ValueError(f"tiers must be (directions >= 1, bits in {BITS}) pairs, got {tiers!r}")
    return out


def encode_tiers(c: torch.Tensor, tiers: list[Tier], block: int) -> Payload:
    """Coefficients c (T, n), columns by falling energy, coded tier by tier (see the module
    docstring): ``cs`` each column's RMS (bf16), then per tier i codes ``q{i}`` and scales ``s{i}``."""
    cs = c.pow(2).mean(dim=0).sqrt().to(torch.bfloat16)  # rounded as sent
    csf = cs.float()
    z = c / torch.where(csf > 0, csf, 1.0)
    out: Payload = {"cs": cs}
    start = 0
    for i, (m, bits) in enumerate(tiers):
        zt = z[:, start : start + m]
        start += m
        if bits == 2:
            sig = zt.pow(2).mean(dim=1, keepdim=True).sqrt().to(torch.bfloat16)
            step = sig.float() * _DELTA2
            u = torch.floor(zt / torch.where(step > 0, step, 1.0)).clamp(-2, 1) + 2
            out[f"q{i}"], out[f"s{i}"] = pack_int2(u), sig
        else:
            q, s = quantize_blockwise(zt, block, bits, torch.bfloat16)
            out[f"q{i}"], out[f"s{i}"] = (pack_int4(q) if bits == 4 else q), s
    return out


def decode_tiers(p: Payload, tiers: list[Tier], block: int) -> torch.Tensor:
    """Inverse of ``encode_tiers``: (T, n) fp32; refuses scales or codes of the wrong shape."""
    n = sum(m for m, _ in tiers)
    cs = p["cs"].float()
    if cs.shape != (n,):
        raise ValueError(f"frame carries {tuple(cs.shape)} direction scales, the tiers keep {n}")
    if not torch.isfinite(cs).all() or float(cs.min()) < 0:
        raise ValueError("frame has a negative or non-finite direction scale")
    parts = []
    for i, (m, bits) in enumerate(tiers):
        q, s = p[f"q{i}"], p[f"s{i}"]
        if bits == 2:
            u = unpack_int2(q, m)
            if s.shape != (u.shape[0], 1):
                raise ValueError(f"2-bit tier scales have shape {tuple(s.shape)}, expected ({u.shape[0]}, 1)")
            parts.append((u.float() - 1.5) * (s.float() * _DELTA2))
        else:
            q = unpack_int4(q, m) if bits == 4 else q
            if q.dim() != 2 or q.shape[1] != m:
                raise ValueError(f"tier {i} carries {tuple(q.shape)} codes, expected {m} directions")
            parts.append(dequantize_blockwise(q, s, block))
    rows = {t.shape[0] for t in parts}
    if len(rows) != 1:
        raise ValueError("tiers of one frame carry different numbers of tokens")
    return torch.cat(parts, dim=1) * cs


def tier_bytes_per_token(tiers: list[Tier], block: int) -> float:
    """Codes and per-token scales of ``encode_tiers``, per token (``cs`` is per frame: 2n)."""
    return float(sum(math.ceil(m * b / 8) + 2 * (1 if b == 2 else math.ceil(m / block)) for m, b in tiers))


def tier_dtypes(tiers: list[Tier]) -> dict[str, torch.dtype]:
    d = {"cs": torch.bfloat16}
    for i, (_, bits) in enumerate(tiers):
        d[f"q{i}"], d[f"s{i}"] = (torch.int8 if bits == 8 else torch.uint8), torch.bfloat16
    return d


class TieredCodec(VersionedState, LinkCodec):
    """Fixed full rotations (one per direction), per-frame tiers by energy; see the module docstring."""

    codec_id = "tiered"
    needs_basis = True

    def __init__(
        self,
        tiers: tuple[Tier, ...] | list = TIERS,
        backward_tiers: tuple[Tier, ...] | list | None = None,
        block: int = 32,
    ):
        self.tiers = check_tiers(tiers)
        self.backward_tiers = check_tiers(backward_tiers) if backward_tiers else self.tiers
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = int(block)
        self._rot: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # version -> (R_fwd, R_bwd)
        self._order: list[int] = []
        self._pub: dict[int, tuple] = {}  # version -> the rotations as published

    def _tiers(self, direction: str, hidden: int) -> list[Tier]:
        return tiers_fit(self.tiers if direction == "forward" else self.backward_tiers, hidden)

    # ---- rotations ----------------------------------------------------------------------------

    def set_rotations(self, r_fwd: torch.Tensor, r_bwd: torch.Tensor, version: int) -> None:
        """Install rotation ``version`` (current; the previous one stays decodable).

        Each rotation is rounded as it is published (int8, a bf16 scale per ``ROT_BLOCK``
        entries) and orthonormalised again by the same QR at both ends, so sender and receiver
        code with the same rotation."""
        self._install(*(self._published(r) for r in (r_fwd, r_bwd)), version)

    @staticmethod
    def _published(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if r.dim() != 2 or r.shape[0] != r.shape[1]:
            raise ValueError(f"a rotation must be (H, H), got {tuple(r.shape)}")
        r64 = r.detach().to(torch.float64)
        if (r64 @ r64.T - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item() > _ORTHO_TOL:
            raise ValueError("a rotation must have orthonormal rows")
        return quantize_blockwise(r.detach().float(), ROT_BLOCK, 8, torch.bfloat16)

    def _install(self, fwd: tuple, bwd: tuple, version: int) -> None:
        if self.version is not None and version <= self.version:
            raise ValueError(f"rotation version {version} is not newer than the current {self.version}")
        rots = []
        for q, s in (fwd, bwd):
            if q.dim() != 2 or q.shape[0] != q.shape[1] or q.shape != fwd[0].shape:
                raise ValueError(f"rotations must both be (H, H), got {tuple(q.shape)}")
            rows = dequantize_blockwise(q, s, ROT_BLOCK)
            if float(rows.norm(dim=1).max()) > 1.05:
                raise ValueError("a published rotation's rows are not unit vectors")
            rots.append(orthonormal(rows).T.contiguous())
        self._rot[version] = (rots[0], rots[1])
        self._pub[version] = (fwd, bwd)
        self._order.append(version)
        for old in self._order[:-2]:
            del self._rot[old], self._pub[old]
        self._order = self._order[-2:]

    def rotation(self, version: int, direction: str) -> torch.Tensor:
        if version not in self._rot:
            raise BasisVersionError(f"rotation version {version} not held (have {list(self._order)})")
        return self._rot[version][0 if direction == "forward" else 1]

    def basis_payload(self, version: int | None = None) -> Payload:
        """Both rotations as published (int8 + bf16 scales) and the version: once per boundary."""
        version = self.version if version is None else version
        if version not in self._pub:
            raise BasisVersionError("no rotation set")
        (fq, fs), (bq, bs) = self._pub[version]
        return {
            "Rfq": fq,
            "Rfs": fs,
            "Rbq": bq,
            "Rbs": bs,
            "version": torch.tensor([version], dtype=torch.int64),
        }

    def basis_from_payload(self, payload: Payload) -> int:
        version = int(payload["version"].reshape(-1)[0].item())
        if version != self.version:
            self._install((payload["Rfq"], payload["Rfs"]), (payload["Rbq"], payload["Rbs"]), version)
        return version

    def basis_nbytes(self, hidden: int) -> int:
        """One-time bytes of ``basis_payload``: two int8 H×H rotations with their scales, the version.
        Each direction uses one of the two (``rotation_nbytes``)."""
        return 2 * self.rotation_nbytes(hidden) + 8

    @staticmethod
    def rotation_nbytes(hidden: int) -> int:
        return hidden * (hidden + 2 * math.ceil(hidden / ROT_BLOCK))

    # ---- coefficients ----------------------------------------------------------------------

    def _encode(self, rows: torch.Tensor, r: torch.Tensor, direction: str) -> Payload:
        c = rows @ r.T  # (T, H) in the rotated coordinates
        tiers = self._tiers(direction, r.shape[0])
        n = sum(t for t, _ in tiers)
        idx = c.pow(2).mean(dim=0).argsort(descending=True)[:n]
        out: Payload = {"idx": idx.to(torch.int16)}
        out.update(encode_tiers(c[:, idx], tiers, self.block))
        return out

    def _decode(self, p: Payload, r: torch.Tensor, direction: str) -> torch.Tensor:
        tiers = self._tiers(direction, r.shape[0])
        n = sum(t for t, _ in tiers)
        idx = p["idx"].to(torch.int64)
        if idx.shape != (n,):
            raise ValueError(f"tiered frame names {tuple(idx.shape)} directions, the tiers keep {n}")
        if int(idx.min()) < 0 or int(idx.max()) >= r.shape[0] or idx.unique().numel() != n:
            raise ValueError("tiered frame names directions outside the rotation, or one twice")
        return decode_tiers(p, tiers, self.block) @ r[idx]

    # ---- the interface -----------------------------------------------------------------------

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = h.detach().reshape(-1, h.shape[-1]).to(torch.float32)
        med = rows.median(dim=0).values.to(torch.bfloat16)
        out = self._encode(rows - med.float(), self.rotation(ctx.basis_version, "forward"), "forward")
        out["med"] = med.contiguous()
        return out

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        med = payload["med"]
        if tuple(med.shape) != (shape[-1],):
            raise ValueError(f"median has shape {tuple(med.shape)}, expected ({shape[-1]},)")
        r = self.rotation(ctx.basis_version, "forward")
        return (self._decode(payload, r, "forward") + med.float()).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = g.detach().reshape(-1, g.shape[-1]).to(torch.float32)
        return self._encode(rows, self.rotation(ctx.basis_version, "backward"), "backward")

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode(payload, self.rotation(ctx.basis_version, "backward"), "backward").reshape(shape)

    def coeff_bytes_per_token(self, hidden: int, direction: str = "forward") -> float:
        return tier_bytes_per_token(self._tiers(direction, hidden), self.block)

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> int:
        """Exact payload bytes of one frame of ``tokens`` rows ('forward' adds the median); the
        layout does not depend on how many ``sequences`` they are."""
        n = sum(m for m, _ in self._tiers(direction, hidden))
        extra = 2 * hidden if direction == "forward" else 0
        return int(extra + 4 * n + tokens * self.coeff_bytes_per_token(hidden, direction))

    def bytes_per_token(self, hidden: int) -> float:
        """Codes only, mean of the two directions (per-frame side data: ``frame_bytes``)."""
        return (self.coeff_bytes_per_token(hidden) + self.coeff_bytes_per_token(hidden, "backward")) / 2

    def describe(self) -> dict:
        d = {"codec": self.codec_id, "tiers": [list(t) for t in self.tiers], "block": self.block}
        if self.backward_tiers != self.tiers:
            d["backward_tiers"] = [list(t) for t in self.backward_tiers]
        return d

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        d = {"idx": torch.int16, "med": torch.bfloat16, **tier_dtypes(list(self.backward_tiers))}
        d.update(tier_dtypes(list(self.tiers)))  # a code whose dtype differs by direction: checked in decode
        return d
