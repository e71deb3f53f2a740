"""PCA link codec: exactness in the basis span, int8 bound, adjoint backward, versioning, bytes."""

from __future__ import annotations

import math

import pytest
import torch

from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.pca import (
    BasisVersionError,
    PcaCodec,
    basis_drift,
    fit_basis,
    fit_joint_basis,
    should_refresh,
)
from compression.registry import make_codec

H, K = 48, 12


def _basis(seed: int, hidden: int = H, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    v, _ = torch.linalg.qr(torch.randn(hidden, k, generator=gen, dtype=torch.float64))
    mean = torch.randn(hidden, generator=gen, dtype=torch.float64)
    return mean.float(), v.float()


def _codec(seed: int = 0, version: int = 1, **kw) -> PcaCodec:
    codec = PcaCodec(K, **kw)
    codec.set_basis(*_basis(seed), version=version)
    return codec


def test_fit_basis_recovers_subspace_and_is_deterministic():
    gen = torch.Generator().manual_seed(1)
    true_v, _ = torch.linalg.qr(torch.randn(H, 5, generator=gen, dtype=torch.float64))
    mu = 3.0 * torch.randn(H, generator=gen, dtype=torch.float64)
    scales = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    x = mu + (torch.randn(200, 5, generator=gen, dtype=torch.float64) * scales) @ true_v.T
    mean, v = fit_basis(x.float(), 5)
    assert mean.dtype == v.dtype == torch.float32 and v.shape == (H, 5)
    torch.testing.assert_close(v.T @ v, torch.eye(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(mean.double(), x.mean(0), atol=1e-5, rtol=0)
    # independent reference: right singular vectors of the centred data span the same space
    _, _, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
    ref = vh[:5].T
    torch.testing.assert_close((v @ v.T).double(), ref @ ref.T, atol=1e-4, rtol=0)
    # ordered by variance, and sign rule: largest-|.| entry of each column positive
    col_var = ((x - x.mean(0)) @ v.double()).var(0)
    assert torch.all(col_var[:-1] >= col_var[1:])
    assert torch.all(v[v.abs().argmax(0), torch.arange(5)] > 0)
    mean2, v2 = fit_basis(x.float(), 5)
    assert torch.equal(v, v2) and torch.equal(mean, mean2)


def test_round_trip_exact_in_span_fp32():
    codec = _codec(coeff_dtype="float32")
    mean, v = codec.basis(1)
    a = torch.randn(3, 7, K)
    h = mean + a @ v.T
    ctx = codec.link_context(seed=9)
    out = codec.decode_forward(codec.encode_forward(h, ctx), ctx, tuple(h.shape))
    assert out.shape == h.shape
    torch.testing.assert_close(out, h, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_int8_error_bounded_by_block_scale(scale_dtype):
    block = 5  # K = 12 -> blocks of 5, 5, 2
    codec = _codec(coeff_dtype="int8", block=block, scale_dtype=scale_dtype)
    mean, v = codec.basis(1)
    h = torch.randn(40, H) * torch.logspace(-2, 2, 40).unsqueeze(1)
    ctx = codec.link_context()
    payload = codec.encode_forward(h, ctx)
    c_ref = (h.double() - mean.double()) @ v.double()  # (T, K), independent fp64 reference
    scale = payload["scale"].double()
    assert payload["q"].dtype == torch.int8 and scale.shape == (40, 3)
    # stored scale is absmax/127 rounded up, never down, to the scale dtype
    absmax = torch.stack([c_ref[:, i : i + block].abs().amax(1) for i in range(0, K, block)], 1)
    assert torch.all(scale >= absmax / 127 * (1 - 1e-6))
    assert torch.all(scale <= absmax / 127 * (1 + 2**-7))
    per_coeff = scale.repeat_interleave(block, dim=1)[:, :K]
    c_hat = payload["q"].double() * per_coeff
    assert torch.all((c_hat - c_ref).abs() <= per_coeff / 2 * (1 + 1e-5) + 1e-6)
    # in H space the error against the exact projection is the coefficient error (V orthonormal)
    exact = mean.double() + c_ref @ v.double().T
    out = codec.decode_forward(payload, ctx, tuple(h.shape)).double()
    bound = (per_coeff / 2).pow(2).sum(1).sqrt()
    assert torch.all((out - exact).norm(dim=1) <= bound * (1 + 1e-4) + 1e-5)


@pytest.mark.parametrize("coeff_dtype", ["float32", "int8"])
def test_backward_matches_autograd_through_explicit_projection(coeff_dtype):
    codec = _codec(coeff_dtype=coeff_dtype)
    mean, v = codec.basis(1)
    gen = torch.Generator().manual_seed(3)
    h0 = torch.randn(2, 5, H, generator=gen)
    w = torch.randn(H, H, generator=gen) / math.sqrt(H)

    def f(x):
        return (torch.tanh(x @ w) ** 2).sum()

    h1 = h0.clone().requires_grad_(True)
    f(apply_link(h1, codec, codec.link_context())).backward()
    h2 = h0.clone().requires_grad_(True)
    f(mean + (h2 - mean) @ v @ v.T).backward()
    if coeff_dtype == "float32":
        torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    else:  # quantised adjoint: close, not exact
        rel = (h1.grad - h2.grad).norm() / h2.grad.norm()
        assert 0 < rel < 0.05


def test_old_version_frame_decodes_with_its_basis_after_refresh():
    tx, rx = (
        _codec(seed=0, version=1, coeff_dtype="float32"),
        _codec(seed=0, version=1, coeff_dtype="float32"),
    )
    m1, v1 = _basis(0)
    h = torch.randn(6, H)
    ctx1 = tx.link_context()
    frame = tx.encode_forward(h, ctx1)
    grad_frame = rx.encode_backward(torch.randn(6, H), ctx1)
    m2, v2 = _basis(1)
    for codec in (tx, rx):  # the refresh reaches both ends while the frame is in flight
        codec.set_basis(m2, v2, version=2)
    assert rx.version == 2 and rx.versions == (1, 2)
    out = rx.decode_forward(frame, ctx1, (6, H))
    torch.testing.assert_close(out, m1 + (h - m1) @ v1 @ v1.T, atol=1e-5, rtol=0)
    wrong = rx.decode_forward(frame, LinkContext(basis_version=2), (6, H))
    assert not torch.allclose(out, wrong, atol=1e-2)
    tx.decode_backward(grad_frame, ctx1, (6, H))  # still decodable
    # a third version drops version 1
    rx.set_basis(*_basis(2), version=3)
    with pytest.raises(BasisVersionError):
        rx.decode_forward(frame, ctx1, (6, H))


def test_unknown_version_raises():
    codec = _codec(version=4)
    frame = codec.encode_forward(torch.randn(2, H), LinkContext(basis_version=4))
    for bad in (LinkContext(basis_version=5), LinkContext(basis_version=0)):
        with pytest.raises(BasisVersionError):
            codec.decode_forward(frame, bad, (2, H))
        with pytest.raises(BasisVersionError):
            codec.decode_backward(frame, bad, (2, H))
        with pytest.raises(ValueError):  # a ValueError subclass
            codec.encode_forward(torch.randn(2, H), bad)
    with pytest.raises(BasisVersionError):
        PcaCodec(K).encode_forward(torch.randn(2, H), LinkContext())


def test_set_basis_rejects_stale_conflicting_and_bad_bases():
    codec = _codec(version=3)
    mean, v = _basis(0)
    codec.set_basis(mean, v, version=3)  # identical re-publish: no-op
    assert codec.versions == (3,)
    with pytest.raises(ValueError):
        codec.set_basis(*_basis(1), version=3)
    with pytest.raises(ValueError):
        codec.set_basis(*_basis(1), version=2)
    with pytest.raises(ValueError):
        codec.set_basis(mean, 2 * v, version=4)
    with pytest.raises(ValueError):
        codec.set_basis(mean, v[:, :-1], version=4)


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"coeff_dtype": "int8", "block": 32}, K + 1 * 2),
        ({"coeff_dtype": "int8", "block": 5}, K + 3 * 2),
        ({"coeff_dtype": "int8", "block": 5, "scale_dtype": "float16"}, K + 3 * 2),
        ({"coeff_dtype": "bfloat16"}, 2 * K),
        ({"coeff_dtype": "float32"}, 4 * K),
    ],
)
def test_bytes_per_token_formula_and_payload(kw, expected):
    codec = _codec(**kw)
    assert codec.bytes_per_token(H) == expected
    tokens = 3 * 4
    h = torch.randn(3, 4, H)
    ctx = codec.link_context()
    assert payload_nbytes(codec.encode_forward(h, ctx)) == expected * tokens
    assert payload_nbytes(codec.encode_backward(h, ctx)) == expected * tokens


