"""The lowrank codec with one uniform step per frame and direction (compression/stepped.py).

It must decode every coefficient to within half its step, code exactly what lies in its subspace
up to that, cost what its formula says before entropy coding, beat the tiers' error at no more
bytes where a spectrum falls (the reason it exists), and refuse a malformed frame in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compression.codec import LinkContext, payload_nbytes
from compression.entropy import (
    COLUMN_GROUP,
    ROW_BUCKETS,
    decode_column_groups,
    encode_column_groups,
    row_buckets,
)
from compression.lowrank import LowRankCodec, join_uniform_rows, split_uniform_rows, top_directions
from compression.stepped import decode_stepped, encode_stepped

CTX = LinkContext()


def _falling(rows: int = 1024, hidden: int = 128, k: int = 48, seed: int = 11) -> torch.Tensor:
    """Rows of rank ``k`` whose directions' energy falls 10x, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(hidden, k, generator=g))[0].T
    x = (torch.randn(rows, k, generator=g) * torch.logspace(0, -1, k)) @ basis
    return x + 0.001 * torch.randn(rows, hidden, generator=g)


def test_every_code_is_within_half_its_step_and_the_strong_columns_get_more_levels():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(500, 20, generator=g) * torch.logspace(2, -1, 20)  # 1000x energy first to last
    c[3, 0] = 1e4  # an outlier: its column's step grows so its code stays int8
    p = encode_stepped(c, 1.0)
    assert p["q"].dtype == torch.int8 and p["qstep"].dtype == torch.bfloat16
    d = decode_stepped(p, 20)
    assert bool(((d - c).abs() <= p["qstep"].float() / 2 * (1 + 1e-6)).all())
    levels = [len(torch.unique(p["q"][:, j])) for j in range(20)]
    assert levels[1] > 50 and levels[10] > 3 * levels[-1] and levels[0] < levels[1]  # bits follow energy
    assert int(p["q"].abs().max()) == 127


def test_rank_k_rows_round_trip_inside_the_subspace_up_to_half_a_step():
    """fp32 basis: what lies in the k-dim subspace comes back with each coefficient's error at most
    half its step, so the row error is bounded by the steps, not by anything the basis drops."""
    x = _falling()  # rank 48 plus a 1e-3 noise floor (what lies outside the subspace)
    c = LowRankCodec(k=48, step=0.5, backward_step=0.5, basis_dtype="float32")
    for enc, dec in ((c.encode_forward, c.decode_forward), (c.encode_backward, c.decode_backward)):
        p = enc(x, CTX)
        y = dec(p, CTX, tuple(x.shape))
        bound = float(p["qstep"].float().pow(2).sum().sqrt()) / 2 + 0.001 * 128**0.5 * 1.5
        assert float((y - x).norm(dim=1).max()) <= bound


def test_uncoded_payload_bytes_match_frame_bytes():
    x = _falling().reshape(16, 64, 128)
    for first in (False, True):
        c = LowRankCodec(
            k=40,
            k_backward=24,
            step=1.0,
            backward_step=2.0,
            basis_dtype="int8",
            basis_block=32,
            first_apart=first,
        )
        p = c.encode_forward(x, CTX)
        assert payload_nbytes(p) == c.frame_bytes(1024, 128, "forward", sequences=16)
        g = c.encode_backward(x, CTX)
        assert payload_nbytes(g) == c.frame_bytes(1024, 128, "backward")
        for name, t in {**p, **g}.items():
            assert t.dtype == c.payload_dtypes()[name], name


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_uniform_step_leaves_less_error_than_the_tiers_at_no_more_bytes(direction):
    """The reason for the mode: on a falling spectrum, entropy coded, one step for all 48 directions
    beats 12 at 8 bits + 36 at 4 (the tiers, entropy coded too) at no more bytes."""
    x = _falling()
    tiers = ((12, 8), (36, 4))
    tiered = LowRankCodec(tiers=tiers, backward_tiers=tiers, basis_dtype="int8", basis_block=32, entropy=True)
    stepped = LowRankCodec(
        k=48, step=0.3, backward_step=0.3, basis_dtype="int8", basis_block=32, entropy=True
    )
    out = []
    for c in (tiered, stepped):
        enc, dec = (
            (c.encode_forward, c.decode_forward)
            if direction == "forward"
            else (c.encode_backward, c.decode_backward)
        )
        p = enc(x, CTX)
        out.append((payload_nbytes(p), float((dec(p, CTX, tuple(x.shape)) - x).norm() / x.norm())))
    (b_t, e_t), (b_s, e_s) = out
    assert b_s <= b_t and e_s < 0.5 * e_t, out  # measured: 0.019 against 0.053, 41.3 kB against 42.2


