"""PRF channel selection: determinism, exact K distinct, counter sensitivity, no global RNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compression.prf import k_for_rate, mask_seed, select_channels

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
M64 = (1 << 64) - 1


# --- an independent pure-Python statement of the spec (no numpy, no torch) ---


def _ref_mix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _ref_mask_seed(run_seed: int, step: int, mb: int, boundary: int) -> int:
    h = _ref_mix64((run_seed & M64) ^ 0x6D61736B5F736565)
    for v in (step, mb, boundary):
        h = _ref_mix64(((h ^ (v & M64)) + 0x9E3779B97F4A7C15) & M64)
    return h


def _ref_select(seed: int, n_tokens: int, hidden: int, k: int, rounds: int = 6) -> list[list[int]]:
    bits = max(1, (hidden - 1).bit_length())
    low = (1 << bits) - 1
    shift = (bits + 1) // 2
    base = _ref_mix64(seed)
    rows = []
    for t in range(n_tokens):
        keys = []
        for r in range(rounds):
            z = _ref_mix64((base + (t * rounds + r + 1) * 0x9E3779B97F4A7C15) & M64)
            keys.append((z & low, ((z >> 32) & low) | 1))

        def perm(x: int, keys=keys) -> int:
            for xk, mk in keys:
                x = ((x ^ xk) * mk) & low
                x ^= x >> shift
            return x

        row = []
        for c in range(k):
            y = perm(c)
            while y >= hidden:
                y = perm(y)
            row.append(y)
        rows.append(sorted(row))
    return rows


def test_mask_seed_matches_reference_and_is_64_bit():
    for args in [(0, 0, 0, 0), (1234, 7, 3, 2), (-1, 10**12, 5, 1), (2**64 + 5, 1, 2, 3)]:
        s = mask_seed(*args)
        assert s == _ref_mask_seed(*args)
        assert 0 <= s <= M64


def test_mask_seed_separates_counters():
    seeds = {mask_seed(42, s, m, b) for s in range(6) for m in range(6) for b in range(4)}
    assert len(seeds) == 6 * 6 * 4
    # swapping fields must not collide
    assert mask_seed(42, 1, 2, 0) != mask_seed(42, 2, 1, 0)
    assert mask_seed(42, 0, 1, 0) != mask_seed(42, 0, 0, 1)
    assert mask_seed(1, 0, 0, 0) != mask_seed(2, 0, 0, 0)


@pytest.mark.parametrize(
    "hidden,k", [(1, 1), (2, 1), (7, 3), (64, 8), (100, 5), (576, 29), (1000, 999), (33, 33)]
)
def test_torch_equals_pure_python_reference(hidden, k):
    seed = mask_seed(2024, 3, 1, 2)
    got = select_channels(seed, 9, hidden, k)
    assert got.dtype == torch.int64 and got.shape == (9, k)
    assert got.tolist() == _ref_select(seed, 9, hidden, k)


@pytest.mark.parametrize("hidden,k", [(2, 1), (10, 9), (64, 8), (576, 29), (2048, 102), (3000, 150)])
def test_exactly_k_distinct_in_range(hidden, k):
    idx = select_channels(mask_seed(7, 1, 0, 0), 257, hidden, k)
    assert idx.shape == (257, k)
    assert int(idx.min()) >= 0 and int(idx.max()) < hidden
    assert bool((idx[:, 1:] > idx[:, :-1]).all())  # sorted and strictly increasing => distinct


def test_counters_change_the_mask():
    base = select_channels(mask_seed(5, 10, 2, 1), 16, 576, 29)
    for other in [(5, 11, 2, 1), (5, 10, 3, 1), (5, 10, 2, 0), (6, 10, 2, 1)]:
        o = select_channels(mask_seed(*other), 16, 576, 29)
        # almost every token's set must differ (two random 29-of-576 sets coincide ~never)
        assert (o != base).any(dim=1).sum() == 16
    # and tokens within one frame get different sets
    assert len({tuple(r) for r in base.tolist()}) == 16


def test_channels_are_close_to_uniform():
    """Each channel is kept with frequency ~K/H (a broken PRP would favour some channels)."""
    n, hidden, k = 6000, 64, 8
    idx = select_channels(mask_seed(1, 2, 3, 4), n, hidden, k)
    counts = torch.bincount(idx.flatten(), minlength=hidden).double()
    p = k / hidden
    z = (counts / n - p) / (p * (1 - p) / n) ** 0.5
    assert float(z.abs().max()) < 5.0


def test_does_not_touch_global_rng():
    before = torch.get_rng_state().clone()
    select_channels(mask_seed(3, 3, 3, 3), 64, 576, 29)
    select_channels(123, 8, 100, 100)
    assert torch.equal(before, torch.get_rng_state())
    # and the result does not depend on the global RNG state either
    torch.manual_seed(0)
    a = select_channels(99, 32, 300, 15)
    torch.manual_seed(1)
    torch.rand(100)
    b = select_channels(99, 32, 300, 15)
    assert torch.equal(a, b)


def test_same_mask_in_a_separate_process():
    cases = [(mask_seed(11, 4, 2, 1), 20, 576, 29), (mask_seed(0, 0, 0, 0), 5, 100, 7)]
    code = (
        "import json,sys; from compression.prf import select_channels; "
        "cases=json.loads(sys.argv[1]); "
        "print(json.dumps([select_channels(*c).tolist() for c in cases]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    remote = json.loads(out.stdout)
    assert remote == [select_channels(*c).tolist() for c in cases]


def test_k_for_rate():
    assert k_for_rate(2048, 0.95) == 102
    assert k_for_rate(576, 0.95) == 29
    assert k_for_rate(576, 0.90) == 58
    assert k_for_rate(576, 0.99) == 6
    assert k_for_rate(10, 0.999) == 1  # at least one channel
    assert k_for_rate(64, 0.0) == 64
    with pytest.raises(ValueError):
        k_for_rate(64, 1.0)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        select_channels(1, 4, 10, 11)
    with pytest.raises(ValueError):
        select_channels(1, 4, 10, 0)
    assert select_channels(1, 0, 10, 3).shape == (0, 3)
