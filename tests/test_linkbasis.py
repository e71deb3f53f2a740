"""Link-held basis codec (compression/linkbasis.py): exactness, adjoint, bytes, versions, tracking."""

import pytest
import torch

from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.linkbasis import LinkBasisCodec
from compression.pca import BasisVersionError

CTX = LinkContext()
H = 64


def _in_span(t: int, basis: torch.Tensor, seed: int) -> torch.Tensor:
    """t rows inside the row space of ``basis`` (r, H)."""
    return torch.randn(t, basis.shape[0], generator=torch.Generator().manual_seed(seed)) @ basis


def _subspace(r: int, seed: int) -> torch.Tensor:
    return torch.randn(r, H, generator=torch.Generator().manual_seed(seed))


def test_inputs_inside_the_subspace_round_trip_exactly_in_both_directions():
    """After the first frame both ends hold the (int8-rounded) basis; any frame inside its span
    then crosses exactly (fp32 coefficients), forward around a mean and backward uncentred."""
    tx, rx = LinkBasisCodec(k=8, coeff_dtype="float32"), LinkBasisCodec(k=8, coeff_dtype="float32")
    mean = (3 * torch.randn(H)).bfloat16().float()  # the forward's mean travels as bf16
    h0, g0 = _in_span(40, _subspace(8, 0), 0), _in_span(40, _subspace(8, 1), 1)
    rx.decode_forward(tx.encode_forward(h0 + mean, CTX), CTX, tuple(h0.shape))
    tx.decode_backward(rx.encode_backward(g0, CTX), CTX, tuple(g0.shape))
    qf, qb = rx.basis("forward"), tx.basis("backward")
    assert torch.equal(qf, tx._tx["forward"].q) and torch.equal(qb, rx._tx["backward"].q)
    for frame in range(3):
        a = torch.randn(40, 8, generator=torch.Generator().manual_seed(10 + frame))
        h = ((a - a.mean(0)) @ qf.T + mean).reshape(4, 10, H)
        p = tx.encode_forward(h, CTX)
        assert "uq" not in p and "bq" not in p  # nothing to update: only coefficients cross
        out = rx.decode_forward(p, CTX, tuple(h.shape))
        assert torch.allclose(out, h, atol=1e-5 * float(h.abs().max())), (frame, (out - h).abs().max())
        g = a @ qb.T
        back = tx.decode_backward(rx.encode_backward(g, CTX), CTX, tuple(g.shape))
        assert torch.allclose(back, g, atol=1e-5 * float(g.abs().max()))


def test_the_basis_follows_a_moving_subspace_with_updates_only():
    """Half the directions change: the sender sends only new directions and a rotation of the
    kept ones, never the full basis again, and the new subspace soon crosses (up to int8)."""
    kw = {"k": 8, "coeff_dtype": "float32"}
    tx, rx = LinkBasisCodec(rank=4, threshold=0.999, beta=0.0, **kw), LinkBasisCodec(**kw)
    old = torch.linalg.qr(_subspace(12, 2).T)[0].T  # 12 orthonormal directions
    first, moved = old[:8], torch.cat([old[:4], old[8:]])
    g = _in_span(50, first, 3)
    err0 = float((rx.decode_backward(tx.encode_backward(g, CTX), CTX, tuple(g.shape)) - g).norm() / g.norm())
    keys, errs = [], []
    for frame in range(4):
        g = _in_span(50, moved, 20 + frame)
        p = tx.encode_backward(g, CTX)
        keys.append(sorted(p))
        errs.append(float((rx.decode_backward(p, CTX, tuple(g.shape)) - g).norm() / g.norm()))
    assert all("bq" not in k for k in keys)  # no full basis after the first frame
    assert "uq" in keys[0] and "uq" not in keys[-1], keys  # updated, then settled
    assert err0 < 0.01 and errs[0] < 0.01 and errs[-1] < 0.01, (err0, errs)
    assert tx.stats()["backward"]["updates"] >= 1


def test_backward_equals_autograd_through_the_projection():
    """In-graph link: the sender's gradient is autograd's gradient through h ↦ h Q Qᵀ, with Q the
    backward basis both ends hold; that Q spans the gradient's top-k singular subspace (SVD)."""
    c = LinkBasisCodec(k=6, coeff_dtype="float32")
    h = torch.randn(3, 20, H, requires_grad=True)
    w = torch.randn(3, 20, H, generator=torch.Generator().manual_seed(4))
    w = w * torch.linspace(5, 0.05, H)  # a gradient with a decaying spectrum
    (apply_link(h, c, CTX) * w).sum().backward()
    q = c.basis("backward")
    ref = torch.autograd.grad((h @ q @ q.T * w).sum(), h)[0]
    assert torch.allclose(h.grad, ref, atol=1e-5), (h.grad - ref).abs().max()
    _, _, vh = torch.linalg.svd(w.reshape(-1, H).double(), full_matrices=False)
    overlap = float((vh[:6] @ q.double()).pow(2).sum()) / 6  # 1 = same subspace
    assert overlap > 0.99, overlap