def test_bytes_for_design_configuration():
    # DESIGN §7: 58 components, int8, block 32 -> 58 + 2 bf16 scales = 62 B/token
    assert PcaCodec(58).bytes_per_token(576) == 62


@pytest.mark.parametrize("basis_dtype", ["float32", "bfloat16"])
def test_basis_payload_round_trip(basis_dtype):
    tx = PcaCodec(K, basis_dtype=basis_dtype)
    tx.set_basis(*_basis(5), version=7)
    payload = tx.basis_payload()
    assert payload["V"].dtype == payload["mean"].dtype == getattr(torch, basis_dtype)
    assert (
        payload_nbytes(payload)
        == tx.basis_nbytes()
        == tx.basis_nbytes(H)
        == (H + H * K) * (4 if basis_dtype == "float32" else 2) + 8
    )
    rx = PcaCodec(K, basis_dtype=basis_dtype)
    assert rx.basis_from_payload(payload) == 7
    for a, b in zip(tx.basis(7), rx.basis(7), strict=True):
        assert torch.equal(a, b)  # bit-identical at both ends, also for a bf16 basis
    h = torch.randn(5, H)
    ctx = tx.link_context()
    assert torch.equal(
        rx.decode_forward(tx.encode_forward(h, ctx), ctx, (5, H)),
        tx.decode_forward(tx.encode_forward(h, ctx), ctx, (5, H)),
    )


