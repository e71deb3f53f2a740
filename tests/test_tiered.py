"""Tiered transform codec (compression/tiered.py): exactness in its tiers, bytes, versions,
the per-frame ranking, the 2-bit quantiser against theory, bad input."""

import math

import pytest
import torch

from compression.codec import LinkContext, payload_nbytes
from compression.pca import BasisVersionError
from compression.tiered import TieredCodec, fit_rotation, pack_int2, unpack_int2

CTX = LinkContext(basis_version=0)


def _rotation(h: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(
        torch.randn(h, h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )
    return q.T.float().contiguous()


def _codec(h: int = 64, tiers=((8, 8),), seed: int = 0) -> TieredCodec:
    c = TieredCodec(tiers=tiers)
    c.set_rotations(_rotation(h, seed), _rotation(h, seed + 1), 0)
    return c


def test_rows_inside_the_top_tier_round_trip_to_int8_precision():
    """Rows spanned by 8 of the rotation's directions, tier (8, 8 bits): every other direction is
    empty, so the frame keeps exactly those 8 and only int8 rounding is left."""
    c = _codec()
    r = c.rotation(0, "forward")
    g = torch.Generator().manual_seed(5)
    pick = torch.randperm(64, generator=g)[:8]
    med = torch.randn(64, generator=g)
    half = torch.randn(150, 8, generator=g)
    coeff = torch.cat([half, -half, torch.zeros(1, 8)])  # rows symmetric about 0 and one at 0:
    x = coeff @ r[pick] + med  # the per-channel median is exactly ``med``
    p = c.encode_forward(x, CTX)
    assert set(p["idx"].tolist()) == set(pick.tolist())
    y = c.decode_forward(p, CTX, tuple(x.shape))
    rel = float((y - x).norm() / (x - med).norm())
    assert rel < 0.01, rel
    gb = torch.randn(301, 8, generator=g) @ c.rotation(0, "backward")[pick]
    pb = c.encode_backward(gb, CTX)
    assert set(pb["idx"].tolist()) == set(pick.tolist())
    back = c.decode_backward(pb, CTX, tuple(gb.shape))
    assert float((back - gb).norm() / gb.norm()) < 0.01


def test_the_frame_keeps_the_directions_loud_in_it_not_those_loud_at_calibration():
    """Nothing is cut for good: a direction quiet at calibration that this frame makes loud is
    coded; a fixed top-k basis of the calibration would drop it."""
    h = 48
    g = torch.Generator().manual_seed(1)
    calib = torch.randn(500, h, generator=g) * torch.linspace(5, 0.01, h)
    c = TieredCodec(tiers=((6, 8),))
    c.set_rotations(fit_rotation(calib, centre=True), fit_rotation(calib, centre=False), 0)
    quiet = c.rotation(0, "forward")[-1]  # the calibration's weakest direction
    x = torch.randn(200, h, generator=g) * 0.01 + torch.randn(200, 1, generator=g) * 3 * quiet
    p = c.encode_forward(x, CTX)
    assert int(p["idx"][0]) == h - 1
    y = c.decode_forward(p, CTX, tuple(x.shape))
    signal = (x @ quiet).unsqueeze(1) * quiet
    assert float(((y - x) @ quiet).norm() / signal.norm()) < 0.01


@pytest.mark.parametrize(
    "tiers", [((24, 8), (88, 4), (128, 2)), ((5, 8), (7, 4), (9, 2)), ((40, 4),), ((3, 2),)]
)
@pytest.mark.parametrize("h", [64, 576])
def test_payload_bytes_match_frame_bytes_and_dtypes(tiers, h):
    """Includes H smaller than the tiers (64 < 240 directions): the tiers are cut to fit."""
    c = _codec(h, tiers)
    x = torch.randn(2, 37, h)
    fwd, bwd = c.encode_forward(x, CTX), c.encode_backward(x, CTX)
    assert payload_nbytes(fwd) == c.frame_bytes(74, h, "forward")
    assert payload_nbytes(bwd) == c.frame_bytes(74, h, "backward")
    for name, t in {**fwd, **bwd}.items():
        assert t.dtype == c.payload_dtypes()[name], name


def test_default_tiers_are_ten_times_below_dense_at_the_node_frame():
    """At the GPU default's 2048-token frames and SmolLM2's H = 576, with the one-time rotation
    spread over a 100-step run, each direction is >= 10x below dense bf16 (1152 B/token)."""
    c = TieredCodec()
    t, h = 2048, 576
    for d in ("forward", "backward"):
        per_token = c.frame_bytes(t, h, d) / t + c.rotation_nbytes(h) / (100 * t)
        assert 2 * h / per_token >= 10, (d, per_token)


def test_two_bit_quantiser_meets_the_uniform_gaussian_mse():
    """Independent reference: the MSE-optimal uniform 4-level quantiser of a unit Gaussian has
    distortion 0.1188 (Max, 1960); the tier's quantiser, one scale per token, is within 5%."""
    h = 256
    c = _codec(h, ((h, 2),))
    g = torch.randn(4000, h, generator=torch.Generator().manual_seed(3))
    back = c.decode_backward(c.encode_backward(g, CTX), CTX, tuple(g.shape))
    mse = float((back - g).pow(2).mean() / g.pow(2).mean())
    assert abs(mse - 0.1188) < 0.006, mse


def test_pack_int2_round_trips():
    u = torch.randint(0, 4, (7, 13))
    packed = pack_int2(u)
    assert packed.shape == (7, 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int2(packed, 13), u)


def test_a_version_not_held_is_refused_and_a_published_one_decodes_identically():
    sender = _codec(32, ((16, 8), (16, 4)))
    receiver = TieredCodec(tiers=((16, 8), (16, 4)))
    x = torch.randn(50, 32)
    p = sender.encode_forward(x, CTX)
    with pytest.raises(BasisVersionError, match="not held"):
        receiver.decode_forward(p, CTX, tuple(x.shape))
    assert receiver.basis_from_payload(sender.basis_payload()) == 0
    assert torch.equal(
        receiver.decode_forward(p, CTX, tuple(x.shape)), sender.decode_forward(p, CTX, tuple(x.shape))
    )
    # a refresh: version 1 is current, 0 still decodes (frames in flight), an older one is refused
    sender.set_rotations(_rotation(32, 7), _rotation(32, 8), 1)
    receiver.basis_from_payload(sender.basis_payload())
    receiver.decode_forward(p, CTX, tuple(x.shape))
    with pytest.raises(ValueError, match="not newer"):
        sender.set_rotations(_rotation(32, 9), _rotation(32, 9), 1)
    assert payload_nbytes(sender.basis_payload()) == sender.basis_nbytes(32)


def test_sink_rows_do_not_crush_the_other_rows_levels():
    """A few rows ~100x louder than the rest (a pretrained LM's attention sinks) in one more
    direction: each token has its own scale per tier, so the bulk rows keep int8/int4 precision.
    With one scale per direction (or per frame) their levels would be a sink's hundredth."""
    h = 32
    g = torch.Generator().manual_seed(4)
    calib = torch.randn(2000, h, generator=g) * torch.linspace(3, 0.1, h)
    c = TieredCodec(tiers=((4, 8), (6, 4)))
    c.set_rotations(fit_rotation(calib, centre=True), fit_rotation(calib, centre=False), 0)
    r = c.rotation(0, "forward")
    bulk = torch.randn(2001, 9, generator=g) @ r[:9]
    x = bulk.clone()
    x[::40] += 300.0 * r[20]  # the sinks, in a direction the bulk never uses
    y = c.decode_forward(c.encode_forward(x, CTX), CTX, tuple(x.shape))
    rows = torch.ones(x.shape[0], dtype=torch.bool)
    rows[::40] = False
    rel = (y - x)[rows].norm(dim=1) / (x - x.median(dim=0).values)[rows].norm(dim=1)
    assert float(rel.median()) < 0.08, float(rel.median())  # 4-bit levels, not a sink's hundredth


def test_malformed_payloads_are_refused():
    c = _codec(32, ((8, 8), (8, 2)))
    x = torch.randn(20, 32)
    good = c.encode_backward(x, CTX)
    for name, bad in [
        ("idx", torch.full((16,), 40, dtype=torch.int16)),  # outside the rotation
        ("idx", torch.zeros(16, dtype=torch.int16)),  # one direction twice
        ("idx", torch.arange(8, dtype=torch.int16)),  # fewer than the tiers keep
        ("cs", torch.full((16,), float("nan"), dtype=torch.bfloat16)),
        ("q1", torch.zeros(20, 5, dtype=torch.uint8)),  # 2-bit codes of the wrong width
        ("s1", torch.ones(20, 2, dtype=torch.bfloat16)),
    ]:
        p = dict(good, **{name: bad})
        with pytest.raises(ValueError):
            c.decode_backward(p, CTX, tuple(x.shape))
    with pytest.raises(ValueError, match="orthonormal"):
        c.set_rotations(torch.ones(32, 32), torch.eye(32), 1)
    with pytest.raises(ValueError, match="tiers"):
        TieredCodec(tiers=((8, 3),))
    assert math.isfinite(float(c.decode_backward(good, CTX, tuple(x.shape)).norm()))
