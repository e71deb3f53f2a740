"""pca+mask and outlier-mask link codecs (issue 9): exactness on what is kept, adjoint backward,
byte formulas, seed-derived selection shared by both ends, versioned fitted state."""

from __future__ import annotations

import math

import pytest
import torch

from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.outlier import OutlierMaskCodec, fit_outlier_channels
from compression.pca import BasisVersionError, fit_basis
from compression.pcamask import PcaMaskCodec
from compression.prf import k_for_rate, select_channels
from compression.registry import make_codec
from node.stage.links import build_codec

H, POOL, TOP, RAND = 64, 24, 6, 5


def _basis(seed: int, hidden: int = H, k: int = POOL) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    v, _ = torch.linalg.qr(torch.randn(hidden, k, generator=gen, dtype=torch.float64))
    mean = torch.randn(hidden, generator=gen, dtype=torch.float64)
    return mean.float(), v.float()


def _pcamask(seed: int = 0, version: int = 1, **kw) -> PcaMaskCodec:
    kw = {"k_top": TOP, "k_rand": RAND} | kw
    codec = PcaMaskCodec(POOL, **kw)
    codec.set_basis(*_basis(seed), version=version)
    return codec


def _kept_mask(codec: PcaMaskCodec, ctx: LinkContext, n: int) -> torch.Tensor:
    """(n, POOL) 0/1: the directions token t keeps, built independently from select_channels."""
    m = torch.zeros(n, codec.k)
    m[:, : codec.k_top] = 1.0
    if codec.k_rand:
        idx = select_channels(ctx.seed, n, codec.k - codec.k_top, codec.k_rand) + codec.k_top
        m.scatter_(1, idx, 1.0)
    return m


# ---- pca+mask -------------------------------------------------------------------------------


def test_pcamask_round_trip_exact_on_kept_directions():
    codec = _pcamask(coeff_dtype="float32")
    mean, v = codec.basis(1)
    ctx = codec.link_context(seed=123)
    # in the span of the top directions: exact for every token, whatever the seed
    h = mean + torch.randn(2, 9, TOP) @ v[:, :TOP].T
    out = codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))
    torch.testing.assert_close(out, h, atol=1e-5, rtol=0)
    # on each token's own kept directions (top + its PRF ones): exact too
    m = _kept_mask(codec, ctx, 18)
    h = (mean + (torch.randn(18, POOL) * m) @ v.T).reshape(2, 9, H)
    out = codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))
    torch.testing.assert_close(out, h, atol=1e-5, rtol=0)
    # anything else is projected onto those directions
    h = torch.randn(18, H)
    ref = mean + (((h - mean) @ v) * m) @ v.T
    out = codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k_top,k_rand", [(TOP, RAND), (0, 7), (5, 0), (TOP, POOL - TOP)])
def test_pcamask_backward_matches_autograd_unquantised(k_top, k_rand):
    codec = _pcamask(coeff_dtype="float32", k_top=k_top, k_rand=k_rand)
    mean, v = codec.basis(1)
    ctx = codec.link_context(seed=77)
    h = torch.randn(3, 5, H, dtype=torch.float64)
    w = torch.randn(3, 5, H, dtype=torch.float64)
    m = _kept_mask(codec, ctx, 15).double().reshape(3, 5, POOL)

    h1 = h.clone().float().requires_grad_(True)
    (torch.tanh(apply_link(h1, codec, ctx)) * w.float()).sum().backward()
    h2 = h.clone().requires_grad_(True)
    md, vd = mean.double(), v.double()
    ref = md + (((h2 - md) @ vd) * m) @ vd.T
    (torch.tanh(ref) * w).sum().backward()
    torch.testing.assert_close(h1.grad.double(), h2.grad, atol=1e-5, rtol=1e-5)