def test_column_groups_round_trip_and_refuse_damage():
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(300, 40, generator=g) * torch.logspace(1.5, 0, 40)).round().clamp(-127, 127).long()
    blob = encode_column_groups(q, -127, 127, q.numel())
    assert blob is not None and torch.equal(decode_column_groups(blob, 300, 40, -127, 127), q)
    one = encode_column_groups(q[:, :COLUMN_GROUP], -127, 127, 10**9)
    assert one is not None and 0 < one.numel() < blob.numel()
    for bad in (blob[:-1], torch.cat([blob, blob[:4]]), blob[:3]):
        with pytest.raises(ValueError):
            decode_column_groups(bad, 300, 40, -127, 127)
    with pytest.raises(ValueError):
        decode_column_groups(blob, 301, 40, -127, 127)


@pytest.mark.parametrize("rows", [0, 1, 5, 2000])
def test_row_bucketed_column_groups_round_trip_and_code_rows_of_unequal_size_in_fewer_bytes(rows):
    """Codes whose rows differ in size (a token's norm scales all its coefficients): bucketed by
    the size of the row's codes already coded, a long frame's groups take fewer bytes; every frame
    decodes exactly, whichever coding was kept; damaged, or naming buckets it was not coded in, the
    blob is refused."""
    g = torch.Generator().manual_seed(4)
    size = torch.exp(torch.randn(rows, 1, generator=g))  # log-normal row norms
    q = (torch.randn(rows, 40, generator=g) * size * torch.logspace(1.5, 0, 40)).round().clamp(-127, 127)
    q = q.long()
    flat = encode_column_groups(q, -127, 127, 10**9)
    blob = encode_column_groups(q, -127, 127, 10**9, ROW_BUCKETS)
    assert torch.equal(decode_column_groups(blob, rows, 40, -127, 127), q)
    assert int(flat[0]) == 1 and blob.numel() <= flat.numel()
    if rows < 2000:
        return
    assert int(blob[0]) == ROW_BUCKETS and blob.numel() < 0.97 * flat.numel(), (
        blob.numel(),
        flat.numel(),
    )  # 0.956
    one, many = torch.tensor([1], dtype=torch.uint8), torch.tensor([17], dtype=torch.uint8)
    for bad in (
        blob[:-1],
        torch.cat([blob, blob[:4]]),
        blob[1:],
        torch.cat([one, blob[1:]]),
        torch.cat([many, blob[1:]]),
    ):
        with pytest.raises(ValueError):
            decode_column_groups(bad, rows, 40, -127, 127)


def test_row_buckets_are_equal_shares_by_rank_with_ties_in_row_order():
    got = row_buckets(np.array([5, 1, 1, 9, 0, 1, 7, 2]), 4)
    assert got.tolist() == [2, 0, 1, 3, 0, 1, 3, 2]


def _coded():
    c = LowRankCodec(k=32, step=1.0, basis_dtype="int8", basis_block=32, entropy=True, first_apart=True)
    x = _falling().reshape(16, 64, 128)
    return c, x, c.encode_forward(x, CTX)


