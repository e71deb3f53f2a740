"""SpectralFilter against an independent statement of DESIGN.md 4.2 (explicit projectors)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compression.spectral import SpectralFilter, filter_gradients, is_target_matrix

torch.set_num_threads(1)


def _reference(Gs: list[torch.Tensor], G: torch.Tensor, alpha, tau, beta, rank=None, relative=False):
    """EMA (first packet = M), SVD, d, then P_U G P_V with P_U = U diag(d) U^T, P_V = V diag(d) V^T."""
    M = Gs[0].double().clone()
    for g in Gs[1:]:
        M = beta * M + (1 - beta) * g.double()
    U, s, Vh = torch.linalg.svd(M, full_matrices=False)
    if rank is not None:
        U, s, Vh = U[:, :rank], s[:rank], Vh[:rank]
    t = tau * s[0] if relative else tau
    d = s / (s + t)
    P_U = U @ torch.diag(d) @ U.T
    P_V = Vh.T @ torch.diag(d) @ Vh
    return (alpha * G.double() + (1 - alpha) * P_U @ G.double() @ P_V).float()


@pytest.fixture
def grads():
    g = torch.Generator().manual_seed(0)
    # anchor gradients: low-rank signal + noise, at a scale where tau=1e-3 matters
    base = 1e-3 * torch.randn(12, 3, generator=g) @ torch.randn(3, 7, generator=g)
    anchors = [base + 1e-4 * torch.randn(12, 7, generator=g) for _ in range(3)]
    G = 1e-3 * torch.randn(12, 7, generator=g)
    return anchors, G


def _warm(f: SpectralFilter, anchors, name="w"):
    for i, a in enumerate(anchors):
        assert f.observe(name, a, source_step=i, current_step=i + 5)


def test_cold_start_is_noop(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0)
    out = f.apply("w", G)
    assert torch.equal(out, G)
    _warm(f, anchors, name="other")
    assert torch.equal(f.apply("w", G), G)  # warm for another name only
    assert not torch.equal(f.apply("other", G), G)


def test_alpha_one_returns_g(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=1.0)
    _warm(f, anchors)
    torch.testing.assert_close(f.apply("w", G), G, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(12, 7), (5, 9)])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_matches_explicit_projection(grads, alpha, shape):
    g = torch.Generator().manual_seed(1)
    anchors = [1e-3 * torch.randn(shape, generator=g) for _ in range(4)]
    G = 1e-3 * torch.randn(shape, generator=g)
    f = SpectralFilter(alpha=alpha, tau=1e-3, beta=0.9)
    _warm(f, anchors)
    want = _reference(anchors, G, alpha, 1e-3, 0.9)
    torch.testing.assert_close(f.apply("w", G), want, rtol=1e-4, atol=1e-9)
    # sanity: the filter did something (d is well below 1 at this scale)
    assert not torch.allclose(want, G, rtol=1e-2)


def test_rank_and_relative_tau(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0, tau=0.1, beta=0.95, rank=2, tau_relative=True)
    _warm(f, anchors)
    want = _reference(anchors, G, 0.0, 0.1, 0.95, rank=2, relative=True)
    torch.testing.assert_close(f.apply("w", G), want, rtol=1e-4, atol=1e-10)
    full = _reference(anchors, G, 0.0, 0.1, 0.95, relative=True)
    assert not torch.allclose(want, full, rtol=1e-3)


def test_zero_init_ema_is_the_literal_formula(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0, beta=0.95, ema_init="zero")
    _warm(f, anchors)
    zero_start = [torch.zeros_like(anchors[0])] + anchors  # M0 = 0, then the EMA over every packet
    torch.testing.assert_close(
        f.apply("w", G), _reference(zero_start, G, 0.0, 1e-3, 0.95), rtol=1e-4, atol=1e-10
    )


def test_stale_packets_are_dropped(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0, max_staleness=30)
    assert not f.observe("w", anchors[0], source_step=10, current_step=41)
    assert not f.is_warm("w") and torch.equal(f.apply("w", G), G)
    assert f.observe("w", anchors[0], source_step=10, current_step=40)  # exactly 30: kept
    before = f.apply("w", G)
    assert not f.observe("w", anchors[1] * 1e3, source_step=0, current_step=100)
    torch.testing.assert_close(f.apply("w", G), before, rtol=0, atol=0)
    assert f.state_dict()["w"]["n_obs"] == 1


def test_non_finite_packets_are_dropped(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0)
    _warm(f, anchors[:1])
    before = f.apply("w", G)
    bad = anchors[1].clone()
    bad[0, 0] = float("nan")
    assert not f.observe("w", bad, 1, 1)
    assert not f.observe("w", torch.randn(3, 3), 1, 1)  # wrong shape for this name
    torch.testing.assert_close(f.apply("w", G), before, rtol=0, atol=0)


def test_non_finite_m_falls_back_to_g(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0)
    _warm(f, anchors)
    state = f.state_dict()
    state["w"]["M"][2, 3] = float("inf")
    g = SpectralFilter(alpha=0.0)
    g.load_state_dict(state)
    assert not g.is_warm("w")
    assert torch.equal(g.apply("w", G), G)
    # the next good packet restarts the EMA from itself
    assert g.observe("w", anchors[0], 0, 0)
    torch.testing.assert_close(
        g.apply("w", G), _reference(anchors[:1], G, 0.0, 1e-3, 0.95), rtol=1e-4, atol=1e-10
    )


def test_svd_failure_falls_back_to_g(grads, monkeypatch):
    anchors, G = grads
    f = SpectralFilter(alpha=0.0)

    def boom(*a, **k):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", boom)
    assert f.observe("w", anchors[0], 0, 0)  # packet is folded into M, but no usable SVD
    assert not f.is_warm("w")
    assert torch.equal(f.apply("w", G), G)


def test_state_dict_round_trip(grads):
    anchors, G = grads
    f = SpectralFilter(alpha=0.2, beta=0.9)
    _warm(f, anchors, "a")
    _warm(f, anchors[:2], "b")
    state = f.state_dict()
    assert set(state) == {"a", "b"} and state["a"]["n_obs"] == 3 and state["a"]["last_source_step"] == 2
    g = SpectralFilter(alpha=0.2, beta=0.9)
    g.load_state_dict(state)
    for name in ("a", "b"):
        torch.testing.assert_close(g.apply(name, G), f.apply(name, G), rtol=1e-5, atol=1e-10)
    # continuing after the load equals continuing without it
    f.observe("a", anchors[0], 3, 3)
    g.observe("a", anchors[0], 3, 3)
    torch.testing.assert_close(g.apply("a", G), f.apply("a", G), rtol=1e-5, atol=1e-10)


def test_is_target_matrix():
    w = torch.zeros(4, 4)
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "layers.3.self_attn.k_proj.weight",
        "layers.3.self_attn.v_proj.weight",
        "layers.3.self_attn.o_proj.weight",
        "layers.3.mlp.gate_proj.weight",
        "layers.3.mlp.up_proj.weight",
        "layers.3.mlp.down_proj.weight",
    ]:
        assert is_target_matrix(name, w), name
    for name, p in [
        ("layers.3.self_attn.q_proj.bias", torch.zeros(4)),
        ("layers.3.input_layernorm.weight", torch.zeros(4)),
        ("model.norm.weight", torch.zeros(4)),
        ("model.embed_tokens.weight", w),
        ("lm_head.weight", w),
        ("layers.3.self_attn.q_proj.weight", torch.zeros(4)),  # not 2-D
    ]:
        assert not is_target_matrix(name, p), name


def test_filter_gradients_in_place(grads):
    anchors, _ = grads

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(7, 12)  # weight (12, 7)
            self.norm = nn.LayerNorm(12, bias=False)

    torch.manual_seed(0)  # the module's init and the gradients: the same case every run
    m = Attn()
    m.q_proj.weight.grad = torch.randn(12, 7)
    m.q_proj.bias.grad = torch.randn(12)
    m.norm.weight.grad = torch.randn(12)
    before = {n: p.grad.clone() for n, p in m.named_parameters()}
    f = SpectralFilter(alpha=0.3)
    assert filter_gradients(f, m.named_parameters()) == 0  # cold: nothing changes
    assert all(torch.equal(p.grad, before[n]) for n, p in m.named_parameters())
    _warm(f, anchors, "q_proj.weight")
    assert filter_gradients(f, m.named_parameters()) == 1
    want = _reference(anchors, before["q_proj.weight"], 0.3, 1e-3, 0.95)
    # fp32 SVD rounding: 1e-7 absolute on entries of ~1e-3 (an entry near zero failed rtol alone)
    torch.testing.assert_close(m.q_proj.weight.grad, want, rtol=1e-4, atol=1e-6)
    assert torch.equal(m.q_proj.bias.grad, before["q_proj.bias"])
    assert torch.equal(m.norm.weight.grad, before["norm.weight"])