def test_pcamask_int8_close_and_parts_quantised_apart():
    codec = _pcamask(block=4)  # TOP = 6 -> scale blocks 4 + 2; RAND = 5 -> 4 + 1
    mean, v = codec.basis(1)
    ctx = codec.link_context(seed=5)
    h = torch.randn(20, H) * 3
    p = codec.encode_forward(h, ctx)
    assert p["q"].dtype == torch.int8 and p["q"].shape == (20, TOP + RAND)
    assert p["scale"].dtype == torch.bfloat16 and p["scale"].shape == (20, 2 + 2)
    m = _kept_mask(codec, ctx, 20)
    ref = mean + (((h - mean) @ v) * m) @ v.T
    out = codec.decode_forward(p, ctx, tuple(h.shape))
    # orthonormal V: the token error is at most the coefficient error, each <= scale/2
    bound = (p["scale"].float() / 2).pow(2).mul(torch.tensor([4, 2, 4, 1])).sum(1).sqrt()
    assert torch.all((out - ref).norm(dim=1) <= bound * 1.01 + 1e-5)


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, TOP + RAND + (1 + 1) * 2),  # block 32: one scale per part, bf16
        ({"block": 4}, TOP + RAND + (2 + 2) * 2),
        ({"block": 4, "scale_dtype": "float16"}, TOP + RAND + (2 + 2) * 2),
        ({"k_top": 0, "k_rand": 9, "block": 4}, 9 + 3 * 2),
        ({"k_rand": 0}, TOP + 1 * 2),
        ({"coeff_dtype": "bfloat16"}, (TOP + RAND) * 2),
        ({"coeff_dtype": "float32"}, (TOP + RAND) * 4),
    ],
)
def test_pcamask_bytes_per_token_formula_and_payload(kw, expected):
    codec = _pcamask(**kw)
    assert codec.bytes_per_token(H) == expected
    ctx = codec.link_context(seed=3)
    for n_tok in (1, 17):
        x = torch.randn(n_tok, H)
        assert payload_nbytes(codec.encode_forward(x, ctx)) == expected * n_tok
        assert payload_nbytes(codec.encode_backward(x, ctx)) == expected * n_tok
        for name, t in codec.encode_forward(x, ctx).items():
            assert codec.payload_dtypes()[name] == t.dtype


def test_pcamask_bench_configuration_bytes():
    codec = make_codec("pcamask", k=192, k_top=48, k_rand=48)
    assert codec.bytes_per_token(576) == 96 + (2 + 2) * 2  # 104 B, 11.1x fewer than bf16 dense
    assert codec.basis_nbytes(576) == (576 + 576 * 192) * 4 + 8


def test_pcamask_both_ends_derive_the_same_selection_from_the_seed():
    sender, receiver = _pcamask(), _pcamask()  # same published basis, separate instances
    ctx = sender.link_context(seed=2**63 + 11)
    h = torch.randn(4, 6, H)
    payload = sender.encode_forward(h, ctx)
    out = receiver.decode_forward({k: t.clone() for k, t in payload.items()}, ctx, tuple(h.shape))
    torch.testing.assert_close(out, sender.decode_forward(payload, ctx, tuple(h.shape)), atol=0, rtol=0)
    sel = receiver.selection(ctx, 24)
    assert torch.equal(sel, sender.selection(ctx, 24))
    assert sel.shape == (24, RAND) and int(sel.min()) >= TOP and int(sel.max()) < POOL
    assert all(len(set(row.tolist())) == RAND for row in sel)
    # the random part depends on the seed (and differs between tokens), the top part never does
    other = receiver.selection(LinkContext(seed=ctx.seed + 1, basis_version=1), 24)
    assert not torch.equal(sel, other)
    assert len({tuple(r.tolist()) for r in sel}) > 1


def test_pcamask_wrong_basis_version_refused_and_previous_still_decodes():
    codec = _pcamask(version=1)
    h = torch.randn(5, H)
    old_ctx = codec.link_context(seed=4)
    old_payload = codec.encode_forward(h, old_ctx)
    old_out = codec.decode_forward(old_payload, old_ctx, tuple(h.shape))
    codec.set_basis(*_basis(9), version=2)
    assert codec.versions == (1, 2) and codec.link_context().basis_version == 2
    torch.testing.assert_close(codec.decode_forward(old_payload, old_ctx, tuple(h.shape)), old_out)
    for bad in (0, 3):
        ctx = LinkContext(seed=4, basis_version=bad)
        with pytest.raises(BasisVersionError):
            codec.decode_forward(old_payload, ctx, tuple(h.shape))
        with pytest.raises(BasisVersionError):
            codec.encode_backward(h, ctx)
    codec.set_basis(*_basis(10), version=3)  # version 1 is gone now
    with pytest.raises(BasisVersionError):
        codec.decode_forward(old_payload, old_ctx, tuple(h.shape))


