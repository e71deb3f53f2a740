"""Baseline link codecs: stated error bounds, exact byte counts, top-k selection, int4 packing,
and the bottleneck's adjoint backward."""

from __future__ import annotations

import math

import pytest
import torch

from compression.baselines import (
    BottleneckCodec,
    QuantCodec,
    TopKCodec,
    pack_int4,
    random_orthonormal,
    unpack_int4,
)
from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.registry import make_codec

H = 70


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * torch.logspace(-1, 1, shape[-1])


def _round_trip(codec, h: torch.Tensor, ctx: LinkContext = LinkContext()) -> torch.Tensor:
    return codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))


# ---- top-k ----------------------------------------------------------------------------------


def _ref_mask(h: torch.Tensor, k: int) -> torch.Tensor:
    order = h.abs().argsort(dim=-1, descending=True)
    return torch.zeros_like(h, dtype=torch.bool).scatter(-1, order[..., :k], True)


def test_topk_keeps_exactly_top_k_by_magnitude_within_bound():
    k = 9
    h = _x(3, 5, H)
    codec = TopKCodec(k)
    payload = codec.encode_forward(h, LinkContext())
    assert payload["i"].dtype == torch.int16 and payload["v"].dtype == torch.bfloat16
    mask = _ref_mask(h, k)
    kept = torch.zeros(15, H, dtype=torch.bool).scatter(-1, payload["i"].long(), True)
    assert torch.equal(kept, mask.reshape(15, H))
    out = codec.decode_forward(payload, LinkContext(), tuple(h.shape))
    assert torch.all(out[~mask] == 0)
    torch.testing.assert_close(out[mask], h[mask], rtol=2**-8, atol=0)  # bf16 rounding
    # stated bound: dropped energy <= (H - k)/H of the token's (plus bf16 on the kept part)
    err = (out - h).norm(dim=-1)
    assert torch.all(err <= h.norm(dim=-1) * (math.sqrt((H - k) / H) + 2**-8))


def test_topk_index_dtype_and_bytes():
    codec = TopKCodec(4)
    assert codec.bytes_per_token(H) == 4 * (2 + 2)
    assert codec.bytes_per_token(40000) == 4 * (2 + 4)
    for hidden, idx_dtype in ((H, torch.int16), (32767, torch.int16), (32768, torch.int32)):
        h = torch.randn(2, hidden)
        ctx = LinkContext(seed=hidden)
        fwd = codec.encode_forward(h, ctx)
        assert fwd["i"].dtype == idx_dtype
        assert payload_nbytes(fwd) == 2 * codec.bytes_per_token(hidden)
        codec.decode_forward(fwd, ctx, (2, hidden))
        bwd = codec.encode_backward(torch.randn(2, hidden), ctx)
        assert payload_nbytes(bwd) == 2 * codec.bytes_per_token(hidden)
    assert TopKCodec(4, value_dtype="float32").bytes_per_token(H) == 4 * (4 + 2)


def test_topk_backward_is_gradient_at_forward_indices():
    k = 7
    h0 = _x(4, H, seed=1)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(H, H, generator=gen) / math.sqrt(H)

    def f(x):
        return (torch.sin(x @ w) * x).sum()

    codec = TopKCodec(k, value_dtype="float32")
    h1 = h0.clone().requires_grad_(True)
    f(apply_link(h1, codec, LinkContext(seed=5))).backward()
    h2 = h0.clone().requires_grad_(True)
    f(h2 * _ref_mask(h0, k)).backward()  # autograd through the explicit selection
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):  # the pending indices were consumed
        codec.encode_backward(torch.randn(4, H), LinkContext(seed=5))


def test_topk_two_frames_in_flight_and_stateless_mode():
    codec = TopKCodec(3, value_dtype="float32")
    ha, hb = _x(2, H, seed=3), _x(2, H, seed=4)
    ca, cb = LinkContext(seed=1), LinkContext(seed=2)
    codec.decode_forward(codec.encode_forward(ha, ca), ca, (2, H))
    codec.decode_forward(codec.encode_forward(hb, cb), cb, (2, H))
    g = torch.randn(2, H)
    ga = codec.decode_backward(codec.encode_backward(g, ca), ca, (2, H))
    torch.testing.assert_close(ga, g * _ref_mask(ha, 3))
    # stateless mode: the top-k of the gradient itself
    st = TopKCodec(3, value_dtype="float32", backward="topk")
    gs = st.decode_backward(st.encode_backward(g, cb), cb, (2, H))
    torch.testing.assert_close(gs, g * _ref_mask(g, 3))


def test_topk_pending_is_bounded():
    codec = TopKCodec(2, max_pending=3)
    for s in range(5):
        ctx = LinkContext(seed=s)
        codec.decode_forward(codec.encode_forward(torch.randn(1, H), ctx), ctx, (1, H))
    with pytest.raises(ValueError):
        codec.encode_backward(torch.randn(1, H), LinkContext(seed=0))  # evicted
    codec.encode_backward(torch.randn(1, H), LinkContext(seed=4))