BAD = {
    "steps of other directions": lambda p: p | {"qstep": p["qstep"][:-1]},
    "a negative step": lambda p: p | {"qstep": -p["qstep"]},
    "a non-finite step": lambda p: p | {"qstep": p["qstep"] * float("inf")},
    "no steps": lambda p: {k: v for k, v in p.items() if k != "qstep"},
    "coded and raw": lambda p: p | {"q": torch.zeros(1008, 32, dtype=torch.int8)},
    "a truncated code": lambda p: p | {"eq": p["eq"][:-5]},
    "more steps than k": lambda p: p | {"qstep": torch.ones(40, dtype=torch.bfloat16)},
}


@pytest.mark.parametrize("damage", list(BAD))
def test_malformed_stepped_frames_are_refused_in_one_line(damage):
    c, x, p = _coded()
    assert {"eq", "qstep"} <= set(p)
    with pytest.raises(ValueError) as e:
        c.decode_forward(BAD[damage](dict(p)), CTX, tuple(x.shape))
    assert "\n" not in str(e.value)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="step"):
        LowRankCodec(step=-1.0)
    with pytest.raises(ValueError, match="step"):
        LowRankCodec(step=float("nan"))
    with pytest.raises(ValueError, match="tiers"):
        LowRankCodec(step=1.0, tiers=((8, 8), (24, 4)))
    with pytest.raises(ValueError, match="backward_bits"):
        LowRankCodec(backward_step=1.0, backward_bits=4)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="first_gain"):
            LowRankCodec(first_gain=bad)
        with pytest.raises(ValueError, match="basis_step"):
            LowRankCodec(step=1.0, basis_dtype="int8", entropy=True, basis_step=bad)
    for kw in ({}, {"step": 1.0, "basis_dtype": "int8"}, {"step": 1.0, "entropy": True}):
        with pytest.raises(ValueError, match="basis_step needs"):
            LowRankCodec(**kw, basis_step=1.0)


# k = 48 in both directions at step 1, entropy coded: the link the two tests below change
STEPPED = {
    "k": 48,
    "step": 1.0,
    "backward_step": 1.0,
    "basis_dtype": "int8",
    "basis_block": 32,
    "entropy": True,
}


def test_a_stepped_basis_costs_fewer_bytes_for_the_same_error_and_decodes_within_its_block_steps():
    """``basis_step``: the weak directions' basis entries take the coefficients' step over the
    direction's norm. Against the same link with an 8-bit basis everywhere, on a falling spectrum:
    the frame shrinks, its error barely moves, every decoded basis entry lies within half its block
    step of the exact direction, and the weak directions' steps are the coarse ones."""
    x = _falling()
    plain, coarse = LowRankCodec(**STEPPED), LowRankCodec(**STEPPED, basis_step=1.0)
    out = []
    for c in (plain, coarse):
        for enc, dec in ((c.encode_forward, c.decode_forward), (c.encode_backward, c.decode_backward)):
            p = enc(x, CTX)
            out.append((payload_nbytes(p), float((dec(p, CTX, tuple(x.shape)) - x).norm() / x.norm())))
    for (b0, e0), (b1, e1) in zip(out[:2], out[2:]):
        assert b1 < b0 and e1 < 1.1 * e0, out  # measured: 6% fewer bytes, error 0.061 against 0.064
    p, q = coarse.encode_backward(x, CTX), plain.encode_backward(x, CTX)
    assert "evq" in p and "vq" not in p  # coded by column groups

    def basis(p):
        return payload_nbytes({n: p[n] for n in ("vq", "evq", "vscale") if n in p})

    assert basis(p) < 0.8 * basis(q), (basis(p), basis(q))  # measured: 4734 B against 6528
    exact = top_directions(x, 48).T  # what the sender fitted (backward rows: uncentred)
    whole = _whole_scales(p)
    sent = coarse._basis_of(coarse._entropy_decode(whole, "backward", 128, 1024), "backward")
    step = whole["vscale"].float().repeat_interleave(32, dim=1)
    assert bool(((sent - exact).abs() <= step / 2 * (1 + 1e-3)).all())
    assert float(step[-1].min()) > 5 * float(step[0].max())


