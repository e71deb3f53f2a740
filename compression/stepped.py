"""Coefficients at one uniform step for every direction (for an entropy coder to size).

Why: entropy coded, a uniform quantiser with the same step everywhere is the MSE-optimal way to
share bits among directions of unequal energy (reverse water-filling at high rate): a direction
gets about log2(its spread / step) bits, the weak ones mostly zeros that cost next to nothing.
Fixed tiers (8 bits for the first few dozen, 4 for the rest) only approximate that.

The step is ``rel`` times the RMS of the last (weakest) column over the frame, so one number fits
every model and frame scale. A column whose codes would pass ±127 gets the step that fits its
absmax instead (the codes stay int8). Payload: ``q`` int8 (rows, k), ``qstep`` bf16 (k,); no
per-row scales. The decoded value is ``q * qstep``, within ``qstep / 2`` of the coefficient.
"""

from __future__ import annotations

import math

import torch

from compression.codec import Payload

QMAX = 127


def frame_step(c: torch.Tensor, rel: float) -> float:
    """The frame's step before any column's raise: ``rel`` times the last column's RMS (rows > 0)."""
    return rel * float(c.pow(2).mean(dim=0)[-1].sqrt())


def encode_stepped(c: torch.Tensor, rel: float) -> Payload:
    """Coefficients ``c`` (rows, k), columns by falling energy, at one step (see the docstring)."""
    if c.numel() == 0:  # no rows or no directions: nothing to size a step by
        return {
            "q": torch.zeros(c.shape, dtype=torch.int8),
            "qstep": torch.zeros(c.shape[1], dtype=torch.bfloat16),
        }
    step = torch.clamp(c.abs().amax(dim=0) / QMAX, min=frame_step(c, rel))
    # rounded up as sent, so no code passes ±QMAX after the bf16 rounding of the step
    wire = step.to(torch.bfloat16)
    wire = torch.where(
        wire.float() < step, torch.nextafter(wire, torch.tensor(math.inf, dtype=wire.dtype)), wire
    )
    s = wire.float()
    q = torch.round(c / torch.where(s > 0, s, 1.0)).clamp(-QMAX, QMAX)
    return {"q": q.to(torch.int8), "qstep": wire}


def decode_stepped(p: Payload, k: int) -> torch.Tensor:
    """Inverse of ``encode_stepped`` for ``k`` directions: (rows, k) fp32; refuses steps or codes of
    the wrong shape or a negative, non-finite step."""
    try:
        q, step = p["q"], p["qstep"]
    except KeyError as e:
        raise ValueError(f"lowrank frame lacks its {e.args[0]}") from None
    if q.dim() != 2 or q.shape[1] != k or step.shape != (k,):
        raise ValueError(
            f"frame carries codes {tuple(q.shape)} and steps {tuple(step.shape)} for {k} directions"
        )
    s = step.float()
    if not torch.isfinite(s).all() or bool((s < 0).any()):
        raise ValueError("frame has a negative or non-finite direction step")
    return q.float() * s
