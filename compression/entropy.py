"""Lossless entropy coding of a codec's small-integer fields (one table per field per frame).

Why: the default long-frame link's integer fields (8-bit tier codes, packed 4-bit codes, the
int8 basis) are ~90% of its bytes, and their symbols are far from uniform: blockwise absmax codes
of roughly Gaussian values crowd near zero (bench/results/code_entropy.md: order-0 entropy 90.6
of 98.9 integer bytes per token forward). Coding them with their own frame's histogram removes
that redundancy and changes no decoded value, so learning is unchanged by construction.

Model, chosen by measurement on the bundled model's 2048-token word frames (bench/results/entropy.md):
an order-0 categorical per field and frame, its table sent with the field (~0.26 B/token for the
three fields). The best single-scale quantized Laplace (Gaussian) costs 0.6 (1.2) B/token more
forward, table included: absmax codes put one symbol per block at ±qmax and the rest by the
block's own spread. Per-column tables would save ~1.6 B/token on the 8-bit codes before their
cost, 24 tables of up to 257 B per frame (more than they save). Block scales as a context helped
only through all-zero blocks, which the caller skips (a zero block scale forces zero codes).

Blob layout (uint8, little-endian): ``a`` (1 byte: the smallest symbol present, minus ``lo``),
``m - 1`` (1 byte: alphabet size minus one), ``m`` weight levels (1 byte each: 0 = absent,
v >= 1 = weight ``_WEIGHTS[v]``, a 1/12-octave log scale over 21 octaves), then the ANS words
(uint32) of the symbols followed by a 32-bit sentinel. The weights are integers (exact in
float64 at both ends), so the probability table a receiver rebuilds is the sender's bit for bit.
An empty blob means zero symbols.

The receiver must know how many symbols to decode from the frame's shape (``count``): decoding
never runs past it; a stream that is not exactly used up by ``count`` symbols and the sentinel
(truncated, extended, corrupted, or read with another count) is refused, and a blob longer than
``count`` symbols could need at the coder's 24-bit precision is refused before decoding. Errors
are ``ValueError``. What it does not catch, no raw field would either: a stream corrupted into
another valid one (odds ~2^-32 per field; the transport's checksums guard the bytes).
"""

from __future__ import annotations

import math

import constriction
import numpy as np
import torch

