"""SCAPE (compression/scape.py): AdamS, first-moment masks, sparse sync, bytes, replicas."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from compression.scape import (
    AdamS,
    ScapeReplicaSim,
    next_mask,
    partitioned_mask,
    slice_quota,
    sparse_sync,
    step_bytes,
)

B1, B2, EPS = 0.9, 0.95, 1e-8


def _problem(world: int, n: int, seed: int = 0):
    """Per-replica quadratic losses 0.5·||A_r θ − b_r||², so gradients depend on θ."""
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(n, n, generator=g, dtype=torch.float64) / n**0.5 for _ in range(world)]
    vecs = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(world)]
    theta0 = torch.randn(n, generator=g, dtype=torch.float64)

    def grad(r: int, theta: torch.Tensor) -> torch.Tensor:
        return mats[r].T @ (mats[r] @ theta - vecs[r])

    return theta0, grad


def test_adams_matches_explicit_reference():
    lr, wd = 0.05, 0.1
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4)]
    p = torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))
    ref_p = [float(x) for x in p.detach()]
    opt = AdamS([p], lr=lr, betas=(B1, B2), eps=EPS, weight_decay=wd)
    m = [0.0] * 5
    for gt in grads:
        p.grad = gt.clone()
        opt.step()
        for i in range(5):
            gi = float(gt[i])
            v = B2 * m[i] ** 2 + (1 - B2) * gi**2  # previous m, before its update
            m[i] = B1 * m[i] + (1 - B1) * gi
            ref_p[i] = ref_p[i] * (1 - lr * wd) - lr * m[i] / (math.sqrt(v) + EPS)
    assert torch.allclose(p.detach(), torch.tensor(ref_p, dtype=torch.float64), atol=1e-12, rtol=0)
    assert set(opt.state[p]) == {"m"}  # no second-moment state


def test_density_one_equals_dense_adams_on_mean_gradient():
    world, n, lr = 3, 40, 0.02
    theta0, grad = _problem(world, n)
    sim = ScapeReplicaSim(theta0, world=world, density=1.0, lr=lr, weight_decay=0.01)
    ref = torch.nn.Parameter(theta0.clone())
    opt = AdamS([ref], lr=lr, weight_decay=0.01)
    for _ in range(6):
        rec = sim.step([grad(r, sim.params[r]) for r in range(world)])
        ref.grad = torch.stack([grad(r, ref.detach()) for r in range(world)]).mean(0)
        opt.step()
        assert rec["mask"] is None and rec["total"] == rec["dense"] == n * 2
    assert sim.replica_distance() == 0.0
    for r in range(world):
        assert (sim.params[r] - ref.detach()).abs().max() < 1e-6
    assert not torch.allclose(sim.params[0], theta0)  # it did move


def _reference_mask(m, errs, density, world):
    """Owner r of {i : i mod world = r} keeps its top round(density·|slice|) of |β1 m + (1−β1) e_r|."""
    keep = []
    for r in range(world):
        idx = list(range(r, m[r].numel(), world))
        score = {i: abs(B1 * float(m[r][i]) + (1 - B1) * float(errs[r][i])) for i in idx}
        quota = min(len(idx), max(1, round(density * len(idx))))
        keep += sorted(idx, key=lambda i: (-score[i], i))[:quota]
    return sorted(keep)


def test_mask_used_at_step_t_was_computed_after_step_t_minus_1():
    world, n, density = 2, 60, 0.2
    theta0, grad = _problem(world, n, seed=3)
    sim = ScapeReplicaSim(theta0, world=world, density=density, lr=0.01)
    assert sim.pending_mask is None  # step 0: no statistics yet, dense
    rec0 = sim.step([grad(r, sim.params[r]) for r in range(world)])
    assert rec0["mask"] is None
    for t in range(1, 4):
        expected = _reference_mask(sim.m, sim.err, density, world)  # from the moments after step t−1
        known = sim.pending_mask.clone()
        assert known.tolist() == expected and sim.pending_mask_from == t - 1
        # the step-t gradients cannot change the mask step t uses
        other = copy.deepcopy(sim)
        rec = sim.step([grad(r, sim.params[r]) for r in range(world)])
        rec_other = other.step([torch.randn(n, dtype=torch.float64) for _ in range(world)])
        assert torch.equal(rec["mask"], known) and torch.equal(rec_other["mask"], known)
        assert rec["mask_from"] == t - 1 and rec["step"] == t
        assert len(known) == sum(slice_quota(len(range(r, n, world)), density) for r in range(world))


def test_sparse_steps_keep_replicas_identical_and_unmasked_untouched():
    world, n, density = 3, 90, 0.1
    theta0, grad = _problem(world, n, seed=5)
    sim = ScapeReplicaSim(theta0, world=world, density=density, lr=0.01)
    sim.step([grad(r, sim.params[r]) for r in range(world)])
    for _ in range(4):
        before_p, before_m = sim.params[0].clone(), sim.m[0].clone()
        rec = sim.step([grad(r, sim.params[r]) for r in range(world)])
        outside = torch.ones(n, dtype=torch.bool)
        outside[rec["mask"]] = False
        assert torch.equal(sim.params[0][outside], before_p[outside])
        assert torch.equal(sim.m[0][outside], before_m[outside])
        assert not torch.equal(sim.params[0][~outside], before_p[~outside])
    assert sim.replica_distance() == 0.0


def test_local_policy_moves_every_coordinate_and_drifts():
    world, n = 2, 50
    theta0, grad = _problem(world, n, seed=6)
    sim = ScapeReplicaSim(theta0, world=world, density=0.1, lr=0.01, unmasked="local")
    sim.step([grad(r, sim.params[r]) for r in range(world)])  # dense step 0
    assert sim.replica_distance() == 0.0
    before = sim.params[0].clone()
    rec = sim.step([grad(r, sim.params[r]) for r in range(world)])
    assert bool((sim.params[0] != before).all())  # unmasked coordinates moved too
    assert sim.replica_distance() > 0.0  # with their own gradients: replicas differ there
    same = (sim.params[0] - sim.params[1]).abs()
    assert float(same[rec["mask"]].max()) == 0.0  # equal θ and m before, same synced update on M_t


def test_sparse_sync_error_feedback_conserves_gradient_mass():
    world, n = 3, 20
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=g) for _ in range(world)]
    errs = [torch.randn(n, generator=g) for _ in range(world)]
    mask = torch.tensor([1, 4, 7, 19])
    values, new = sparse_sync(grads, mask, errs)
    total = sum(a + b for a, b in zip(grads, errs))
    sent = torch.zeros(n)
    sent[mask] = values * world
    assert torch.allclose(sent + sum(new), total, atol=1e-5)
    assert torch.allclose(values, torch.stack([a[mask] + b[mask] for a, b in zip(grads, errs)]).mean(0))
    assert all(float(e[mask].abs().max()) == 0.0 for e in new)
    dropped, none = sparse_sync(grads, mask)
    assert none is None and torch.allclose(dropped, torch.stack([a[mask] for a in grads]).mean(0))


def test_bytes_scale_with_density():
    n, world = 100_000, 4
    b10, b1 = step_bytes(n, 0.1, world), step_bytes(n, 0.01, world)
    assert b10["values"] == 2 * 10_000 and b1["values"] == 2 * 1_000
    assert b10["dense"] == b1["dense"] == 2 * n
    assert b10["exchange"] == math.ceil(25_000 / 8)  # a bitmap of the own slice is smaller than indices
    assert b1["exchange"] == 250 * 4  # 250 indices of 4 bytes
    assert step_bytes(n, 0.1, 1)["exchange"] == 0.0  # one replica publishes to nobody
    theta0, grad = _problem(2, 200, seed=4)
    totals = {}
    for d in (0.1, 0.01):
        sim = ScapeReplicaSim(theta0, world=2, density=d, lr=0.01)
        recs = [sim.step([grad(r, sim.params[r]) for r in range(2)]) for _ in range(3)]
        totals[d] = sum(r["values"] for r in recs[1:])  # after the dense step 0
        assert recs[0]["values"] == recs[0]["dense"]
    assert totals[0.1] == 10 * totals[0.01]


def test_partitioned_mask_equals_global_topk_when_balanced():
    world, per, density = 4, 25, 0.2
    g = torch.Generator().manual_seed(7)
    base = torch.randn(per, generator=g).abs() + 0.01
    scores = torch.empty(world * per)
    for r in range(world):  # every strided slice holds the same multiset of scores (+ tiny offsets)
        scores[r::world] = base[torch.randperm(per, generator=g)] + 1e-6 * r
    k = world * slice_quota(per, density)
    global_top = sorted(torch.topk(scores, k).indices.tolist())
    assert partitioned_mask([scores] * world, density).tolist() == global_top
    assert next_mask(scores, density).tolist() == sorted(torch.topk(scores, 20).indices.tolist())

    skewed = torch.arange(world * per, dtype=torch.float32)
    skewed[0::world] += 1000.0  # all large scores in rank 0's slice
    got = partitioned_mask([skewed] * world, density).tolist()
    assert got != sorted(torch.topk(skewed, k).indices.tolist())  # quotas, not the global top-k
    zeros, errs = [torch.zeros_like(skewed)] * world, [skewed / (1 - B1)] * world  # score = skewed
    assert got == _reference_mask(zeros, errs, density, world)


def test_segment_quotas_give_every_tensor_its_share():
    sizes, density, world = [40, 7, 53], 0.2, 3
    n = sum(sizes)
    scores = torch.zeros(n)
    scores[:40] = 100.0 + torch.arange(40.0)  # the first tensor dominates any global ranking
    scores[40:] = torch.rand(n - 40, generator=torch.Generator().manual_seed(3))
    glob = partitioned_mask([scores] * world, density)
    per = partitioned_mask([scores] * world, density, segments=sizes)
    assert int((glob < 40).sum()) == len(glob)  # global: all from the first tensor
    bounds = [0, 40, 47, 100]
    for i in range(3):  # per tensor: each strided slice of each tensor keeps its own quota
        inside = [j for j in per.tolist() if bounds[i] <= j < bounds[i + 1]]
        expect = 0
        for r in range(world):
            owned = [j for j in range(bounds[i], bounds[i + 1]) if j % world == r]
            top = sorted(owned, key=lambda j: (-float(scores[j]), j))[: slice_quota(len(owned), density)]
            expect += len(top)
            assert set(top) <= set(inside)
        assert len(inside) == expect
    assert torch.equal(partitioned_mask([scores] * world, density, segments=[n]), glob)
    assert step_bytes(n, density, world, segments=sizes)["nnz"] == len(per)
    with pytest.raises(ValueError):
        next_mask(scores, density, segments=[10, 10])


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        slice_quota(10, 0.0)
    with pytest.raises(ValueError):
        ScapeReplicaSim(torch.zeros(4), world=2, density=0.1, unmasked="keep")
    with pytest.raises(ValueError):
        next_mask(torch.zeros(4), 0.5, (2, 2))
