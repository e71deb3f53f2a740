"""Per-microbatch low-rank link codec: the basis travels with the data, so it follows training.

Why: a fixed PCA basis fitted at step 0 keeps the forward nearly exact but cuts the directions
fine-tuning moves into (bench/results/quality.md, codec probe), and the upstream stages only
ever get gradient inside it. Here every frame carries its own basis: the sender takes the top-k
directions of *this* microbatch's rows and sends them with the k coefficients per token.

Forward: rows X (T, H), mean μ (H,), V (H, k) = top-k eigenvectors of (X−μ)ᵀ(X−μ); payload μ,
V (wire dtype) and C = (X−μ)V (int8 blocks or wire dtype); the receiver rebuilds μ + C Vᵀ.
Backward: the gradient rows G get their own basis, top-k eigenvectors of GᵀG (uncentred:
energy, not variance), and travel the same way without a mean. So each direction is the best
rank-k approximation of what it carries (up to quantisation), whatever the weights are by now.

Bytes per frame: H·2 (mean, forward only) + kH·w (+ 2k scales for an int8 basis) + T·(k +
scales), with w the basis dtype's size; per token the basis costs kH·w/T, so it pays off for long
microbatches (T ≫ H·w) and is charged honestly for short ones (``frame_bytes``).
"""

from __future__ import annotations

import math

import torch

from compression.baselines import (
    decode_coeffs,
    dequantize_blockwise,
    encode_coeffs,
    pack_int4,
    quantize_blockwise,
    unpack_int4,
)
from compression.codec import WIRE_DTYPES, LinkCodec, LinkContext, Payload
from compression.entropy import (
    ROW_BUCKETS,
    decode_column_groups,
    decode_symbols,
    encode_column_groups,
    encode_symbols,
)
from compression.repeats import decode_references, drop_repeats, encode_references, restore_repeats
from compression.stepped import decode_stepped, encode_stepped, frame_step
from compression.tiered import (
    check_tiers,
    decode_tiers,
    encode_tiers,
    tier_bytes_per_token,
    tier_dtypes,
    tiers_fit,
)

COEFF_DTYPES = ("int8", "bfloat16", "float32")
BASIS_DTYPES = ("int8", "bfloat16", "float32")  # int8: bf16 absmax scales (see basis_block)
FIRST_K = 4  # directions of the first positions' own basis (identical first tokens need none)
_NORM_TOL = 0.05  # decoded basis rows are unit vectors up to rounding; more is a malformed frame
_COARSE_NORM_TOL = 0.5  # the same with ``basis_step``, whose weak directions carry 2-3 bits an entry


def top_directions(rows: torch.Tensor, k: int) -> torch.Tensor:
    """V (H, k): orthonormal top-k eigenvectors of rowsᵀrows, largest first, signs fixed.

    The Gram matrix is H×H, so the cost is T·H² + H³ whatever T is. fp64 for the
    eigensolver (fp32 Gram loses the tail ordering when the spectrum is steep). Each column's
    largest-magnitude entry is made positive so the same rows always give the same V.
    """
    gram = (rows.T @ rows).to(torch.float64)
    _, vecs = torch.linalg.eigh(gram)  # ascending
    v = vecs[:, -k:].flip(-1)
    pivot = v.abs().argmax(dim=0)
    sign = torch.sign(v[pivot, torch.arange(v.shape[1], device=v.device)])
    sign[sign == 0] = 1.0
    return (v * sign).to(rows.dtype).contiguous()


def split_uniform_rows(scale: torch.Tensor) -> Payload:
    """A stepped basis's block scales (k, blocks): ``vscale``, the rows up to the last one whose
    blocks differ, and ``vrow``, one value for each row after it (its every block's scale). Why:
    ``basis_step`` floors a weak direction's blocks at one step, and the directions come strongest
    first, so most rows are one value repeated (~110 of 128 forward on 2048-token word frames):
    1.8 B/token forward and 1.6 backward sent as 0.4 and 0.1, every scale as before."""
    uniform = (scale == scale[:, :1]).all(dim=1)
    tail = int(uniform.flip(0).cumprod(0).sum())  # the trailing rows whose blocks share one scale
    head = scale.shape[0] - tail
    return {"vscale": scale[:head].contiguous(), "vrow": scale[head:, 0].contiguous()}


def join_uniform_rows(head: torch.Tensor | None, vrow: torch.Tensor, hidden: int, block: int) -> torch.Tensor:
    """The (k, blocks) block scales ``split_uniform_rows`` split; ValueError if they do not fit
    ``hidden``'s blocks."""
    blocks = math.ceil(hidden / block)
    if head is None or head.dim() != 2 or head.shape[1] != blocks or vrow.dim() != 1:
        raise ValueError(f"lowrank basis scales must be (rows, {blocks}) and one-scale rows 1-D")
    if vrow.dtype != head.dtype:
        raise ValueError(f"lowrank one-scale basis rows are {vrow.dtype}, its scales {head.dtype}")
    return torch.cat([head, vrow[:, None].expand(-1, blocks)])


