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
