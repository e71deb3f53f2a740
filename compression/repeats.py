"""Rows of a frame's codes that repeat an earlier row exactly, sent once (lossless).

Why: a causal LM gives every position with the same token prefix the same activations, so in a
microbatch of sequences that share their first tokens (a task's prompt template, a chat template's
system prompt) those rows are equal at a boundary, and so are their codes. On the bundled model's
2048-token word frames 13.2% of the forward rows past position 0 repeat an earlier row
(bench/results/entropy.md). A repeated row travels as a reference: (its row, the unique row it
repeats), int32, 8 bytes instead of its ~70 bytes of codes and scales.

``drop_repeats`` takes the per-row fields of one frame (each (T, ...), row t of every field
together being row t's code) and returns them with each repeated row removed, plus ``rep``
(n, 2) int32: the rows dropped, increasing, and for each the index of its twin among the rows
kept. ``restore_repeats`` is its inverse; it refuses, with ``ValueError``, a ``rep`` that is not
(n, 2) int32, names rows out of order or outside the frame, or twins that are not kept rows.
"""

from __future__ import annotations

import numpy as np
import torch

from compression.entropy import decode_symbols, encode_symbols


def _row_bytes(fields: list[torch.Tensor]) -> torch.Tensor:
    """(T, bytes) uint8: every field's row t side by side, so equal rows are equal byte rows."""
    return torch.cat([f.reshape(f.shape[0], -1).contiguous().view(torch.uint8) for f in fields], dim=1)


