"""MaskCodec: payload size, forward = h * mask, backward = adjoint, rescale, value independence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.mask import MaskCodec, is_dense_step
from compression.prf import k_for_rate, mask_seed, select_channels
from compression.registry import make_codec

torch.set_num_threads(1)


def _explicit_mask(seed: int, shape: tuple[int, ...], rate: float) -> torch.Tensor:
    """0/1 mask of ``shape`` built by a plain loop from the PRF indices (no scatter)."""
    hidden = shape[-1]
    n = 1
    for s in shape[:-1]:
        n *= s
    idx = select_channels(seed, n, hidden, k_for_rate(hidden, rate)).tolist()
    m = torch.zeros(n, hidden)
    for t, row in enumerate(idx):
        for c in row:
            m[t, c] = 1.0
    return m.reshape(shape)


@pytest.mark.parametrize("wire,size", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_payload_bytes(wire, size):
    codec = MaskCodec(rate=0.95, wire_dtype=wire)
    h = torch.randn(3, 5, 576)
    p = codec.encode_forward(h, LinkContext(seed=mask_seed(1, 0, 0, 0)))
    assert set(p) == {"v"}
    assert payload_nbytes(p) == 15 * 29 * size
    assert codec.bytes_per_token(576) == 29 * size
    g = codec.encode_backward(torch.randn(3, 5, 576), LinkContext(seed=1))
    assert set(g) == {"g"} and payload_nbytes(g) == 15 * 29 * size
    assert MaskCodec(rate=0.95, wire_dtype="bfloat16").bytes_per_token(2048) == 204  # DESIGN 4.1


@pytest.mark.parametrize("rescale", [False, True])
def test_decode_encode_equals_h_times_mask(rescale):
    rate, shape = 0.9, (2, 7, 40)
    seed = mask_seed(3, 1, 4, 1)
    ctx = LinkContext(seed=seed)
    h = torch.randn(shape)
    m = _explicit_mask(seed, shape, rate)
    scale = 1 / (1 - rate) if rescale else 1.0

    codec32 = MaskCodec(rate=rate, wire_dtype="float32", rescale=rescale)
    out = codec32.decode_forward(codec32.encode_forward(h, ctx), ctx, shape)
    assert out.dtype == torch.float32 and out.shape == shape
    torch.testing.assert_close(out, h * m * scale, rtol=1e-6, atol=0)
    assert int((out != 0).sum(-1).min()) == k_for_rate(40, rate)

    codec16 = MaskCodec(rate=rate, wire_dtype="bfloat16", rescale=rescale)
    out16 = codec16.decode_forward(codec16.encode_forward(h, ctx), ctx, shape)
    torch.testing.assert_close(out16, h.to(torch.bfloat16).float() * m * scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rescale", [False, True])
def test_link_backward_equals_explicit_masked_forward(rescale):
    torch.manual_seed(0)
    rate, hidden = 0.75, 16
    seed = mask_seed(9, 2, 0, 1)
    a, b = nn.Linear(8, hidden), nn.Linear(hidden, 4)
    x = torch.randn(3, 5, 8)
    codec = MaskCodec(rate=rate, wire_dtype="float32", rescale=rescale)
    scale = 1 / (1 - rate) if rescale else 1.0
    m = _explicit_mask(seed, (3, 5, hidden), rate)

    def run(link):
        for p in (*a.parameters(), *b.parameters()):
            p.grad = None
        xi = x.clone().requires_grad_(True)
        y = b(torch.tanh(link(a(xi))))
        (y**2).sum().backward()
        return [xi.grad.clone()] + [p.grad.clone() for p in (*a.parameters(), *b.parameters())]

    got = run(lambda h: apply_link(h, codec, LinkContext(seed=seed)))
    want = run(lambda h: h * m * scale)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the first stage's input gradient really went through the mask: not the dense one
    dense = run(lambda h: h)
    assert not torch.allclose(got[0], dense[0])


def test_backward_payload_is_gradient_at_kept_positions():
    rate, shape, seed = 0.8, (4, 30), 1234
    codec = MaskCodec(rate=rate, wire_dtype="float32")
    ctx = LinkContext(seed=seed)
    g = torch.randn(shape)
    m = _explicit_mask(seed, shape, rate)
    back = codec.decode_backward(codec.encode_backward(g, ctx), ctx, shape)
    torch.testing.assert_close(back, g * m, rtol=0, atol=0)


def test_mask_does_not_depend_on_activation_values():
    codec = MaskCodec(rate=0.9, wire_dtype="float32")
    ctx = LinkContext(seed=mask_seed(1, 1, 1, 1))
    shape = (6, 50)
    h1 = torch.rand(shape) + 0.5  # no zeros, so the support is exactly the mask
    h2 = -100.0 * torch.rand(shape) - 1.0
    s1 = codec.decode_forward(codec.encode_forward(h1, ctx), ctx, shape) != 0
    s2 = codec.decode_forward(codec.encode_forward(h2, ctx), ctx, shape) != 0
    assert torch.equal(s1, s2)
    other = codec.decode_forward(codec.encode_forward(h1, LinkContext(seed=5)), LinkContext(seed=5), shape)
    assert not torch.equal(s1, other != 0)


def test_wrong_payload_shape_is_refused():
    codec = MaskCodec(rate=0.9, wire_dtype="float32")
    ctx = LinkContext(seed=1)
    p = codec.encode_forward(torch.randn(4, 50), ctx)
    with pytest.raises(ValueError):
        codec.decode_forward(p, ctx, (5, 50))
    with pytest.raises(ValueError):
        codec.decode_forward({"v": p["v"][:, :-1]}, ctx, (4, 50))


def test_describe_and_registry():
    codec = make_codec("mask", rate=0.99, wire_dtype="float16", rescale=True)
    assert isinstance(codec, MaskCodec)
    assert codec.describe() == {"codec": "mask", "rate": 0.99, "wire_dtype": "float16", "rescale": True}
    with pytest.raises(ValueError):
        MaskCodec(rate=1.0)
    with pytest.raises(ValueError):
        MaskCodec(wire_dtype="int8")


def test_is_dense_step():
    assert [s for s in range(12) if is_dense_step(s, 5)] == [0, 5, 10]
    assert sum(is_dense_step(s, 5) for s in range(100)) == 20
    assert not any(is_dense_step(s, 0) for s in range(10))
    assert all(is_dense_step(s, 1) for s in range(10))
