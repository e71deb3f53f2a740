"""The lowrank codec's lossless entropy stage (compression.entropy, ``entropy=True``).

The coded link must decode to the very tensors the uncoded one does (learning unchanged by
construction), send fewer bytes and count them exactly, and refuse a damaged coded field in one
line without decoding past the symbol count its frame's shape fixes.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from compression.codec import LinkContext, payload_nbytes
from compression.entropy import decode_symbols, encode_symbols, max_blob_bytes
from compression.registry import make_codec
from protocol.frames import Frame, decode_frame, encode_frame

H = 256
LONG = {  # the long-frame layout, narrowed to H = 256 (tiers of 8 and 24 directions, blocks of 8)
    "k": 32,
    "coeff_dtype": "int8",
    "block": 8,
    "basis_dtype": "int8",
    "basis_block": 32,
    "tiers": ((8, 8), (24, 4)),
    "backward_tiers": ((8, 8), (24, 4)),
}
PLAIN = {"k": 48, "coeff_dtype": "int8", "basis_dtype": "int8", "basis_block": 32}  # short frames
GRAD4 = {"k": 48, "k_backward": 64, "backward_bits": 4, "basis_dtype": "int8", "basis_block": 32}
STEP = {
    "k": 32,
    "k_backward": 48,
    "step": 1.0,
    "backward_step": 1.0,
    "basis_dtype": "int8",
    "basis_block": 32,
}


def _frame(kind: str, b: int = 40, t: int = 50) -> torch.Tensor:
    """A (b, t, H) frame: Gaussian rows, or heavy-tailed ones with LM-like sinks at position 0."""
    g = torch.Generator().manual_seed(3)
    low = torch.randn(b, t, 12, generator=g) @ torch.randn(12, H, generator=g)
    x = low + 0.1 * torch.randn(b, t, H, generator=g)
    if kind == "heavy":
        x = x * torch.distributions.StudentT(1.5).sample((b, t, 1)).abs().clamp(max=50)
        x[:, 0] *= 100.0  # the attention sink: ~100x the others' norm
        x[:, :, 5] += 30.0  # a massive-activation channel
    return x


def _pair(layout: dict, **kw):
    return make_codec("lowrank", **layout, **kw), make_codec("lowrank", **layout, entropy=True, **kw)


def _codes(codec, direction: str):
    enc = codec.encode_forward if direction == "forward" else codec.encode_backward
    dec = codec.decode_forward if direction == "forward" else codec.decode_backward
    return enc, dec


@pytest.mark.parametrize("kind", ["gauss", "heavy"])
@pytest.mark.parametrize("first_apart", [False, True])
@pytest.mark.parametrize("layout", [LONG, PLAIN, GRAD4, STEP], ids=["tiers", "plain", "grad4bit", "step"])
def test_entropy_coded_link_decodes_bit_identical_with_fewer_bytes(kind, first_apart, layout):
    plain, coded = _pair(layout, first_apart=first_apart)
    x, ctx = _frame(kind), LinkContext()
    for direction in ("forward", "backward"):
        (enc_p, dec_p), (enc_c, dec_c) = _codes(plain, direction), _codes(coded, direction)
        raw, ent = enc_p(x, ctx), enc_c(x, ctx)
        fields = {"e" + f[0] for f in coded._int_fields(direction, H)} | (
            {"eq"} if "step" in layout else set()
        )
        assert fields <= set(ent), f"{direction}: {sorted(fields - set(ent))} not entropy coded"
        assert torch.equal(dec_c(ent, ctx, tuple(x.shape)), dec_p(raw, ctx, tuple(x.shape))), direction
        assert payload_nbytes(ent) < payload_nbytes(raw), direction
        dtypes = coded.payload_dtypes()  # what a receiving node checks before decoding
        assert all(t.dtype == dtypes[name] for name, t in ent.items()), direction
        assert len(ent) == len(raw)  # a coded field replaces its raw one: the frame's tensor count holds


def test_gradient_rows_with_zero_scales_are_skipped_and_still_identical():
    """Rows past the last labelled position carry a zero gradient: their codes are known to be 0
    from the zero block scales and are not coded at all."""
    plain, coded = _pair(LONG)
    g = _frame("gauss")
    g[:, 30:] = 0.0
    ctx = LinkContext()
    raw, ent = plain.encode_backward(g, ctx), coded.encode_backward(g, ctx)
    assert torch.equal(
        coded.decode_backward(ent, ctx, tuple(g.shape)), plain.decode_backward(raw, ctx, g.shape)
    )
    full = coded.encode_backward(_frame("gauss"), ctx)
    assert ent["eq1"].numel() < 0.75 * full["eq1"].numel()  # 40% of the rows are zero


def test_the_bytes_counted_are_the_bytes_serialized():
    """``payload_nbytes`` of a coded frame is exactly the tensor bytes the frame encoder writes; the
    codec's ``frame_bytes`` is the uncoded size, an upper bound (exact with entropy off)."""
    plain, coded = _pair(LONG, first_apart=True)
    x, ctx = _frame("heavy"), LinkContext()
    for direction in ("forward", "backward"):
        for codec in (plain, coded):
            p = _codes(codec, direction)[0](x, ctx)
            body = encode_frame(Frame(kind=direction, run_id="r", shape=list(x.shape), tensors=p))
            back = decode_frame(body, run_id="r")
            specs = msgpack.unpackb(body, raw=False)["t"]
            assert sum(len(spec["b"]) for spec in specs.values()) == payload_nbytes(p)
            assert torch.equal(
                _codes(codec, direction)[1](back.tensors, ctx, tuple(x.shape)),
                _codes(codec, direction)[1](p, ctx, tuple(x.shape)),
            )
            bound = codec.frame_bytes(x.shape[0] * x.shape[1], H, direction, sequences=x.shape[0])
            if codec is plain:
                assert payload_nbytes(p) == bound
            else:
                assert payload_nbytes(p) < bound


