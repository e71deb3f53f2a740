"""Outer optimizers for data-parallel replicas (DESIGN.md 4.3), on flat dicts of named tensors.

DiLoCo: every H inner steps each replica forms the pseudo-gradient
    delta_i = theta_global - theta_local_i
the group averages it (possibly PowerSGD-compressed) and every replica applies the same
Nesterov SGD step to theta_global (``OuterNesterov``).

GASLoC (mix first, then momentum on the mixed sequence), per peer i:
    y_i,t     = theta_i,t + eta * g_i,t          g_i,t = theta_local_i - theta_i,t = -delta_i
    z_i,t     = sum_j W_ij y_j,t                 W = I - alpha * Laplacian of the group graph
    theta_i,t+1 = z_i,t + gamma * (z_i,t - z_i,t-1)
(``GaslocOuter``). For a group of k peers on a complete graph, Laplacian = k I - 1 1^T, so
z_i = (1 - alpha k) y_i + alpha k * mean_j y_j: the caller only needs the group mean of y,
and ``mix_weight`` = alpha k (1.0 = plain mean).

Exact reduction of GASLoC to DiLoCo (derivation). Take one group holding every replica,
mix_weight = 1, no compression, all replicas starting from the same theta_0, and
z_{-1} = theta_0. Then every peer holds the same theta_t, and with Delta_t = mean_i delta_i,
    z_t = theta_t - eta * Delta_t.
Let d_t = z_t - z_{t-1}. Since theta_t = z_{t-1} + gamma d_{t-1},
    d_t = gamma d_{t-1} - eta Delta_t,     theta_{t+1} = theta_t - eta Delta_t + gamma d_t.
Write d_t = -eta b_t: b_t = gamma b_{t-1} + Delta_t and
    theta_{t+1} = theta_t - eta (Delta_t + gamma b_t),
which is torch.optim.SGD(nesterov=True) with lr = eta, momentum = gamma, gradient Delta_t.
The initial conditions match too: z_{-1} = theta_0 gives d_0 = -eta Delta_0, i.e. b_0 = Delta_0,
which is exactly torch's first step (buffer = clone(grad)). So the mapping is eta = lr (0.7)
and gamma = momentum (0.9), with no other conditions; the reduction is exact in real
arithmetic and agrees to rounding (~1e-7 relative) in fp32. It stops being exact when groups
are partial or change (peers' theta drift apart: watch ``param_distance``), when
mix_weight != 1, or when a peer starts without z_{t-1} = its own previous z (a newcomer
starting with z_prev = theta behaves like a fresh momentum buffer).

With compression: mean_j y_j = mean_j theta_j - eta * mean_j delta_j. When all peers share
theta (one group), only the delta part needs averaging and it can go through PowerSGD; in a
gossip setting the theta part differs per peer and must be averaged too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

Params = dict[str, torch.Tensor]


def pseudo_gradient(
    global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]
) -> Params:
    """DiLoCo's Delta = theta_global - theta_local (the direction the outer step descends along)."""
    _check_keys(global_params, local_params)
    return {k: global_params[k].detach() - local_params[k].detach() for k in global_params}


