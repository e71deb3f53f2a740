"""Repeated rows sent once (compression.repeats, the lowrank codec's ``repeats=True``): lossless,
fewer bytes when sequences share a prefix, a malformed reference list refused in one line."""

from __future__ import annotations

import pytest
import torch

from compression import repeats
from compression.codec import LinkContext, payload_nbytes
from compression.registry import make_codec
from compression.repeats import decode_references, drop_repeats, encode_references, restore_repeats

H = 256
LONG = {
    "k": 32,
    "block": 8,
    "basis_dtype": "int8",
    "basis_block": 32,
    "tiers": ((8, 8), (24, 4)),
    "backward_tiers": ((8, 8), (24, 4)),
}
PLAIN = {"k": 48, "basis_dtype": "int8", "basis_block": 32}
GRAD4 = {"k": 48, "k_backward": 64, "backward_bits": 4}
WIDE = {"k": 24, "coeff_dtype": "bfloat16"}  # coefficients in a wire dtype: a float field per row


def _shared_prefix(b: int = 30, t: int = 40, prefix: int = 12) -> torch.Tensor:
    """(b, t, H) rows where every sequence's first ``prefix`` positions equal sequence 0's (a prompt
    template: a causal LM gives a shared prefix the same activations), the rest its own."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(b, t, 12, generator=g) @ torch.randn(12, H, generator=g) + 0.1 * torch.randn(
        b, t, H, generator=g
    )
    x[:, :prefix] = x[:1, :prefix]
    return x


def test_drop_and_restore_are_inverse_and_keep_first_occurrences():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-2, 3, (200, 3), generator=g).to(torch.int8)  # few values: many repeats
    scales = codes[:, :1].to(torch.bfloat16) * 0.5  # a float field that repeats with them
    (kc, ks), rep = drop_repeats([codes, scales])
    assert rep.dtype == torch.int32 and rep.shape[0] == 200 - kc.shape[0] > 0
    assert torch.equal(torch.unique(kc, dim=0), torch.unique(codes, dim=0))  # every distinct row once
    back = restore_repeats([kc, ks], rep, 200)
    assert torch.equal(back[0], codes) and torch.equal(back[1].view(torch.int16), scales.view(torch.int16))
    plain = torch.randn(50, 4, generator=g)
    (same,), none = drop_repeats([plain])
    assert same is plain and none.shape == (0, 2)
    assert restore_repeats([plain], none, 50)[0] is plain


def _dropped():
    codes = torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2], [3, 4]], dtype=torch.int8)
    (kept,), rep = drop_repeats([codes])
    assert rep.tolist() == [[1, 0], [3, 0], [4, 1]]
    return kept, rep


BAD = {
    "int64 references": lambda k, r: ([k], r.long(), 5),
    "one column": lambda k, r: ([k], r[:, :1], 5),
    "rows out of order": lambda k, r: ([k], r.flip(0), 5),
    "a row twice": lambda k, r: ([k], r[[0, 0, 2]], 5),
    "a row past the frame": lambda k, r: ([k], r, 4),
    "a negative row": lambda k, r: ([k], r - torch.tensor([[2, 0]], dtype=torch.int32), 5),
    "a twin not sent": lambda k, r: ([k], r + torch.tensor([[0, 2]], dtype=torch.int32), 5),
    "more references than rows": lambda k, r: ([k], torch.zeros(5, 2, dtype=torch.int32), 5),
    "fields of another length": lambda k, r: ([k[:1]], r, 5),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_malformed_references_are_refused_in_one_line(bad):
    kept, rep = _dropped()
    with pytest.raises(ValueError) as e:
        restore_repeats(*BAD[bad](kept, rep))
    assert "\n" not in str(e.value)


def _frame_references(rows: int = 2000, seed: int = 0) -> torch.Tensor:
    """``rep`` of a frame whose sequences share a 20-row prompt and whose tail rows are all zero (a
    gradient past the last label): runs of dropped rows with twins in order, and one twin for many."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-100, 100, (rows, 6), generator=g).to(torch.int8)
    for start in range(50, rows - 50, 50):
        codes[start : start + 20] = codes[:20]
        codes[start + 40 : start + 50] = 0
    return drop_repeats([codes])[1]


@pytest.mark.parametrize("rows", [50, 2000, 70_000])
def test_coded_references_round_trip_in_fewer_bytes(rows):
    rep = (
        _frame_references(2000) if rows == 2000 else drop_repeats([torch.zeros(rows, 2, dtype=torch.int8)])[1]
    )
    blob = encode_references(rep)
    assert blob is not None and torch.equal(decode_references(blob, rows), rep)
    if rows == 2000:  # 1,170 references: 9,360 bytes raw
        assert blob.numel() < 0.1 * rep.numel() * 4, blob.numel()  # measured: 2.5%
    assert encode_references(rep[:1]) is None  # one reference: no smaller coded
    assert encode_references(torch.empty(0, 2, dtype=torch.int32)) is None