def test_only_the_trailing_one_scale_rows_are_split_off():
    """A one-scale row before a row whose blocks differ stays whole: the receiver rebuilds the rows
    in order, head first."""
    scale = torch.tensor([[1.0, 2.0], [3.0, 3.0], [4.0, 5.0], [6.0, 6.0], [7.0, 7.0]], dtype=torch.bfloat16)
    sent = split_uniform_rows(scale)
    assert sent["vscale"].shape == (3, 2) and sent["vrow"].tolist() == [6.0, 7.0]
    assert torch.equal(join_uniform_rows(sent["vscale"], sent["vrow"], 64, 32), scale)
    with pytest.raises(ValueError, match="scales must be"):
        join_uniform_rows(sent["vscale"], sent["vrow"], 96, 32)  # three blocks a row, not two


def _whole_scales(p: dict) -> dict:
    """``p`` with its basis scales sent whole: one per block of every row, no ``vrow``."""
    out = {k: v for k, v in p.items() if k != "vrow"}
    return out | {"vscale": torch.cat([p["vscale"], p["vrow"][:, None].expand(-1, 4)])}


def test_one_scale_basis_rows_travel_as_one_value_and_decode_bit_for_bit():
    """The stepped basis's trailing rows whose blocks share one scale (its weak directions, floored
    at one step) travel as that value: the frame shrinks, and it decodes to exactly what the same
    frame with every block's scale sent decodes to, both directions."""
    g = torch.Generator().manual_seed(3)
    strong = torch.randn(1024, 2, generator=g) @ torch.linalg.qr(torch.randn(128, 2, generator=g))[0].T
    x = _falling()
    x = (x + 10 * x.std() * strong).reshape(16, 64, 128)  # two directions too strong to floor
    c = LowRankCodec(**STEPPED, basis_step=1.0)
    for enc, dec in ((c.encode_forward, c.decode_forward), (c.encode_backward, c.decode_backward)):
        p = enc(x, CTX)
        assert p["vscale"].shape[0] == 2 and p["vrow"].numel() == 46, (p["vscale"].shape, p["vrow"].shape)
        whole = _whole_scales(p)
        assert payload_nbytes(p) <= payload_nbytes(whole) - 6 * p["vrow"].numel()  # 3 bf16 a row
        assert torch.equal(dec(p, CTX, tuple(x.shape)), dec(whole, CTX, tuple(x.shape)))
    plain = LowRankCodec(**STEPPED)  # a run without basis_step sends no one-scale rows
    with pytest.raises(ValueError, match="one-scale"):
        plain.decode_backward(c.encode_backward(x, CTX), CTX, tuple(x.shape))


def test_a_gained_first_position_keeps_a_small_sink_gradient_the_step_would_zero():
    """``first_gain``: a frame whose position-0 rows are small and lie off the bulk's directions
    (the attention sink's gradient): with no gain the basis and the step leave them out; gained 8x
    they come back close, at the price of the directions they take from the rest (measured: sink
    0.84 -> 0.12, the rest 0.060 -> 0.090). Frames with no sequence axis are not touched."""
    g = torch.Generator().manual_seed(5)
    x = _falling().reshape(16, 64, 128).clone()
    x[:, 0] = 0.25 * torch.randn(16, 4, generator=g) @ torch.randn(4, 128, generator=g) / 128**0.5
    errs = []
    for gain in (0.0, 8.0):
        c = LowRankCodec(**STEPPED, first_gain=gain)
        y = c.decode_backward(c.encode_backward(x, CTX), CTX, tuple(x.shape))
        errs.append([float((y - x)[:, sl].norm() / x[:, sl].norm()) for sl in (0, slice(1, None))])
    (sink0, rest0), (sink8, rest8) = errs
    assert sink0 > 0.5 and sink8 < 0.2 and rest8 < 1.6 * rest0, errs
    flat = x.reshape(-1, 128)
    a = LowRankCodec(**STEPPED, first_gain=8.0).encode_backward(flat, CTX)
    b = LowRankCodec(**STEPPED).encode_backward(flat, CTX)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _coarse():
    c = LowRankCodec(k=32, step=1.0, basis_dtype="int8", basis_block=32, entropy=True, basis_step=1.0)
    x = _falling().reshape(16, 64, 128)
    return c, x, c.encode_forward(x, CTX)