class OuterNesterov:
    """DiLoCo outer step: Nesterov SGD on theta_global with the group-averaged pseudo-gradient.

    Same arithmetic as torch.optim.SGD(lr, momentum, nesterov=True, dampening=0,
    weight_decay=0), per tensor, with g = averaged Delta:
        b_t = g                         (first step: torch clones the gradient)
        b_t = momentum * b_{t-1} + g    (later steps)
        theta <- theta - lr * (g + momentum * b_t)
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buffers: Params = {}
        self.steps = 0

    @torch.no_grad()
    def step(
        self, global_params: Mapping[str, torch.Tensor], avg_delta: Mapping[str, torch.Tensor]
    ) -> Params:
        """Return the new theta_global (fresh tensors; the inputs are not modified)."""
        _check_keys(global_params, avg_delta)
        out: Params = {}
        for name, theta in global_params.items():
            g = avg_delta[name].to(device=theta.device, dtype=theta.dtype)
            buf = self.buffers.get(name)
            if buf is None:
                buf = g.clone()
            else:
                buf.mul_(self.momentum).add_(g)
            self.buffers[name] = buf
            update = g.add(buf, alpha=self.momentum)
            out[name] = theta.detach().add(update, alpha=-self.lr)
        self.steps += 1
        return out

    def state_dict(self) -> dict:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "steps": self.steps,
            "buffers": {k: v.clone() for k, v in self.buffers.items()},
        }

    def load_state_dict(self, sd: Mapping) -> None:
        self.lr = float(sd["lr"])
        self.momentum = float(sd["momentum"])
        self.steps = int(sd["steps"])
        self.buffers = {k: v.clone() for k, v in sd["buffers"].items()}


class GaslocOuter:
    """GASLoC's mix-then-momentum outer step for one peer (see the module docstring).

    ``eta`` plays DiLoCo's outer lr and ``gamma`` its momentum: with one group holding every
    replica, mix_weight = 1 and no compression, this reproduces ``OuterNesterov(eta, gamma)``.
    """

    def __init__(self, eta: float = 0.7, gamma: float = 0.9, mix_weight: float = 1.0) -> None:
        if eta <= 0 or not 0 <= gamma < 1 or not 0 < mix_weight <= 1:
            raise ValueError(
                f"need eta > 0, 0 <= gamma < 1, 0 < mix_weight <= 1; got {eta}, {gamma}, {mix_weight}"
            )
        self.eta = float(eta)
        self.gamma = float(gamma)
        self.mix_weight = float(mix_weight)
        self.z_prev: Params | None = None
        self.steps = 0

    @torch.no_grad()
    def make_y(self, theta: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]) -> Params:
        """y = theta + eta * g with g = theta_local - theta: what this peer contributes to the mixing."""
        _check_keys(theta, local_params)
        return {
            k: theta[k].detach() + self.eta * (local_params[k].detach() - theta[k].detach()) for k in theta
        }

    @torch.no_grad()
    def step(
        self,
        theta: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        y_group_mean: Mapping[str, torch.Tensor],
    ) -> Params:
        """theta_{t+1} = z_t + gamma (z_t - z_{t-1}), z_t = (1 - w) y + w * mean(y).

        ``theta`` (this peer's theta_t) is only read on the first step, as z_{-1}: that makes
        the first momentum term equal torch's first Nesterov step (see the derivation).
        """
        _check_keys(y, y_group_mean)
        _check_keys(theta, y)
        w = self.mix_weight
        z = {
            k: (
                y_group_mean[k].detach().clone()
                if w == 1.0
                else (1 - w) * y[k].detach() + w * y_group_mean[k]
            )
            for k in y
        }
        z_prev = self.z_prev if self.z_prev is not None else {k: theta[k].detach() for k in theta}
        _check_keys(z, z_prev)
        out = {k: z[k] + self.gamma * (z[k] - z_prev[k]) for k in z}
        self.z_prev = z
        self.steps += 1
        return out

    def state_dict(self) -> dict:
        return {
            "eta": self.eta,
            "gamma": self.gamma,
            "mix_weight": self.mix_weight,
            "steps": self.steps,
            "z_prev": None if self.z_prev is None else {k: v.clone() for k, v in self.z_prev.items()},
        }

    def load_state_dict(self, sd: Mapping) -> None:
        self.eta = float(sd["eta"])
        self.gamma = float(sd["gamma"])
        self.mix_weight = float(sd["mix_weight"])
        self.steps = int(sd["steps"])
        self.z_prev = None if sd["z_prev"] is None else {k: v.clone() for k, v in sd["z_prev"].items()}


def param_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Relative L2 distance ||a - b|| / max(||a||, ||b||) over all tensors together (0 if both are 0).

    Symmetric and in [0, 2]; computed in float64 so that nearly equal replicas read as such.
    """
    _check_keys(a, b)
    diff_sq = norm_a_sq = norm_b_sq = 0.0
    for k in a:
        ta = a[k].detach().to(torch.float64)
        tb = b[k].detach().to(device=ta.device, dtype=torch.float64)
        diff_sq += float((ta - tb).square().sum())
        norm_a_sq += float(ta.square().sum())
        norm_b_sq += float(tb.square().sum())
    denom = math.sqrt(max(norm_a_sq, norm_b_sq))
    return 0.0 if denom == 0.0 else math.sqrt(diff_sq) / denom


def _check_keys(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    if a.keys() != b.keys():
        missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise KeyError(f"parameter names differ: missing {missing[:5]}, extra {extra[:5]}")
