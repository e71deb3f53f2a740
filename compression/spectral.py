"""Anchor priors: the spectral filter for masked gradients (DESIGN.md 4.2).

Per target matrix W (m x n) the fast replica keeps M, an fp32 EMA of the dense gradients
anchor replicas send, and its thin SVD. Each inner step the masked gradient G becomes

    G' = alpha * G + (1 - alpha) * U diag(d) (U^T G V) diag(d) V^T,   d = s / (s + tau)

i.e. G is shrunk towards the leading subspaces of the anchors' (stale, dense) gradients.
The anchor gradient itself is never applied. Until a name's first packet arrives, and
whenever its state is unusable (SVD failed, M not finite), the filter returns G.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# Llama/Mistral/Qwen-style decoder projections (plus the fused forms some models use).
_TARGET_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"}
)


def is_target_matrix(name: str, param: torch.Tensor) -> bool:
    """2-D decoder matrices (q, k, v, o, gate, up, down); not norms, biases, embeddings, lm_head."""
    parts = name.split(".")
    return param.ndim == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _TARGET_MODULES


@dataclass
class _Entry:
    M: torch.Tensor  # fp32 EMA of anchor gradients
    n_obs: int
    last_source_step: int
    U: torch.Tensor | None = None  # None: state unusable, apply() falls back to G
    d: torch.Tensor | None = None
    Vh: torch.Tensor | None = None


class SpectralFilter:
    """EMA + thin-SVD filter per matrix name.

    ``tau_relative``: use tau * s_1 instead of an absolute tau (DESIGN.md: absolute tau
    depends on gradient scale; this is a labelled deviation from the paper).
    ``rank``: keep only the top-r singular triplets (None: all).
    ``ema_init``: "first" sets M = G_a on the first packet; "zero" is the literal EMA from
    M = 0, i.e. M = (1-beta) G_a. The default is "first": U and V are the same either way,
    but with an absolute tau a zero start shrinks s by (1-beta^n) for the first ~1/(1-beta)
    packets, so d (how much of the subspace is kept) would drift with the packet count
    rather than reflect the gradients.
    """

    def __init__(
        self,
        alpha: float = 0.3,
        tau: float = 1e-3,
        beta: float = 0.95,
        max_staleness: int = 30,
        tau_relative: bool = False,
        rank: int | None = None,
        ema_init: str = "first",
    ):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        if rank is not None and rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {rank}")
        if ema_init not in ("first", "zero"):
            raise ValueError(f"ema_init must be 'first' or 'zero', got {ema_init!r}")
        self.alpha = float(alpha)
        self.tau = float(tau)
        self.beta = float(beta)
        self.max_staleness = int(max_staleness)
        self.tau_relative = bool(tau_relative)
        self.rank = rank
        self.ema_init = ema_init
        self._state: dict[str, _Entry] = {}

    def describe(self) -> dict:
        return {
            "alpha": self.alpha,
            "tau": self.tau,
            "beta": self.beta,
            "max_staleness": self.max_staleness,
            "tau_relative": self.tau_relative,
            "rank": self.rank,
            "ema_init": self.ema_init,
        }

    def is_warm(self, name: str) -> bool:
        e = self._state.get(name)
        return e is not None and e.U is not None

    def names(self) -> list[str]:
        return sorted(self._state)

    def observe(self, name: str, grad_anchor: torch.Tensor, source_step: int, current_step: int) -> bool:
        """Fold one anchor gradient into M and refresh the SVD; False if the packet was dropped.

        Dropped: older than max_staleness steps, not 2-D, a shape other than the one this
        name already has, or not finite (one NaN would poison the EMA for good).
        """
        if current_step - source_step > self.max_staleness:
            return False
        if grad_anchor.ndim != 2:
            return False
        g = grad_anchor.detach().to(torch.float32)
        if not torch.isfinite(g).all():
            return False
        e = self._state.get(name)
        if e is not None and e.M.shape != g.shape:
            return False
        # A missing or unusable (non-finite) M restarts from this packet.
        if e is None or not torch.isfinite(e.M).all():
            M = g.clone() if self.ema_init == "first" else (1.0 - self.beta) * g
            e = _Entry(M=M, n_obs=0, last_source_step=source_step)
            self._state[name] = e
        else:
            e.M.mul_(self.beta).add_(g, alpha=1.0 - self.beta)
        e.n_obs += 1
        e.last_source_step = max(e.last_source_step, source_step)
        self._refresh(e)
        return True

    def _refresh(self, e: _Entry) -> None:
        e.U = e.d = e.Vh = None
        if not torch.isfinite(e.M).all():
            return
        try:
            U, s, Vh = torch.linalg.svd(e.M, full_matrices=False)
        except RuntimeError:  # e.g. LAPACK/cuSOLVER failed to converge: keep G unfiltered
            return
        if self.rank is not None:
            U, s, Vh = U[:, : self.rank], s[: self.rank], Vh[: self.rank]
        tau = self.tau * float(s[0]) if (self.tau_relative and s.numel()) else self.tau
        denom = s + tau
        # s = 0 with tau = 0 (or a zero M under relative tau): that direction carries nothing.
        d = torch.where(denom > 0, s / denom.clamp_min(torch.finfo(s.dtype).tiny), torch.zeros_like(s))
        if not (torch.isfinite(U).all() and torch.isfinite(Vh).all() and torch.isfinite(d).all()):
            return
        e.U, e.d, e.Vh = U.contiguous(), d, Vh.contiguous()

    def apply(self, name: str, G: torch.Tensor) -> torch.Tensor:
        """alpha*G + (1-alpha)*U diag(d) (U^T G V) diag(d) V^T; G itself while cold/unusable."""
        e = self._state.get(name)
        if e is None or e.U is None:
            return G
        if tuple(G.shape) != tuple(e.M.shape):
            raise ValueError(f"{name}: gradient shape {tuple(G.shape)} != filter state {tuple(e.M.shape)}")
        U, d, Vh = e.U.to(G.device), e.d.to(G.device), e.Vh.to(G.device)
        g = G.to(torch.float32)
        core = (U.T @ g @ Vh.T) * d[:, None] * d[None, :]  # r x r: cost O(m n r), no m x m projector
        out = self.alpha * g + (1.0 - self.alpha) * (U @ core @ Vh)
        return out.to(G.dtype)

    def state_dict(self) -> dict:
        """Per-name EMA state (tensors and ints); the SVD is recomputed on load."""
        return {
            name: {"M": e.M.clone(), "n_obs": e.n_obs, "last_source_step": e.last_source_step}
            for name, e in self._state.items()
        }

    def load_state_dict(self, state: dict) -> None:
        self._state = {}
        for name, s in state.items():
            e = _Entry(
                M=s["M"].detach().to(torch.float32).clone(),
                n_obs=int(s["n_obs"]),
                last_source_step=int(s["last_source_step"]),
            )
            self._refresh(e)
            self._state[name] = e


def filter_gradients(filt: SpectralFilter, named_params: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Replace .grad of every target matrix by its filtered version, in place.

    Returns how many gradients were filtered (warm names only), for logging.
    """
    n = 0
    for name, p in named_params:
        if p.grad is None or not is_target_matrix(name, p) or not filt.is_warm(name):
            continue
        p.grad.copy_(filt.apply(name, p.grad))
        n += 1
    return n
