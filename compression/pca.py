"""Fixed PCA-basis link codec (DESIGN.md §7): the codec that learns at M95's bytes.

The sender fits the mean μ (H,) and an orthonormal basis V (H, k) of its boundary
activations from calibration batches (``fit_basis``) and publishes them once
(``basis_payload``). Forward sends the k coefficients c = (h − μ) V per token; the receiver
rebuilds μ + c Vᵀ. Backward sends Vᵀ g per token; the sender rebuilds (Vᵀ g) Vᵀ, i.e.
g V Vᵀ. With unquantised coefficients the pipeline is therefore exactly the network
f(μ + (h − μ) V Vᵀ), and the hop-by-hop backward is its true gradient.

Coefficients go as int8 with one absmax scale per block of ``block`` coefficients (the §7
winner: more components at 8 bits beat bf16 precision), or as plain bf16/fp32. With int8
the backward is the quantised adjoint, Q(g V) Vᵀ, no longer exactly the gradient of the
(quantised) forward: the rounding of the two directions is independent.

Bases are versioned: every frame's LinkContext names the ``basis_version`` it was encoded
with. A codec keeps the current and the previous version, so frames in flight during a
refresh still decode with the basis they were encoded with; any other version raises
``BasisVersionError`` rather than decoding with the wrong basis.
"""

from __future__ import annotations

import math

import torch

from compression.baselines import decode_coeffs, encode_coeffs
from compression.codec import WIRE_DTYPES, LinkCodec, LinkContext, Payload

COEFF_DTYPES = ("int8", "bfloat16", "float32")
BASIS_DTYPES = ("float32", "bfloat16")
_ORTHO_TOL = 1e-2  # loose: catches a transposed or unnormalised V, tolerates a bf16-rounded one


class BasisVersionError(ValueError):
    """A frame names a basis version this codec does not hold (never decode with another)."""


