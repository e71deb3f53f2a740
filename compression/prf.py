"""PRF channel selection for activation masking (DESIGN.md 4.1).

Sender and receiver of a pipeline link must pick the same K channels per token without
sending indices, so the choice is a pure function of a 64-bit seed (carried in the frame
header) and the token position: never of activation values, never of torch's global RNG.

Construction (per token t):
  * round keys come from a counter-based splitmix64 stream keyed by the seed, indexed by
    (t, round): computed with numpy uint64, whose arithmetic wraps mod 2**64 by definition
    (torch int64 overflow is not something to build a wire format on);
  * those keys drive a small keyed bijection pi_t on [0, 2**m), 2**m >= H, made of rounds
    of xor-key, multiply-by-odd-key mod 2**m, xorshift (each step is invertible, so the
    composition is a permutation);
  * cycle-walking restricts pi_t to a permutation of [0, H): y = pi_t(c); while y >= H,
    y = pi_t(y). Since 2**m < 2H, fewer than two steps are needed on average;
  * the kept channels are the images of c = 0..K-1: exactly K distinct channels, at
    O(K) cost per token, independent of H.

Why not an affine map c -> (a*c + b) mod H: it is cheaper still, but its K-subsets are
arithmetic progressions, so some channel pairs (e.g. distance H/2) are never kept
together. The keyed permutation approximates a uniformly random K-subset, which is what
the paper's reference (top-K of i.i.d. PRF values per channel) draws.

All per-channel arithmetic stays below 2**62 in int64 (m <= 31), so the torch part never
overflows and gives the same result on any device and torch version.
"""

from __future__ import annotations

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Domain constant so that a mask seed never equals the raw run seed's plain mix.
_SEED_DOMAIN = 0x6D61736B5F736565  # "mask_see"
ROUNDS = 6  # keyed rounds; 4 left measurable pair correlations at H = 2**m, 6 did not
MAX_HIDDEN = 1 << 31  # keeps x * key < 2**62 in int64


def mix64(z: int) -> int:
    """splitmix64 finaliser on a Python int (masked to 64 bits)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def mask_seed(run_seed: int, step: int, microbatch: int, boundary: int) -> int:
    """64-bit mask seed for one (step, microbatch, boundary); goes in the frame header.

    Chained mixing (not XOR of the counters) so that swapping two counters, or moving a
    value between fields, gives an unrelated seed.
    """
    h = mix64((run_seed & MASK64) ^ _SEED_DOMAIN)
    for v in (step, microbatch, boundary):
        h = mix64((h ^ (v & MASK64)) + GOLDEN)
    return h


def k_for_rate(hidden: int, rate: float) -> int:
    """Channels kept per token at mask rate ``rate``: round((1-rate)*hidden), at least 1.

    Python's round (half to even) as DESIGN.md writes it; every component must call this
    function rather than recompute K, so sender and receiver agree.
    """
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"mask rate must be in [0, 1), got {rate}")
    return min(hidden, max(1, round((1.0 - rate) * hidden)))


def _domain_bits(hidden: int) -> int:
    return max(1, (hidden - 1).bit_length())


def _round_keys(seed: int, n_tokens: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token (xor, mul) keys, shape (n_tokens, ROUNDS) each, as int64 below 2**bits.

    Key for (token t, round r) is the (t*ROUNDS + r + 1)-th output of a splitmix64 stream
    whose state starts at mix64(seed): counter-based, so any token's keys are computable
    on their own.
    """
    u = np.uint64
    base = u(mix64(seed))
    ctr = np.arange(n_tokens * ROUNDS, dtype=np.uint64) + u(1)
    z = base + ctr * u(GOLDEN)  # uint64 arithmetic wraps mod 2**64
    z = (z ^ (z >> u(30))) * u(_MIX1)
    z = (z ^ (z >> u(27))) * u(_MIX2)
    z = z ^ (z >> u(31))
    low = u((1 << bits) - 1)
    xor_k = (z & low).astype(np.int64).reshape(n_tokens, ROUNDS)
    mul_k = (((z >> u(32)) & low) | u(1)).astype(np.int64).reshape(n_tokens, ROUNDS)
    return xor_k, mul_k


def _permute(x: torch.Tensor, xor_k: torch.Tensor, mul_k: torch.Tensor, bits: int) -> torch.Tensor:
    """Keyed bijection on [0, 2**bits); x (N, C), keys (N, ROUNDS) broadcast per row."""
    mask = (1 << bits) - 1
    shift = (bits + 1) // 2
    for r in range(ROUNDS):
        x = x ^ xor_k[:, r : r + 1]
        x = (x * mul_k[:, r : r + 1]) & mask  # odd multiplier: invertible mod 2**bits
        x = x ^ (x >> shift)  # values are non-negative, so >> is a logical shift
    return x


def select_channels(
    seed: int, n_tokens: int, hidden: int, k: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Kept channels per token: LongTensor (n_tokens, k), k distinct sorted indices per row.

    Token position t is the row index of the flattened (..., H) activations. ``device``
    only says where the result lives; the values do not depend on it.
    """
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in [1, 2**31], got {hidden}")
    if not 1 <= k <= hidden:
        raise ValueError(f"k must be in [1, hidden={hidden}], got {k}")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if k == hidden:  # every channel: no hashing needed
        return torch.arange(hidden, device=device).expand(n_tokens, hidden).contiguous()
    bits = _domain_bits(hidden)
    xor_np, mul_np = _round_keys(seed, n_tokens, bits)
    # int32 whenever x * key < 2**(2 bits) fits (H <= 2**15): the same values, ~2.5x faster
    # on CPU, where mask generation was a fifth of a masked node's time (bench/results/harness.md)
    idt = torch.int32 if 2 * bits <= 31 else torch.int64
    xor_k = torch.from_numpy(xor_np).to(device=device, dtype=idt)
    mul_k = torch.from_numpy(mul_np).to(device=device, dtype=idt)
    x = torch.arange(k, dtype=idt, device=device).expand(n_tokens, k)
    y = _permute(x, xor_k, mul_k, bits)
    # Cycle-walk only the entries that left [0, H); terminates because each cycle of the
    # permutation through a start value c < H comes back to c.
    rows, cols = torch.nonzero(y >= hidden, as_tuple=True)
    while rows.numel():
        v = _permute(y[rows, cols].unsqueeze(1), xor_k[rows], mul_k[rows], bits).squeeze(1)
        y[rows, cols] = v
        out = v >= hidden
        rows, cols = rows[out], cols[out]
    return torch.sort(y, dim=1).values.to(torch.int64)  # gather/scatter take int64 indices
