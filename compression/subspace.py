"""Subspace Networks: the pretraining-mode architecture and its exact boundary codec (DESIGN.md 4.4).

Two fixed tensors come from the run's seed, on every peer, with nothing downloaded or sent:

* ``U`` (H, k), orthonormal columns (``subspace_basis``);
* ``T`` (V, H), a high-rank token table (``token_table``).

The model is constrained so that its residual stream is always ``T[tok] + span(U)``: in a
Llama-style pre-norm decoder the residual stream is written only by the embedding, the
attention output projection (``o_proj``) and the MLP output projection (``down_proj``).
The embedding becomes ``E[tok] Uᵀ + T[tok]`` (trainable E, V×k) and both output projections
become ``W = U Z`` (trainable Z, k×in). The RMSNorm gains act only on branch *inputs* (and
on the final norm before the head), so they never write the residual and need no change.
``unconstrained_last`` blocks before the head may keep dense output projections: the
residual leaves the subspace after them, so no boundary may sit there.

Boundary codec (``SubspaceCodec``, registry name "subspace"): forward sends
``c = (x − T[tok]) U`` (k numbers) plus the token id of every position; the receiver
rebuilds ``x = c Uᵀ + T[tok]``. Backward sends ``g U`` (k numbers) and the sender rebuilds
``(g U) Uᵀ``. On a constrained model both directions are exact (up to the wire dtype):
``x − T[tok]`` lies in span(U), and every derivative of the residual with respect to an
upstream parameter lies in span(U) too, so projecting the gradient onto span(U) changes no
upstream parameter gradient.

Token ids: ``LinkCodec.encode_forward(h, ctx)`` only sees ``h``, but the encoder needs the
ids. Use ``encode_forward_with_tokens(h, tokens, ctx)`` (stateless: what the node should
call), or ``set_tokens(ids)`` right before ``encode_forward`` / ``apply_link`` (one-shot:
the ids are consumed by the next encode, so stale ids can never be reused silently).
``encode_forward`` without ids raises ``MissingTokensError``. The ids travel in the
payload as 2 bytes each when the vocabulary has at most 2**16 entries (int32 otherwise),
so the receiver needs nothing but the payload.

Bytes per token: forward 2(k+1) in bf16 with 2-byte ids, backward 2k (no ids needed).

Randomness: only explicit ``torch.Generator`` objects on the CPU, seeded from the run seed
and a per-tensor domain tag; torch's global RNG is never read or advanced (the model
builder, ``node.model.subspace.build_subspace_model``, forks it). The basis is computed in
float64 (QR with a sign convention that makes it unique) and rounded to float32, so peers get
the same bits for the same seed and torch version. ``fingerprint`` hashes U and T so peers can
check they agree.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import torch
from torch import nn

from compression.codec import WIRE_DTYPES, LinkCodec, LinkContext, Payload

_MASK64 = (1 << 64) - 1
_TAG_BASIS = 0x7375627370616365  # "subspace"
_TAG_TABLE = 0x746F6B5F7461626C  # "tok_tabl"
DEFAULT_T_STD = 0.02  # LlamaConfig.initializer_range: the scale a fresh embedding row has


class MissingTokensError(RuntimeError):
    """encode_forward was called without the token ids of the microbatch."""


def _derive_seed(seed: int, tag: int) -> int:
    """splitmix64(seed ^ tag): independent generator seeds for U and T from one run seed."""
    z = (((seed & _MASK64) ^ tag) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _generator(seed: int, tag: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(_derive_seed(seed, tag))
    return g


@lru_cache(maxsize=8)
def _basis_cached(seed: int, hidden: int, k: int) -> torch.Tensor:
    a = torch.randn(hidden, k, generator=_generator(seed, _TAG_BASIS), dtype=torch.float64)
    q, r = torch.linalg.qr(a, mode="reduced")
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(torch.float32).contiguous()  # unique: positive diagonal of R


def subspace_basis(seed: int, hidden: int, k: int) -> torch.Tensor:
    """Orthonormal U (hidden, k), a pure function of (seed, hidden, k). Returns a fresh copy."""
    if not 1 <= k <= hidden:
        raise ValueError(f"need 1 <= k <= hidden = {hidden}, got k = {k}")
    return _basis_cached(int(seed), int(hidden), int(k)).clone()


@lru_cache(maxsize=4)
def _table_cached(seed: int, vocab: int, hidden: int, std: float) -> torch.Tensor:
    t = torch.randn(vocab, hidden, generator=_generator(seed, _TAG_TABLE), dtype=torch.float32)
    return t.mul_(std).contiguous()


def token_table(seed: int, vocab: int, hidden: int, std: float = DEFAULT_T_STD) -> torch.Tensor:
    """Fixed Gaussian token table T (vocab, hidden), entries N(0, std²): full rank min(V, H)
    with probability 1. A pure function of its arguments. Returns a fresh copy."""
    if vocab < 1 or hidden < 1:
        raise ValueError(f"vocab and hidden must be >= 1, got {vocab}, {hidden}")
    return _table_cached(int(seed), int(vocab), int(hidden), float(std)).clone()


def fingerprint(u: torch.Tensor, t: torch.Tensor | None = None) -> str:
    """Short hash of the exact bits of U (and T), for peers to confirm they built the same."""
    h = hashlib.sha256(u.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
    if t is not None:
        h.update(t.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def subspace_residual_error(h: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor, t: torch.Tensor) -> float:
    """Largest per-token ||r − r U Uᵀ|| / ||r|| with r = h − T[tok]: 0 iff h ∈ T[tok] + span(U).

    Computed in float64. Tokens with r = 0 count as 0.
    """
    r = h.detach().to(torch.float64).reshape(-1, h.shape[-1]) - t.to(torch.float64)[tokens.reshape(-1)]
    u64 = u.to(torch.float64)
    off = r - (r @ u64) @ u64.T
    norm = r.norm(dim=-1)
    rel = torch.where(norm > 0, off.norm(dim=-1) / norm.clamp_min(1e-300), torch.zeros_like(norm))
    return float(rel.max().item()) if rel.numel() else 0.0


# --------------------------------------------------------------------------------------------
# The boundary codec
# --------------------------------------------------------------------------------------------


def _pack_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token ids on the wire: int16 (the low 16 bits) when vocab <= 2**16, else int32."""
    ids = ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    if vocab <= 1 << 16:
        return torch.where(ids > 32767, ids - 65536, ids).to(torch.int16)
    return ids.to(torch.int32)


