"""PRF activation masking as a link codec (DESIGN.md 4.1).

Forward sends K values per token (no indices: the receiver rebuilds them from the seed in
the frame header); the receiver's input is h * mask. Backward is the exact adjoint: only
the gradient at the same K positions per token travels back, and the sender scatters it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from compression.codec import WIRE_DTYPES, LinkCodec, LinkContext, Payload
from compression.prf import k_for_rate, select_channels


class MaskCodec(LinkCodec):
    """Keep exactly K = round((1-rate)*H) PRF-chosen channels per token.

    ``rescale`` multiplies the kept values by 1/(1-rate) (unbiased h in expectation); the
    paper's algorithm does not, so it is off by default. Applied on decode, in fp32, in
    both directions, so forward and backward stay each other's adjoint.
    """

    codec_id = "mask"

    def __init__(self, rate: float = 0.95, wire_dtype: str = "bfloat16", rescale: bool = False):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} not in {sorted(WIRE_DTYPES)}")
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"mask rate must be in [0, 1), got {rate}")
        self.rate = float(rate)
        self.wire_dtype = wire_dtype
        self.rescale = bool(rescale)
        self._dtype = WIRE_DTYPES[wire_dtype]
        self._recent: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._recent_max = 64  # microbatches in flight on one link are far fewer

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.rate) if self.rescale else 1.0

    def k(self, hidden: int) -> int:
        return k_for_rate(hidden, self.rate)

    def indices(self, ctx: LinkContext, n_tokens: int, hidden: int, device=None) -> torch.Tensor:
        """The (n_tokens, K) kept channels for this frame; a function of ctx.seed only.

        Each end needs the same mask twice per microbatch (the sender to encode the forward and
        decode the backward, the receiver the other way round), so recent masks are cached.
        """
        key = (ctx.seed, n_tokens, hidden, str(device))
        idx = self._recent.get(key)
        if idx is None:
            idx = select_channels(ctx.seed, n_tokens, hidden, self.k(hidden), device=device)
            self._recent[key] = idx
            while len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)
        return idx

    def _gather(self, x: torch.Tensor, ctx: LinkContext) -> torch.Tensor:
        hidden = x.shape[-1]
        flat = x.detach().reshape(-1, hidden)
        idx = self.indices(ctx, flat.shape[0], hidden, device=flat.device)
        return flat.gather(1, idx).to(self._dtype).contiguous()

    def _scatter(self, values: torch.Tensor, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        hidden = shape[-1]
        n_tokens = math.prod(shape[:-1])
        k = self.k(hidden)
        # A frame with the wrong payload size must fail loudly, not scatter garbage.
        if tuple(values.shape) != (n_tokens, k):
            raise ValueError(f"mask payload has shape {tuple(values.shape)}, expected {(n_tokens, k)}")
        idx = self.indices(ctx, n_tokens, hidden, device=values.device)
        out = torch.zeros(n_tokens, hidden, dtype=torch.float32, device=values.device)
        out.scatter_(1, idx, values.to(torch.float32))
        if self.rescale:
            out.mul_(self.scale)
        return out.reshape(shape)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return {"v": self._gather(h, ctx)}

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._scatter(payload["v"], ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return {"g": self._gather(g, ctx)}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._scatter(payload["g"], ctx, shape)

    def bytes_per_token(self, hidden: int) -> float:
        return float(self.k(hidden) * self._dtype.itemsize)

    def describe(self) -> dict:
        return {
            "codec": self.codec_id,
            "rate": self.rate,
            "wire_dtype": self.wire_dtype,
            "rescale": self.rescale,
        }

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        return {"v": self._dtype, "g": self._dtype}


def is_dense_step(step: int, every: int) -> bool:
    """Baseline "a dense (unmasked) step every ``every``-th step"; every <= 0 means never.

    Steps count from 0 and step 0 is dense, so a run starts from a clean gradient and
    takes exactly ceil(steps/every) dense steps.
    """
    return every > 0 and step % every == 0