def fit_basis(samples: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (H,) and top-k principal directions V (H, k) of calibration activations (N, H).

    Eigenvectors of the covariance of the centred samples, accumulated in fp64 (a one-off
    cost; fp32 covariance loses the small components), returned as fp32. Each column's sign
    is fixed so its largest-magnitude entry is positive, so the same samples always give
    the same V. Directions with (numerically) equal eigenvalues, e.g. beyond rank N − 1,
    are an arbitrary orthonormal completion.
    """
    if samples.dim() != 2:
        raise ValueError(f"samples must be (N, H), got shape {tuple(samples.shape)}")
    n, hidden = samples.shape
    if not 1 <= k <= hidden:
        raise ValueError(f"need 1 <= k <= H = {hidden}, got k = {k}")
    if n < 1:
        raise ValueError("need at least one sample")
    x = samples.detach().to(torch.float64)
    mean = x.mean(dim=0)
    xc = x - mean
    cov = xc.T @ xc / max(n - 1, 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    v = vecs[:, -k:].flip(-1)
    pivot = v.abs().argmax(dim=0)
    sign = torch.sign(v[pivot, torch.arange(k, device=v.device)])
    sign[sign == 0] = 1.0
    return mean.to(torch.float32).contiguous(), (v * sign).to(torch.float32).contiguous()


def fit_joint_basis(
    acts: torch.Tensor, grads: torch.Tensor, k: int, k_grad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (H,) and V (H, k): k − k_grad principal directions of the activations, then the
    k_grad directions holding most of the gradients' energy outside them.

    Why: an activation-only basis keeps the forward nearly exact but carries only 13-25% of
    the boundary gradient's energy on SmolLM2 (bench/results/quality.md), so the upstream
    stages learn from a sliver of their gradient. Gradients of the loss with respect to the
    residual stream concentrate in a few directions that the activations barely use; adding
    them costs the forward little (their coefficients are small) and lets Vᵀg carry most of
    the backward. Gradient directions are uncentred (energy, not variance: Vᵀg must keep
    g's mean too) and come last, so int8 blocks of small coefficients get their own scales.
    """
    if grads.dim() != 2 or grads.shape[1] != acts.shape[-1]:
        raise ValueError(f"grads must be (N, H = {acts.shape[-1]}), got shape {tuple(grads.shape)}")
    if not 0 <= k_grad < k:
        raise ValueError(f"need 0 <= k_grad < k = {k}, got k_grad = {k_grad}")
    mean, va = fit_basis(acts, k - k_grad)
    if k_grad == 0:
        return mean, va
    g = grads.detach().to(torch.float64)
    va64 = va.to(torch.float64)
    resid = g - (g @ va64) @ va64.T
    _, vecs = torch.linalg.eigh(resid.T @ resid)
    vg = vecs[:, -k_grad:].flip(-1)
    vg = vg - va64 @ (va64.T @ vg)  # exact orthogonality to va despite rounding
    vg, _ = torch.linalg.qr(vg)
    pivot = vg.abs().argmax(dim=0)
    sign = torch.sign(vg[pivot, torch.arange(k_grad, device=vg.device)])
    sign[sign == 0] = 1.0
    v = torch.cat([va64, vg * sign], dim=1)
    return mean, v.to(torch.float32).contiguous()


def basis_drift(v_old: torch.Tensor, v_new: torch.Tensor) -> float:
    """1 − ||V_oldᵀ V_new||_F² / k: 0 for the same subspace, 1 for orthogonal ones.

    Invariant to rotations within the subspace (and sign flips). With different k the
    larger one divides, so a strict sub- or superspace counts as drift.
    """
    if v_old.shape[0] != v_new.shape[0]:
        raise ValueError(f"bases of different H: {v_old.shape[0]} vs {v_new.shape[0]}")
    k = max(v_old.shape[1], v_new.shape[1])
    overlap = (v_old.to(torch.float64).T @ v_new.to(torch.float64)).pow(2).sum().item()
    return float(min(max(1.0 - overlap / k, 0.0), 1.0))


def should_refresh(
    step: int, every: int | None, drift: float | None = None, drift_threshold: float | None = None
) -> bool:
    """Refresh policy: every ``every`` steps (never at step 0, where the first basis is fitted;
    ``None``/0 disables), or as soon as the measured ``drift`` exceeds ``drift_threshold``."""
    if every and step > 0 and step % every == 0:
        return True
    return drift is not None and drift_threshold is not None and drift > drift_threshold


class VersionedState:
    """The current and previous version of a boundary's fitted state (a basis, a channel set).

    Subclasses keep ``_order`` (versions held, oldest first) and name the state in
    ``_state_name`` for the error a frame gets before any state is set.
    """

    _order: list[int]
    _state_name = "basis"

    @property
    def version(self) -> int | None:
        """The current version (the one new frames should name), None before any."""
        return self._order[-1] if self._order else None

    @property
    def versions(self) -> tuple[int, ...]:
        """Versions that still decode: (previous, current) once refreshed."""
        return tuple(self._order)

    def link_context(self, seed: int = 0) -> LinkContext:
        """A context naming the current version, for a new frame."""
        if self.version is None:
            raise BasisVersionError(f"no {self._state_name} set")
        return LinkContext(seed=seed, basis_version=self.version)


class PcaCodec(VersionedState, LinkCodec):
    """Versioned fixed-basis PCA codec; see the module docstring.

    Payload per direction: ``q`` (T, k) int8 and ``scale`` (T, ceil(k/block)) in
    ``scale_dtype`` for int8 coefficients, else ``c`` (T, k) in ``coeff_dtype``.
    Bytes per token = k * coefficient bytes + ceil(k/block) * scale bytes (int8 only).
    int8 error: each coefficient within scale/2 of (h − μ)V, so (V orthonormal) the rebuilt
    token is within sqrt(Σ (scale_b/2)²) of the exact projection μ + (h − μ)VVᵀ.

    ``basis_dtype`` is the precision the basis is published in; ``set_basis`` rounds to it
    first, so sender and receiver use bit-identical bases.
    """

    codec_id = "pca"
    needs_basis = True  # the node fetches the boundary's basis from peers before decoding

    def __init__(
        self,
        k: int,
        coeff_dtype: str = "int8",
        block: int = 32,
        scale_dtype: str = "bfloat16",
        basis_dtype: str = "float32",
        grad_k: int = 0,
    ):
        if k < 1:
            raise ValueError(f"k must be >= 1, not {k}")
        if coeff_dtype not in COEFF_DTYPES:
            raise ValueError(f"coeff dtype {coeff_dtype!r} not in {COEFF_DTYPES}")
        if block < 1:
            raise ValueError(f"block must be >= 1, not {block}")
        if scale_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"scale dtype {scale_dtype!r} not in ('bfloat16', 'float16')")
        if basis_dtype not in BASIS_DTYPES:
            raise ValueError(f"basis dtype {basis_dtype!r} not in {BASIS_DTYPES}")
        if not 0 <= grad_k < k:
            raise ValueError(f"grad_k must be in [0, k = {k}), not {grad_k}")
        # how many of the k directions calibration takes from gradients (fit_joint_basis);
        # the codec itself only needs V, but both ends publish the setting in the run record
        self.grad_k = grad_k
        self.k, self.coeff_dtype, self.block = k, coeff_dtype, block
        self.scale_dtype, self.basis_dtype = scale_dtype, basis_dtype
        self._sdtype = WIRE_DTYPES[scale_dtype]
        self._bdtype = WIRE_DTYPES[basis_dtype]
        # version -> (mean, V) fp32 on the device set_basis got; at most previous + current
        self._bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._order: list[int] = []
        self._on_device: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- basis management -------------------------------------------------------------------

    def set_basis(self, mean: torch.Tensor, v: torch.Tensor, version: int) -> None:
        """Install basis ``version`` as current; the former current stays decodable, older go.

        Versions only grow, so a late, stale publish cannot displace a newer basis;
        re-installing the current version with identical tensors is a no-op (a re-publish).
        """
        if v.dim() != 2 or v.shape[1] != self.k or mean.shape != (v.shape[0],):
            raise ValueError(f"need mean (H,) and V (H, {self.k}), got {tuple(mean.shape)}, {tuple(v.shape)}")
        if v.shape[0] < self.k:
            raise ValueError(f"k = {self.k} exceeds H = {v.shape[0]}")
        if not 0 <= version < 2**63:
            raise ValueError(f"basis version must be a non-negative int64, not {version}")
        gram = v.detach().to(torch.float64).T @ v.detach().to(torch.float64)
        eye = torch.eye(self.k, dtype=torch.float64, device=v.device)
        if (gram - eye).abs().max().item() > _ORTHO_TOL:
            raise ValueError("V must have orthonormal columns")
        mean = mean.detach().to(self._bdtype).to(torch.float32).contiguous()
        v = v.detach().to(self._bdtype).to(torch.float32).contiguous()
        current = self.version
        if current is not None and version == current:
            cm, cv = self._bases[current]
            same = (
                cv.shape == v.shape
                and torch.equal(cm, mean.to(cm.device))
                and torch.equal(cv, v.to(cv.device))
            )
            if same:
                return
            raise ValueError(f"basis version {version} already set with different values")
        if current is not None and version < current:
            raise ValueError(f"basis version {version} is older than the current {current}")
        self._bases[version] = (mean, v)
        self._order.append(version)
        for old in self._order[:-2]:
            del self._bases[old]
        self._order = self._order[-2:]
        self._on_device = {key: t for key, t in self._on_device.items() if key[0] in self._bases}

    def basis(
        self, version: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, V) fp32 of ``version``; raises BasisVersionError if not held."""
        if version not in self._bases:
            raise BasisVersionError(f"basis version {version} not held (have {list(self._order)})")
        mean, v = self._bases[version]
        if device is None or torch.device(device) == mean.device:
            return mean, v
        key = (version, torch.device(device))
        if key not in self._on_device:  # copy once per device, not per frame
            self._on_device[key] = (mean.to(device), v.to(device))
        return self._on_device[key]

    def basis_payload(self, version: int | None = None) -> Payload:
        """The basis to publish once per boundary: mean (H,), V (H, k) in ``basis_dtype``, and
        its version as an int64 (1,) tensor. Lossless, since ``set_basis`` rounded already."""
        version = self.version if version is None else version
        if version is None:
            raise BasisVersionError("no basis set")
        mean, v = self.basis(version)
        return {
            "mean": mean.to(self._bdtype).cpu().contiguous(),
            "V": v.to(self._bdtype).cpu().contiguous(),
            "version": torch.tensor([version], dtype=torch.int64),
        }

    def basis_from_payload(self, payload: Payload) -> int:
        """Install a published basis (see ``set_basis``); returns its version."""
        version = int(payload["version"].reshape(-1)[0].item())
        self.set_basis(payload["mean"].to(torch.float32), payload["V"].to(torch.float32), version)
        return version

    def basis_nbytes(self, hidden: int | None = None) -> int:
        """One-time bytes of ``basis_payload``: (H + H k) * basis bytes + 8 for the version."""
        if hidden is None:
            if self.version is None:
                raise BasisVersionError("no basis set; pass hidden")
            hidden = self._bases[self.version][1].shape[0]
        return (hidden + hidden * self.k) * self._bdtype.itemsize + 8

    # ---- coefficients -----------------------------------------------------------------------

    def _pack(self, c: torch.Tensor) -> Payload:
        return encode_coeffs(c, self.coeff_dtype, self.block, self._sdtype)

    def _unpack(self, payload: Payload) -> torch.Tensor:
        return decode_coeffs(payload, self.coeff_dtype, self.block)

    def encode_forward(self, h: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = h.detach().reshape(-1, h.shape[-1]).to(torch.float32)
        mean, v = self.basis(ctx.basis_version, rows.device)
        return self._pack((rows - mean) @ v)

    def decode_forward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        c = self._unpack(payload)
        mean, v = self.basis(ctx.basis_version, c.device)
        return torch.addmm(mean, c, v.T).reshape(shape)

    def encode_backward(self, g: torch.Tensor, ctx: LinkContext) -> Payload:
        rows = g.detach().reshape(-1, g.shape[-1]).to(torch.float32)
        _, v = self.basis(ctx.basis_version, rows.device)
        return self._pack(rows @ v)

    def decode_backward(self, payload: Payload, ctx: LinkContext, shape: tuple[int, ...]) -> torch.Tensor:
        c = self._unpack(payload)
        _, v = self.basis(ctx.basis_version, c.device)
        return (c @ v.T).reshape(shape)

    def bytes_per_token(self, hidden: int) -> float:
        """Per direction; independent of ``hidden`` (the basis is paid once, see basis_nbytes)."""
        if self.coeff_dtype == "int8":
            return float(self.k + math.ceil(self.k / self.block) * self._sdtype.itemsize)
        return float(self.k * WIRE_DTYPES[self.coeff_dtype].itemsize)

    def describe(self) -> dict:
        d = {"codec": self.codec_id, "k": self.k, "coeff_dtype": self.coeff_dtype}
        if self.coeff_dtype == "int8":
            d.update(block=self.block, scale_dtype=self.scale_dtype)
        d["basis_dtype"] = self.basis_dtype
        if self.grad_k:
            d["grad_k"] = self.grad_k
        return d