def _unpack_ids(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    if packed.dtype == torch.int16:
        ids = packed.to(torch.int64) & 0xFFFF
    elif packed.dtype == torch.int32:
        ids = packed.to(torch.int64)
    else:
        raise ValueError(f"token ids must be int16 or int32, not {packed.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token id outside [0, {vocab}) in payload")
    return ids


class SubspaceCodec(LinkCodec):
    """Exact subspace boundary codec; see the module docstring.

    Payload forward: ``c`` (N, k) in ``wire_dtype`` and ``tok`` (N,) int16/int32 for the N
    tokens of the frame. Payload backward: ``g`` (N, k) in ``wire_dtype``.
    ``bytes_per_token`` reports the forward figure, 2(k+1) for bf16 with 2-byte ids;
    ``backward_bytes_per_token`` is 2k. Error: zero for x ∈ T[tok] + span(U) beyond the
    rounding of c (and g) to the wire dtype; for any other x the receiver gets the
    projection T[tok] + (x − T[tok]) U Uᵀ, and the backward is exactly its adjoint.
    """

    codec_id = "subspace"
    carries_tokens = True

    def __init__(
        self,
        k: int,
        seed: int,
        vocab: int,
        hidden: int,
        wire_dtype: str = "bfloat16",
        t_std: float = DEFAULT_T_STD,
    ):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} not in {sorted(WIRE_DTYPES)}")
        self.k, self.seed, self.vocab, self.hidden = int(k), int(seed), int(vocab), int(hidden)
        self.wire_dtype, self.t_std = wire_dtype, float(t_std)
        self._dtype = WIRE_DTYPES[wire_dtype]
        self.u = subspace_basis(self.seed, self.hidden, self.k)
        self.t = token_table(self.seed, self.vocab, self.hidden, self.t_std)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: torch.Tensor | None = None

    def _ut(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.u.to(device), self.t.to(device))
        return self._on_device[device]

    # ---- token ids -----------------------------------------------------------------------------

    def set_tokens(self, tokens: torch.Tensor) -> None:
        """Token ids (same leading shape as h) for the next ``encode_forward`` only."""
        self._pending = tokens.detach()

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        tokens, self._pending = self._pending, None
        if tokens is None:
            raise MissingTokensError(
                "SubspaceCodec needs the token ids: call encode_forward_with_tokens(h, tokens, ctx), "
                "or set_tokens(ids) right before encode_forward/apply_link"
            )
        return self.encode_forward_with_tokens(h, tokens, ctx)

    def encode_forward_with_tokens(self, h: torch.Tensor, tokens: torch.Tensor, ctx: LinkContext) -> Payload:
        if h.shape[-1] != self.hidden:
            raise ValueError(f"hidden size {h.shape[-1]} != codec hidden {self.hidden}")
        if tuple(tokens.shape) != tuple(h.shape[:-1]):
            raise ValueError(f"tokens shape {tuple(tokens.shape)} != h leading shape {tuple(h.shape[:-1])}")
        u, t = self._ut(h.device)
        ids = tokens.reshape(-1).to(device=h.device, dtype=torch.long)
        packed = _pack_ids(ids, self.vocab)
        x = h.detach().reshape(-1, self.hidden).to(torch.float32)
        c = (x - t[ids]) @ u
        return {"c": c.to(self._dtype).contiguous(), "tok": packed.contiguous()}

    def tokens_from_payload(self, payload: Payload) -> torch.Tensor:
        """The token ids a forward payload carries (N,) int64: a body stage passes them on to
        ``encode_forward_with_tokens`` for its own outgoing link."""
        return _unpack_ids(payload["tok"].reshape(-1), self.vocab)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        c = payload["c"]
        if c.dim() != 2 or c.shape[1] != self.k:
            raise ValueError(f"payload c must be (N, {self.k}), got {tuple(c.shape)}")
        ids = _unpack_ids(payload["tok"].reshape(-1), self.vocab).to(c.device)
        if ids.numel() != c.shape[0]:
            raise ValueError(f"{ids.numel()} token ids for {c.shape[0]} coefficient rows")
        u, t = self._ut(c.device)
        return (c.to(torch.float32) @ u.T + t[ids]).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        u, _ = self._ut(g.device)
        gc = g.detach().reshape(-1, self.hidden).to(torch.float32) @ u
        return {"g": gc.to(self._dtype).contiguous()}

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        gc = payload["g"]
        if gc.dim() != 2 or gc.shape[1] != self.k:
            raise ValueError(f"payload g must be (N, {self.k}), got {tuple(gc.shape)}")
        u, _ = self._ut(gc.device)
        return (gc.to(torch.float32) @ u.T).reshape(shape)

    def _id_bytes(self) -> int:
        return 2 if self.vocab <= 1 << 16 else 4

    def bytes_per_token(self, hidden: int) -> float:
        """Forward bytes per token: k coefficients plus the token id (2(k+1) in bf16)."""
        return float(self.k * self._dtype.itemsize + self._id_bytes())

    def backward_bytes_per_token(self) -> float:
        return float(self.k * self._dtype.itemsize)

    def describe(self) -> dict:
        return {
            "codec": self.codec_id,
            "k": self.k,
            "seed": self.seed,
            "vocab": self.vocab,
            "hidden": self.hidden,
            "wire_dtype": self.wire_dtype,
            "t_std": self.t_std,
        }


