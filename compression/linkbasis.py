"""Link-held basis codec: both ends of a link keep a k-direction basis per direction, and the
sender updates it incrementally from the frames it sends.

Why: a fixed PCA basis cuts the directions fine-tuning moves into (bench/results/quality.md),
and the per-frame basis of ``compression.lowrank`` follows them but pays k·H bytes in every
frame. Here the basis lives on the link: the first frame (or a new peer) gets it in full, and
afterwards a frame carries only the few directions that changed.

Sender, per direction (forward: rows centred by the frame's mean; backward: gradient rows,
uncentred), for every frame X (T, H):
  1. G ← β·G + XᵀX/T, an fp64 running Gram matrix of recent frames (sender only, never sent).
  2. The captured share of G's energy, tr(QᵀGQ) / (sum of G's top-k eigenvalues), with Q the
     held basis. If it is below ``threshold`` (or every ``update_every`` frames), up to ``rank``
     candidates are taken from G's top-k eigenvectors outside span(Q) (weighted by their
     eigenvalues); each replaces one of the held directions carrying the least energy (after
     rotating Q to G's eigenbasis inside it) if it carries more. A warm-started subspace
     tracker: the update is the n new directions (int8) and the k−n kept ones as int8
     coordinates in the old basis (a k-entry row each, far smaller than an H-entry one).
  3. The frame is encoded with the (possibly new) basis: C = X Q, int8 with a bf16 scale per
     ``block`` coefficients.
Receiver: applies the update carried by the frame (it must hold the version it is based on),
then decodes μ + C Qᵀ. Q is the QR orthonormalisation (``orthonormal``) of what the update
carries, computed the same way at both ends, so both hold the same Q. (Across different
hardware the two QRs may differ in the last bits; a full basis re-synchronises exactly.)

Versions: every change of a direction's basis makes a new version, named in every frame
(``ver``). A receiver keeps the last ``keep`` versions (frames in flight during an update
still decode); a frame naming any other version, or an update based on a version the receiver
does not hold, raises ``BasisVersionError``: the receiver must ask for the full basis
(``full_basis`` / ``install_basis``), never decode with another one.

Bytes, per frame of T tokens (``frame_bytes``): 4 (version) + 2H (the forward's bf16 mean)
+ T·(k + 2⌈k/block⌉) coefficients; per update bringing in n directions (``update_bytes``)
n·(H + 2⌈H/bb⌉) + (k−n)·(k + 2⌈k/bb⌉), bb = ``basis_block``; in the first frame the int8
basis, k·(H + 2⌈H/bb⌉); once per late peer (``full_basis``) the fp32 basis, 4kH.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from compression.baselines import dequantize_blockwise, quantize_blockwise
from compression.codec import LinkCodec, LinkContext, Payload
from compression.pca import BasisVersionError

DIRECTIONS = ("forward", "backward")
_VER = torch.int32


def orthonormal(rows: torch.Tensor) -> torch.Tensor:
    """Q (H, k) spanning ``rows`` (k, H): fp64 QR with R's diagonal made positive, so the same
    rows give the same Q at both ends."""
    q, r = torch.linalg.qr(rows.to(torch.float64).T)
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(torch.float32).contiguous()


def _signed(rows: torch.Tensor) -> torch.Tensor:
    """Each row with its largest-magnitude entry positive: the same frames give the same basis."""
    pivot = rows.abs().argmax(dim=1)
    sign = torch.sign(rows[torch.arange(rows.shape[0]), pivot])
    sign[sign == 0] = 1.0
    return rows * sign.unsqueeze(1)


def rotate_and_extend(q: torch.Tensor, rot: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The next basis from an update: the kept directions ``rot`` (k−n, k) in the coordinates of
    the held Q (H, k), then the ``new`` directions (n, H); what both ends compute."""
    return orthonormal(torch.cat([rot @ q.T, new]))


def _nbytes(p: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in p.values())


@dataclass
class _Sender:
    q: torch.Tensor | None = None  # (H, k) the held basis, as the receiver holds it
    gram: torch.Tensor | None = None  # (H, H) fp64 running Gram of recent frames
    version: int = -1
    frames: int = 0
    updates: int = 0
    update_bytes: int = 0
    full_bytes: int = 0
    captured: list[float] = field(default_factory=list)  # captured share of G, frames after the first