def row_share(loss_rows: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row weights (float, flattened) that give the ``loss_rows`` (bool, any shape) the same total
    weight as all the other rows; None when there is no mask or either side is empty."""
    if loss_rows is None:
        return None
    loss_rows = loss_rows.reshape(-1)
    n_loss = int(loss_rows.sum())
    n_other = loss_rows.numel() - n_loss
    if n_loss == 0 or n_other == 0:
        return None
    return torch.where(loss_rows, n_other / n_loss, 1.0).to(torch.float32)


class LowRankCodec(LinkCodec):
    """Top-k directions of each microbatch, sent with its coefficients (both directions)."""

    codec_id = "lowrank"

    def __init__(
        self,
        k: int = 64,
        coeff_dtype: str = "int8",
        block: int = 32,
        scale_dtype: str = "bfloat16",
        basis_dtype: str = "bfloat16",
        basis_block: int = 0,
        k_backward: int = 0,
        backward_bits: int = 8,
        tiers=None,
        backward_tiers=None,
        centre: str = "mean",
        first_apart: bool = False,
        loss_share: bool = False,
        entropy: bool = False,
        repeats: bool = False,
        step: float = 0.0,
        backward_step: float = 0.0,
        basis_step: float = 0.0,
        first_gain: float = 0.0,
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if k_backward < 0:
            raise ValueError(f"k_backward must be >= 0 (0: k), got {k_backward}")
        if backward_bits not in (4, 8) or (backward_bits == 4 and coeff_dtype != "int8"):
            raise ValueError(f"backward_bits must be 8, or 4 with int8 coefficients; got {backward_bits}")
        if coeff_dtype not in COEFF_DTYPES:
            raise ValueError(f"coeff_dtype {coeff_dtype!r} not in {COEFF_DTYPES}")
        if basis_dtype not in BASIS_DTYPES:
            raise ValueError(f"basis_dtype {basis_dtype!r} not in {BASIS_DTYPES}")
        if scale_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"scale_dtype {scale_dtype!r} must be bfloat16 or float32")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if centre not in ("mean", "median"):
            raise ValueError(f"centre must be mean or median, got {centre!r}")
        # Tiers of falling precision for the coefficients, e.g. ((24, 8), (88, 4)): k = 112
        # directions where one 8-bit tier of 80 costs the same bytes. Why: at 2048-token frames the
        # forward's per-token error falls slowly with k (7.5% at 80, 5.2% at 128: the bulk rows are
        # not rank-80 once the sink rows are set aside), and the directions past the first few
        # dozen need fewer levels (bench/results/quality.md, eighth section).
        self.tiers = check_tiers(tiers) if tiers else None
        self.backward_tiers = check_tiers(backward_tiers) if backward_tiers else None
        if (self.tiers or self.backward_tiers) and coeff_dtype != "int8":
            raise ValueError("tiers code the coefficients themselves; leave coeff_dtype int8")
        # The forward's centre. Why median: a pretrained LM's few sink rows (~100x the others'
        # norm) pull the mean towards them, an offset every other row then carries; centred by the
        # median, the same k leaves 27% less KL on the answer logits (SmolLM2, 2048-token frames).
        self.centre = centre
        # The forward's first position of every sequence coded apart (mean + FIRST_K directions of
        # its own). Why: a pretrained LM's first position is its attention sink, with a norm ~100x
        # the others' (SmolLM2 at boundaries 1-2: 70 rows of a 2030-token frame, all at position
        # 0, hold 99.6-99.9% of the energy). In one basis with the rest they take directions and
        # the mean, and the other rows keep 11-12% error per row at k = 80; apart, a basis of the
        # rest alone leaves 7.7-9.8% (bench/results/quality.md, ninth section). Position 0 is
        # known to both ends from the frame's shape, so no index travels.
        self.first_apart = bool(first_apart)
        # The forward's basis (and mean) fitted with the rows the loss reads (``LinkContext.
        # loss_rows``) given as much weight, all together, as all the other rows. Why it was tried:
        # in fine-tuning the loss reads a few positions (the answer: 7-15% of a frame's rows), and a
        # basis fitted to all rows alike spends its directions on the prompt's bulk; on one
        # 2048-token frame of each task it cuts the answer logits' KL by a third at the same bytes.
        # Measured over 100 steps it learns worse (word EM 0.690 / 0.680 on two seeds against
        # 0.765 / 0.735 without it; bench/results/quality.md, tenth section), so it is off by
        # default: the step-0 KL on the answer is the wrong proxy for what the downstream stages
        # learn from the context rows. A sender-side choice: the receiver decodes the same payload;
        # frames where every row or none is read (pretraining, generation) are fitted as before.
        self.loss_share = bool(loss_share)
        # The integer fields (int8 basis, 8- and 4-bit codes) entropy coded with their own frame's
        # histogram (``compression.entropy``), each replaced by a uint8 blob "e<name>" when that is
        # smaller. Why: their symbols crowd near zero, so the same decoded tensors cost 7-13% fewer
        # bytes at 2048-token frames (bench/results/entropy.md); lossless, so learning is unchanged.
        # ``frame_bytes`` then is the uncoded size, an upper bound; the payload is what is sent.
        self.entropy = bool(entropy)
        # Rows whose codes repeat an earlier row's exactly sent as a reference (``compression.
        # repeats``, a "rep" field, empty when none). Why: rows with the same token prefix have the
        # same activations, and sequences of one microbatch often share their first tokens (13% of a
        # word frame's rows); lossless. ``frame_bytes`` is the size with no repeats, an upper bound.
        self.repeats = bool(repeats)
        self.k, self.coeff_dtype, self.block = int(k), coeff_dtype, int(block)
        # One quantiser step for all k directions of a frame (0: off), as a fraction of the k-th
        # direction's RMS; a direction whose codes would pass ±127 gets the step that fits them (a
        # bf16 step per direction is sent). Codes are int8 with no per-row scales, entropy coded 16
        # columns to a table. Why: with entropy coding a uniform step is the MSE-optimal allocation
        # of bits by energy (high-energy directions get more levels, the last few mostly zeros),
        # where tiers fix two precisions. On 2048-token word frames it leaves the tiers' error with
        # 5% fewer bytes forward and 14% backward (bench/results/quality.md, fifteenth section).
        self.step, self.backward_step = float(step), float(backward_step)
        for name, v, t in (
            ("step", self.step, self.tiers),
            ("backward_step", self.backward_step, self.backward_tiers),
        ):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {v}")
            if v and (t or coeff_dtype != "int8"):
                raise ValueError(
                    f"{name} codes the coefficients itself; leave tiers unset and coeff_dtype int8"
                )
        # The backward's own k. Why: a pretrained model's boundary activations are nearly rank-k
        # (top 32 directions leave 1-12% of the centred signal), its boundary gradients are not
        # (top 64 leave 22-28% at 2048-token frames, top 128 15-19%: bench.quality.grad_struct), so the
        # bytes buy more where the gradient is.
        self.k_backward = int(k_backward)
        # 4-bit backward coefficients, each direction first divided by its RMS over the frame (k
        # bf16 scales per frame). Why: a gradient's spectrum is flat, so at equal bytes twice the
        # directions at half the bits leave less error (2048-token word frames: k = 128 at 4 bits,
        # 111 B/token, 0.18-0.21 relative error; k = 64 at 8 bits, 87 B, 0.22-0.28), and without
        # the per-direction scale the top direction's block absmax crushes the small ones at 4 bits.
        self.backward_bits = int(backward_bits)
        if self.backward_step and self.backward_bits != 8:
            raise ValueError("backward_step codes the backward's coefficients itself; leave backward_bits 8")
        self.scale_dtype, self.basis_dtype = scale_dtype, basis_dtype
        if basis_block < 0:
            raise ValueError(f"basis_block must be >= 0, got {basis_block}")
        # int8 basis: one scale per basis_block entries of a direction (0: one per direction).
        # Why blocks: the top directions concentrate on the few massive-activation channels, so
        # one absmax per direction leaves the other entries a handful of levels.
        self.basis_block = int(basis_block)
        # In a direction with a step: the int8 basis's blocks no finer than ``basis_step`` times the
        # coefficients' step divided by the direction's norm over the frame (0: off), the codes
        # entropy coded 16 directions to a table. Why: a basis entry's error e in direction j costs
        # |c_j|·e over the frame, a coefficient's error costs itself, so equal distortion per code
        # means a basis step of (coefficient step) / |c_j|: the strong directions keep their 8 bits,
        # the weak ones drop to 2-3. On 2048-token word frames the basis falls from 30 to 20 B/token
        # forward and 19 to 10 backward at basis_step 1, the frame's error up by 1%
        # (bench/results/quality.md, sixteenth section).
        self.basis_step = float(basis_step)
        if not (math.isfinite(self.basis_step) and self.basis_step >= 0):
            raise ValueError(f"basis_step must be a finite number >= 0 (0: off), got {basis_step}")
        if self.basis_step and not (
            (self.step or self.backward_step) and basis_dtype == "int8" and self.entropy
        ):
            raise ValueError(
                "basis_step needs a step (step or backward_step), an int8 basis and entropy coding"
            )
        # The backward's first position of every sequence multiplied by ``first_gain`` before coding
        # and divided after (0: off). Why: the attention-sink position's gradient is 2-4x smaller
        # than the others' past the first boundary, so neither the basis nor a uniform step spends
        # anything on it, yet through the sink's massive activations it carries a large share of
        # the upstream stage's weight gradient: on 2048-token word frames, step-coded at k = 128,
        # stage 1's weight gradient is off by 0.31 with no gain and by 0.045 at gain 8, at the same
        # bytes (bench/results/quality.md, sixteenth section).
        self.first_gain = float(first_gain)
        if not (math.isfinite(self.first_gain) and self.first_gain >= 0):
            raise ValueError(f"first_gain must be a finite number >= 0 (0: off), got {first_gain}")
        self._sdtype = WIRE_DTYPES[scale_dtype]
        self._bdtype = WIRE_DTYPES.get(basis_dtype, torch.bfloat16)  # the mean's dtype with an int8 basis

    # ---- pieces shared by both directions ----------------------------------------------------

    def _tiers(self, direction: str, hidden: int) -> list | None:
        tiers = self.backward_tiers if direction == "backward" else self.tiers
        return tiers_fit(tiers, hidden) if tiers else None

    def _step_of(self, direction: str) -> float:
        return self.backward_step if direction == "backward" else self.step

    def _k(self, direction: str, hidden: int) -> int:
        tiers = self._tiers(direction, hidden)
        if tiers:
            return sum(n for n, _ in tiers)
        k = self.k_backward if direction == "backward" and self.k_backward else self.k
        return min(k, hidden)

    def _basis(self, rows: torch.Tensor, k: int) -> tuple[Payload, torch.Tensor]:
        """The top directions of ``rows`` (the rows to fit, possibly weighted) as sent, and as both
        ends will use them (rounded first)."""
        vt = top_directions(rows, k).T.contiguous()  # (k, H)
        if self.basis_dtype == "int8":
            bb = self._bblock(vt.shape[1])
            q, scale = quantize_blockwise(vt, bb, 8, torch.bfloat16)
            return {"vq": q, "vscale": scale}, dequantize_blockwise(q, scale, bb)
        wire = vt.to(self._bdtype)
        return {"v": wire}, wire.to(torch.float32)

    def _coarse(self, direction: str) -> bool:
        """Whether ``direction``'s basis is quantised by the coefficients' step (``basis_step``)."""
        return bool(self.basis_step and self._step_of(direction))

    def _stepped_basis(
        self, rows: torch.Tensor, fit: torch.Tensor, k: int, step: float
    ) -> tuple[Payload, torch.Tensor, torch.Tensor]:
        """The top directions of ``fit`` as sent (see ``basis_step``), as both ends will use them,
        and the coefficients of ``rows`` in the exact directions. Why exact: in the rounded basis a
        coarse direction would pick up a share of every strong one through its rounding error."""
        v = top_directions(fit, k).T.contiguous()  # (k, H)
        c = rows @ v.T
        floor = None
        if c.shape[0]:
            norm = c.norm(dim=0)
            delta = self.basis_step * frame_step(c, step)
            floor = torch.where(norm > 0, delta / norm.clamp_min(1e-30), 0.0)
        bb = self._bblock(v.shape[1])
        q, scale = quantize_blockwise(v, bb, 8, torch.bfloat16, floor)
        return {"vq": q} | split_uniform_rows(scale), dequantize_blockwise(q, scale, bb), c

    def _bblock(self, hidden: int) -> int:
        return self.basis_block or hidden

    def _basis_of(self, payload: Payload, direction: str) -> torch.Tensor:
        if self.basis_dtype == "int8":
            q, scale = payload["vq"], payload["vscale"]
            if q.dim() != 2:
                raise ValueError("lowrank basis must be 2-D")
            bb = self._bblock(q.shape[1])
            if scale.shape != (q.shape[0], math.ceil(q.shape[1] / bb)):
                raise ValueError("lowrank basis and its scales do not match")
            vt = dequantize_blockwise(q, scale, bb)
        else:
            vt = payload["v"].to(torch.float32)
        # unit rows keep decode a bounded operator, so the payload magnitude check bounds the output
        if (
            vt.dim() != 2
            or vt.shape[0] > self._k(direction, vt.shape[1])
            or float(vt.norm(dim=1).max()) > 1 + (_COARSE_NORM_TOL if self._coarse(direction) else _NORM_TOL)
        ):
            raise ValueError("lowrank basis is not a set of at most k unit vectors")
        return vt

    def _encode(self, rows: torch.Tensor, direction: str, fit: torch.Tensor | None = None) -> Payload:
        """``rows`` coded in the top directions of ``fit`` (default: of ``rows`` themselves)."""
        k = self._k(direction, rows.shape[-1])
        if self._coarse(direction):
            out, vt, c = self._stepped_basis(rows, rows if fit is None else fit, k, self._step_of(direction))
        else:
            out, vt = self._basis(rows if fit is None else fit, k)
            c = rows @ vt.T
        tiers = self._tiers(direction, rows.shape[-1])
        if tiers:
            out.update(encode_tiers(c, tiers, self.block))
        elif self._step_of(direction):
            out.update(encode_stepped(c, self._step_of(direction)))
        elif direction == "backward" and self.backward_bits == 4:
            cs = c.pow(2).mean(dim=0).sqrt().to(self._sdtype)  # per direction, rounded as sent
            csf = cs.to(torch.float32)
            q, scale = quantize_blockwise(c / torch.where(csf > 0, csf, 1.0), self.block, 4, self._sdtype)
            out.update(q4=pack_int4(q), scale=scale, cs=cs)
        else:
            out.update(self._plain_codes(c))
        if self.repeats:
            names = self._row_fields(direction, rows.shape[-1])
            kept, out["rep"] = drop_repeats([out[n] for n in names])
            out.update(zip(names, kept))
        return self._entropy_code(out, direction, rows.shape[-1]) if self.entropy else out

    def _row_fields(self, direction: str, hidden: int) -> list[str]:
        """The payload fields with a row per token (codes and their per-token scales)."""
        tiers = self._tiers(direction, hidden)
        if tiers:
            return [n for i in range(len(tiers)) for n in (f"q{i}", f"s{i}")]
        if self._step_of(direction):
            return ["q"]
        if direction == "backward" and self.backward_bits == 4:
            return ["q4", "scale"]
        return ["q", "scale"] if self.coeff_dtype == "int8" else ["c"]

    def _int_fields(self, direction: str, hidden: int) -> list[tuple[str, str, int, int, int]]:
        """(name, its block scales' name, bits, columns, block) of the integer fields entropy coding
        covers; a zero block scale forces zero codes there (``quantize_blockwise``), so those
        positions are not coded at all (a gradient's rows past the last labelled position)."""
        out = []
        if self.basis_dtype == "int8" and not self._coarse(direction):  # else by column groups
            out.append(("vq", "vscale", 8, hidden, self._bblock(hidden)))
        tiers = self._tiers(direction, hidden)
        if tiers:
            out += [(f"q{i}", f"s{i}", b, m, self.block) for i, (m, b) in enumerate(tiers) if b in (4, 8)]
        elif self._step_of(direction):
            pass  # no block scales: coded by column groups (_entropy_code)
        elif direction == "backward" and self.backward_bits == 4:
            out.append(("q4", "scale", 4, self._k(direction, hidden), self.block))
        elif self.coeff_dtype == "int8":
            out.append(("q", "scale", 8, self._k(direction, hidden), self.block))
        return out

    @staticmethod
    def _live(scale: torch.Tensor, cols: int, block: int) -> torch.Tensor:
        """Which codes (rows, cols) have a nonzero block scale: the ones coded."""
        return (scale != 0).repeat_interleave(block, dim=1)[:, :cols]

    def _entropy_code(self, payload: Payload, direction: str, hidden: int) -> Payload:
        for name, sname, bits, cols, block in self._int_fields(direction, hidden):
            raw, scale = payload[name], payload[sname]
            q = unpack_int4(raw, cols) if bits == 4 else raw
            if bool((scale == 0).any()):  # else every code is coded: no mask to build (faster)
                live = self._live(scale, cols, block)
                if bool(q[~live].any()):  # not our quantiser's output: keep it as it is
                    continue
                q = q[live]
            qmax = 2 ** (bits - 1) - 1
            blob = encode_symbols(q, -qmax, qmax, raw.numel() * raw.element_size())
            if blob is not None:
                del payload[name]
                payload["e" + name] = blob
        if self._coarse(direction):  # a table per 16 directions: their steps differ by direction
            vq = payload["vq"]
            blob = encode_column_groups(vq.T.contiguous(), -127, 127, vq.numel())
            if blob is not None:
                payload["evq"] = blob
                del payload["vq"]
        if self._step_of(direction):
            blob = encode_column_groups(payload["q"], -127, 127, payload["q"].numel(), ROW_BUCKETS)
            if blob is not None:
                payload["eq"] = blob
                del payload["q"]
        if "rep" in payload:
            blob = encode_references(payload["rep"])
            if blob is not None:
                payload["erep"] = blob
                del payload["rep"]
        return payload

    def _entropy_decode(self, payload: Payload, direction: str, hidden: int, rows: int) -> Payload:
        """``payload`` with every entropy-coded field back as sent uncoded (bit for bit); ``rows``:
        the frame's rows, known from its shape, so the symbol count is known before decoding."""
        out = dict(payload)
        for name, sname, bits, cols, block in self._int_fields(direction, hidden):
            blob = out.pop("e" + name, None)
            if blob is None:
                continue
            if not self.entropy:
                raise ValueError(f"lowrank frame carries an entropy-coded {name}; this run codes none")
            if name in out or sname not in out:
                raise ValueError(f"lowrank frame carries {name} coded and raw, or without its scales")
            scale = out[sname]
            if scale.dim() != 2:
                raise ValueError(f"lowrank {name} scales must be 2-D, got shape {tuple(scale.shape)}")
            n = scale.shape[0] if name == "vq" else rows  # the basis: its scales' rows, at most k
            if name == "vq" and n > self._k(direction, hidden):
                raise ValueError("lowrank basis is not a set of at most k unit vectors")
            if tuple(scale.shape) != (n, math.ceil(cols / block)):
                raise ValueError(f"lowrank {name} scales have shape {tuple(scale.shape)}, not {n} rows")
            qmax = 2 ** (bits - 1) - 1
            if bool((scale == 0).any()):
                live = self._live(scale, cols, block)
                q = torch.zeros(n, cols, dtype=torch.int8, device=scale.device)
                q[live] = decode_symbols(blob, int(live.sum()), -qmax, qmax).to(q.device, torch.int8)
            else:
                q = decode_symbols(blob, n * cols, -qmax, qmax).to(scale.device, torch.int8).view(n, cols)
            out[name] = pack_int4(q) if bits == 4 else q
        blob = out.pop("evq", None) if self._coarse(direction) else None
        if blob is not None:
            if "vq" in out or "vscale" not in out or out["vscale"].dim() != 2:
                raise ValueError("lowrank frame carries its basis coded and raw, or without its scales")
            n, blocks = out["vscale"].shape
            if n > self._k(direction, hidden) or blocks != math.ceil(hidden / self._bblock(hidden)):
                raise ValueError("lowrank basis is not a set of at most k unit vectors")
            vq = decode_column_groups(blob, hidden, n, -127, 127).T.contiguous()
            out["vq"] = vq.to(out["vscale"].device, torch.int8)
        blob = out.pop("eq", None) if self._step_of(direction) else None
        if blob is not None:
            if not self.entropy:
                raise ValueError("lowrank frame carries an entropy-coded q; this run codes none")
            if "q" in out or "qstep" not in out or out["qstep"].dim() != 1:
                raise ValueError("lowrank frame carries q coded and raw, or without its steps")
            k, most = out["qstep"].shape[0], self._k(direction, hidden)
            if k > most:
                raise ValueError(f"lowrank frame has {k} direction steps, this run codes at most {most}")
            q = decode_column_groups(blob, rows, k, -127, 127)
            out["q"] = q.to(out["qstep"].device, torch.int8)
        return out

    def _plain_codes(self, c: torch.Tensor) -> Payload:
        return encode_coeffs(c, self.coeff_dtype, self.block, self._sdtype)

    def _plain_values(self, payload: Payload) -> torch.Tensor:
        return decode_coeffs(payload, self.coeff_dtype, self.block)

    def _plain_bytes(self, k: int) -> float:
        """Bytes per row of ``_plain_codes`` for k coefficients."""
        if self.coeff_dtype == "int8":
            return float(k + math.ceil(k / self.block) * self._sdtype.itemsize)
        return float(k * WIRE_DTYPES[self.coeff_dtype].itemsize)

    def _decode(self, payload: Payload, direction: str, hidden: int, rows: int) -> torch.Tensor:
        rep = payload.get("rep")
        if "erep" in payload:
            if rep is not None or not self.entropy:
                raise ValueError(
                    "lowrank frame's repeated rows are coded and raw, or coded in a run that codes none"
                )
            rep = decode_references(payload["erep"], rows)
        if (rep is None) == self.repeats:
            raise ValueError("lowrank frame's repeated rows do not match this run's setting (repeats)")
        if rep is not None and (rep.dim() != 2 or rep.shape[0] >= max(rows, 1)):
            raise ValueError(f"lowrank frame names {tuple(rep.shape)} repeated rows of its {rows}")
        sent = rows - (rep.shape[0] if rep is not None else 0)  # the rows the frame's codes carry
        if "vrow" in payload:
            if not self._coarse(direction):
                raise ValueError("lowrank frame carries one-scale basis rows; this run sends none")
            payload = dict(payload)
            payload["vscale"] = join_uniform_rows(
                payload.get("vscale"), payload.pop("vrow"), hidden, self._bblock(hidden)
            )
        payload = self._entropy_decode(payload, direction, hidden, sent)
        if rep is not None:
            names = self._row_fields(direction, hidden)
            try:
                fields = [payload[n] for n in names]
            except KeyError as e:
                raise ValueError(f"lowrank frame lacks its {e.args[0]}") from None
            payload = payload | dict(zip(names, restore_repeats(fields, rep, rows)))
        vt = self._basis_of(payload, direction)
        tiers = self._tiers(direction, vt.shape[1])
        if tiers:
            if vt.shape[0] != sum(n for n, _ in tiers):
                raise ValueError(
                    f"lowrank basis has {vt.shape[0]} directions, the tiers code {sum(n for n, _ in tiers)}"
                )
            c = decode_tiers(payload, tiers, self.block)
        elif self._step_of(direction):
            c = decode_stepped(payload, vt.shape[0])
        elif direction == "backward" and self.backward_bits == 4:
            cs = payload["cs"]
            if cs.shape != (vt.shape[0],):
                raise ValueError(f"direction scales {tuple(cs.shape)} do not match {vt.shape[0]} directions")
            q = unpack_int4(payload["q4"], vt.shape[0])
            c = dequantize_blockwise(q, payload["scale"], self.block) * cs.to(torch.float32)
        else:
            c = self._plain_values(payload)
        return c @ vt

    # ---- the interface -----------------------------------------------------------------------

    def _apart(self, shape: tuple[int, ...]) -> bool:
        """Whether a forward frame of ``shape`` (sequences, positions, H) sends position 0 apart."""
        return self.first_apart and len(shape) == 3 and shape[1] > 1

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        x = h.detach().to(torch.float32)
        hidden, read = x.shape[-1], self._loss_mask(ctx.loss_rows, tuple(x.shape))
        if self._apart(tuple(x.shape)):
            rest = None if read is None else read[:, 1:]
            out = self._encode_centred(x[:, 1:].reshape(-1, hidden), row_share(rest))
            out.update(self._encode_first(x[:, 0]))
            return out
        return self._encode_centred(x.reshape(-1, hidden), row_share(read))

    def _loss_mask(self, loss_rows: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The rows the loss reads (bool, the frame's leading shape), when this codec fits by them."""
        if not self.loss_share or loss_rows is None:
            return None
        if tuple(loss_rows.shape) != shape[:-1]:
            raise ValueError(f"loss rows {tuple(loss_rows.shape)} do not match the frame {shape[:-1]}")
        return loss_rows.to(torch.bool).cpu()

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        if not self._apart(tuple(shape)):
            return self._decode_centred(payload, math.prod(shape[:-1]), shape[-1]).reshape(shape)
        b, t, hidden = shape
        rest = self._decode_centred(payload, b * (t - 1), hidden).reshape(b, t - 1, hidden)
        return torch.cat([self._decode_first(payload, b, hidden)[:, None], rest], dim=1)

    def _encode_centred(self, rows: torch.Tensor, weight: torch.Tensor | None = None) -> Payload:
        """Rows minus their centre, in the top directions of the (row-``weight``ed) centred rows."""
        if self.centre == "median":
            mean = rows.median(dim=0).values
        elif weight is None:
            mean = rows.mean(dim=0)
        else:
            mean = weight.to(rows) @ rows / float(weight.sum())
        mean = mean.to(self._bdtype)
        centred = rows - mean.to(torch.float32)
        fit = None if weight is None else centred * weight.to(rows).sqrt()[:, None]
        out = self._encode(centred, "forward", fit)
        out["mean"] = mean.contiguous()
        return out

    def _decode_centred(self, payload: Payload, n_rows: int, hidden: int) -> torch.Tensor:
        mean = payload["mean"]
        if tuple(mean.shape) != (hidden,):  # a shorter one would broadcast silently (fuzz finding)
            raise ValueError(f"mean has shape {tuple(mean.shape)}, expected ({hidden},)")
        rows = self._decode(payload, "forward", hidden, n_rows)
        if rows.shape[0] != n_rows:
            raise ValueError(f"lowrank payload has {rows.shape[0]} rows, the frame {n_rows}")
        return rows + mean.to(torch.float32)

    def _encode_first(self, rows: torch.Tensor) -> Payload:
        """The first positions (B, H): their own mean and min(B, FIRST_K) directions, the codes in
        the coefficients' dtype."""
        mean = rows.mean(dim=0).to(self._bdtype)
        centred = rows - mean.to(torch.float32)
        sub, vt = self._basis(centred, min(FIRST_K, rows.shape[0]))
        sub.update(self._plain_codes(centred @ vt.T))
        return {"f_mean": mean.contiguous()} | {"f_" + n: v for n, v in sub.items()}

    def _first_names(self) -> tuple[str, ...]:
        basis = ("vq", "vscale") if self.basis_dtype == "int8" else ("v",)
        return basis + (("q", "scale") if self.coeff_dtype == "int8" else ("c",))

    def _decode_first(self, payload: Payload, b: int, hidden: int) -> torch.Tensor:
        try:
            mean, sub = payload["f_mean"], {n: payload["f_" + n] for n in self._first_names()}
        except KeyError as e:
            raise ValueError(f"lowrank frame lacks its first positions' {e.args[0]}") from None
        vt, k = self._basis_of(sub, "forward"), min(FIRST_K, b)
        c = sub["q"] if self.coeff_dtype == "int8" else sub["c"]
        if tuple(mean.shape) != (hidden,) or tuple(vt.shape) != (k, hidden) or tuple(c.shape) != (b, k):
            raise ValueError(f"lowrank first positions do not match {b} sequences of width {hidden}")
        if self.coeff_dtype == "int8" and tuple(sub["scale"].shape) != (b, math.ceil(k / self.block)):
            raise ValueError("lowrank first positions' codes and scales do not match")
        return self._plain_values(sub) @ vt + mean.to(torch.float32)

    def _gained(self, shape: tuple[int, ...]) -> bool:
        """Whether a backward frame of ``shape`` has its first positions gained (``first_gain``)."""
        return bool(self.first_gain) and len(shape) == 3 and shape[1] > 1

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        g = g.detach().to(torch.float32)
        if self._gained(tuple(g.shape)):
            g = torch.cat([g[:, :1] * self.first_gain, g[:, 1:]], dim=1)
        return self._encode(g.reshape(-1, g.shape[-1]), "backward")

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        rows = math.prod(shape[:-1])
        out = self._decode(payload, "backward", shape[-1], rows).reshape(shape)
        if self._gained(tuple(shape)):
            out = torch.cat([out[:, :1] / self.first_gain, out[:, 1:]], dim=1)
        return out

    def coeff_bytes_per_token(self, hidden: int, direction: str = "forward") -> float:
        tiers = self._tiers(direction, hidden)
        if tiers:
            return tier_bytes_per_token(tiers, self.block)
        k = self._k(direction, hidden)
        if self._step_of(direction):
            return float(k)  # int8 codes, no per-row scales
        if direction == "backward" and self.backward_bits == 4:
            return float(math.ceil(k / 2) + math.ceil(k / self.block) * self._sdtype.itemsize)
        return self._plain_bytes(k)

    def _basis_bytes(self, k: int, hidden: int) -> int:
        if self.basis_dtype == "int8":
            return k * hidden + 2 * k * math.ceil(hidden / self._bblock(hidden))  # int8 + bf16 scales
        return k * hidden * self._bdtype.itemsize

    def frame_bytes(self, tokens: int, hidden: int, direction: str, sequences: int = 0) -> int:
        """Exact payload bytes of one frame of ``tokens`` rows in ``sequences`` sequences (0: rows
        with no sequence structure); 'forward' adds the mean, and with ``first_apart`` the first
        positions' own code. With ``entropy`` or ``repeats`` an upper bound: the bytes before coding
        (a field is coded only where that makes it smaller) with no row repeated; the bytes sent are
        the payload's."""
        k = self._k(direction, hidden)
        first = 0
        if direction == "forward" and self.first_apart and 0 < sequences < tokens:
            ks = min(FIRST_K, sequences)
            first = (
                hidden * self._bdtype.itemsize
                + self._basis_bytes(ks, hidden)
                + sequences * self._plain_bytes(ks)
            )
            tokens -= sequences
        basis = self._basis_bytes(k, hidden) + first
        extra = hidden * self._bdtype.itemsize if direction == "forward" else 0  # the mean
        if self._tiers(direction, hidden) or self._step_of(direction):
            extra += 2 * k  # a bf16 scale (cs) or step (qstep) per direction
        elif direction == "backward" and self.backward_bits == 4:
            extra += k * self._sdtype.itemsize  # per-direction scales
        return int(basis + extra + tokens * self.coeff_bytes_per_token(hidden, direction))

    def bytes_per_token(self, hidden: int) -> float:
        """Coefficients only, mean of the two directions: the per-frame basis depends on the frame's
        length (``frame_bytes``)."""
        return (self.coeff_bytes_per_token(hidden) + self.coeff_bytes_per_token(hidden, "backward")) / 2

    def describe(self) -> dict:
        d = {
            "codec": self.codec_id,
            "k": self.k,
            "coeff_dtype": self.coeff_dtype,
            "basis_dtype": self.basis_dtype,
        }
        if self.coeff_dtype == "int8":
            d.update(block=self.block, scale_dtype=self.scale_dtype)
        if self.basis_block:
            d["basis_block"] = self.basis_block
        if self.k_backward:
            d["k_backward"] = self.k_backward
        if self.backward_bits != 8:
            d["backward_bits"] = self.backward_bits
        if self.tiers:
            d["tiers"] = [list(t) for t in self.tiers]
        if self.backward_tiers:
            d["backward_tiers"] = [list(t) for t in self.backward_tiers]
        if self.centre != "mean":
            d["centre"] = self.centre
        if self.first_apart:
            d["first_apart"] = True
        if self.loss_share:
            d["loss_share"] = True
        if self.entropy:
            d["entropy"] = True
        if self.repeats:
            d["repeats"] = True
        if self.step:
            d["step"] = self.step
        if self.backward_step:
            d["backward_step"] = self.backward_step
        if self.basis_step:
            d["basis_step"] = self.basis_step
        if self.first_gain:
            d["first_gain"] = self.first_gain
        return d

    def payload_dtypes(self) -> dict[str, torch.dtype]:
        d = (
            {"vq": torch.int8, "vscale": torch.bfloat16}
            if self.basis_dtype == "int8"
            else {"v": self._bdtype}
        )
        d["mean"] = self._bdtype
        if self.coeff_dtype == "int8":
            d.update(q=torch.int8, scale=self._sdtype)
        else:
            d["c"] = WIRE_DTYPES[self.coeff_dtype]
        if self.backward_bits == 4:
            d.update(q4=torch.uint8, cs=self._sdtype)
        for tiers in (self.backward_tiers, self.tiers):  # forward last: a code whose dtype differs
            if tiers:  # by direction is checked in decode
                d.update(tier_dtypes(list(tiers)))
        if self.step or self.backward_step:
            d["qstep"] = torch.bfloat16
        if self.basis_step:
            d["vrow"] = torch.bfloat16
        if self.first_apart:
            d.update({"f_mean": self._bdtype} | {"f_" + n: d[n] for n in self._first_names()})
        if self.repeats:
            d["rep"] = torch.int32
        if self.entropy:  # the coded fields' blobs, whichever of them a frame carries
            d.update({"e" + n: torch.uint8 for n in ("vq", "q", "q4", "rep")})
            n_tiers = max(len(self.tiers or ()), len(self.backward_tiers or ()))
            d.update({f"eq{i}": torch.uint8 for i in range(n_tiers)})
        return d