def test_incompressible_field_is_sent_raw():
    """Uniform symbols over the whole range would not be smaller coded: the coder says so (None) and
    the codec keeps that field as it was."""
    u = torch.randint(-127, 128, (4000,), generator=torch.Generator().manual_seed(0))
    assert encode_symbols(u, -127, 127, raw_nbytes=u.numel()) is None
    skewed = (torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3).round().clamp(-127, 127)
    blob = encode_symbols(skewed, -127, 127, raw_nbytes=4000)
    assert blob is not None and torch.equal(decode_symbols(blob, 4000, -127, 127), skewed.long())


def _coded_frame():
    _, coded = _pair(LONG, first_apart=True)
    x = _frame("heavy")
    return coded, x, coded.encode_forward(x, LinkContext())


def _flip(t: torch.Tensor, i: int) -> torch.Tensor:
    t = t.clone()
    t[i] ^= 0x5A
    return t


DAMAGE = {
    "truncated by a word": lambda p: p | {"eq1": p["eq1"][:-4]},
    "truncated by a byte": lambda p: p | {"eq1": p["eq1"][:-1]},
    "extended by a word": lambda p: p | {"eq1": torch.cat([p["eq1"], p["eq1"][-4:]])},
    "a stream byte flipped": lambda p: p | {"eq0": _flip(p["eq0"], p["eq0"].numel() // 2)},
    "the last word flipped": lambda p: p | {"evq": _flip(p["evq"], -2)},
    "a table byte flipped": lambda p: p | {"eq0": _flip(p["eq0"], 40)},
    "a range beyond the codes": lambda p: (
        p | {"eq1": torch.cat([torch.tensor([9, 14], dtype=torch.uint8), p["eq1"][2:]])}
    ),
    "empty": lambda p: p | {"evq": p["evq"][:0]},
    "oversized": lambda p: p | {"eq0": torch.cat([p["eq0"], torch.full((10**6,), 7, dtype=torch.uint8)])},
    "wrong dtype": lambda p: p | {"eq0": p["eq0"].to(torch.int8)},
    "coded and raw": lambda p: p | {"q0": torch.zeros(p["s0"].shape[0], 8, dtype=torch.int8)},
    "scales of other rows": lambda p: p | {"s0": p["s0"][:-1]},
    "a basis wider than k": lambda p: p | {"vscale": torch.ones(40, H // 32, dtype=torch.bfloat16)},
    "scales of no rows": lambda p: p | {"vscale": torch.ones((), dtype=torch.bfloat16)},
    "the last word zero": lambda p: (
        p | {"eq1": torch.cat([p["eq1"][:-4], torch.zeros(4, dtype=torch.uint8)])}
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_coded_field_is_refused_in_one_line(damage):
    coded, x, p = _coded_frame()
    assert {"eq0", "eq1", "evq"} <= set(p)
    bad = DAMAGE[damage](dict(p))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        coded.decode_forward(bad, LinkContext(), tuple(x.shape))
    assert "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 2.0  # refused up front, never a long decode


def test_random_blobs_decode_or_are_refused_never_anything_else():
    """Whatever bytes arrive in a coded field, decoding ends in a ValueError or in codes in range."""
    coded, x, p = _coded_frame()
    g = torch.Generator().manual_seed(5)
    for i in range(200):
        n = int(torch.randint(0, 3 * p["eq0"].numel(), (1,), generator=g))
        blob = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if i % 2:  # a plausible header and table: the stream itself is what is random
            blob[: 2 + 255] = p["eq0"][: 2 + 255][: blob.numel()]
        try:
            coded.decode_forward(p | {"eq0": blob}, LinkContext(), tuple(x.shape))
        except ValueError:
            continue


def test_a_coded_field_is_refused_by_a_run_that_codes_none():
    coded, x, p = _coded_frame()
    plain = make_codec("lowrank", **LONG, first_apart=True)
    with pytest.raises(ValueError, match="entropy-coded"):
        plain.decode_forward(p, LinkContext(), tuple(x.shape))


def test_decoder_decodes_the_count_the_shape_gives_and_no_other():
    """A blob longer than any coding of ``count`` symbols could be is refused before decoding; a
    blob read with another count than the sender's (a frame whose shape was altered) is refused."""
    with pytest.raises(ValueError, match="too long"):
        decode_symbols(torch.zeros(max_blob_bytes(10, 3) + 4, dtype=torch.uint8), 10, -1, 1)
    sym = (torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 5).round().clamp(-7, 7).long()
    blob = encode_symbols(sym, -7, 7, raw_nbytes=2500)
    assert blob is not None and torch.equal(decode_symbols(blob, 5000, -7, 7), sym)
    for count in (4999, 5001, 2500, 10_000):
        with pytest.raises(ValueError, match="not used up|too long"):
            decode_symbols(blob, count, -7, 7)


@pytest.mark.parametrize("value", [-127, 0, 3, 127])
def test_a_field_of_one_repeated_symbol_codes_and_decodes(value):
    """Every code equal (an all-zero gradient group, a one-row frame): a one-entry table, which the
    coder cannot take alone, still codes to a few bytes and back."""
    sym = torch.full((700,), value, dtype=torch.int64)
    blob = encode_symbols(sym, -127, 127, raw_nbytes=700)
    assert blob is not None and blob.numel() < 16 and torch.equal(decode_symbols(blob, 700, -127, 127), sym)


def test_entropy_flag_reaches_the_codec_and_its_record():
    from node.argv import config_from_args
    from node.cli import FlagError, build_parser, check_run_flags, resolve_defaults
    from node.stage.links import codec_settings

    def resolved(argv):
        args = build_parser().parse_args(["join", *argv])
        resolve_defaults(args)
        check_run_flags(args)
        return config_from_args(args)

    on = codec_settings(resolved(["--microbatch-tokens", "0", "--lowrank-entropy", "on"]))
    assert on["entropy"] is True and make_codec(on.pop("codec"), **on).entropy
    off = codec_settings(resolved(["--microbatch-tokens", "2048", "--lowrank-entropy", "off"]))
    assert "entropy" not in off
    with pytest.raises(FlagError, match="--lowrank-entropy does nothing with --codec dense"):
        resolved(["--codec", "dense", "--lowrank-entropy", "on"])


# slow: a real two-process swarm (~75 s); the codec-level tests above are what CI runs
@pytest.mark.slow
def test_swarm_with_both_lossless_stages_trains_and_sends_fewer_bytes(tmp_path):
    """The default long-frame link with --lowrank-entropy and --lowrank-repeats on, through real
    frames, p2pd and the DHT: the record carries both settings, the loss falls, and each direction
    sends fewer bytes per token than the uncoded frame (``frame_bytes``, its upper bound)."""
    from tests.conftest import run_swarm

    text = "Volunteers train together over slow links, so every byte on the wire counts. "
    data = tmp_path / "text.txt"
    data.write_text("\n\n".join(text * 3 for _ in range(60)))
    flags = ["--nodes", "2", "--stages", "2", "--steps", "12", "--model", "tiny:2:640", "--lr", "1e-3"]
    flags += ["--seq-len", "128", "--microbatch", "4", "--batch-tokens", "512", "--data", str(data)]
    flags += ["--microbatch-tokens", "2048", "--lowrank-entropy", "on", "--lowrank-repeats", "on"]
    rep = run_swarm(tmp_path / "run", *flags, timeout=400, codec=None)
    published = rep["codec_settings"]
    assert published["entropy"] is True and published["repeats"] is True
    loss = rep["loss"]
    assert sum(loss[-3:]) / 3 < 0.9 * sum(loss[:3]) / 3
    tiers = ((24, 8), (88, 4))
    plain = make_codec(
        "lowrank", tiers=tiers, backward_tiers=tiers, first_apart=True, basis_dtype="int8", basis_block=32
    )
    for lk in rep["links"]:
        bound = plain.frame_bytes(16 * 128, 640, lk["direction"], sequences=16) / (16 * 128)
        assert lk["bytes_per_token"] < bound, lk
