"""Rank-r PowerSGD with error feedback for DiLoCo pseudo-gradients (DESIGN.md 4.3).

One round over a group of peers is split into three local steps with two averaging phases
in between, so that the node can run the averaging over the network:

    P_i     = phase1(name, delta_i)     # M_i = delta_i + e_i ;  P_i = M_i Q
    P_avg   = mean_i P_i                # network phase 1: r*m numbers per matrix
    Q_i     = phase2(name, P_avg)       # P_hat = qr(P_avg).Q ;  Q_i = M_i^T P_hat
    Q_avg   = mean_i Q_i                # network phase 2: r*n numbers per matrix
    d_hat   = finish(name, Q_avg)       # d_hat = P_hat Q_avg^T ;  e_i <- M_i - d_hat ;  Q <- Q_avg

d_hat is identical on every member of the group (it depends only on averaged quantities) and
approximates mean_i(delta_i + e_i). Tensors for which ``is_compressed`` is False (vectors,
small matrices, rank too high to pay, rank 0) are not handled here: the caller averages them
densely, in phase 2 alongside the Q's.

Why QR and not hivemind's single-pass Gram-Schmidt: when the mean has rank below r, the extra
columns of P are rounding noise; Gram-Schmidt normalises that noise and loses orthogonality,
so P_hat P_hat^T is no longer a projection (relative errors of 0.4-0.8 measured at r=16 on a
rank-12 mean). Householder QR returns an orthonormal basis whatever the rank of P.

Warm start: Q is shared state. Every member of a group must hold the same Q when phase 1
starts, otherwise mean_i(M_i Q_i) is not M_bar Q for any Q. That holds when the group is
the same every round (all replicas of a stage in one group), since each round ends with the
same Q_avg everywhere. When groups change between rounds, call ``reset_q(salt)`` with the same
salt (e.g. the outer round number) on every member before phase 1, or ship Q to newcomers.

Pure tensor math: no I/O, no global RNG (Q comes from an explicit generator seeded from the
run seed and the parameter name).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_MIN_COMPRESS_NUMEL = 16384


def _as_matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The 2-D view PowerSGD uses: (shape[0], prod(rest)); None for 0-D/1-D tensors."""
    if len(shape) < 2:
        return None
    m = int(shape[0])
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return m, n


def compressible(
    shape: Sequence[int], rank: int, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL
) -> bool:
    """Whether a tensor of this shape goes through PowerSGD at this rank.

    Compression needs a matrix (>= 2-D, viewed as (shape[0], rest)), enough elements to be
    worth the extra round trip, and rank < min(m, n) / 2: then r(m+n) < mn strictly, and the
    reduced QR of the m x r matrix P is well defined.
    """
    if rank <= 0:
        return False
    mn = _as_matrix_shape(shape)
    if mn is None:
        return False
    m, n = mn
    return m * n >= min_compress_numel and 2 * rank < min(m, n)


def wire_numbers(
    shape: Sequence[int], rank: int, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL
) -> int:
    """Numbers one peer contributes to the averaging of one tensor per round: r(m+n) or numel."""
    if compressible(shape, rank, min_compress_numel):
        m, n = _as_matrix_shape(shape)  # type: ignore[misc]
        return rank * (m + n)
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel


def bytes_for(
    named_shapes: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]],
    rank: int,
    dtype_bytes: int = 4,
    min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
) -> int:
    """Payload bytes one peer contributes per round (P + Q + dense tensors), at ``dtype_bytes`` each.

    This is the size of the vectors being averaged; an all-reduce moves about 2(k-1)/k times
    that per peer in a group of k (reduce-scatter + all-gather).
    """
    items = named_shapes.items() if isinstance(named_shapes, Mapping) else named_shapes
    return dtype_bytes * sum(wire_numbers(shape, rank, min_compress_numel) for _, shape in items)


