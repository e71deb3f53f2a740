"""Outer-round tensors at 8 or 4 bits, with error feedback (DESIGN.md 4.3).

An outer round can carry its pseudo-gradients (and PowerSGD's P and Q factors) quantised
instead of in fp32, as INTELLECT-1 (int8 outer deltas) and SparseLoCo (2-bit with error
feedback) do. A flat tensor is cut into blocks of ``BLOCK`` values from its start; each block
has one bf16 scale s = absmax / qmax, rounded *up* (so no value clips), and codes
q = round(x / s) in [-qmax, qmax], qmax = 2**(bits-1) - 1.

The value a block stands for is q * s. That product is exact in fp32 (q has at most 7
significant bits, a bf16 scale 8), and so is (q * s) / s = q: a sender that keeps the values
it meant to send and their scales can encode them again without any further rounding, and a
receiver decodes exactly those values. Every member of a group therefore agrees bit for bit
on what was sent, which the averager needs (``node/dp/diloco.py`` keeps members' outer state
bit-identical).

Error feedback: a sender quantises x = delta + e and keeps e <- x - sent for its next round,
so what quantisation drops this round is sent later instead of lost (the sum of what was sent
over rounds tracks the sum of the deltas within one round's error).

Wire bytes for n values: 2 per block (the bf16 scale) + ceil(n * bits / 8).
Pure tensor math: no I/O.
"""

from __future__ import annotations

import math

import torch

from compression.baselines import dequantize_blockwise, pack_int4, quantize_blockwise, unpack_int4

BITS = (32, 8, 4)  # 32: fp32 as before (nothing here is used)
BLOCK = 64  # values per scale: 0.25 bits of scale per value


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"outer bits must be one of {BITS}, not {bits}")
    return int(bits)


def wire_nbytes(n: int, bits: int) -> int:
    """Bytes of ``encode`` for n values (fp32: 4 n)."""
    if check_bits(bits) == 32:
        return 4 * n
    return 2 * math.ceil(n / BLOCK) + math.ceil(n * bits / 8)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales): the fp32 values x stands for at ``bits`` (same shape), and its bf16 block scales."""
    flat = x.detach().reshape(1, -1).to(torch.float32)
    q, scales = quantize_blockwise(flat, BLOCK, check_bits(bits), torch.bfloat16)
    return dequantize_blockwise(q, scales, BLOCK).reshape(x.shape), scales.reshape(-1)


def with_feedback(
    delta: torch.Tensor, err: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sent, scales, new_err) for one tensor: sent = quantised (delta + err), new_err = delta + err - sent.

    Nothing is modified in place: a round that fails keeps ``err`` as it was."""
    x = delta.detach().to(torch.float32) + err
    sent, scales = quantize(x, bits)
    return sent, scales, x - sent


def encode(values: torch.Tensor, scales: torch.Tensor, bits: int) -> bytes:
    """Bytes of 1-D ``values`` that are exact multiples of their bf16 block ``scales`` (from ``quantize``,
    or any block-aligned slice of its output with the matching scales)."""
    n = values.numel()
    nb = math.ceil(n / BLOCK)
    if scales.numel() != nb:
        raise ValueError(f"{n} values need {nb} block scales, got {scales.numel()}")
    qmax = 2 ** (check_bits(bits) - 1) - 1
    s = torch.repeat_interleave(scales.to(torch.float32), BLOCK)[:n]
    div = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(values.reshape(-1).to(torch.float32) / div).clamp_(-qmax, qmax).to(torch.int8)
    packed = pack_int4(codes.reshape(1, -1)) if bits == 4 else codes
    return scales.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes() + (
        packed.contiguous().numpy().tobytes()
    )


def decode(buf: bytes, n: int, bits: int) -> torch.Tensor:
    """The fp32 values (1-D, n) of ``encode``'s bytes; a buffer of the wrong size is refused."""
    if len(buf) != wire_nbytes(n, bits):
        raise ValueError(f"{len(buf)} bytes for {n} values at {bits} bits, want {wire_nbytes(n, bits)}")
    nb = math.ceil(n / BLOCK)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    scales = raw[: 2 * nb].view(torch.bfloat16).reshape(1, nb)
    body = raw[2 * nb :]
    codes = unpack_int4(body.reshape(1, -1), n) if bits == 4 else body.view(torch.int8).reshape(1, n)
    return dequantize_blockwise(codes, scales, BLOCK).reshape(n)


def roundtrip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What a receiver of ``x`` quantised afresh gets: decode(encode(quantize(x)))."""
    values, scales = quantize(x.reshape(-1), bits)
    return decode(encode(values, scales, bits), x.numel(), bits).reshape(x.shape)