BAD_CODED = {
    "truncated": lambda b, rows: (b[:-1], rows),
    "extended": lambda b, rows: (torch.cat([b, b[-4:]]), rows),
    "no header": lambda b, rows: (b[:3], rows),
    "as many references as rows": lambda b, rows: (b, int(b[:4].clone().view(torch.int32))),
    "2^31 - 1 references": lambda b, rows: (
        torch.cat([torch.tensor([2**31 - 1]).int().view(torch.uint8), b[4:]]),
        rows,
    ),
    "a reference past the frame": lambda b, rows: (b, rows - 60),  # the last is row 1949
    "five planes": lambda b, rows: (torch.cat([b[:4], torch.tensor([5], dtype=torch.uint8), b[5:]]), rows),
    "int8 blob": lambda b, rows: (b.view(torch.int8), rows),
}


@pytest.mark.parametrize("bad", list(BAD_CODED))
def test_malformed_coded_references_are_refused_in_one_line(bad, monkeypatch):
    blob = encode_references(_frame_references())
    if bad == "2^31 - 1 references":  # refused from the header, before any symbol is decoded
        monkeypatch.setattr(repeats, "decode_symbols", lambda *a: pytest.fail("decoded a symbol"))
    with pytest.raises(ValueError) as e:
        decode_references(*BAD_CODED[bad](blob, 2000))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("first_apart", [False, True])
@pytest.mark.parametrize("layout", [LONG, PLAIN, GRAD4, WIDE], ids=["tiers", "plain", "grad4bit", "bf16"])
def test_repeats_decode_bit_identical_with_fewer_bytes(layout, first_apart, entropy):
    plain = make_codec("lowrank", **layout, first_apart=first_apart)
    coded = make_codec("lowrank", **layout, first_apart=first_apart, repeats=True, entropy=entropy)
    x, ctx = _shared_prefix(), LinkContext()
    g = x.clone()
    g[:, 30:] = 0.0  # gradient rows past the last labelled position: all equal (zero)
    for direction, t in (("forward", x), ("backward", g)):
        enc_p, enc_c = (
            (plain.encode_forward, coded.encode_forward)
            if direction == "forward"
            else (
                plain.encode_backward,
                coded.encode_backward,
            )
        )
        dec_p, dec_c = (
            (plain.decode_forward, coded.decode_forward)
            if direction == "forward"
            else (
                plain.decode_backward,
                coded.decode_backward,
            )
        )
        raw, rep = enc_p(t, ctx), enc_c(t, ctx)
        assert ("erep" in rep) == entropy, direction  # the references coded when entropy is on
        refs = decode_references(rep["erep"], t[..., 0].numel()) if entropy else rep["rep"]
        assert refs.shape[0] > 0, direction
        assert torch.equal(dec_c(rep, ctx, tuple(t.shape)), dec_p(raw, ctx, tuple(t.shape))), direction
        assert payload_nbytes(rep) < payload_nbytes(raw), direction
        dtypes = coded.payload_dtypes()
        assert all(v.dtype == dtypes[n] for n, v in rep.items()), direction


def test_without_repeats_the_frame_costs_what_frame_bytes_says():
    """Random rows never repeat: the reference list is empty and the bytes are ``frame_bytes``
    exactly (with repeats it is an upper bound)."""
    coded = make_codec("lowrank", **LONG, first_apart=True, repeats=True)
    x = torch.randn(6, 40, H, generator=torch.Generator().manual_seed(2))
    for direction in ("forward", "backward"):
        enc = coded.encode_forward if direction == "forward" else coded.encode_backward
        p = enc(x, LinkContext())
        assert p["rep"].shape == (0, 2)
        assert payload_nbytes(p) == coded.frame_bytes(6 * 40, H, direction, sequences=6)


def test_a_frame_with_references_is_refused_by_a_run_without_and_the_reverse():
    with_rep = make_codec("lowrank", **LONG, repeats=True)
    without = make_codec("lowrank", **LONG)
    x, ctx = _shared_prefix(), LinkContext()
    shape = tuple(x.shape)
    with pytest.raises(ValueError, match="repeats"):
        without.decode_forward(with_rep.encode_forward(x, ctx), ctx, shape)
    with pytest.raises(ValueError, match="repeats"):
        with_rep.decode_forward(without.encode_forward(x, ctx), ctx, shape)
    p = with_rep.encode_forward(x, ctx)
    for bad in (
        torch.zeros(x.shape[0] * x.shape[1], 2, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
    ):
        with pytest.raises(ValueError, match="repeated rows of its"):
            with_rep.decode_forward(p | {"rep": bad}, ctx, shape)
    del p["q1"]
    with pytest.raises(ValueError, match="lacks its q1"):
        with_rep.decode_forward(p, ctx, shape)


def test_repeats_flag_reaches_the_codec_and_its_record():
    from node.argv import config_from_args
    from node.cli import FlagError, build_parser, check_run_flags, resolve_defaults
    from node.stage.links import codec_settings

    def resolved(argv):
        args = build_parser().parse_args(["join", *argv])
        resolve_defaults(args)
        check_run_flags(args)
        return config_from_args(args)

    on = codec_settings(resolved(["--microbatch-tokens", "0", "--lowrank-repeats", "on"]))
    assert on["repeats"] is True and make_codec(on.pop("codec"), **on).repeats
    assert "repeats" not in codec_settings(resolved(["--microbatch-tokens", "0"]))
    assert "repeats" not in codec_settings(
        resolved(["--microbatch-tokens", "2048", "--lowrank-repeats", "off"])
    )
    with pytest.raises(FlagError, match="--lowrank-repeats does nothing with --codec pca"):
        resolved(["--codec", "pca", "--lowrank-repeats", "on"])
