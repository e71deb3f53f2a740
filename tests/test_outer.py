"""Outer optimizers: DiLoCo against torch.optim.SGD(nesterov=True), GASLoC's reduction, distances."""

from __future__ import annotations

import math

import pytest
import torch

from compression.outer import GaslocOuter, OuterNesterov, param_distance, pseudo_gradient

SHAPES = {"w": (12, 7), "b": (7,), "emb": (5, 3, 2)}
REPLICAS = 3
ROUNDS = 6


def _init(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _inner_drift(theta: dict[str, torch.Tensor], gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Stand-in for H inner steps: each replica ends somewhere near the start."""
    return [
        {k: v - 0.05 * torch.randn(v.shape, generator=gen) for k, v in theta.items()} for _ in range(REPLICAS)
    ]


def _reference_diloco(
    theta0: dict[str, torch.Tensor], locals_per_round: list
) -> list[dict[str, torch.Tensor]]:
    """DiLoCo written independently: torch's Nesterov SGD, .grad = mean(theta_global - theta_local)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in theta0.items()}
    opt = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for local_fn in locals_per_round:
        local = local_fn({k: p.detach().clone() for k, p in params.items()})
        for k, p in params.items():
            p.grad = torch.stack([p.detach() - loc[k] for loc in local]).mean(0)
        opt.step()
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history


def _round_fns(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [lambda theta, g=gen: _inner_drift(theta, g) for _ in range(ROUNDS)]


def test_outer_nesterov_equals_torch_sgd_nesterov() -> None:
    theta0 = _init(torch.Generator().manual_seed(0))
    ref = _reference_diloco(theta0, _round_fns(1))

    opt = OuterNesterov()  # defaults: lr 0.7, momentum 0.9
    gen = torch.Generator().manual_seed(1)
    theta = {k: v.clone() for k, v in theta0.items()}
    for t in range(ROUNDS):
        local = _inner_drift(theta, gen)
        deltas = [pseudo_gradient(theta, loc) for loc in local]
        avg = {k: torch.stack([d[k] for d in deltas]).mean(0) for k in theta}
        inputs, before = theta, {k: v.clone() for k, v in theta.items()}
        theta = opt.step(theta, avg)
        for k in theta:
            torch.testing.assert_close(theta[k], ref[t][k], rtol=1e-6, atol=1e-6)
            assert torch.equal(inputs[k], before[k])  # inputs untouched (fresh tensors returned)
        if t == 0:
            # The test can fail: plain SGD (no momentum) lands elsewhere after one step.
            plain = {k: before[k] - 0.7 * avg[k] for k in before}
            assert param_distance(theta, plain) > 1e-3
    assert opt.steps == ROUNDS


def test_outer_nesterov_state_roundtrip() -> None:
    gen = torch.Generator().manual_seed(2)
    theta = _init(gen)
    a = OuterNesterov(lr=0.5, momentum=0.8)
    delta = {k: torch.randn(v.shape, generator=gen) for k, v in theta.items()}
    a.step(theta, delta)
    b = OuterNesterov()
    b.load_state_dict(a.state_dict())
    out_a, out_b = a.step(theta, delta), b.step(theta, delta)
    for k in theta:
        assert torch.equal(out_a[k], out_b[k])


def test_gasloc_complete_graph_reduces_to_diloco() -> None:
    """One group with every replica, mix_weight 1, no compression, eta = lr, gamma = momentum."""
    theta0 = _init(torch.Generator().manual_seed(0))
    ref = _reference_diloco(theta0, _round_fns(1))

    peers = [GaslocOuter(eta=0.7, gamma=0.9) for _ in range(REPLICAS)]
    thetas = [{k: v.clone() for k, v in theta0.items()} for _ in range(REPLICAS)]
    gen = torch.Generator().manual_seed(1)
    for t in range(ROUNDS):
        # Same random drift as the reference: peers hold the same theta, so draw once from theta[0].
        local = _inner_drift(thetas[0], gen)
        ys = [p.make_y(th, loc) for p, th, loc in zip(peers, thetas, local, strict=True)]
        y_mean = {k: torch.stack([y[k] for y in ys]).mean(0) for k in ys[0]}
        thetas = [p.step(th, y, y_mean) for p, th, y in zip(peers, thetas, ys, strict=True)]
        for th in thetas:
            for k in th:
                torch.testing.assert_close(th[k], ref[t][k], rtol=1e-6, atol=1e-6)


def test_gasloc_partial_mixing_differs_and_first_step_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    theta = _init(gen)
    local = _inner_drift(theta, gen)
    full, half = GaslocOuter(), GaslocOuter(mix_weight=0.5)
    y = full.make_y(theta, local[0])
    ys = [full.make_y(theta, loc) for loc in local]
    y_mean = {k: torch.stack([yy[k] for yy in ys]).mean(0) for k in theta}
    out_full = full.step(theta, y, y_mean)
    out_half = half.step(theta, y, y_mean)
    for k in theta:
        # First step, written out: z = mean y; theta_1 = z + gamma (z - theta_0).
        torch.testing.assert_close(out_full[k], y_mean[k] + 0.9 * (y_mean[k] - theta[k]))
        z_half = 0.5 * y[k] + 0.5 * y_mean[k]
        torch.testing.assert_close(out_half[k], z_half + 0.9 * (z_half - theta[k]))
    assert param_distance(out_full, out_half) > 1e-4


def test_param_distance_basics() -> None:
    a = {"x": torch.tensor([3.0, 0.0]), "y": torch.tensor([[0.0, 4.0]])}
    b = {"x": torch.tensor([3.0, 0.0]), "y": torch.tensor([[0.0, 0.0]])}
    assert param_distance(a, a) == 0.0
    assert math.isclose(param_distance(a, b), 4.0 / 5.0)  # ||a-b|| = 4, max norm = 5
    assert math.isclose(param_distance(a, b), param_distance(b, a))
    zeros = {"x": torch.zeros(2), "y": torch.zeros(1, 2)}
    assert param_distance(zeros, zeros) == 0.0
    assert math.isclose(param_distance(a, {k: -v for k, v in a.items()}), 2.0)
    with pytest.raises(KeyError):
        param_distance(a, {"x": a["x"]})