def test_pcamask_basis_publication_and_describe_round_trip():
    sender = _pcamask()
    receiver = build_codec(sender.describe())  # what a node builds from the run record
    assert isinstance(receiver, PcaMaskCodec) and receiver.describe() == sender.describe()
    assert receiver.basis_from_payload(sender.basis_payload()) == 1
    assert payload_nbytes(sender.basis_payload()) == sender.basis_nbytes()
    ctx = sender.link_context(seed=8)
    h = torch.randn(7, H)
    p = sender.encode_forward(h, ctx)
    torch.testing.assert_close(receiver.decode_forward(p, ctx, (7, H)), sender.decode_forward(p, ctx, (7, H)))


def test_pcamask_rejects_bad_settings_and_payloads():
    for kw in ({"k_top": POOL + 1, "k_rand": 0}, {"k_top": 20, "k_rand": 5}, {"k_top": 0, "k_rand": 0}):
        with pytest.raises(ValueError):
            PcaMaskCodec(POOL, **kw)
    codec = _pcamask()
    ctx = codec.link_context(seed=1)
    p = codec.encode_forward(torch.randn(3, H), ctx)
    with pytest.raises(ValueError):
        codec.decode_forward({"q": p["q"][:, :-1], "scale": p["scale"]}, ctx, (3, H))
    with pytest.raises(ValueError):
        codec.decode_forward({"q": p["q"], "scale": p["scale"][:, :1]}, ctx, (3, H))


def test_pcamask_with_a_fitted_pool_keeps_the_top_variance_exactly():
    gen = torch.Generator().manual_seed(2)
    scales = torch.linspace(10, 0.1, H)
    x = torch.randn(400, H, generator=gen) * scales
    mean, v = fit_basis(x, POOL)
    codec = PcaMaskCodec(POOL, TOP, RAND, coeff_dtype="float32")
    codec.set_basis(mean, v, 1)
    ctx = codec.link_context(seed=6)
    out = codec.decode_forward(codec.encode_forward(x, ctx), ctx, tuple(x.shape))
    top = ((x - mean) @ v[:, :TOP]).pow(2).sum()
    kept = ((out - mean) @ v).pow(2).sum()
    assert kept >= top * (1 - 1e-5)


# ---- outlier-mask -----------------------------------------------------------------------------


N_OUT, RATE = 4, 0.8


def _outlier(version: int = 1, channels=(3, 17, 40, 63), **kw) -> OutlierMaskCodec:
    codec = OutlierMaskCodec(N_OUT, rate=RATE, **kw)
    codec.set_channels(torch.tensor(channels), H, version)
    return codec


def _channel_mask(codec: OutlierMaskCodec, ctx: LinkContext, n: int) -> torch.Tensor:
    ch = codec.channels(ctx.basis_version)
    rest = torch.tensor([c for c in range(H) if c not in set(ch.tolist())])
    m = torch.zeros(n, H)
    m[:, ch] = 1.0
    m.scatter_(1, rest[select_channels(ctx.seed, n, H - N_OUT, k_for_rate(H - N_OUT, RATE))], 1.0)
    return m


def test_fit_outlier_channels_largest_mean_abs():
    x = torch.randn(300, H)
    x[:, 10] += 50.0
    x[:, 33] -= 40.0
    x[::2, 5] = 200.0  # mean |h| ~ 100 from half the tokens
    x[:, 50] *= 20.0
    assert fit_outlier_channels(x, 4).tolist() == [5, 10, 33, 50]
    assert fit_outlier_channels(torch.zeros(3, H), 2).tolist() == [0, 1]  # ties: lower channel


def test_outlier_round_trip_exact_on_kept_channels():
    codec = _outlier(wire_dtype="float32")
    ctx = codec.link_context(seed=99)
    h = torch.zeros(2, 8, H)
    h[..., [3, 17, 40, 63]] = torch.randn(2, 8, N_OUT) * 1000  # outliers: every token, every seed
    for seed in (1, 2):
        c = LinkContext(seed=seed, basis_version=1)
        torch.testing.assert_close(codec.decode_forward(codec.encode_forward(h, c), c, h.shape), h)
    m = _channel_mask(codec, ctx, 16)
    h = (torch.randn(16, H) * m).reshape(2, 8, H)
    out = codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))
    assert torch.equal(out, h)
    h = torch.randn(16, H)
    assert torch.equal(codec.decode_forward(codec.encode_forward(h, ctx), ctx, (16, H)), h * m)