def test_payload_bytes_match_frame_bytes():
    tx = LinkBasisCodec(k=16, rank=4, block=8, basis_block=16)
    seen = set()
    for frame, span in enumerate([_subspace(16, 5)] * 2 + [_subspace(16, 6)] * 3):
        h = torch.randn(30, 16, generator=torch.Generator().manual_seed(frame)) @ span
        for direction, p in (
            ("forward", tx.encode_forward(h, CTX)),
            ("backward", tx.encode_backward(h, CTX)),
        ):
            n_upd = p["uq"].shape[0] if "uq" in p else 0
            assert payload_nbytes(p) == tx.frame_bytes(30, H, direction, update=n_upd, full="bq" in p)
            seen.add(("full" if "bq" in p else "update" if n_upd else "plain", direction))
            for name, t in p.items():
                assert t.dtype == tx.payload_dtypes()[name], name
    assert {("full", "forward"), ("update", "forward"), ("plain", "forward")} <= seen, seen
    # by hand: 16 int8 coefficients + 2 bf16 scales per token, 4 B version, bf16 mean forward;
    # a direction is 64 int8 entries + 4 bf16 scales; an update bringing in 3 directions also
    # sends the 13 kept ones as 16 int8 coordinates + 1 bf16 scale each
    assert tx.frame_bytes(100, H, "backward") == 4 + 100 * 20
    assert tx.frame_bytes(100, H, "forward", full=True) == 4 + 128 + 100 * 20 + 16 * 72
    assert tx.frame_bytes(100, H, "backward", update=3) == 4 + 100 * 20 + 3 * 72 + 13 * 18
    st = tx.stats()["forward"]
    assert st["full_bytes"] == 16 * 72 and st["update_bytes"] > 0


def _frames(n: int) -> list[dict]:
    """A sender's backward frames; threshold 1.0: every frame that can improve the basis updates it."""
    tx = LinkBasisCodec(k=4, rank=2, threshold=1.0)
    out = []
    for i in range(n):
        g = torch.randn(20, H, generator=torch.Generator().manual_seed(i)) * torch.linspace(2, 0.1, H)
        out.append(tx.encode_backward(g, CTX))
    return tx, out


def test_a_version_the_receiver_does_not_hold_is_refused_never_guessed():
    tx, frames = _frames(6)
    vers = [int(p["ver"][0]) for p in frames]
    upd = [i for i, p in enumerate(frames) if "uq" in p]
    assert vers == sorted(vers) and len(upd) >= 2, vers
    rx = LinkBasisCodec(k=4)
    rx.decode_backward(frames[0], CTX, (20, H))  # the full basis
    with pytest.raises(BasisVersionError, match="needs version"):  # the update before it was lost
        rx.decode_backward(frames[upd[1]], CTX, (20, H))
    plain = {k: v for k, v in frames[0].items() if k not in ("bq", "bscale")}
    with pytest.raises(BasisVersionError, match="not held"):  # a version never sent
        rx.decode_backward(dict(plain, ver=torch.tensor([99], dtype=torch.int32)), CTX, (20, H))
    # the fix the error names: the sender's full basis; then the newest frame decodes exactly as
    # at a receiver that saw every frame in order
    assert rx.install_basis("backward", tx.full_basis("backward")) == vers[-1]
    in_order = LinkBasisCodec(k=4, keep=2)
    for p in frames:
        want = in_order.decode_backward(p, CTX, (20, H))
    assert torch.equal(rx.decode_backward(frames[-1], CTX, (20, H)), want)
    with pytest.raises(BasisVersionError, match="not held"):  # older than the `keep` versions held
        in_order.decode_backward(plain, CTX, (20, H))


def test_a_fixed_subspace_sends_no_updates():
    tx = LinkBasisCodec(k=8)
    span = _subspace(6, 7)
    sizes = [payload_nbytes(tx.encode_backward(_in_span(40, span, i), CTX)) for i in range(5)]
    assert sizes[1:] == [tx.frame_bytes(40, H, "backward")] * 4, sizes
    assert tx.stats()["backward"]["updates"] == 0


@pytest.mark.parametrize(
    "kw", [{"k": 0}, {"rank": 0}, {"threshold": 1.5}, {"beta": 1.0}, {"coeff_dtype": "int4"}]
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        LinkBasisCodec(**kw)


def test_malformed_frames_are_refused():
    tx, frames = _frames(1)
    rx = LinkBasisCodec(k=4)
    with pytest.raises(ValueError, match="unit vectors"):
        rx.decode_backward(dict(frames[0], bscale=frames[0]["bscale"] * 100), CTX, (20, H))
    with pytest.raises(ValueError, match="no basis version"):
        rx.decode_backward({k: v for k, v in frames[0].items() if k != "ver"}, CTX, (20, H))