BAD_BASIS = {
    "coded and raw": lambda p: p | {"vq": torch.zeros(32, 128, dtype=torch.int8)},
    "a truncated basis": lambda p: p | {"evq": p["evq"][:-5]},
    "scales of another width": lambda p: p | {"vscale": p["vscale"][:, :-1]},
    "more directions than k": lambda p: p | {"vscale": torch.ones(40, 4, dtype=torch.bfloat16)},
    "no scales": lambda p: {k: v for k, v in p.items() if k != "vscale"},
    "one-scale rows 2-D": lambda p: p | {"vrow": p["vrow"][:, None]},
    "one-scale rows in float32": lambda p: p | {"vrow": p["vrow"].float()},
    "one-scale rows past k": lambda p: p | {"vrow": torch.ones(40, dtype=torch.bfloat16)},
}


@pytest.mark.parametrize("damage", list(BAD_BASIS))
def test_malformed_stepped_bases_are_refused_in_one_line(damage):
    c, x, p = _coarse()
    assert {"evq", "vscale", "vrow"} <= set(p)
    with pytest.raises(ValueError) as e:
        c.decode_forward(BAD_BASIS[damage](dict(p)), CTX, tuple(x.shape))
    assert "\n" not in str(e.value)


# slow: a real two-process swarm (~75 s); the codec-level tests above are what CI runs
@pytest.mark.slow
def test_swarm_with_a_uniform_step_trains_and_sends_the_bytes_its_frames_hold(tmp_path):
    """``--lowrank-step`` (with the basis at its step and the sinks gained) through real frames,
    p2pd and the DHT: the record carries the settings, the loss falls, and each direction sends
    fewer bytes per token than its uncoded frame would hold."""
    from tests.conftest import run_swarm

    text = "Volunteers train together over slow links, so every byte on the wire counts. "
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(text * 3 for _ in range(60)))
    flags = ["--nodes", "2", "--stages", "2", "--steps", "12", "--model", "tiny:2:640", "--lr", "1e-3"]
    flags += ["--seq-len", "128", "--microbatch", "4", "--batch-tokens", "512", "--data", str(data)]
    flags += ["--microbatch-tokens", "2048", "--codec-k", "104", "--lowrank-k-backward", "64"]
    flags += ["--lowrank-step", "1", "--lowrank-entropy", "on", "--lowrank-repeats", "on"]
    flags += ["--lowrank-basis-step", "1", "--lowrank-first-gain", "8"]
    rep = run_swarm(tmp_path / "run", *flags, timeout=400, codec=None)
    published = rep["codec_settings"]
    assert published["step"] == published["backward_step"] == 1.0 and "tiers" not in published
    assert published["k"] == 104 and published["k_backward"] == 64
    assert published["basis_step"] == 1.0 and published["first_gain"] == 8.0
    loss = rep["loss"]
    assert sum(loss[-3:]) / 3 < 0.9 * sum(loss[:3]) / 3
    lossless = ("codec", "entropy", "repeats", "basis_step")  # basis_step: only with entropy coding
    uncoded = LowRankCodec(**{k: v for k, v in published.items() if k not in lossless})
    for lk in rep["links"]:
        bound = uncoded.frame_bytes(16 * 128, 640, lk["direction"], sequences=16) / (16 * 128)
        assert lk["bytes_per_token"] < bound, lk