def test_outlier_backward_matches_autograd_unquantised():
    codec = _outlier(wire_dtype="float32")
    ctx = codec.link_context(seed=31)
    h = torch.randn(3, 5, H, dtype=torch.float64)
    w = torch.randn(3, 5, H, dtype=torch.float64)
    m = _channel_mask(codec, ctx, 15).double().reshape(3, 5, H)
    h1 = h.clone().float().requires_grad_(True)
    (torch.tanh(apply_link(h1, codec, ctx)) * w.float()).sum().backward()
    h2 = h.clone().requires_grad_(True)
    (torch.tanh(h2 * m) * w).sum().backward()
    torch.testing.assert_close(h1.grad.double(), h2.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("wire,item", [("bfloat16", 2), ("float32", 4)])
def test_outlier_bytes_per_token_formula_and_payload(wire, item):
    codec = _outlier(wire_dtype=wire)
    expected = (N_OUT + k_for_rate(H - N_OUT, RATE)) * item
    assert codec.bytes_per_token(H) == expected
    ctx = codec.link_context(seed=2)
    for n_tok in (1, 13):
        x = torch.randn(n_tok, H)
        assert payload_nbytes(codec.encode_forward(x, ctx)) == expected * n_tok
        assert payload_nbytes(codec.encode_backward(x, ctx)) == expected * n_tok
    assert payload_nbytes(codec.channels_payload()) == codec.basis_nbytes() == N_OUT * 2 + 8
    bench = make_codec("outliermask", n_outlier=16, rate=0.95)
    assert bench.bytes_per_token(576) == (16 + round(0.05 * 560)) * 2  # 88 B


def test_outlier_both_ends_derive_the_same_selection_from_the_seed():
    sender = _outlier()
    receiver = build_codec(sender.describe())
    assert isinstance(receiver, OutlierMaskCodec) and receiver.describe() == sender.describe()
    assert receiver.channels_from_payload(sender.channels_payload(), H) == 1
    ctx = sender.link_context(seed=12345)
    idx = sender.indices(ctx, 10, H)
    assert torch.equal(idx, receiver.indices(ctx, 10, H))
    k = k_for_rate(H - N_OUT, RATE)
    assert idx.shape == (10, N_OUT + k)
    assert torch.equal(idx[:, :N_OUT], torch.tensor([3, 17, 40, 63]).expand(10, N_OUT))
    for row in idx:  # random part: distinct, never an outlier channel
        assert len(set(row.tolist())) == N_OUT + k
    h = torch.randn(10, H)
    p = sender.encode_forward(h, ctx)
    assert torch.equal(receiver.decode_forward(p, ctx, (10, H)), sender.decode_forward(p, ctx, (10, H)))
    assert not torch.equal(idx, sender.indices(LinkContext(seed=12346, basis_version=1), 10, H))


def test_outlier_wrong_version_refused_and_previous_still_decodes():
    codec = _outlier(version=1)
    h = torch.randn(6, H)
    old = codec.link_context(seed=3)
    p = codec.encode_forward(h, old)
    out = codec.decode_forward(p, old, (6, H))
    codec.set_channels(torch.tensor([0, 1, 2, 5]), H, 2)
    assert codec.versions == (1, 2) and codec.link_context().basis_version == 2
    assert torch.equal(codec.decode_forward(p, old, (6, H)), out)
    for bad in (0, 7):
        with pytest.raises(BasisVersionError):
            codec.decode_forward(p, LinkContext(seed=3, basis_version=bad), (6, H))
    with pytest.raises(ValueError):
        codec.set_channels(torch.tensor([0, 1, 2, 6]), H, 2)  # same version, other channels
    with pytest.raises(ValueError):
        codec.set_channels(torch.tensor([0, 1, 2, 6]), H, 1)  # older than current
    codec.set_channels(torch.tensor([0, 1, 2, 5]), H, 2)  # re-publish: no-op
    for bad in ([0, 1, 2], [0, 0, 1, 2], [0, 1, 2, H]):
        with pytest.raises(ValueError):
            codec.set_channels(torch.tensor(bad), H, 3)
    codec.set_channels(torch.tensor([7, 8, 9, 10]), H, 3)
    with pytest.raises(BasisVersionError):
        codec.decode_forward(p, old, (6, H))
    assert math.isclose(codec.bytes_per_token(H), (N_OUT + k_for_rate(H - N_OUT, RATE)) * 2)