@dataclass
class _Receiver:
    qs: dict[int, torch.Tensor] = field(default_factory=dict)  # version -> Q, the last `keep`


class LinkBasisCodec(LinkCodec):
    """A basis per direction held by both ends of one link, updated by the sender."""

    codec_id = "linkbasis"

    def __init__(
        self,
        k: int = 64,
        rank: int = 8,
        threshold: float = 0.99,
        update_every: int = 0,
        beta: float = 0.5,
        block: int = 32,
        basis_block: int = 32,
        keep: int = 4,
        coeff_dtype: str = "int8",
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if rank < 1:
            raise ValueError(f"rank (directions per update) must be >= 1, got {rank}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is a share of energy in [0, 1], got {threshold}")
        if update_every < 0:
            raise ValueError(f"update_every must be >= 0 (0: by threshold only), got {update_every}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if block < 1 or basis_block < 1:
            raise ValueError(f"block and basis_block must be >= 1, got {block}, {basis_block}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if coeff_dtype not in ("int8", "float32"):
            raise ValueError(f"coeff_dtype {coeff_dtype!r} must be int8 or float32 (float32: exact tests)")
        self.k, self.rank, self.threshold = int(k), min(int(rank), int(k)), float(threshold)
        self.update_every, self.beta = int(update_every), float(beta)
        self.block, self.basis_block, self.keep = int(block), int(basis_block), int(keep)
        self.coeff_dtype = coeff_dtype
        self._tx = {d: _Sender() for d in DIRECTIONS}
        self._rx = {d: _Receiver() for d in DIRECTIONS}

    # ---- sender ------------------------------------------------------------------------------

    def _quantise(self, rows: torch.Tensor, block: int) -> tuple[Payload, torch.Tensor]:
        """int8 rows with bf16 scales, and the rows as both ends will hold them."""
        q, scale = quantize_blockwise(rows.to(torch.float32), block, 8, torch.bfloat16)
        return {"q": q, "s": scale}, dequantize_blockwise(q, scale, block)

    def _basis_update(self, tx: _Sender, rows: torch.Tensor) -> Payload:
        """Fold ``rows`` into the Gram matrix; return what changed in the basis (may be empty)."""
        x = rows.to(torch.float64)
        g_frame = x.T @ x / max(x.shape[0], 1)
        tx.gram = g_frame if tx.gram is None else self.beta * tx.gram + (1 - self.beta) * g_frame
        tx.frames += 1
        k = min(self.k, rows.shape[1])
        evals, evecs = torch.linalg.eigh(tx.gram)  # ascending
        if tx.q is None:  # first frame: the full basis, int8
            p, held = self._quantise(_signed(evecs[:, -k:].flip(-1).T), self.basis_block)
            tx.q, tx.version = orthonormal(held), 0
            out = {"bq": p["q"], "bscale": p["s"]}
            tx.full_bytes += _nbytes(out)
            return out
        q64 = tx.q.to(torch.float64)
        inner = q64.T @ tx.gram @ q64  # G inside the held span
        best = float(evals[-k:].clamp_min(0).sum())
        captured = float(torch.trace(inner)) / best if best > 0 else 1.0
        tx.captured.append(captured)
        due = self.update_every and tx.frames % self.update_every == 0
        if captured >= self.threshold and not due:
            return {}
        # candidates: G's top-k directions outside span(Q), weighted by their energy
        top = evecs[:, -k:] * evals[-k:].clamp_min(0).sqrt()
        u, sv, _ = torch.linalg.svd(top - q64 @ (q64.T @ top), full_matrices=False)
        gain = sv[: self.rank] ** 2  # energy each candidate adds (at least)
        held_e, held_v = torch.linalg.eigh(inner)  # held directions by energy, weakest first
        n = int((gain > held_e[: gain.numel()]).sum())  # i-th best candidate vs i-th weakest held
        if n == 0:
            return {}
        rot_p, rot = self._quantise(_signed(held_v[:, n:].flip(-1).T), self.basis_block)
        new_p, new = self._quantise(_signed(u[:, :n].T), self.basis_block)
        tx.q, tx.version = rotate_and_extend(tx.q, rot, new), tx.version + 1
        out = {"urot": rot_p["q"], "urscale": rot_p["s"], "uq": new_p["q"], "uscale": new_p["s"]}
        tx.updates += 1
        tx.update_bytes += _nbytes(out)
        return out

    def _encode(self, direction: str, rows: torch.Tensor) -> Payload:
        tx = self._tx[direction]
        out = self._basis_update(tx, rows)
        c = rows @ tx.q
        if self.coeff_dtype == "int8":
            q, scale = quantize_blockwise(c, self.block, 8, torch.bfloat16)
            out.update(q=q, scale=scale)
        else:
            out["c"] = c.contiguous()
        out["ver"] = torch.tensor([tx.version], dtype=_VER)
        return out

    # ---- receiver ----------------------------------------------------------------------------

    def _hold(self, rx: _Receiver, version: int, q: torch.Tensor) -> None:
        rx.qs[version] = q
        for old in sorted(rx.qs)[: -self.keep]:
            del rx.qs[old]

    def _decode(self, direction: str, payload: Payload) -> torch.Tensor:
        rx = self._rx[direction]
        if "ver" not in payload or payload["ver"].numel() != 1:
            raise ValueError("linkbasis frame carries no basis version")
        ver = int(payload["ver"][0])
        if "bq" in payload:
            self._hold(rx, ver, orthonormal(self._rows_of(payload["bq"], payload["bscale"], self.k)))
        elif "uq" in payload and ver not in rx.qs:  # held already: a full basis came first
            base = rx.qs.get(ver - 1)
            if base is None:
                raise BasisVersionError(
                    f"{direction} basis update to version {ver} needs version {ver - 1}, this end holds "
                    f"{sorted(rx.qs)}; ask the sender for the full basis"
                )
            new = self._rows_of(payload["uq"], payload["uscale"], self.k)
            rot = self._rows_of(payload["urot"], payload["urscale"], self.k)
            if rot.shape != (base.shape[1] - new.shape[0], base.shape[1]) or new.shape[1] != base.shape[0]:
                raise ValueError("linkbasis update does not fit the basis it is based on")
            self._hold(rx, ver, rotate_and_extend(base, rot, new))
        q = rx.qs.get(ver)
        if q is None:
            raise BasisVersionError(
                f"{direction} basis version {ver} not held (have {sorted(rx.qs)}); "
                "ask the sender for the full basis"
            )
        if self.coeff_dtype == "int8":
            c = dequantize_blockwise(payload["q"], payload["scale"], self.block)
        else:
            c = payload["c"].to(torch.float32)
        if c.dim() != 2 or c.shape[1] != q.shape[1]:
            raise ValueError(f"linkbasis coefficients have {c.shape[-1]} columns, the basis {q.shape[1]}")
        return c @ q.T

    def _rows_of(self, q8: torch.Tensor, scale: torch.Tensor, max_rows: int) -> torch.Tensor:
        if (
            q8.dim() != 2
            or q8.shape[0] > max_rows
            or scale.shape != (q8.shape[0], math.ceil(q8.shape[1] / self.basis_block))
        ):
            raise ValueError("linkbasis directions and their scales do not match")
        rows = dequantize_blockwise(q8, scale, self.basis_block)
        if float(rows.norm(dim=1).max()) > 1.05:  # unit vectors up to rounding: decode stays bounded
            raise ValueError("linkbasis directions are not unit vectors")
        return rows

    # ---- a new peer --------------------------------------------------------------------------

    def full_basis(self, direction: str) -> Payload:
        """The sender's current basis in full (fp32: after updates the held basis is no longer
        int8-exact), for a receiver that joins late or lost a version; counted in ``stats``."""
        tx = self._tx[direction]
        if tx.q is None:
            raise BasisVersionError(f"no {direction} basis yet: the first frame carries it")
        out = {"ver": torch.tensor([tx.version], dtype=_VER), "bfull": tx.q.T.contiguous()}
        tx.full_bytes += _nbytes(out)
        return out

    def install_basis(self, direction: str, payload: Payload) -> int:
        """Receiver: hold the basis ``full_basis`` sent; returns its version."""
        ver, rows = int(payload["ver"][0]), payload["bfull"].to(torch.float32)
        if rows.dim() != 2 or rows.shape[0] > self.k:
            raise ValueError(f"a full linkbasis basis is (<= k = {self.k}, H), got {tuple(rows.shape)}")
        gram = rows @ rows.T
        if not torch.allclose(gram, torch.eye(rows.shape[0]), atol=1e-4):
            raise ValueError("a full linkbasis basis must be orthonormal")
        self._hold(self._rx[direction], ver, rows.T.contiguous())
        return ver

    # ---- the interface -----------------------------------------------------------------------

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = h.detach().reshape(-1, h.shape[-1]).to(torch.float32)
        mean = rows.mean(dim=0).to(torch.bfloat16)
        out = self._encode("forward", rows - mean.to(torch.float32))
        out["mean"] = mean.contiguous()
        return out

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return (self._decode("forward", payload) + payload["mean"].to(torch.float32)).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        return self._encode("backward", g.detach().reshape(-1, g.shape[-1]).to(torch.float32))

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        return self._decode("backward", payload).reshape(shape)

    def basis(self, direction: str, version: int | None = None) -> torch.Tensor:
        """Q (H, k) the receiver decodes ``version`` (default: its newest) of ``direction`` with."""
        rx = self._rx[direction]
        v = max(rx.qs, default=-1) if version is None else version
        if v not in rx.qs:
            raise BasisVersionError(f"{direction} basis version {v} not held (have {sorted(rx.qs)})")
        return rx.qs[v]

    def coeff_bytes_per_token(self, hidden: int) -> float:
        k = min(self.k, hidden)
        if self.coeff_dtype == "float32":
            return float(4 * k)
        return float(k + 2 * math.ceil(k / self.block))

    def directions_bytes(self, n: int, length: int) -> int:
        """Bytes of n int8 rows of ``length`` entries with their bf16 scales."""
        return n * (length + 2 * math.ceil(length / self.basis_block))

    def update_bytes(self, n: int, hidden: int) -> int:
        """Bytes of an update bringing in n new directions: the k−n kept ones as int8
        coordinates in the old basis (k each), and the n new ones (H each)."""
        k = min(self.k, hidden)
        return self.directions_bytes(k - n, k) + self.directions_bytes(n, hidden)

    def frame_bytes(
        self,
        tokens: int,
        hidden: int,
        direction: str,
        update: int = 0,
        full: bool = False,
        sequences: int = 0,
    ) -> int:
        """Exact payload bytes of one frame: version, mean (forward), coefficients, and an update
        bringing in ``update`` directions, or the int8 ``full`` basis of a first frame (the
        layout does not depend on how many ``sequences`` the tokens are)."""
        mean = 2 * hidden if direction == "forward" else 0
        basis = self.directions_bytes(min(self.k, hidden), hidden) if full else 0
        if update:
            basis += self.update_bytes(update, hidden)
        return int(4 + mean + tokens * self.coeff_bytes_per_token(hidden) + basis)

    def bytes_per_token(self, hidden: int) -> float:
        """Coefficients only: the per-frame version and mean, and the basis updates, depend on
        the frames (``frame_bytes``, ``stats``)."""
        return self.coeff_bytes_per_token(hidden)

    def stats(self) -> dict:
        """Sender-side counts per direction: frames, updates, update and full-basis bytes."""
        return {
            d: {
                "frames": tx.frames,
                "updates": tx.updates,
                "update_bytes": tx.update_bytes,
                "full_bytes": tx.full_bytes,
                "version": tx.version,
                "captured_mean": sum(tx.captured) / max(len(tx.captured), 1),
            }
            for d, tx in self._tx.items()
        }

    def describe(self) -> dict:
        return {
            "codec": self.codec_id,
            "k": self.k,
            "rank": self.rank,
            "threshold": self.threshold,
            "update_every": self.update_every,
            "beta": self.beta,
            "block": self.block,
            "basis_block": self.basis_block,
            "coeff_dtype": self.coeff_dtype,
        }

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        return {
            "ver": _VER,
            "mean": torch.bfloat16,
            "q": torch.int8,
            "scale": torch.bfloat16,
            "c": torch.float32,
            "bq": torch.int8,
            "bscale": torch.bfloat16,
            "bfull": torch.float32,
            "urot": torch.int8,
            "urscale": torch.bfloat16,
            "uq": torch.int8,
            "uscale": torch.bfloat16,
        }