def _derive_seed(seed: int, name: str, salt: int) -> int:
    # Deterministic across processes and Python versions (unlike hash()); 64 bits so that
    # different parameters practically never share a Q.
    digest = hashlib.blake2b(f"{int(seed)}/{int(salt)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def initial_q(seed: int, name: str, n: int, rank: int, salt: int = 0) -> torch.Tensor:
    """The shared starting Q (n x rank, fp32, CPU): Gaussian from a generator seeded by (seed, salt, name).

    Gaussian rather than hivemind's uniform [0, 1): uniform columns are all nearly parallel to
    the all-ones vector, which makes M Q badly conditioned.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_derive_seed(seed, name, salt))
    return torch.randn((n, rank), generator=gen, dtype=torch.float32)


@dataclass
class PowerSGDState:
    """Per-matrix state: the local error buffer e (m x n) and the shared warm-started Q (n x r)."""

    error: torch.Tensor
    q: torch.Tensor


@dataclass
class _Pending:
    """What a round in progress keeps between phases (dropped on finish or abort)."""

    m: torch.Tensor  # M = delta + e, fp32, 2-D
    p_hat: torch.Tensor | None = None
    shape: torch.Size = field(default_factory=torch.Size)
    dtype: torch.dtype = torch.float32


class PowerSGD:
    """Stepwise PowerSGD compressor for one peer; one instance per peer, keyed by parameter name.

    All math runs in fp32 whatever the delta's dtype; ``finish`` returns the delta's dtype.
    """

    def __init__(
        self, rank: int, seed: int, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL, salt: int = 0
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.rank = int(rank)
        self.seed = int(seed)
        self.min_compress_numel = int(min_compress_numel)
        self.salt = int(salt)
        self.states: dict[str, PowerSGDState] = {}
        self._pending: dict[str, _Pending] = {}

    # ------------------------------------------------------------------ queries
    def is_compressed(self, name: str, tensor: torch.Tensor | Sequence[int]) -> bool:
        """True if ``tensor`` (or a shape) goes through phase1/phase2/finish; else average it densely."""
        shape = tensor.shape if isinstance(tensor, torch.Tensor) else tuple(tensor)
        return compressible(shape, self.rank, self.min_compress_numel)

    def wire_numbers(self, shape: Sequence[int]) -> int:
        return wire_numbers(shape, self.rank, self.min_compress_numel)

    def _state(self, name: str, m: int, n: int, device: torch.device) -> PowerSGDState:
        st = self.states.get(name)
        if st is None:
            st = PowerSGDState(
                error=torch.zeros((m, n), dtype=torch.float32, device=device),
                q=initial_q(self.seed, name, n, self.rank, self.salt).to(device),
            )
            self.states[name] = st
        elif st.error.shape != (m, n):
            raise ValueError(f"{name}: shape changed from {tuple(st.error.shape)} to {(m, n)}")
        return st

    # ------------------------------------------------------------------ the round
    def phase1(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """M = delta + e; return P_local = M Q (m x r, fp32) to be averaged across the group."""
        if not self.is_compressed(name, delta):
            raise ValueError(f"{name}: shape {tuple(delta.shape)} is not compressed at rank {self.rank}")
        m, n = _as_matrix_shape(delta.shape)  # type: ignore[misc]
        st = self._state(name, m, n, delta.device)
        # M is a fresh tensor: e stays untouched until finish(), so an aborted round loses nothing.
        mat = delta.detach().reshape(m, n).to(torch.float32) + st.error
        self._pending[name] = _Pending(m=mat, shape=delta.shape, dtype=delta.dtype)
        return mat @ st.q

    def phase2(self, name: str, p_avg: torch.Tensor) -> torch.Tensor:
        """Orthonormalise the group-averaged P (reduced QR); return Q_local = M^T P_hat (n x r)."""
        pend = self._pending_for(name, want_p_hat=False)
        p_avg = p_avg.to(device=pend.m.device, dtype=torch.float32)
        if p_avg.shape != (pend.m.shape[0], self.rank):
            raise ValueError(
                f"{name}: P_avg has shape {tuple(p_avg.shape)}, want {(pend.m.shape[0], self.rank)}"
            )
        p_hat, _ = torch.linalg.qr(p_avg, mode="reduced")
        pend.p_hat = p_hat
        return pend.m.T @ p_hat

    def finish(self, name: str, q_avg: torch.Tensor) -> torch.Tensor:
        """d_hat = P_hat Q_avg^T; e <- M - d_hat; keep Q_avg as next round's warm start."""
        pend = self._pending_for(name, want_p_hat=True)
        st = self.states[name]
        q_avg = q_avg.to(device=pend.m.device, dtype=torch.float32)
        if q_avg.shape != st.q.shape:
            raise ValueError(f"{name}: Q_avg has shape {tuple(q_avg.shape)}, want {tuple(st.q.shape)}")
        d_hat = pend.p_hat @ q_avg.T  # type: ignore[operator]
        st.error = pend.m - d_hat
        st.q = q_avg.clone()
        del self._pending[name]
        return d_hat.reshape(pend.shape).to(pend.dtype)

    def abort(self, name: str | None = None) -> None:
        """Forget a round in progress (one name or all): e and Q stay as they were before phase1."""
        if name is None:
            self._pending.clear()
        else:
            self._pending.pop(name, None)

    def reset_q(self, salt: int) -> None:
        """Re-draw every Q from (seed, salt, name): call with the same salt on all members of a new group."""
        self.salt = int(salt)
        for name, st in self.states.items():
            st.q = initial_q(self.seed, name, st.q.shape[0], self.rank, self.salt).to(st.q.device)

    def _pending_for(self, name: str, want_p_hat: bool) -> _Pending:
        pend = self._pending.get(name)
        if pend is None:
            raise RuntimeError(f"{name}: no round in progress (call phase1 first)")
        if want_p_hat and pend.p_hat is None:
            raise RuntimeError(f"{name}: phase2 has not run")
        return pend

    # ------------------------------------------------------------------ dict-level helpers
    def phase1_all(
        self, deltas: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Split a round's deltas: (P_local per compressed name, dense tensors to average as they are)."""
        ps, dense = {}, {}
        for name, delta in deltas.items():
            if self.is_compressed(name, delta):
                ps[name] = self.phase1(name, delta)
            else:
                dense[name] = delta
        return ps, dense

    def phase2_all(self, p_avgs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.phase2(name, p) for name, p in p_avgs.items()}

    def finish_all(
        self, q_avgs: Mapping[str, torch.Tensor], dense_avgs: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        out = {name: self.finish(name, q) for name, q in q_avgs.items()}
        out.update(dense_avgs or {})
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "rank": self.rank,
            "seed": self.seed,
            "salt": self.salt,
            "min_compress_numel": self.min_compress_numel,
            "error": {k: s.error.clone() for k, s in self.states.items()},
            "q": {k: s.q.clone() for k, s in self.states.items()},
        }

    def load_state_dict(self, sd: Mapping) -> None:
        if int(sd["rank"]) != self.rank:
            raise ValueError(f"state has rank {sd['rank']}, compressor has rank {self.rank}")
        self.seed = int(sd["seed"])
        self.salt = int(sd["salt"])
        self.min_compress_numel = int(sd["min_compress_numel"])
        self.states = {
            k: PowerSGDState(error=sd["error"][k].clone(), q=sd["q"][k].clone()) for k in sd["error"]
        }
        self._pending.clear()


def _mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(tensors)).mean(dim=0)


def simulate_round(
    compressors_per_peer: Sequence[PowerSGD], deltas_per_peer: Sequence[Mapping[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """One round with in-process averaging (one group holding every peer): d_hat per peer.

    Mirrors what the node does over the network; the d_hat's are identical across peers.
    """
    if len(compressors_per_peer) != len(deltas_per_peer) or not compressors_per_peer:
        raise ValueError("need one compressor per peer and at least one peer")
    names = list(deltas_per_peer[0])
    split = [c.phase1_all(d) for c, d in zip(compressors_per_peer, deltas_per_peer, strict=True)]
    comp_names = [n for n in names if n in split[0][0]]
    dense_names = [n for n in names if n in split[0][1]]
    p_avg = {n: _mean([ps[n] for ps, _ in split]) for n in comp_names}
    qs = [c.phase2_all(p_avg) for c in compressors_per_peer]
    q_avg = {n: _mean([q[n] for q in qs]) for n in comp_names}
    dense_avg = {n: _mean([dense[n] for _, dense in split]) for n in dense_names}
    # Each peer gets its own copy of the dense means, as it would off the network.
    outs = [c.finish_all(q_avg, {n: t.clone() for n, t in dense_avg.items()}) for c in compressors_per_peer]
    return [{n: out[n] for n in names} for out in outs]
