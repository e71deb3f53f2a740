"""The GPU side of an emulated stage (issue 16): compute and link codecs whose tensor work is a sleep.

A node whose model is emulated (``--model emulate:...``, node/model/emulated.py) gets
``EmulatedCompute`` and ``EmulatedLinkCodec`` (node.runtime builds them): the stage's
forward/backward/loss and the codec's dense-side tensor work (gather, scatter, projection,
eigendecomposition, the copies between GPU and host) become sleeps from a cost model of the GPU
(``node.model.emulated.codec_gpu_seconds``), and inside the node an activation is a zero-stride
stand-in of shape (B, T, H) that holds no (T, H) data. What crosses a link stays real: every frame
carries a payload of the real codec's names, dtypes and shapes (cut from the real codec's own
output on a small probe), through the real frame encoder, checks, auth and libp2p.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from compression.codec import LinkCodec, LinkContext, Payload, payload_nbytes
from compression.lowrank import FIRST_K
from node.model.emulated import GPUS, Gpu, codec_gpu_seconds, lm_head_us_per_token, sleep_for
from node.stage.compute import Compute

_ZERO = torch.zeros(())


def standin(shape: tuple[int, ...]) -> torch.Tensor:
    """A (B, T, H) activation that holds no data: one zero, expanded (every stride 0)."""
    return _ZERO.expand(*shape)


class EmulatedCompute(Compute):
    """The compute thread of an emulated stage: forward, backward and loss are sleeps, no tensors.

    Forward sleeps a third of the stage's layer time, backward two thirds (training FLOPs split
    1:2); the tail also pays for a 1B model's lm_head (``lm_head_us_per_token``). Outputs and
    input gradients are zero-stride stand-ins, so no (T, H) tensor is ever built on the CPU.
    """

    def __init__(self, stage, device: torch.device | None = None) -> None:
        super().__init__(device)
        cfg = stage.config
        self.gpu = GPUS[cfg.emulate_gpu]
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.layer_s = sum(layer.us_per_token for layer in stage.layers) * 1e-6
        self.lm_head_s = lm_head_us_per_token(self.gpu, cfg.hidden_size) * 1e-6 if stage.is_tail else 0.0
        # the optimizer steps what it is given: zero gradients keep every step path exercised
        self.params = [p for p in stage.parameters() if p.requires_grad]

    def _zero_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def forward(self, stage, x: torch.Tensor, is_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = x.shape[:2]
        sleep_for(b * t * self.layer_s / 3.0)
        return standin((b, t, self.hidden)), None if is_head else x

    def tail(self, stage, x: torch.Tensor, labels: torch.Tensor, is_head: bool):
        b, t = x.shape[:2]
        sleep_for(b * t * (self.layer_s + self.lm_head_s))
        n = int((labels[:, 1:] != -100).sum())
        self._zero_grads()
        # no logits exist: the loss reported is that of a uniform guess
        return math.log(self.vocab), n, None if is_head else standin((b, t, self.hidden))

    def backward(
        self, y: torch.Tensor, grad_y: torch.Tensor, leaf: torch.Tensor | None
    ) -> torch.Tensor | None:
        b, t = y.shape[:2]
        sleep_for(b * t * self.layer_s * 2.0 / 3.0)
        self._zero_grads()
        return None if leaf is None else standin(tuple(leaf.shape))


# a probe of (PROBE_B, PROBE_T, PROBE_H or H): its payload dims equal to these scale with the frame
PROBE_B, PROBE_T, PROBE_H = 7, 131, 257


class EmulatedLinkCodec(LinkCodec):
    """The real codec's payload layout and bytes, with its GPU-side tensor work as a sleep.

    Encode returns a payload of the names, dtypes and shapes the wrapped codec produces for
    this frame, cut from its own output on a (7, 131, H) probe and tiled to the frame's size
    (checked against the codec's own byte count); decode checks names and shapes and returns
    a stand-in. Basis handling (PCA) is the wrapped codec's: fetch, install, versions.
    """

    def __init__(self, inner: LinkCodec, gpu: Gpu) -> None:
        if inner.carries_tokens:
            raise ValueError(f"emulated links do not cover codec {inner.codec_id!r} (it carries token ids)")
        if getattr(inner, "entropy", False):  # coded sizes depend on values the emulation never computes
            raise ValueError(
                "emulated links do not cover --lowrank-entropy on (its bytes depend on the data); "
                "measure it with python -m bench.quality.code_entropy --mode coder"
            )
        self.inner, self.gpu = inner, gpu
        self.codec_id, self.needs_basis = inner.codec_id, inner.needs_basis
        k = getattr(inner, "k", 0)
        self.k = k if isinstance(k, int) else 0
        self._templates: dict[tuple[str, tuple[int, ...], int], Payload] = {}

    # -------- the wrapped codec's settings and basis
    def bytes_per_token(self, hidden: int) -> float:
        return self.inner.bytes_per_token(hidden)

    def describe(self) -> dict:
        return self.inner.describe()

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        return self.inner.payload_dtypes()

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def versions(self) -> tuple[int, ...]:
        return self.inner.versions

    def holds_basis(self, version: int) -> bool:
        return self.inner.holds_basis(version)

    def basis_from_payload(self, payload: Payload) -> int:
        return self.inner.basis_from_payload(payload)

    def __getattr__(self, name: str):  # anything else a basis store asks the codec
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -------- payloads
    def template(self, direction: str, shape: tuple[int, ...], ctx: LinkContext) -> Payload:
        key = (direction, tuple(shape), ctx.basis_version)
        if key not in self._templates:
            self._templates[key] = self._build(direction, tuple(shape), ctx)
        return self._templates[key]

    def _build(self, direction: str, shape: tuple[int, ...], ctx: LinkContext) -> Payload:
        """The payload of a ``shape`` frame; the cheapest probe that reproduces the codec's byte count.

        A probe of width PROBE_H first (lowrank's eigendecomposition of a 2048-wide Gram matrix
        takes ~45 s on these CPUs, once per direction), the frame's own width if the layout does
        not scale with it (the mask's K, a PCA basis of fixed width)."""
        b, t, hidden = shape
        rows = b * t
        if hasattr(self.inner, "frame_bytes"):
            want = self.inner.frame_bytes(rows, hidden, direction, sequences=b)
        else:
            want = round(self.inner.bytes_per_token(hidden) * rows)
        got = {}
        for width in (PROBE_H, hidden) if PROBE_H < hidden else (hidden,):
            try:
                out = self._tile(direction, shape, width, ctx)
            except (RuntimeError, ValueError):  # a codec with a basis of the frame's width
                continue
            got[width] = payload_nbytes(out)
            if got[width] == want:
                return out
        raise RuntimeError(
            f"emulated {self.codec_id} {direction} payload: probes gave {got} B for {rows} tokens, the "
            f"codec says {want} B: its layout did not scale"
        )

    def _tile(self, direction: str, shape: tuple[int, ...], width: int, ctx: LinkContext) -> Payload:
        b, t, hidden = shape
        gen = torch.Generator().manual_seed(ctx.seed & 0x7FFFFFFF)
        probe = torch.randn(PROBE_B, PROBE_T, width, generator=gen)
        enc = self.inner.encode_forward if direction == "forward" else self.inner.encode_backward
        sizes = {PROBE_B: b, PROBE_T: t, PROBE_B * PROBE_T: b * t, width: hidden}
        sizes[PROBE_B * (PROBE_T - 1)] = b * (t - 1)  # lowrank first_apart: the rows after position 0
        first = {PROBE_B: b, min(FIRST_K, PROBE_B): min(FIRST_K, b), width: hidden}  # and position 0's
        out = {}
        # the layout is the frame's shape's alone: a fit by the loss rows (of the real frame) moves no byte
        for name, x in enc(probe, replace(ctx, loss_rows=None)).items():
            new = tuple((first if name.startswith("f_") else sizes).get(d, d) for d in x.shape)
            n = math.prod(new)
            flat = x.reshape(-1)
            out[name] = flat.repeat(-(-n // max(flat.numel(), 1)))[:n].reshape(new).contiguous()
        return out

    def _encode(self, direction: str, x: torch.Tensor, ctx: LinkContext) -> Payload:
        payload = self.template(direction, tuple(x.shape), ctx)
        rows, k = x.shape[0] * x.shape[1], self._k(payload)
        nbytes = payload_nbytes(payload)
        sleep_for(codec_gpu_seconds(self.codec_id, "encode", rows, x.shape[-1], nbytes, self.gpu, k))
        return dict(payload)

    def _decode(
        self, direction: str, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]
    ) -> torch.Tensor:
        want = self.template(direction, tuple(shape), ctx)
        if set(payload) != set(want) or any(tuple(payload[n].shape) != tuple(want[n].shape) for n in want):
            got = {n: tuple(v.shape) for n, v in payload.items()}
            raise ValueError(f"payload {got} is not the {self.codec_id} layout of a {tuple(shape)} frame")
        rows = shape[0] * shape[1]
        sleep_for(
            codec_gpu_seconds(
                self.codec_id, "decode", rows, shape[-1], payload_nbytes(payload), self.gpu, self._k(payload)
            )
        )
        return standin(tuple(shape))

    def _k(self, payload: Payload) -> int:
        """Directions projected onto: a per-frame basis' rows (lowrank, tiers included), else k."""
        basis = payload.get("vq", payload.get("v"))
        return int(basis.shape[0]) if basis is not None else self.k

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._encode("forward", h, ctx)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode("forward", payload, ctx, shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._encode("backward", g, ctx)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode("backward", payload, ctx, shape)


def emulate_links(linkio, gpu_name: str) -> None:
    """Wrap both links' codecs of a node.stage.linkio.LinkIO in EmulatedLinkCodec."""
    gpu = GPUS[gpu_name]
    for link in (linkio.link_in, linkio.link_out):
        if link is None:
            continue
        dense_is_main = link.dense is link.main
        link.main = EmulatedLinkCodec(link.main, gpu)
        link.dense = link.main if dense_is_main else EmulatedLinkCodec(link.dense, gpu)