def test_basis_drift_and_refresh_policy():
    _, v = _basis(0)
    rot, _ = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))
    assert basis_drift(v, v) == pytest.approx(0, abs=1e-6)
    assert basis_drift(v, (v.double() @ rot).float()) == pytest.approx(0, abs=1e-6)
    full, _ = torch.linalg.qr(torch.randn(H, 2 * K, dtype=torch.float64))
    assert basis_drift(full[:, :K], full[:, K:]) == pytest.approx(1, abs=1e-6)
    half = torch.cat([full[:, : K // 2], full[:, K : K + K // 2]], 1)
    assert basis_drift(full[:, :K], half) == pytest.approx(0.5, abs=1e-6)

    assert not should_refresh(0, 100, None, None)
    assert should_refresh(200, 100, None, None)
    assert not should_refresh(150, 100, None, None)
    assert not should_refresh(150, None, 0.05, 0.1)
    assert should_refresh(150, 0, 0.2, 0.1)
    assert not should_refresh(150, 100, 0.2, None)


def test_registry_and_describe():
    codec = make_codec("pca", k=58, coeff_dtype="int8", block=32)
    assert isinstance(codec, PcaCodec)
    assert codec.describe() == {
        "codec": "pca",
        "k": 58,
        "coeff_dtype": "int8",
        "block": 32,
        "scale_dtype": "bfloat16",
        "basis_dtype": "float32",
    }


def test_joint_basis_keeps_gradient_directions_the_activations_miss():
    torch.manual_seed(0)
    hidden, n = 48, 2000
    # activations: large variance in channels 0-7; gradients: live in channels 40-43 only
    acts = torch.randn(n, hidden) * 0.05
    acts[:, :8] += torch.randn(n, 8) * 5.0
    grads = torch.zeros(n, hidden)
    grads[:, 40:44] = torch.randn(n, 4)
    mean_a, v_act = fit_basis(acts, 12)
    mean_j, v_joint = fit_joint_basis(acts, grads, 12, 4)

    def kept(v: torch.Tensor) -> float:
        return float((grads @ v).pow(2).sum() / grads.pow(2).sum())

    assert kept(v_act) < 0.5  # the activation basis keeps little of these gradients
    assert kept(v_joint) > 0.999  # the 4 gradient directions are found exactly
    gram = v_joint.T @ v_joint
    assert torch.allclose(gram, torch.eye(12), atol=1e-5)
    # the activation part is the plain PCA basis of k - k_grad components, same mean
    _, v8 = fit_basis(acts, 8)
    assert torch.allclose(v_joint[:, :8], v8, atol=1e-6)
    assert torch.equal(mean_j, mean_a)
    # the forward still reconstructs the high-variance part
    xc = acts - mean_j
    err = (xc - xc @ v_joint @ v_joint.T).norm() / xc.norm()
    assert err < 0.1


def test_joint_basis_rejects_bad_sizes():
    acts, grads = torch.randn(50, 16), torch.randn(50, 16)
    with pytest.raises(ValueError, match="k_grad"):
        fit_joint_basis(acts, grads, 8, 8)
    with pytest.raises(ValueError, match="grads"):
        fit_joint_basis(acts, torch.randn(50, 15), 8, 2)
    with pytest.raises(ValueError, match="grad_k"):
        PcaCodec(k=8, grad_k=8)
