"""PRF masking plus fixed outlier channels (issue 9's ``outlier-mask`` candidate).

Residual streams carry a few channels of very large magnitude at every token; the paper's
PRF mask (``MaskCodec``) drops each of them at rate p, which is most of a token's norm. This
codec keeps a fixed set of ``n_outlier`` such channels per boundary at every token and
PRF-masks the others at ``rate``: per token it sends the outlier channels plus K = round((1 −
rate)(H − n_outlier)) channels chosen by ``select_channels`` among the rest (no indices: the
receiver rebuilds them from the frame's seed). The receiver's input is h * mask, backward is
the adjoint (the gradient at the same channels), exactly as for ``MaskCodec``.

The outlier set is found at calibration (``fit_outlier_channels``: largest mean |activation|)
and published once per boundary like a basis (``channels_payload``, ``basis_nbytes`` one-time
bytes); it is versioned like ``PcaCodec``'s basis: frames name the version in
``LinkContext.basis_version``, the codec keeps the current and previous versions, and any
other raises ``BasisVersionError``.

Payload per direction: ``v`` (T, n_outlier + K) in ``wire_dtype``, outlier channels first
(in increasing channel order), then the random ones; bytes per token = (n_outlier + K) * 2
for bf16.
"""

from __future__ import annotations

import torch

from compression.codec import LinkContext, Payload
from compression.mask import MaskCodec
from compression.pca import BasisVersionError, VersionedState
from compression.prf import k_for_rate, select_channels


def fit_outlier_channels(samples: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` channels of largest mean |activation| over calibration samples (N, H), as a
    sorted int64 (n,) tensor; ties go to the lower channel, so the same samples give the same set."""
    if samples.dim() != 2:
        raise ValueError(f"samples must be (N, H), got shape {tuple(samples.shape)}")
    if not 1 <= n <= samples.shape[1]:
        raise ValueError(f"need 1 <= n <= H = {samples.shape[1]}, got {n}")
    score = samples.detach().to(torch.float64).abs().mean(dim=0)
    order = torch.sort(-score, stable=True).indices  # descending, stable: lower channel first
    return torch.sort(order[:n]).values.to(torch.int64)


class OutlierMaskCodec(VersionedState, MaskCodec):
    """``n_outlier`` fixed channels plus PRF-masked ones at ``rate``; see the module docstring."""

    codec_id = "outliermask"
    _state_name = "outlier channels"

    def __init__(self, n_outlier: int, rate: float = 0.95, wire_dtype: str = "bfloat16"):
        super().__init__(rate=rate, wire_dtype=wire_dtype, rescale=False)
        if n_outlier < 1:
            raise ValueError(f"n_outlier must be >= 1, not {n_outlier}")
        self.n_outlier = n_outlier
        # version -> (channels (n,) int64, the other channels (H − n,) int64), at most previous + current
        self._channels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._order: list[int] = []

    # ---- the published channel set ----------------------------------------------------------

    def set_channels(self, channels: torch.Tensor, hidden: int, version: int) -> None:
        """Install the outlier set ``version`` of a boundary of width ``hidden`` as current; the
        former current stays decodable, older go. Versions only grow; re-installing the current
        version with the same channels is a no-op."""
        ch = torch.as_tensor(channels).detach().to(torch.int64).cpu().reshape(-1)
        if ch.numel() != self.n_outlier:
            raise ValueError(f"need {self.n_outlier} channels, got {ch.numel()}")
        if self.n_outlier >= hidden:
            raise ValueError(f"n_outlier = {self.n_outlier} leaves no channel to mask in H = {hidden}")
        if int(ch.min()) < 0 or int(ch.max()) >= hidden or torch.unique(ch).numel() != ch.numel():
            raise ValueError(f"outlier channels must be distinct and in [0, {hidden})")
        if not 0 <= version < 2**63:
            raise ValueError(f"version must be a non-negative int64, not {version}")
        ch = torch.sort(ch).values
        current = self.version
        if current is not None and version == current:
            held, rest = self._channels[current]
            if torch.equal(held, ch) and held.numel() + rest.numel() == hidden:
                return
            raise ValueError(f"outlier channel version {version} already set with different values")
        if current is not None and version < current:
            raise ValueError(f"outlier channel version {version} is older than the current {current}")
        keep = torch.ones(hidden, dtype=torch.bool)
        keep[ch] = False
        self._channels[version] = (ch, torch.nonzero(keep).squeeze(1))
        self._order.append(version)
        for old in self._order[:-2]:
            del self._channels[old]
        self._order = self._order[-2:]
        self._recent.clear()

    def channels(self, version: int) -> torch.Tensor:
        if version not in self._channels:
            raise BasisVersionError(f"outlier channel version {version} not held (have {list(self._order)})")
        return self._channels[version][0]

    def channels_payload(self, version: int | None = None) -> Payload:
        """What a boundary publishes once: ``channels`` (n,) int16 and ``version`` (1,) int64."""
        version = self.version if version is None else version
        if version is None:
            raise BasisVersionError("no outlier channels set")
        return {
            "channels": self.channels(version).to(torch.int16).contiguous(),
            "version": torch.tensor([version], dtype=torch.int64),
        }

    def channels_from_payload(self, payload: Payload, hidden: int) -> int:
        version = int(payload["version"].reshape(-1)[0].item())
        self.set_channels(payload["channels"].to(torch.int64), hidden, version)
        return version

    def basis_nbytes(self, hidden: int | None = None) -> int:
        """One-time bytes of ``channels_payload`` (named like ``PcaCodec.basis_nbytes``)."""
        return self.n_outlier * 2 + 8

    # ---- the mask -----------------------------------------------------------------------------

    def k_rand(self, hidden: int) -> int:
        return k_for_rate(hidden - self.n_outlier, self.rate)

    def k(self, hidden: int) -> int:
        """Channels sent per token: the outliers and the PRF-chosen ones."""
        return self.n_outlier + self.k_rand(hidden)

    def indices(self, ctx: LinkContext, n_tokens: int, hidden: int, device=None) -> torch.Tensor:
        """(n_tokens, n_outlier + K) kept channels: the version's outliers, then K of the others
        chosen from ctx.seed (cached: each end needs the same mask twice per microbatch)."""
        held = self._channels.get(ctx.basis_version)
        if held is None:
            raise BasisVersionError(
                f"outlier channel version {ctx.basis_version} not held (have {list(self._order)})"
            )
        ch, rest = held
        if ch.numel() + rest.numel() != hidden:
            raise ValueError(f"outlier channels were set for H = {ch.numel() + rest.numel()}, not {hidden}")
        key = (ctx.seed, ctx.basis_version, n_tokens, hidden, str(device))
        idx = self._recent.get(key)
        if idx is None:
            pick = select_channels(ctx.seed, n_tokens, rest.numel(), self.k_rand(hidden))
            idx = torch.cat([ch.expand(n_tokens, ch.numel()), rest[pick]], dim=1).to(device)
            self._recent[key] = idx
            while len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)
        return idx

    def describe(self) -> dict:
        return {
            "codec": self.codec_id,
            "n_outlier": self.n_outlier,
            "rate": self.rate,
            "wire_dtype": self.wire_dtype,
        }
