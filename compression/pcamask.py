"""PRF masking in a fixed PCA basis (issue 9's ``pca+mask`` candidate).

The sender fits a basis of ``k`` directions (the "pool", ``fit_basis`` as for ``PcaCodec``,
ordered by variance). Per token it always sends the coefficients of the top ``k_top``
directions, plus those of ``k_rand`` directions chosen among the other ``k − k_top`` by the
PRF (``compression.prf.select_channels`` on the frame's seed), so the random part costs no
indices on the wire: the receiver rebuilds the same choice from the seed in the header.

For token t with kept directions S_t (the top ones and its random ones), the receiver's input
is μ + (h − μ) V_S V_Sᵀ: an orthogonal projection onto a per-token subspace of the pool.
Backward is the adjoint: g V_S travels back (same directions, same order) and the sender
rebuilds (g V_S) V_Sᵀ. With unquantised coefficients the pipeline is exactly the network
with that projection in it, and hop-by-hop backward is its true gradient.

Basis publication and versioning are ``PcaCodec``'s (this class is one): the published
basis is the whole pool (mean (H,), V (H, k)), frames name its version, a receiver never
decodes with another one.

Payload per direction, int8 (default): ``q`` (T, k_top + k_rand) int8, top coefficients
first, then the random ones in increasing direction order, and ``scale`` (T, ceil(k_top/block)
+ ceil(k_rand/block)): the two parts are quantised separately, so the small tail
coefficients never share a scale with the large leading ones. bf16/fp32: ``c`` (T, k_top +
k_rand). Bytes per token = (k_top + k_rand) * coefficient bytes (+ the scales for int8).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from compression.baselines import dequantize_blockwise, quantize_blockwise
from compression.codec import WIRE_DTYPES, LinkContext, Payload
from compression.pca import PcaCodec
from compression.prf import select_channels


class PcaMaskCodec(PcaCodec):
    """Top-``k_top`` plus PRF-chosen ``k_rand`` of a ``k``-direction PCA pool; see the module."""

    codec_id = "pcamask"

    def __init__(
        self,
        k: int,
        k_top: int,
        k_rand: int,
        coeff_dtype: str = "int8",
        block: int = 32,
        scale_dtype: str = "bfloat16",
        basis_dtype: str = "float32",
    ):
        super().__init__(
            k, coeff_dtype=coeff_dtype, block=block, scale_dtype=scale_dtype, basis_dtype=basis_dtype
        )
        if not 0 <= k_top <= k:
            raise ValueError(f"k_top must be in [0, k = {k}], not {k_top}")
        if not 0 <= k_rand <= k - k_top:
            raise ValueError(f"k_rand must be in [0, k − k_top = {k - k_top}], not {k_rand}")
        if k_top + k_rand < 1:
            raise ValueError("k_top + k_rand must be >= 1")
        self.k_top, self.k_rand = k_top, k_rand
        self._recent: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._recent_max = 64  # microbatches in flight on one link are far fewer

    @property
    def kept(self) -> int:
        """Coefficients sent per token."""
        return self.k_top + self.k_rand

    def selection(self, ctx: LinkContext, n_tokens: int, device=None) -> torch.Tensor:
        """(n_tokens, k_rand) pool indices in [k_top, k) of the random directions: a function of
        ctx.seed only (each end needs it twice per microbatch, so recent ones are cached)."""
        key = (ctx.seed, n_tokens, str(device))
        idx = self._recent.get(key)
        if idx is None:
            pool = self.k - self.k_top
            idx = select_channels(ctx.seed, n_tokens, pool, self.k_rand, device=device) + self.k_top
            self._recent[key] = idx
            while len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)
        return idx

    # ---- coefficients -----------------------------------------------------------------------

    def _pack(self, c: torch.Tensor) -> Payload:
        if self.coeff_dtype != "int8":
            return {"c": c.to(WIRE_DTYPES[self.coeff_dtype]).contiguous()}
        parts = [p for p in (c[:, : self.k_top], c[:, self.k_top :]) if p.shape[1]]
        packed = [quantize_blockwise(p, self.block, 8, self._sdtype) for p in parts]
        return {
            "q": torch.cat([q for q, _ in packed], dim=1).contiguous(),
            "scale": torch.cat([s for _, s in packed], dim=1).contiguous(),
        }

    def _unpack(self, payload: Payload) -> torch.Tensor:
        if self.coeff_dtype != "int8":
            c = payload["c"]
            if c.dim() != 2 or c.shape[1] != self.kept:
                raise ValueError(f"pcamask payload has shape {tuple(c.shape)}, expected (T, {self.kept})")
            return c.to(torch.float32)
        q, scale = payload["q"], payload["scale"]
        nb_top = math.ceil(self.k_top / self.block)
        nb = nb_top + math.ceil(self.k_rand / self.block)
        if q.dim() != 2 or q.shape[1] != self.kept or tuple(scale.shape) != (q.shape[0], nb):
            raise ValueError(
                f"pcamask payload q {tuple(q.shape)}, scale {tuple(scale.shape)}: "
                f"expected (T, {self.kept}) and (T, {nb})"
            )
        parts = []
        if self.k_top:
            parts.append(dequantize_blockwise(q[:, : self.k_top], scale[:, :nb_top], self.block))
        if self.k_rand:
            parts.append(dequantize_blockwise(q[:, self.k_top :], scale[:, nb_top:], self.block))
        return torch.cat(parts, dim=1)

    def _select(self, coeffs: torch.Tensor, ctx: LinkContext) -> torch.Tensor:
        """(T, k) pool coefficients -> (T, k_top + k_rand) kept ones, top first."""
        top = coeffs[:, : self.k_top]
        if not self.k_rand:
            return top
        return torch.cat([top, coeffs.gather(1, self.selection(ctx, coeffs.shape[0], coeffs.device))], dim=1)

    def _expand(self, kept: torch.Tensor, ctx: LinkContext) -> torch.Tensor:
        """Inverse of ``_select``: (T, k) with zeros at the directions not kept."""
        full = torch.zeros(kept.shape[0], self.k, dtype=torch.float32, device=kept.device)
        full[:, : self.k_top] = kept[:, : self.k_top]
        if self.k_rand:
            full.scatter_(1, self.selection(ctx, kept.shape[0], kept.device), kept[:, self.k_top :])
        return full

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = h.detach().reshape(-1, h.shape[-1]).to(torch.float32)
        mean, v = self.basis(ctx.basis_version, rows.device)
        return self._pack(self._select((rows - mean) @ v, ctx))

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        c = self._expand(self._unpack(payload), ctx)
        mean, v = self.basis(ctx.basis_version, c.device)
        return torch.addmm(mean, c, v.T).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = g.detach().reshape(-1, g.shape[-1]).to(torch.float32)
        _, v = self.basis(ctx.basis_version, rows.device)
        return self._pack(self._select(rows @ v, ctx))

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        c = self._expand(self._unpack(payload), ctx)
        _, v = self.basis(ctx.basis_version, c.device)
        return (c @ v.T).reshape(shape)

    def bytes_per_token(self, hidden: int) -> float:
        """Per direction; the pool basis is paid once (``basis_nbytes``)."""
        if self.coeff_dtype == "int8":
            n_scales = math.ceil(self.k_top / self.block) + math.ceil(self.k_rand / self.block)
            return float(self.kept + n_scales * self._sdtype.itemsize)
        return float(self.kept * WIRE_DTYPES[self.coeff_dtype].itemsize)

    def describe(self) -> dict:
        d = super().describe()
        d.update(codec=self.codec_id, k_top=self.k_top, k_rand=self.k_rand)
        return d

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        if self.coeff_dtype == "int8":
            return {"q": torch.int8, "scale": self._sdtype}
        return {"c": WIRE_DTYPES[self.coeff_dtype]}