# ---- int8 / int4 ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hidden, block", [(H, 16), (77, 64), (64, 64)])
def test_quant_round_trip_within_half_scale(bits, hidden, block):
    codec = QuantCodec(bits=bits, block=block)
    h = _x(3, 2, hidden, seed=bits)
    h[0, 0, :block] = 0.0  # an all-zero block
    payload = codec.encode_forward(h, LinkContext())
    out = codec.decode_forward(payload, LinkContext(), tuple(h.shape))
    nb = math.ceil(hidden / block)
    qmax = 2 ** (bits - 1) - 1
    rows = h.reshape(-1, hidden)
    ref_scale = torch.stack([rows[:, i * block : (i + 1) * block].abs().amax(1) / qmax for i in range(nb)], 1)
    scale = payload["scale"].float()
    assert scale.shape == (6, nb)
    assert torch.all(scale >= ref_scale * (1 - 1e-6)) and torch.all(scale <= ref_scale * (1 + 2**-7))
    per = scale.repeat_interleave(block, dim=1)[:, :hidden].reshape(h.shape)
    assert torch.all((out - h).abs() <= per / 2 * (1 + 1e-5) + 1e-7)
    assert torch.all(out[0, 0, :block] == 0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("hidden, block", [(H, 16), (77, 64)])
def test_quant_bytes_formula_and_payload(bits, hidden, block):
    codec = QuantCodec(bits=bits, block=block)
    values = hidden if bits == 8 else math.ceil(hidden / 2)
    expected = values + math.ceil(hidden / block) * 2
    assert codec.bytes_per_token(hidden) == expected
    h = torch.randn(5, hidden)
    assert payload_nbytes(codec.encode_forward(h, LinkContext())) == 5 * expected
    assert payload_nbytes(codec.encode_backward(h, LinkContext())) == 5 * expected
    assert QuantCodec(bits=bits, block=block, scale_dtype="float32").bytes_per_token(hidden) == (
        values + math.ceil(hidden / block) * 4
    )


def test_int4_design_cost():
    # DESIGN §7: int4 blockwise at H = 576 costs 153 bf16-equivalents = 306 B/token
    assert make_codec("int4").bytes_per_token(576) == 306


def test_int4_pack_round_trip_and_layout():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(3, 1)  # (3, 15): odd length
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_int4(packed, 15), q)
    # element 0 (-7 -> 1) in the low nibble, element 1 (-6 -> 2) in the high nibble
    assert packed[0, 0].item() == 1 | (2 << 4)
    assert packed[0, 7].item() == (7 + 8) | (8 << 4)  # last value, then the zero pad


def test_quant_backward_bounded():
    codec = QuantCodec(bits=8, block=32)
    h = _x(4, H, seed=6).requires_grad_(True)
    g = _x(4, H, seed=7)
    apply_link(h, codec, LinkContext()).backward(g)
    assert (h.grad - g).norm() / g.norm() < 0.01


def test_float16_scale_overflow_raises():
    codec = QuantCodec(bits=8, block=16, scale_dtype="float16")
    with pytest.raises(ValueError):
        codec.encode_forward(torch.full((1, 16), 1e7), LinkContext())


# ---- bottleneck -----------------------------------------------------------------------------


def test_bottleneck_projection_deterministic_and_private_rng():
    state = torch.random.get_rng_state()
    p = BottleneckCodec(10, seed=3).projection(H)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert p.shape == (H, 10)
    torch.testing.assert_close(p.T @ p, torch.eye(10), atol=1e-5, rtol=0)
    assert torch.equal(p, BottleneckCodec(10, seed=3).projection(H))
    assert torch.equal(p, random_orthonormal(H, 10, 3))
    assert not torch.allclose(p, BottleneckCodec(10, seed=4).projection(H))


def test_bottleneck_round_trip_and_bound():
    codec = BottleneckCodec(10, seed=1, wire_dtype="float32")
    p = codec.projection(H)
    a = torch.randn(6, 10)
    in_span = a @ p.T
    torch.testing.assert_close(_round_trip(codec, in_span), in_span, atol=1e-5, rtol=0)
    h = _x(6, H, seed=8)
    out = _round_trip(codec, h)
    assert torch.all(out.norm(dim=-1) <= h.norm(dim=-1) * (1 + 1e-6))
    assert torch.allclose((out * (h - out)).sum(-1), torch.zeros(6), atol=1e-3)  # orthogonal


def test_bottleneck_backward_matches_autograd_through_explicit_projection():
    codec = BottleneckCodec(12, seed=2, wire_dtype="float32")
    p = codec.projection(H)
    h0 = _x(2, 3, H, seed=9)
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(H, H, generator=gen) / math.sqrt(H)

    def f(x):
        return (torch.tanh(x @ w) ** 2).sum()

    h1 = h0.clone().requires_grad_(True)
    f(apply_link(h1, codec, LinkContext())).backward()
    h2 = h0.clone().requires_grad_(True)
    f(h2 @ p @ p.T).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)


def test_bottleneck_bytes():
    for wire, size in (("bfloat16", 2), ("float32", 4)):
        codec = BottleneckCodec(12, wire_dtype=wire)
        assert codec.bytes_per_token(H) == 12 * size
        h = torch.randn(2, 4, H)
        assert payload_nbytes(codec.encode_forward(h, LinkContext())) == 8 * 12 * size
        assert payload_nbytes(codec.encode_backward(h, LinkContext())) == 8 * 12 * size


def test_registry_names():
    assert isinstance(make_codec("topk", k=4), TopKCodec)
    i8, i4 = make_codec("int8"), make_codec("int4", block=32)
    assert (i8.codec_id, i8.bits, i4.codec_id, i4.bits, i4.block) == ("int8", 8, "int4", 4, 32)
    assert i4.describe() == {"codec": "int4", "block": 32, "scale_dtype": "bfloat16"}
    bn = make_codec("bottleneck", k=8, seed=5)
    assert isinstance(bn, BottleneckCodec) and bn.describe()["seed"] == 5
