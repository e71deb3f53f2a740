"""compression/outer_quant.py: 8/4-bit outer-round tensors, their bytes, error feedback (pure tensor math)."""

from __future__ import annotations

import math

import pytest
import torch

from compression import outer_quant as oq

SIZES = (1, 63, 64, 65, 1000)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of different magnitudes, so the scales differ from block to block
    return torch.randn(n, generator=g) * torch.logspace(-4, 1, n)


def _step(scales: torch.Tensor, n: int) -> torch.Tensor:
    """Each value's block scale (the quantiser's step)."""
    return torch.repeat_interleave(scales.to(torch.float32), oq.BLOCK)[:n]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("n", SIZES)
def test_encode_decode_round_trips_bit_exactly(bits, n):
    values, scales = oq.quantize(_x(n), bits)
    assert scales.numel() == math.ceil(n / oq.BLOCK) and scales.dtype == torch.bfloat16
    out = oq.decode(oq.encode(values, scales, bits), n, bits)
    assert out.dtype == torch.float32 and out.shape == (n,)
    assert torch.equal(out, values)
    # and what a receiver decodes, encoded again, is the same bytes: every member agrees
    assert oq.encode(out, scales, bits) == oq.encode(values, scales, bits)


@pytest.mark.parametrize("bits", (8, 4))
def test_a_block_aligned_slice_encodes_to_the_same_values_with_its_scales(bits):
    n, b = 1000, oq.BLOCK
    values, scales = oq.quantize(_x(n, seed=1), bits)
    for lo, hi in ((b, 3 * b), (0, b), (5 * b, n)):  # the last one ends on the short final block
        part, part_scales = values[lo:hi], scales[lo // b : math.ceil(hi / b)]
        buf = oq.encode(part, part_scales, bits)
        assert len(buf) == oq.wire_nbytes(hi - lo, bits)
        assert torch.equal(oq.decode(buf, hi - lo, bits), part)
    with pytest.raises(ValueError):  # the wrong number of scales for the slice
        oq.encode(values[b : 3 * b], scales[1:2], bits)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("n", SIZES)
def test_each_value_is_within_half_its_blocks_step(bits, n):
    x = _x(n, seed=2)
    values, scales = oq.quantize(x, bits)
    step = _step(scales, n)
    assert bool(((x - values).abs() <= step / 2 * (1 + 1e-6)).all())
    # no value clips: the largest of each block is representable
    qmax = 2 ** (bits - 1) - 1
    assert bool((values.abs() <= qmax * step).all())


def test_an_all_zero_tensor_quantises_to_zeros():
    values, scales = oq.quantize(torch.zeros(100), 4)
    assert not values.any() and not scales.float().any()
    assert torch.equal(oq.decode(oq.encode(values, scales, 4), 100, 4), values)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("n", SIZES)
def test_wire_nbytes_is_the_length_of_encode(bits, n):
    values, scales = oq.quantize(_x(n), bits)
    assert len(oq.encode(values, scales, bits)) == oq.wire_nbytes(n, bits)
    assert oq.wire_nbytes(n, bits) == 2 * math.ceil(n / oq.BLOCK) + math.ceil(n * bits / 8)


def test_wire_nbytes_at_32_bits_is_fp32():
    assert [oq.wire_nbytes(n, 32) for n in SIZES] == [4 * n for n in SIZES]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("n", (1, 65, 1000))
def test_decode_refuses_a_buffer_of_the_wrong_length(bits, n):
    values, scales = oq.quantize(_x(n), bits)
    buf = oq.encode(values, scales, bits)
    for bad in (buf[:-1], buf + b"\x00", buf[2:], b""):
        with pytest.raises(ValueError):
            oq.decode(bad, n, bits)


@pytest.mark.parametrize("bits", (0, 1, 2, 16, 33, 64))
def test_other_bits_are_refused(bits):
    with pytest.raises(ValueError):
        oq.check_bits(bits)
    with pytest.raises(ValueError):
        oq.wire_nbytes(10, bits)
    with pytest.raises(ValueError):
        oq.quantize(torch.ones(10), bits)
    with pytest.raises(ValueError):
        oq.decode(b"\x00" * 12, 10, bits)


@pytest.mark.parametrize("bits", (8, 4))
def test_roundtrip_is_decode_of_encode_of_quantize(bits):
    x = _x(300, seed=3).reshape(3, 100)
    values, scales = oq.quantize(x.reshape(-1), bits)
    out = oq.roundtrip(x, bits)
    assert out.shape == x.shape
    assert torch.equal(out.reshape(-1), oq.decode(oq.encode(values, scales, bits), 300, bits))


@pytest.mark.parametrize("bits", (8, 4))
def test_error_feedback_sends_what_one_round_drops_later(bits):
    # one block: one large value sets the step, the others are far below half of it
    rounds, big = 250, 1.0
    delta = torch.full((oq.BLOCK,), 2e-3)
    delta[0] = big
    qmax = 2 ** (bits - 1) - 1
    half_step = big / qmax / 2
    assert float(delta[1:].max()) < half_step
    err = torch.zeros_like(delta)
    sent_sum = torch.zeros_like(delta)
    largest_step = 0.0
    for _ in range(rounds):
        before = err.clone()
        sent, scales, new_err = oq.with_feedback(delta, err, bits)
        assert torch.equal(err, before)  # nothing modified in place
        assert torch.equal(sent + new_err, delta + err)  # the residual is exactly what was not sent
        largest_step = max(largest_step, float(scales.float().max()))
        sent_sum += sent
        err = new_err
    want = delta * rounds
    # the sum of what was sent tracks the sum of the deltas within one step of the block
    assert float((sent_sum - want).abs().max()) <= largest_step
    assert float(sent_sum[1:].min()) > 0
    # without feedback the small values are never sent: their sum stays 0, several steps from the
    # deltas' sum (rounds x 2e-3)
    plain = oq.quantize(delta, bits)[0]
    assert not plain[1:].any()
    assert float(want[1:].min()) > 3 * largest_step
