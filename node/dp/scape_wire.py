"""SCAPE's message formats and lineage rules (pure functions; ``node.dp.scape`` moves them).

A mask slice travels as int32 indices or a bitmap of the replica's strided slice, whichever
is smaller; digests name a mask and a parameter vector; a lineage is a hash chained over the
group steps a replica took, and ``winning_lineage`` is the one a group re-anchors on.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import defaultdict

import torch

from protocol.frames import Frame, FrameError

ANCHOR_CHUNK = 16 * 1024 * 1024  # floats per re-anchoring frame (64 MiB, under MAX_FRAME_BYTES)
INITIAL_LINEAGE = "init"  # replicas built from the same weights that have not stepped yet


def next_lineage(lineage: str, step: int, tag: str) -> str:
    """The lineage after one step: equal inputs (same state, same group, same mask) give equal outputs."""
    return hashlib.blake2b(f"{lineage}|{step}|{tag}".encode(), digest_size=8).hexdigest()


def winning_lineage(views: dict[str, tuple[str, int]]) -> str:
    """The lineage a group re-anchors on, from each member's (lineage, steps applied).

    Most steps applied first (a replica resumed from an old checkpoint, or one that pulled
    only weights, must not roll the others back), then the most holders (keeps the majority's
    state), then the one held by the lowest peer id (a deterministic tie-break every member
    computes alike from the same views).
    """
    holders: dict[str, list[str]] = defaultdict(list)
    applied: dict[str, int] = {}
    for peer, (lin, n) in views.items():
        holders[lin].append(peer)
        applied[lin] = max(applied.get(lin, 0), int(n))
    return min(holders, key=lambda lin: (-applied[lin], -len(holders[lin]), min(holders[lin])))


def anchor_key(frame: Frame) -> str:
    """Inbox key of one re-anchoring chunk, after checking what the receiver will rely on."""
    v, meta = frame.tensors.get("v"), frame.meta
    chunk, chunks = meta.get("chunk"), meta.get("chunks")
    if not (isinstance(chunk, int) and isinstance(chunks, int) and 0 <= chunk < chunks <= 1024):
        raise FrameError("scape anchor chunk index malformed")
    if v is None or v.dtype != torch.float32 or v.dim() != 1 or v.numel() > ANCHOR_CHUNK:
        raise FrameError("scape anchor values malformed")
    if not isinstance(meta.get("lineage"), str) or not isinstance(meta.get("applied"), int):
        raise FrameError("scape anchor without lineage")
    return f"anchor{chunk}"


def mask_digest(mask: torch.Tensor | None, numel: int) -> int:
    """CRC32 of the mask's indices (of the vector length for a dense step)."""
    if mask is None:
        return zlib.crc32(f"dense:{numel}".encode())
    return zlib.crc32(mask.to(torch.int64).numpy().tobytes())


def param_digest(flat: torch.Tensor) -> int:
    return zlib.crc32(flat.detach().to(torch.float32).contiguous().numpy().tobytes())


def encode_slice(indices: torch.Tensor, rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    """A slice of the next mask: int32 indices, or a bitmap over the slice {i : i mod world = rank}."""
    n_r = len(range(rank, numel, world))
    if indices.numel() * 4 <= (n_r + 7) // 8:
        return {"i": indices.to(torch.int32)}
    bits = torch.zeros((n_r + 7) // 8 * 8, dtype=torch.uint8)
    bits[(indices - rank) // world] = 1
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return {"b": (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)}


def decode_slice(tensors: dict[str, torch.Tensor], rank: int, world: int, numel: int) -> torch.Tensor:
    """Inverse of ``encode_slice``; raises FrameError on anything that is not a valid slice."""
    if not 0 <= rank < world:
        raise FrameError(f"slice rank {rank} outside world {world}")
    n_r = len(range(rank, numel, world))
    if "i" in tensors:
        idx = tensors["i"]
        if idx.dtype != torch.int32 or idx.dim() != 1:
            raise FrameError("slice indices must be a 1-D int32 tensor")
        idx = idx.to(torch.int64)
        bad = idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel)
        if bad or bool((idx % world != rank).any()):
            raise FrameError("slice indices outside this replica's slice")
        return idx
    b = tensors.get("b")
    if b is None or b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != (n_r + 7) // 8:
        raise FrameError("slice bitmap has the wrong size or dtype")
    shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)
    bits = ((b.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n_r]
    return torch.nonzero(bits, as_tuple=False).reshape(-1) * world + rank
