"""PowerSGD: exact low-rank recovery, the explicit algebra, error feedback, seeds, bytes, pass-through."""

from __future__ import annotations

import pytest
import torch

from compression.powersgd import PowerSGD, bytes_for, compressible, simulate_round, wire_numbers

SEED = 1234


def _rank_r_family(m: int, n: int, r: int, peers: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Peers' deltas U A_i V^T sharing U, V: each has rank <= r and so does their mean."""
    u = torch.randn(m, r, generator=gen)
    v = torch.randn(n, r, generator=gen)
    return [u @ torch.randn(r, r, generator=gen) @ v.T for _ in range(peers)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("m,n,r,true_rank", [(96, 160, 8, 8), (120, 80, 8, 5), (64, 3 * 40, 4, 4)])
def test_exact_recovery_of_low_rank_mean(m: int, n: int, r: int, true_rank: int) -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = _rank_r_family(m, n, true_rank, peers=3, gen=gen)
    if n == 120:  # also a 3-D tensor, viewed as (m, 3*40)
        deltas = [d.reshape(m, 3, 40) for d in deltas]
    mean = torch.stack(deltas).mean(0)
    comps = [PowerSGD(r, SEED, min_compress_numel=1) for _ in deltas]
    outs = simulate_round(comps, [{"w": d} for d in deltas])
    for out in outs:
        assert out["w"].shape == mean.shape
        assert _rel(out["w"], mean) < 1e-5
    # d_hat is the same on every peer, and each peer's error buffer is its own M_i - d_hat.
    assert torch.equal(outs[0]["w"], outs[1]["w"])
    for c, d in zip(comps, deltas, strict=True):
        torch.testing.assert_close(c.states["w"].error, (d - outs[0]["w"]).reshape(m, -1))


def test_matches_explicit_power_iteration_over_two_rounds() -> None:
    gen = torch.Generator().manual_seed(1)
    m, n, r = 50, 70, 6
    comps = [PowerSGD(r, SEED, min_compress_numel=1) for _ in range(2)]
    errors = [torch.zeros(m, n), torch.zeros(m, n)]
    q = None
    for _round in range(2):
        deltas = [torch.randn(m, n, generator=gen) for _ in range(2)]
        p_locals = [c.phase1("w", d) for c, d in zip(comps, deltas, strict=True)]
        if q is None:
            q = comps[0].states["w"].q.clone()  # the shared initial Q
            assert torch.equal(q, comps[1].states["w"].q)
        # Reference, written out: M_i = delta_i + e_i; P = mean(M_i Q); P_hat = qr(P).Q;
        # Q' = mean(M_i^T P_hat); d_hat = P_hat Q'^T; e_i = M_i - d_hat.
        ms = [d + e for d, e in zip(deltas, errors, strict=True)]
        for p_loc, mi in zip(p_locals, ms, strict=True):
            torch.testing.assert_close(p_loc, mi @ q)
        p_ref = (ms[0] @ q + ms[1] @ q) / 2
        p_hat_ref, _ = torch.linalg.qr(p_ref)
        q_ref = (ms[0].T @ p_hat_ref + ms[1].T @ p_hat_ref) / 2
        d_hat_ref = p_hat_ref @ q_ref.T

        p_avg = (p_locals[0] + p_locals[1]) / 2
        q_locals = [c.phase2("w", p_avg) for c in comps]
        for q_loc, mi in zip(q_locals, ms, strict=True):
            torch.testing.assert_close(q_loc, mi.T @ p_hat_ref)
        q_avg = (q_locals[0] + q_locals[1]) / 2
        outs = [c.finish("w", q_avg) for c in comps]
        for out in outs:
            torch.testing.assert_close(out, d_hat_ref)
        errors = [mi - d_hat_ref for mi in ms]
        for c, e in zip(comps, errors, strict=True):
            torch.testing.assert_close(c.states["w"].error, e)
            torch.testing.assert_close(c.states["w"].q, q_ref)  # warm start for the next round
        q = q_ref


def test_error_feedback_tracks_the_sum_of_true_updates() -> None:
    gen = torch.Generator().manual_seed(2)
    m, n, r = 64, 96, 4
    delta = torch.randn(m, n, generator=gen)  # full rank, far from rank 4
    with_ef = PowerSGD(r, SEED, min_compress_numel=1)
    applied = torch.zeros(m, n)
    applied_no_ef = torch.zeros(m, n)
    gaps, err_norm = {}, {}
    for t in range(1, 81):
        applied += simulate_round([with_ef], [{"w": delta}])[0]["w"]
        # Without error feedback: a fresh compressor each round sees only delta.
        applied_no_ef += simulate_round([PowerSGD(r, SEED, min_compress_numel=1)], [{"w": delta}])[0]["w"]
        if t in (10, 40, 80):
            gaps[t] = (_rel(applied, t * delta), _rel(applied_no_ef, t * delta))
            err_norm[t] = float(with_ef.states["w"].error.norm())
    # sum of d_hat = t * delta - e_t, so the gap is ||e_t|| / (t ||delta||). The residual
    # saturates (~10 ||delta|| here: rank 4 needs ~min(m,n)/r rounds to cover the spectrum),
    # so with EF the relative gap falls like 1/t; without EF it stays near 1.
    assert gaps[80][0] < gaps[40][0] < gaps[10][0]
    assert gaps[80][0] < 0.15
    assert gaps[80][1] > 0.5
    assert err_norm[80] < 1.1 * err_norm[40]  # bounded, not growing
    assert err_norm[80] < 15 * float(delta.norm())


def test_q_init_depends_only_on_seed_and_name() -> None:
    d = torch.randn(40, 60)
    a, b, c = PowerSGD(4, 7, min_compress_numel=1), PowerSGD(4, 7, min_compress_numel=1), PowerSGD(4, 8, 1)
    for comp in (a, b, c):
        comp.phase1("layer.0.w", d)
        comp.phase1("layer.1.w", d)
    assert torch.equal(a.states["layer.0.w"].q, b.states["layer.0.w"].q)
    assert not torch.equal(a.states["layer.0.w"].q, c.states["layer.0.w"].q)
    assert not torch.equal(a.states["layer.0.w"].q, a.states["layer.1.w"].q)
    # reset_q with a common salt re-synchronises, and changes Q.
    before = a.states["layer.0.w"].q.clone()
    a.reset_q(salt=3)
    b.reset_q(salt=3)
    assert torch.equal(a.states["layer.0.w"].q, b.states["layer.0.w"].q)
    assert not torch.equal(a.states["layer.0.w"].q, before)


def test_does_not_touch_global_rng() -> None:
    torch.manual_seed(99)
    state = torch.get_rng_state()
    comps = [PowerSGD(4, SEED, min_compress_numel=1) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    simulate_round(comps, [{"w": torch.randn(30, 50, generator=gen), "b": torch.ones(5)} for _ in comps])
    comps[0].reset_q(1)
    assert torch.equal(torch.get_rng_state(), state)


def test_byte_accounting() -> None:
    assert wire_numbers((2048, 2048), 16) == 16 * (2048 + 2048)
    assert 2048 * 2048 / wire_numbers((2048, 2048), 16) == 64  # DESIGN.md's 64x
    assert wire_numbers((192, 576), 64) == 64 * (192 + 576)
    assert wire_numbers((192, 576), 96) == 192 * 576  # rank >= min(m, n) / 2: dense
    assert wire_numbers((576,), 16) == 576
    assert wire_numbers((8, 8), 2) == 64  # below the size threshold
    assert wire_numbers((8, 8), 2, min_compress_numel=1) == 2 * 16
    assert wire_numbers((4, 6, 10), 1, min_compress_numel=1) == 1 * (4 + 60)  # viewed as (4, 60)
    assert wire_numbers((576, 576), 0) == 576 * 576
    shapes = {"q": (576, 576), "k": (192, 576), "norm": (576,)}
    expected = 16 * (576 + 576) + 16 * (192 + 576) + 576
    assert bytes_for(shapes, 16) == 4 * expected
    assert bytes_for(list(shapes.items()), 16, dtype_bytes=2) == 2 * expected
    # The compressor's own decision agrees with the accounting.
    comp = PowerSGD(16, SEED)
    for shape in shapes.values():
        assert comp.is_compressed("x", shape) == compressible(shape, 16)
        assert comp.wire_numbers(shape) == wire_numbers(shape, 16)
    # And with the numbers actually produced in a round: P is m x r, Q is n x r.
    c = PowerSGD(16, SEED)
    p = c.phase1("q", torch.randn(576, 576))
    qv = c.phase2("q", p)
    assert p.numel() + qv.numel() == wire_numbers((576, 576), 16)


def test_rank_zero_and_small_tensors_pass_through_exactly() -> None:
    gen = torch.Generator().manual_seed(4)
    deltas = [
        {
            "w": torch.randn(200, 300, generator=gen),
            "b": torch.randn(300, generator=gen),
            "s": torch.randn(4, 4),
        }
        for _ in range(2)
    ]
    for rank in (0, 8):
        comps = [PowerSGD(rank, SEED) for _ in deltas]
        outs = simulate_round(comps, deltas)
        for name in ("b", "s") if rank else ("w", "b", "s"):
            assert not comps[0].is_compressed(name, deltas[0][name])
            ref = (deltas[0][name] + deltas[1][name]) / 2
            assert torch.equal(outs[0][name], ref) and torch.equal(outs[1][name], ref)
        assert comps[0].is_compressed("w", deltas[0]["w"]) == (rank > 0)
    one = PowerSGD(0, SEED)
    out = simulate_round([one], [deltas[0]])[0]
    for name, t in deltas[0].items():
        assert torch.equal(out[name], t)
    with pytest.raises(ValueError):
        one.phase1("w", deltas[0]["w"])


def test_abort_keeps_state_and_dtype_is_preserved() -> None:
    gen = torch.Generator().manual_seed(5)
    c = PowerSGD(4, SEED, min_compress_numel=1)
    simulate_round([c], [{"w": torch.randn(40, 50, generator=gen)}])
    e, q = c.states["w"].error.clone(), c.states["w"].q.clone()
    p = c.phase1("w", torch.randn(40, 50, generator=gen))
    c.phase2("w", p)
    c.abort()
    assert torch.equal(c.states["w"].error, e) and torch.equal(c.states["w"].q, q)
    with pytest.raises(RuntimeError):
        c.finish("w", q)
    out = simulate_round([c], [{"w": torch.randn(40, 50, generator=gen).to(torch.bfloat16)}])[0]["w"]
    assert out.dtype == torch.bfloat16 and out.shape == (40, 50)
    # A checkpoint restores the exact state.
    c2 = PowerSGD(4, 0)
    c2.load_state_dict(c.state_dict())
    assert torch.equal(c2.states["w"].q, c.states["w"].q) and c2.seed == SEED
