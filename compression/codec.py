"""The pipeline-link codec interface: what crosses a boundary between two stages.

A codec turns the sender's activations ``h`` (..., H) into a small payload of named tensors,
and the receiver rebuilds a dense (..., H) input from it. The backward direction is the
adjoint: the receiver encodes the gradient with respect to the tensor it rebuilt, and the
sender decodes it into the gradient with respect to ``h``. For a linear codec D∘E this
makes the pipeline exactly the network ``f(D(E(h)))``, so autograd through the codec and
the hop-by-hop backward agree.

Everything here is pure tensor math: no I/O, no hivemind. The node only moves the payload
dicts over the wire (``protocol.frames``) and the context fields in the frame header.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

Payload = dict[str, torch.Tensor]

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LinkContext:
    """Per-frame context shared by both ends of a link, carried in the frame header.

    ``seed`` is the 64-bit mask seed (derived from run seed, step, microbatch and boundary);
    codecs that need no randomness ignore it. ``basis_version`` names the fixed basis a
    basis codec encoded with, so that a receiver never decodes with the wrong one.
    ``loss_rows`` (bool, the frame's leading shape, or None) marks the positions whose output the
    loss reads; both ends know it from the labels every forward frame carries, so it costs no
    header byte. A sender may spend its bytes where they matter to the loss; decoding never
    depends on it.
    """

    seed: int = 0
    basis_version: int = 0
    loss_rows: torch.Tensor | None = field(default=None, compare=False)


class LinkCodec(ABC):
    """Encode/decode both directions of one pipeline boundary."""

    codec_id: str = "abstract"
    # Optional capabilities, declared by the codecs that have them (the node asks these, never hasattr):
    # ``needs_basis``: a fixed basis per boundary, fetched from peers before decoding
    # (``holds_basis``, ``basis_from_payload``, ``basis_version``); ``carries_tokens``: the
    # forward payload carries the microbatch's token ids (``encode_forward_with_tokens``,
    # ``tokens_from_payload``), which a body stage passes on to the next link.
    needs_basis: bool = False
    carries_tokens: bool = False

    @abstractmethod
    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload: ...

    @abstractmethod
    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor: ...

    @abstractmethod
    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload: ...

    @abstractmethod
    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor: ...

    @abstractmethod
    def bytes_per_token(self, hidden: int) -> float:
        """Payload bytes per token per direction (excluding frame header and labels)."""

    def describe(self) -> dict:
        """Settings that both ends must agree on (published in the run record)."""
        return {"codec": self.codec_id}

    @property
    def version(self) -> int | None:
        """The current basis version (the one new frames name); None without a basis."""
        return None

    @property
    def versions(self) -> tuple[int, ...]:
        """Basis versions that decode; empty without a basis."""
        return ()

    def holds_basis(self, version: int) -> bool:
        """Whether a frame naming basis ``version`` decodes here (always, for codecs without a basis)."""
        return not self.needs_basis or version in self.versions

    def basis_from_payload(self, payload: Payload) -> int:
        raise NotImplementedError(f"codec {self.codec_id!r} takes no basis")

    def encode_forward_with_tokens(self, h: torch.Tensor, tokens: torch.Tensor, ctx: LinkContext) -> Payload:
        raise NotImplementedError(f"codec {self.codec_id!r} does not carry token ids")

    def tokens_from_payload(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError(f"codec {self.codec_id!r} does not carry token ids")

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each payload tensor must have; a receiver refuses others (empty: unchecked)."""
        return {}


class DenseCodec(LinkCodec):
    """Uncompressed link: the activations themselves, cast to the wire dtype."""

    codec_id = "dense"

    def __init__(self, wire_dtype: str = "bfloat16"):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} not in {sorted(WIRE_DTYPES)}")
        self.wire_dtype = wire_dtype
        self._dtype = WIRE_DTYPES[wire_dtype]

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return {"h": h.detach().to(self._dtype).contiguous()}

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return payload["h"].to(torch.float32).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return {"g": g.detach().to(self._dtype).contiguous()}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return payload["g"].to(torch.float32).reshape(shape)

    def bytes_per_token(self, hidden: int) -> float:
        return float(hidden * self._dtype.itemsize)

    def describe(self) -> dict:
        return {"codec": self.codec_id, "wire_dtype": self.wire_dtype}

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        return {"h": self._dtype, "g": self._dtype}


class _Link(torch.autograd.Function):
    """In-process link: the exact forward and backward a two-process hop computes."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, codec: LinkCodec, link: LinkContext) -> torch.Tensor:
        ctx.codec, ctx.link, ctx.shape = codec, link, tuple(h.shape)
        return codec.decode_forward(codec.encode_forward(h, link), link, tuple(h.shape)).to(h.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        codec, link = ctx.codec, ctx.link
        grad = codec.decode_backward(codec.encode_backward(g, link), link, ctx.shape).to(g.dtype)
        return grad, None, None


def apply_link(h: torch.Tensor, codec: LinkCodec, link: LinkContext) -> torch.Tensor:
    """Pass ``h`` through ``codec`` in-graph (forward and backward), as two stages would."""
    return _Link.apply(h, codec, link)


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())