_LEVELS = 12  # weight levels per octave: a level's rounding costs < 0.001 bit per symbol
# round(4096 * 2 ** (i / 12)), written out so that both ends hold the same integers
_BASE = (4096, 4340, 4598, 4871, 5161, 5468, 5793, 6137, 6502, 6889, 7298, 7732)
_WEIGHTS = np.array(
    [0] + [_BASE[(v - 1) % _LEVELS] << ((v - 1) // _LEVELS) for v in range(1, 256)], dtype=np.float64
)
_PRECISION_BITS = 24  # constriction's default ANS coder: no symbol costs more than 24 bits
_HEADER = 2
# 32 known bits decoded after the symbols. Why: an ANS stack decodes on from an empty state
# without complaint, so a count larger than the sender's would pass the "used up" check; the
# sentinel is then read from the empty state (zeros) or from the symbols (a count too small), and
# a corrupted stream shifts it too (missed with odds 2^-32). 4 bytes per field.
_SENTINEL = np.array([0xB7E1, 0x5163], dtype=np.int32)
_UNIFORM16 = constriction.stream.model.Uniform(1 << 16)


def _model(levels: np.ndarray):
    weights = _WEIGHTS[levels]
    if weights.size == 1:  # one symbol (a field of equal codes): constriction needs two entries
        weights = np.append(weights, 0.0)
    return constriction.stream.model.Categorical(weights, perfect=False)


def _levels(counts: np.ndarray) -> np.ndarray:
    """Weight levels (uint8) of symbol counts: the largest at 255, absent symbols 0."""
    out = np.zeros(counts.shape, dtype=np.uint8)
    seen = counts > 0
    rel = np.log2(counts[seen] / counts.max()) * _LEVELS
    out[seen] = np.clip(np.round(rel) + 255, 1, 255).astype(np.uint8)
    return out


def encode_symbols(symbols: torch.Tensor, lo: int, hi: int, raw_nbytes: int) -> torch.Tensor | None:
    """``symbols`` (any shape, integers in [lo, hi], hi - lo < 256) coded as a uint8 blob, or None
    when the blob would not be smaller than ``raw_nbytes`` (the field as it is sent uncoded)."""
    if not 0 <= hi - lo < 256:
        raise ValueError(f"symbol range [{lo}, {hi}] does not fit a byte-sized alphabet")
    s = symbols.detach().reshape(-1).cpu().to(torch.int64).numpy()
    if s.size == 0:
        return torch.empty(0, dtype=torch.uint8) if raw_nbytes > 0 else None
    smin, smax = int(s.min()), int(s.max())
    if smin < lo or smax > hi:
        raise ValueError(f"symbols in [{smin}, {smax}] outside [{lo}, {hi}]")
    rel = (s - smin).astype(np.int32)
    levels = _levels(np.bincount(rel, minlength=smax - smin + 1))
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(_SENTINEL, _UNIFORM16)  # a stack: decoded after the symbols
    coder.encode_reverse(rel, _model(levels))
    words = coder.get_compressed().astype("<u4", copy=False)
    nbytes = _HEADER + levels.size + words.nbytes
    if nbytes >= raw_nbytes:
        return None
    head = np.array([smin - lo, smax - smin], dtype=np.uint8)
    blob = np.concatenate([head, levels, words.view(np.uint8)])
    return torch.from_numpy(blob)


def max_blob_bytes(count: int, alphabet: int) -> int:
    """The largest blob ``count`` symbols of an ``alphabet``-sized range can need (header, table
    and every symbol at the coder's least probable 24 bits, plus the sentinel and the state's words)."""
    return _HEADER + alphabet + 4 * (math.ceil(count * _PRECISION_BITS / 32) + 3)


def decode_symbols(blob: torch.Tensor, count: int, lo: int, hi: int) -> torch.Tensor:
    """The ``count`` symbols (int64, 1-D, in [lo, hi]) of ``encode_symbols``' blob; ValueError if
    the blob is malformed, truncated, too long or does not decode to exactly ``count`` symbols."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"an entropy-coded field must be 1-D uint8, got {blob.dtype} {tuple(blob.shape)}")
    n = blob.numel()
    if count == 0 or n == 0:
        if count or n:
            raise ValueError(f"entropy-coded field of {n} bytes for {count} symbols")
        return torch.empty(0, dtype=torch.int64)
    if n > max_blob_bytes(count, hi - lo + 1):
        raise ValueError(f"entropy-coded field of {n} bytes is too long for {count} symbols")
    b = blob.cpu().numpy()
    if n < _HEADER:
        raise ValueError("entropy-coded field is shorter than its header")
    start, m = int(b[0]), int(b[1]) + 1
    if lo + start + m - 1 > hi:
        raise ValueError(f"entropy-coded field names symbols beyond [{lo}, {hi}]")
    body = n - _HEADER - m
    if body <= 0 or body % 4:
        raise ValueError(f"entropy-coded field of {n} bytes is truncated or padded")
    levels = b[_HEADER : _HEADER + m]
    if not levels.any():
        raise ValueError("entropy-coded field has an empty table")
    words = np.frombuffer(b[_HEADER + m :].tobytes(), dtype="<u4").astype(np.uint32)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        rel = coder.decode(_model(levels), count)
        sentinel = coder.decode(_UNIFORM16, len(_SENTINEL))
    except Exception as e:  # constriction raises its own kinds for a malformed stream
        raise ValueError(f"entropy-coded field does not decode: {e}") from None
    if not np.array_equal(sentinel, _SENTINEL) or not coder.is_empty():
        raise ValueError(
            f"entropy-coded field is corrupted, truncated or not {count} symbols (stream not used up exactly)"
        )
    if levels[rel].min() == 0:  # a symbol the table says is absent: not what the sender coded
        raise ValueError("entropy-coded field decodes to a symbol its table marks absent")
    return torch.from_numpy(rel).to(torch.int64) + (lo + start)


# Columns per table of ``encode_column_groups``. Why 16: codes whose spread falls column by column
# (a uniform step over directions of falling energy) cost 5% more in one table than in tables of
# 16 columns, on the bundled model's word frames, and tables of 8 save nothing more.
COLUMN_GROUP = 16
_GROUP_HEAD = 4  # a group's blob length, uint32 little-endian


# Row buckets of ``encode_column_groups(..., buckets=ROW_BUCKETS)``. Why: a token's codes are
# large or small together (its norm), so a column group's codes split by how large the row's codes
# already coded are need fewer bits than one table over all rows: on the bundled model's 2048-token
# word frames the stepped coefficients cost 1.6 B/token less forward and 2.0 backward in 4 buckets
# (3 and 6 are within 0.2 of it; the tables of more buckets eat their gain).
ROW_BUCKETS = 4
_MAX_BUCKETS = 16  # what a receiver accepts: each bucket adds a table per group


def row_buckets(context: np.ndarray, buckets: int) -> np.ndarray:
    """Each row's bucket (int64): its rank by ``context`` (ties by row index) in ``buckets`` equal
    shares. Integer arithmetic on codes both ends hold, so the receiver's buckets are the sender's."""
    rank = np.empty(len(context), dtype=np.int64)
    rank[np.argsort(context, kind="stable")] = np.arange(len(context))
    return rank * buckets // max(len(context), 1)


def _group_order(cols: int, buckets: int) -> list[int]:
    """The groups' first columns in coding order: the weakest (last) group first when rows are
    bucketed, so the strong groups, where a row's size tells the most, have the most context."""
    starts = list(range(0, cols, COLUMN_GROUP))
    return starts[::-1] if buckets > 1 else starts


def encode_column_groups(
    q: torch.Tensor, lo: int, hi: int, raw_nbytes: int, buckets: int = 1
) -> torch.Tensor | None:
    """``q`` (rows, cols) coded COLUMN_GROUP columns to a table: a byte naming the row buckets
    used, then each group's ``encode_symbols`` blob behind its length; None when the whole would not
    be smaller than ``raw_nbytes``. Why groups: codes whose spread differs by column share no single
    histogram well. With ``buckets`` > 1 the rows are also tried in buckets, and the smaller coding
    kept (a short frame's extra tables can cost more than they save): the groups coded last first
    and, after the first, each in ``buckets`` blobs, the rows of each ``row_buckets`` share by their
    sum of |code| over the groups coded before."""
    if q.dim() != 2:
        raise ValueError(f"column groups need a 2-D field, got shape {tuple(q.shape)}")
    if not 1 <= buckets <= _MAX_BUCKETS:
        raise ValueError(f"row buckets must be in [1, {_MAX_BUCKETS}], got {buckets}")
    codes = q.detach().cpu().to(torch.int64)
    out = min((_groups(codes, lo, hi, b) for b in {1, buckets}), key=len)
    return out if out.numel() < raw_nbytes else None


def _groups(codes: torch.Tensor, lo: int, hi: int, buckets: int) -> torch.Tensor:
    context = np.zeros(codes.shape[0], dtype=np.int64)
    parts = [torch.tensor([buckets], dtype=torch.uint8)]
    for i, start in enumerate(_group_order(codes.shape[1], buckets)):
        group = codes[:, start : start + COLUMN_GROUP]
        shares = (
            [group] if i == 0 or buckets == 1 else _by_bucket(group, row_buckets(context, buckets), buckets)
        )
        for share in shares:
            blob = encode_symbols(share, lo, hi, 1 << 62)
            parts += [torch.tensor([blob.numel()], dtype=torch.int32).view(torch.uint8), blob]
        context += group.abs().sum(dim=1).numpy()
    return torch.cat(parts)


def _by_bucket(group: torch.Tensor, bucket: np.ndarray, buckets: int) -> list[torch.Tensor]:
    b = torch.from_numpy(bucket)
    return [group[b == j] for j in range(buckets)]


def decode_column_groups(blob: torch.Tensor, rows: int, cols: int, lo: int, hi: int) -> torch.Tensor:
    """The (rows, cols) int64 codes of ``encode_column_groups``' blob; ValueError if any group is
    malformed or the blob is not used up exactly."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"an entropy-coded field must be 1-D uint8, got {blob.dtype} {tuple(blob.shape)}")
    if blob.numel() == 0 or not 1 <= int(blob[0]) <= _MAX_BUCKETS:
        raise ValueError("entropy-coded column groups do not name their row buckets")
    buckets = int(blob[0])
    out = torch.zeros(rows, cols, dtype=torch.int64)
    context = np.zeros(rows, dtype=np.int64)
    at = 1

    def take(count: int) -> torch.Tensor:
        nonlocal at
        if at + _GROUP_HEAD > blob.numel():
            raise ValueError("entropy-coded column groups are truncated")
        n = int(blob[at : at + _GROUP_HEAD].clone().view(torch.int32))
        at += _GROUP_HEAD
        if n < 0 or at + n > blob.numel():
            raise ValueError("entropy-coded column group runs past its field")
        symbols = decode_symbols(blob[at : at + n], count, lo, hi)
        at += n
        return symbols

    for i, start in enumerate(_group_order(cols, buckets)):
        width = min(COLUMN_GROUP, cols - start)
        if i == 0 or buckets == 1:
            group = take(rows * width).view(rows, width)
        else:
            bucket = torch.from_numpy(row_buckets(context, buckets))
            group = torch.zeros(rows, width, dtype=torch.int64)
            for j in range(buckets):
                sel = bucket == j
                group[sel] = take(int(sel.sum()) * width).view(-1, width)
        out[:, start : start + width] = group
        context += group.abs().sum(dim=1).numpy()
    if at != blob.numel():
        raise ValueError(f"entropy-coded column groups leave {blob.numel() - at} bytes over")
    return out
