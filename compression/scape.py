"""SCAPE: per-step sparse data-parallel sync on a first-moment mask, with AdamS (DESIGN.md 4.5).

AdamS (Zhang, Wang, Chen 2025, "Momentum itself can be a normalizer") keeps no second-moment
state: with g the gradient and m the first moment,

    v = β2 · m_prev² + (1 − β2) · g²
    m = β1 · m_prev + (1 − β1) · g
    θ ← θ · (1 − η λ) − η · m / (√v + ε)          (decoupled weight decay λ, no bias correction)

SCAPE step t among N replicas of a stage (all pure functions here; ``ScapeReplicaSim`` runs
N replicas in one process):

1. The mask M_t (a set of coordinates of the flat parameter vector) was fixed at the end of
   step t−1 (``next_mask``), so every replica knows it before step t starts and the sync of
   step t can overlap its backward pass. Step 0 has no statistics yet: it syncs densely.
2. Each replica computes its gradient g_r and adds its error buffer e_r (below). Only the
   values on M_t travel (``sparse_sync``): every replica ends with the same single sparse
   buffer, the mean over replicas of (g_r + e_r) on M_t. The indices never travel, since
   they are known to all.
3. AdamS updates m and θ on M_t from that one buffer, so both the first moment and the
   second-moment quantity v come from the same values (``adams_masked_step_``).
4. Mask generation for step t+1 is partitioned: replica r owns the strided slice
   {i : i mod N = r} of the flat vector, scores it, and keeps the top ``density`` fraction
   of its slice; it publishes those indices (or a bitmap of its slice, whichever is
   smaller) and the union over replicas is M_{t+1}. The score is the first moment the
   coordinate would have if its pending error were synced now, |β1·m + (1 − β1)·e_r|
   (``mask_scores``). Strided slices give every replica a share of every tensor, so the
   per-slice quotas rarely distort the global ranking (see ``next_mask``). With
   ``segments`` (one per parameter tensor) the quota is per tensor as well: first moments
   differ by orders of magnitude between tensors, and one global ranking starves whole
   tensors (measured in ``bench/dp/subspace_scape.py``).

Unmasked coordinates (not public in the paper; our choice): **error feedback**. A replica's
gradient on a coordinate outside M_t is added to its local error buffer e_r instead of
being applied, and θ and m are left unchanged there. When the coordinate is next in a mask
the accumulated mass is synced and applied. Why:

* replicas stay bit-identical (θ and m only ever change by synced values), so no
  parameter drift, no averaging rounds, and a joiner can copy any replica;
* no gradient mass is lost: sparsified SGD with error feedback converges like its dense
  counterpart (Stich et al. 2018; Karimireddy et al. 2019), whereas dropping the rest is
  a biased gradient;
* applying the *local* gradient instead would let replicas drift on 90-99% of the
  coordinates, and an AdamS step on a coordinate with g = 0 is not a no-op: its ratio
  m/√v = β1/√β2 stays near 1 whatever m's size, so a stale direction would keep moving
  at full learning rate. Leaving θ and m untouched avoids that;
* putting e_r in the mask score bounds staleness: a coordinate whose pending gradient
  grows is eventually chosen, instead of starving because its old |m| was small.

Two other policies are kept for comparison (and measured in ``bench/dp/subspace_scape.py``):
``unmasked="drop"`` discards the rest (no error buffer; replicas stay identical), and
``unmasked="local"`` applies each replica's own gradient to the coordinates outside the
mask (a full local AdamS step with the synced mean on the mask): every coordinate moves
every step, but replicas drift apart on the unmasked coordinates and nothing pulls them
back (``replica_distance`` measures it), and each replica's m, hence its mask scores,
are its own.

Measured (``bench/results/subspace_scape.md``, a 0.85M-parameter model, 2 replicas, 200
steps, one seed): error feedback with per-tensor quotas ended at 2.89 nats/byte (d = 0.1)
and 2.94 (d = 0.01) against 2.44 for dense per-step DP; dropping did no worse than error
feedback there; "local" matched dense DP but its replicas drifted apart. Error feedback
stays the default for its guarantees (identical replicas, no lost mass), not because it
won that short run.

Bytes (per replica per step, ``step_bytes``): the masked values, nnz · value_bytes (the
payload each replica contributes to the all-reduce; a ring all-reduce moves 2(N−1)/N of a
payload per replica for dense and sparse alike, so the ratio to dense is that of the
payloads), plus the mask-partition exchange: each replica publishes its own slice's
choice, min(k_r · index_bytes, ⌈|slice_r| / 8⌉) bytes, once per step. Dense per-step DP
sends numel · value_bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

UNMASKED_POLICIES = ("error_feedback", "drop", "local")


# --------------------------------------------------------------------------------------------
# AdamS
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def adams_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    """One AdamS step on every coordinate of ``p``, in place (``m`` is the first moment)."""
    b1, b2 = betas
    v = m.square().mul_(b2).addcmul_(g, g, value=1.0 - b2)  # uses m_prev
    m.mul_(b1).add_(g, alpha=1.0 - b1)
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    p.addcdiv_(m, v.sqrt_().add_(eps), value=-lr)


@torch.no_grad()
def adams_masked_step_(
    p: torch.Tensor,
    m: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> None:
    """AdamS on the coordinates ``mask`` of flat ``p``/``m`` with gradient ``values`` (nnz,).

    Coordinates outside the mask keep their θ and m (weight decay, being decoupled and the
    same on every replica, applies to all). ``mask=None`` means every coordinate.
    """
    if mask is None:
        adams_step_(p, values, m, lr, betas, eps, weight_decay)
        return
    b1, b2 = betas
    m_prev = m[mask]
    v = m_prev.square().mul_(b2).addcmul_(values, values, value=1.0 - b2)
    m_new = m_prev.mul(b1).add_(values, alpha=1.0 - b1)
    m[mask] = m_new
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    p[mask] = p[mask] - lr * m_new / (v.sqrt_() + eps)


class AdamS(torch.optim.Optimizer):
    """AdamS: Adam's update with the momentum as its own normaliser (no second-moment state).

    State per parameter: ``m`` only (half of AdamW's optimizer memory). No bias correction;
    decoupled weight decay. The default β2 = 0.95 keeps the first step's ratio
    (1 − β1)/√(1 − β2) ≈ 0.45 below one.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                adams_step_(
                    p, p.grad, state["m"], group["lr"], group["betas"], group["eps"], group["weight_decay"]
                )
        return loss


# --------------------------------------------------------------------------------------------
# Masks, sync and bytes
# --------------------------------------------------------------------------------------------


def slice_quota(slice_len: int, density: float) -> int:
    """Coordinates a slice of ``slice_len`` keeps: round(density · len), at least 1, at most len."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must lie in (0, 1], got {density}")
    if slice_len <= 0:
        return 0
    return min(slice_len, max(1, round(density * slice_len)))


def _segments(numel: int, segments: Sequence[int] | None) -> list[int]:
    if segments is None:
        return [numel]
    segs = [int(x) for x in segments]
    if sum(segs) != numel or any(x < 0 for x in segs):
        raise ValueError(f"segments {segs} do not tile a vector of {numel}")
    return segs


def _owned(start: int, size: int, rank: int, world: int) -> range:
    """Global indices of segment [start, start + size) in rank's strided slice (i mod world = rank)."""
    return range(start + (rank - start) % world, start + size, world)


def next_mask(
    m_stats: torch.Tensor,
    density: float,
    partition: tuple[int, int] | None = None,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """Top-|stats| coordinates (sorted int64 indices into the flat vector).

    ``partition=None``: the global top ``slice_quota(numel, density)``. ``partition=(rank,
    world)``: only the strided slice {i : i mod world = rank}, keeping its own quota; the
    union over ranks (``partitioned_mask``) is the global mask. That union equals the global
    top-k exactly when the global top-k holds exactly k_r coordinates of every slice (e.g.
    when every slice has the same multiset of scores); in general it is the global top-k
    under per-slice quotas. Ties break towards the lower index.

    ``segments`` (sizes that tile the flat vector, e.g. one per parameter tensor): the quota
    applies per segment (and slice), so every tensor keeps ``density`` of its coordinates.
    Without it, one global ranking lets tensors with large first moments take the whole
    budget (measured: q/k projections and the post-attention norms got none).
    """
    flat = m_stats.detach().reshape(-1).abs()
    if partition is None:
        rank, world = 0, 1
    else:
        rank, world = partition
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
    picked, start = [], 0
    for size in _segments(flat.numel(), segments):
        owned = _owned(start, size, rank, world)
        start += size
        if len(owned) == 0:
            continue
        part = flat[owned.start : owned.stop : owned.step]
        k = slice_quota(part.numel(), density)
        if k == part.numel():
            local = torch.arange(part.numel(), device=flat.device)
        else:
            # stable ordering so equal scores pick the lower index on every replica
            local = torch.sort(part, descending=True, stable=True).indices[:k]
        picked.append(local * world + owned.start)
    if not picked:
        return torch.zeros(0, dtype=torch.long, device=flat.device)
    return torch.sort(torch.cat(picked)).values


def partitioned_mask(
    scores_per_rank: Sequence[torch.Tensor], density: float, segments: Sequence[int] | None = None
) -> torch.Tensor:
    """Union of every rank's ``next_mask`` on its own slice, rank r scoring with its own stats."""
    world = len(scores_per_rank)
    parts = [next_mask(s, density, (r, world), segments) for r, s in enumerate(scores_per_rank)]
    return torch.sort(torch.cat(parts)).values


def mask_scores(m: torch.Tensor, err: torch.Tensor | None, beta1: float) -> torch.Tensor:
    """|β1·m + (1 − β1)·e|: the first moment a coordinate would have if synced with its error."""
    if err is None:
        return m.abs()
    return (m * beta1 + err * (1.0 - beta1)).abs()


@torch.no_grad()
def sparse_sync(
    grads_per_replica: Sequence[torch.Tensor],
    mask: torch.Tensor | None,
    errors: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Average only the masked coordinates of the replicas' flat gradients.

    Returns ``(values, new_errors)``: ``values`` (nnz,) is the mean over replicas of
    (g_r + e_r)[mask], the one sparse buffer every replica receives (``mask=None``: all
    coordinates, the dense all-reduce). With ``errors`` (error feedback), replica r's new
    error buffer is g_r + e_r with the masked coordinates zeroed: what it did not send
    waits for a later mask. ``errors=None`` drops the unmasked gradient (``new_errors`` None).
    """
    if errors is not None and len(errors) != len(grads_per_replica):
        raise ValueError(f"{len(errors)} error buffers for {len(grads_per_replica)} replicas")
    acc = list(grads_per_replica) if errors is None else [g + e for g, e in zip(grads_per_replica, errors)]
    if mask is None:
        values = torch.stack(acc).mean(dim=0)
    else:
        values = torch.stack([a[mask] for a in acc]).mean(dim=0)
    if errors is None:
        return values, None
    new_errors = []
    for a in acc:  # fresh tensors (g + e), safe to edit in place
        if mask is None:
            a.zero_()
        else:
            a[mask] = 0.0
        new_errors.append(a)
    return values, new_errors


def step_bytes(
    numel: int,
    density: float | None,
    world: int,
    value_bytes: int = 2,
    index_bytes: int = 4,
    segments: Sequence[int] | None = None,
) -> dict[str, float]:
    """Bytes one replica sends in one SCAPE step (``density=None``: the dense step 0 / dense DP).

    ``values``: nnz · value_bytes, its payload in the masked all-reduce. ``exchange``: the average
    over replicas of what each publishes for its own slice, min(k_r · index_bytes,
    ⌈|slice_r|/8⌉) (indices or a bitmap), zero for one replica or a dense step. ``dense``:
    numel · value_bytes, the dense per-step DP payload, for the ratio. ``segments`` as in
    ``next_mask`` (quotas per segment).
    """
    dense = float(numel * value_bytes)
    if density is None or density >= 1.0 or world < 1:
        return {"values": dense, "exchange": 0.0, "total": dense, "dense": dense, "nnz": float(numel)}
    segs = _segments(numel, segments)
    nnz, mask_b = 0, 0.0
    for r in range(world):
        k_r = n_r = 0
        start = 0
        for size in segs:
            owned = len(_owned(start, size, r, world))
            start += size
            n_r += owned
            k_r += slice_quota(owned, density)
        nnz += k_r
        if world > 1:
            mask_b += min(k_r * index_bytes, math.ceil(n_r / 8))
    mask_b /= world
    values = float(nnz * value_bytes)
    return {"values": values, "exchange": mask_b, "total": values + mask_b, "dense": dense, "nnz": float(nnz)}


# --------------------------------------------------------------------------------------------
# N replicas in one process
# --------------------------------------------------------------------------------------------


class ScapeReplicaSim:
    """N SCAPE replicas of one flat parameter vector, simulated in-process.

    ``pending_mask`` is the mask the next ``step`` will use (None before step 0: dense), and
    ``pending_mask_from`` the step after which it was computed. ``step(grads)`` takes one
    flat gradient per replica (computed at that replica's current ``params[r]``) and
    returns that step's record: the mask it used, when that mask was computed, bytes.
    Every replica keeps its own θ, m and error buffer, so replicas staying identical is a
    property the tests check, not an assumption.
    """

    def __init__(
        self,
        params: torch.Tensor,
        world: int,
        density: float,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        unmasked: str = "error_feedback",
        value_bytes: int = 2,
        index_bytes: int = 4,
        segments: Sequence[int] | None = None,
    ):
        if world < 1:
            raise ValueError("world must be >= 1")
        if unmasked not in UNMASKED_POLICIES:
            raise ValueError(f"unmasked policy {unmasked!r} not in {UNMASKED_POLICIES}")
        slice_quota(1, density)  # validates density
        flat = params.detach().reshape(-1).clone()
        self.world, self.density, self.lr = world, float(density), lr
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.unmasked, self.value_bytes, self.index_bytes = unmasked, value_bytes, index_bytes
        self.segments = None if segments is None else _segments(flat.numel(), segments)
        self.params = [flat.clone() for _ in range(world)]
        self.m = [torch.zeros_like(flat) for _ in range(world)]
        self.err = [torch.zeros_like(flat) for _ in range(world)] if unmasked == "error_feedback" else None
        self.t = 0
        self.pending_mask: torch.Tensor | None = None
        self.pending_mask_from: int | None = None
        self.bytes_total = 0.0
        self.dense_bytes_total = 0.0

    @property
    def numel(self) -> int:
        return self.params[0].numel()

    def replica_distance(self) -> float:
        """Largest |θ_r − θ_0| over replicas and coordinates (0 while they stay identical)."""
        return max(float((p - self.params[0]).abs().max()) for p in self.params)

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float | None = None) -> dict:
        if len(grads) != self.world:
            raise ValueError(f"{len(grads)} gradients for {self.world} replicas")
        lr = self.lr if lr is None else lr
        grads = [g.detach().reshape(-1).to(self.params[0].dtype) for g in grads]
        mask, mask_from = self.pending_mask, self.pending_mask_from
        if self.density >= 1.0:
            mask = None  # density 1: every coordinate, every step
        values, new_err = sparse_sync(grads, mask, self.err)
        if self.err is not None:
            self.err = new_err
        for r in range(self.world):
            if self.unmasked == "local" and mask is not None:
                g = grads[r].clone()  # own gradient off the mask, the synced mean on it
                g[mask] = values
                adams_step_(self.params[r], g, self.m[r], lr, self.betas, self.eps, self.weight_decay)
            else:
                adams_masked_step_(
                    self.params[r], self.m[r], values, mask, lr, self.betas, self.eps, self.weight_decay
                )
        nbytes = step_bytes(
            self.numel,
            None if mask is None else self.density,
            self.world,
            self.value_bytes,
            self.index_bytes,
            self.segments,
        )
        self.bytes_total += nbytes["total"]
        self.dense_bytes_total += nbytes["dense"]
        record = {"step": self.t, "mask": mask, "mask_from": mask_from, **nbytes}
        # mask for the next step, from the first moments (and pending errors) after this one
        if self.density < 1.0:
            scores = [
                mask_scores(self.m[r], None if self.err is None else self.err[r], self.betas[0])
                for r in range(self.world)
            ]
            self.pending_mask = partitioned_mask(scores, self.density, self.segments)
            self.pending_mask_from = self.t
        self.t += 1
        return record