def drop_repeats(fields: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``fields`` without the rows that repeat an earlier row of all of them, and ``rep``."""
    rows = _row_bytes([f.cpu() for f in fields]).numpy()
    t = rows.shape[0]
    if t == 0:
        return fields, torch.empty(0, 2, dtype=torch.int32)
    # each row as one opaque value: numpy sorts those by their bytes, ~10x faster than a sort of
    # (T, bytes) rows (0.3 against 2.7 ms for a 2048-token frame's 76-byte rows)
    opaque = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1]))).ravel()
    _, first_of, inverse = np.unique(opaque, return_index=True, return_inverse=True)
    first = torch.from_numpy(first_of[inverse.reshape(-1)]).to(torch.int64)  # each row's first twin
    keep = first == torch.arange(t)
    if bool(keep.all()):
        return fields, torch.empty(0, 2, dtype=torch.int32)
    kept_index = torch.cumsum(keep, 0) - 1  # a kept row's index among the kept rows
    dropped = (~keep).nonzero().squeeze(1)
    rep = torch.stack([dropped, kept_index[first[dropped]]], dim=1).to(torch.int32)
    keep = keep.to(fields[0].device)
    return [f[keep] for f in fields], rep


def restore_repeats(fields: list[torch.Tensor], rep: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """The ``rows``-row fields ``drop_repeats`` was given, from its output and ``rep``."""
    if rep.dtype != torch.int32 or rep.dim() != 2 or rep.shape[1] != 2 or rep.shape[0] >= max(rows, 1):
        raise ValueError(f"repeated rows must be (n < {rows}, 2) int32, got {rep.dtype} {tuple(rep.shape)}")
    n = rep.shape[0]
    if n == 0:
        return fields
    kept = rows - n
    dropped, twin = rep[:, 0].to(torch.int64), rep[:, 1].to(torch.int64)
    increasing = n == 1 or bool((dropped[1:] > dropped[:-1]).all())
    if int(dropped[0]) < 0 or int(dropped[-1]) >= rows or not increasing:
        raise ValueError(f"repeated rows must be increasing rows of the frame's {rows}")
    if int(twin.min()) < 0 or int(twin.max()) >= kept:
        raise ValueError(f"a repeated row names a twin outside the {kept} rows sent")
    index = torch.empty(rows, dtype=torch.int64)
    keep = torch.ones(rows, dtype=torch.bool)
    keep[dropped] = False
    index[keep] = torch.arange(kept)
    index[dropped] = twin
    out = []
    for f in fields:
        if f.shape[0] != kept:
            raise ValueError(f"a per-row field has {f.shape[0]} rows, the frame sends {kept}")
        out.append(f[index.to(f.device)])
    return out


# ---- the references entropy coded (with the codec's ``entropy``) ------------------------------
# Why: 8 bytes a repeated row is ~1 B/token on 2048-token frames (~270 of 2030 forward rows, up to
# ~410 backward). The rows dropped come in runs (gap 0 to the previous one), and so do their twins
# (a shared prompt repeats an earlier sequence's rows in order; a gradient's all-zero rows repeat
# one row): coded as the gap to the previous row and the step from the previous twin, each value's
# bytes a plane of symbols with its own table, they cost ~1 byte a row forward and less backward.
_PLANES_MAX = 4  # bytes per value: int32 rows


def _zigzag(v: np.ndarray) -> np.ndarray:
    return np.where(v >= 0, 2 * v, -2 * v - 1)


def encode_references(rep: torch.Tensor) -> torch.Tensor | None:
    """``rep`` (n, 2) int32 from ``drop_repeats`` as a uint8 blob, or None when that is not smaller
    than ``rep`` itself. Layout: n (uint32 LE), planes p (uint8), then the gaps' p byte planes and
    the twin steps' p byte planes, each an ``encode_symbols`` blob behind its int32 length."""
    r = rep.detach().cpu().to(torch.int64).numpy()
    n = r.shape[0]
    if n == 0:
        return None
    gaps = np.diff(r[:, 0], prepend=-1) - 1
    steps = _zigzag(np.diff(r[:, 1], prepend=-1) - 1)
    planes = max(1, (int(max(gaps.max(), steps.max())).bit_length() + 7) // 8)
    parts = [
        torch.tensor([n], dtype=torch.int32).view(torch.uint8),
        torch.tensor([planes], dtype=torch.uint8),
    ]
    for values in (gaps, steps):
        for j in range(planes):
            blob = encode_symbols(torch.from_numpy((values >> (8 * j)) & 0xFF), 0, 255, 1 << 62)
            parts += [torch.tensor([blob.numel()], dtype=torch.int32).view(torch.uint8), blob]
    out = torch.cat(parts)
    return out if out.numel() < rep.numel() * rep.element_size() else None


def decode_references(blob: torch.Tensor, rows: int) -> torch.Tensor:
    """The (n, 2) int32 ``rep`` of ``encode_references``' blob for a frame of ``rows`` rows;
    ValueError if it is malformed, names as many repeated rows as the frame has or more, or is not
    used up exactly (``restore_repeats`` checks the rows it names)."""
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() < 5:
        raise ValueError("coded repeated rows must be a 1-D uint8 blob of at least 5 bytes")
    n, planes = int(blob[:4].clone().view(torch.int32)), int(blob[4])
    if not 0 < n < max(rows, 1) or not 1 <= planes <= _PLANES_MAX:
        raise ValueError(f"coded repeated rows name {n} rows in {planes} planes, for a frame of {rows}")
    at, series = 5, []
    for _ in range(2):
        value = np.zeros(n, dtype=np.int64)
        for j in range(planes):
            if at + 4 > blob.numel():
                raise ValueError("coded repeated rows are truncated")
            size = int(blob[at : at + 4].clone().view(torch.int32))
            at += 4
            if size < 0 or at + size > blob.numel():
                raise ValueError("coded repeated rows run past their field")
            value |= decode_symbols(blob[at : at + size], n, 0, 255).numpy() << (8 * j)
            at += size
        series.append(value)
    if at != blob.numel():
        raise ValueError(f"coded repeated rows leave {blob.numel() - at} bytes over")
    gaps, steps = series
    twin_steps = np.where(steps % 2 == 0, steps // 2, -(steps + 1) // 2)
    rep = np.stack([np.cumsum(gaps + 1) - 1, np.cumsum(twin_steps + 1) - 1], axis=1)
    if rep.min() < 0 or rep.max() >= rows:
        raise ValueError(f"coded repeated rows name rows outside the frame's {rows}")
    return torch.from_numpy(rep.astype(np.int32))