# --------------------------------------------------------------------------------------------
# The constrained layers; node/model/subspace.py puts them into a Llama-style model
# --------------------------------------------------------------------------------------------


class SubspaceLinear(nn.Module):
    """A bias-free Linear whose weight is W = U Z: outputs always lie in span(U).

    ``U`` is a fixed, non-persistent buffer (rebuilt from the seed, never checkpointed);
    ``Z`` (k, in) is the trainable parameter.
    """

    def __init__(self, u: torch.Tensor, z: torch.Tensor):
        super().__init__()
        if u.shape[1] != z.shape[0]:
            raise ValueError(f"U {tuple(u.shape)} and Z {tuple(z.shape)} do not chain")
        self.in_features, self.out_features = z.shape[1], u.shape[0]
        self.register_buffer("U", u, persistent=False)
        self.Z = nn.Parameter(z)

    @classmethod
    def from_linear(cls, linear: nn.Linear, u: torch.Tensor) -> SubspaceLinear:
        """Z = Uᵀ W of a fresh dense layer: W becomes its projection U Uᵀ W onto span(U)."""
        if linear.bias is not None:
            raise ValueError("a bias would put a constant outside span(U); Llama has none here")
        w = linear.weight.detach()
        u = u.to(device=w.device, dtype=w.dtype)
        return cls(u, (u.T @ w).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.Z.T.to(x.dtype)) @ self.U.T.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.Z.shape[0]}"


class SubspaceEmbedding(nn.Module):
    """Embedding E[tok] Uᵀ + T[tok]: trainable E (V, k), fixed U (H, k) and T (V, H)."""

    def __init__(self, e: torch.Tensor, u: torch.Tensor, t: torch.Tensor):
        super().__init__()
        if e.shape[1] != u.shape[1] or t.shape != (e.shape[0], u.shape[0]):
            raise ValueError(f"E {tuple(e.shape)}, U {tuple(u.shape)}, T {tuple(t.shape)} do not fit")
        self.num_embeddings, self.embedding_dim = t.shape
        self.E = nn.Parameter(e)
        self.register_buffer("U", u, persistent=False)
        self.register_buffer("T", t, persistent=False)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, u: torch.Tensor, t: torch.Tensor) -> SubspaceEmbedding:
        """E = W_emb U of a fresh embedding (its projection onto span(U))."""
        w = emb.weight.detach()
        u = u.to(device=w.device, dtype=w.dtype)
        return cls((w @ u).contiguous(), u, t.to(device=w.device, dtype=w.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.E[ids] @ self.U.T + self.T[ids]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, k={self.E.shape[1]}"
