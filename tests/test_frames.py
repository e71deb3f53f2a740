"""Frames round-trip exactly, and every defect is rejected with its own typed error."""

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.frames import (
    MAX_FRAME_BYTES,
    BadDtype,
    Frame,
    FrameError,
    FrameTooLarge,
    MalformedFrame,
    NonFinite,
    ShapeMismatch,
    UnknownVersion,
    WrongRun,
    decode_frame,
    encode_frame,
)


def _frame(**kw) -> Frame:
    base = dict(
        kind="forward",
        run_id="run-1",
        step=7,
        microbatch=2**40 + 3,
        boundary=1,
        path=["QmA", "QmB"],
        codec="dense",
        seed=2**64 - 1,
        shape=[2, 3, 4],
        tensors={
            "h": torch.randn(2, 3, 4).to(torch.bfloat16),
            "labels": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        },
        meta={"loss": 1.5, "tokens": 6},
    )
    base.update(kw)
    return Frame(**base)


def _raw(frame: Frame) -> dict:
    return msgpack.unpackb(encode_frame(frame), raw=False)


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_round_trip_is_exact():
    f = _frame()
    g = decode_frame(encode_frame(f), run_id="run-1")
    for field in (
        "kind",
        "run_id",
        "step",
        "microbatch",
        "boundary",
        "path",
        "codec",
        "seed",
        "shape",
        "meta",
    ):
        assert getattr(g, field) == getattr(f, field), field
    assert set(g.tensors) == {"h", "labels"}
    for k in f.tensors:
        assert g.tensors[k].dtype == f.tensors[k].dtype
        assert torch.equal(g.tensors[k], f.tensors[k])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
    ],
)
def test_every_wire_dtype_round_trips(dtype):
    t = (torch.randn(5, 7) * 10).to(dtype)
    g = decode_frame(encode_frame(_frame(tensors={"x": t})))
    assert torch.equal(g.tensors["x"], t)


def test_empty_tensor_round_trips():
    g = decode_frame(encode_frame(_frame(tensors={"x": torch.zeros(0, 4)})))
    assert g.tensors["x"].shape == (0, 4)


def test_oversized_frame_rejected_before_parsing():
    data = encode_frame(_frame())
    with pytest.raises(FrameTooLarge):
        decode_frame(data, max_bytes=len(data) - 1)
    with pytest.raises(FrameTooLarge):
        encode_frame(_frame(), max_bytes=10)
    assert MAX_FRAME_BYTES < 2**31


def test_wrong_version_and_run():
    body = _raw(_frame())
    body["v"] = 99
    with pytest.raises(UnknownVersion):
        decode_frame(_pack(body))
    with pytest.raises(WrongRun):
        decode_frame(encode_frame(_frame()), run_id="other-run")


def test_dtype_outside_whitelist():
    body = _raw(_frame())
    body["t"]["h"]["d"] = "complex64"
    with pytest.raises(BadDtype):
        decode_frame(_pack(body))
    with pytest.raises(BadDtype):
        encode_frame(_frame(tensors={"x": torch.zeros(2, dtype=torch.complex64)}))


def test_shape_does_not_match_bytes():
    body = _raw(_frame())
    body["t"]["h"]["s"] = [2, 3, 5]
    with pytest.raises(ShapeMismatch):
        decode_frame(_pack(body))
    body["t"]["h"]["s"] = [-1, 12]
    with pytest.raises(ShapeMismatch):
        decode_frame(_pack(body))


def test_huge_declared_shape_allocates_nothing():
    body = _raw(_frame())
    body["t"]["h"]["s"] = [2**30, 2**30]
    with pytest.raises(ShapeMismatch):
        decode_frame(_pack(body))


@pytest.mark.parametrize("where", ["tensor", "frame"])
def test_shape_whose_element_count_overflows_is_refused_typed(where):
    """A zero-byte tensor declared [2^31-1, 2^31-1, 2^31-1, 0] (a live-node fuzz finding): torch
    cannot build it, so it must fail as a typed ShapeMismatch, never reach torch."""
    body = _raw(_frame())
    huge = [2**31 - 1, 2**31 - 1, 2**31 - 1, 0]
    if where == "tensor":
        body["t"]["h"] = {"d": "bfloat16", "s": huge, "b": b""}
    else:
        body["shape"] = huge
    with pytest.raises(ShapeMismatch, match="elements"):
        decode_frame(_pack(body))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values(bad):
    t = torch.zeros(2, 3)
    t[1, 2] = bad
    with pytest.raises(NonFinite):
        decode_frame(encode_frame(_frame(tensors={"h": t})))
    assert decode_frame(encode_frame(_frame(tensors={"h": t})), check_finite=False).tensors[
        "h"
    ].isnan().any() or bad == float("inf")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("run"),
        lambda b: b.update(k="sideways"),
        lambda b: b.update(step=-1),
        lambda b: b.update(step="7"),
        lambda b: b.update(path="QmA"),
        lambda b: b.update(meta={"x": [1, 2]}),
        lambda b: b.update(t={"h": {"d": "float32"}}),
        lambda b: b.update(t={"h": {"d": "float32", "s": [1], "b": "text"}}),
        lambda b: b.update(shape=[1, 2, 3, 4, 5]),
    ],
)
def test_malformed_headers(mutate):
    body = _raw(_frame())
    mutate(body)
    with pytest.raises(FrameError):
        decode_frame(_pack(body))


def test_not_msgpack_at_all():
    for data in (b"", b"\x00" * 10, b"\xc1", b"GET / HTTP/1.1\r\n", _pack([1, 2, 3])):
        with pytest.raises(MalformedFrame):
            decode_frame(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(data):
    try:
        decode_frame(data)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncated_or_flipped_frames_fail_typed(data):
    raw = bytearray(encode_frame(_frame()))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    try:
        decode_frame(bytes(raw))
    except FrameError:
        pass


def test_labels_pack_to_two_bytes_and_back():
    from protocol.frames import pack_labels, unpack_labels

    labels = torch.tensor([[7, 0, 5, 49151], [32767, 32768, 65533, -100]]).repeat(1, 8)
    labels[1, :-1] = labels[1, :-1].abs()  # one ignored position in 64: pretraining-like
    packed = pack_labels(labels, vocab=65534)
    assert set(packed) == {"labels"} and packed["labels"].dtype == torch.int16  # mostly labelled: dense
    assert torch.equal(unpack_labels(packed, [2, 32]), labels)
    wide = pack_labels(labels, vocab=200_000)
    assert wide["labels"].dtype == torch.int32 and torch.equal(unpack_labels(wide, [2, 32]), labels)
    with pytest.raises(BadDtype):
        unpack_labels({"labels": torch.zeros(2, 32, dtype=torch.float32)}, [2, 32])


def test_answer_only_labels_travel_sparse_and_decode_exactly():
    """Fine-tuning labels a few answer positions per row: only those ids and a bit per position
    travel, and they decode to the very same (batch, tokens) labels."""
    from protocol.frames import pack_labels, unpack_labels

    g = torch.Generator().manual_seed(0)
    labels = torch.full((37, 55), -100)
    for r in range(37):
        n = int(torch.randint(1, 5, (1,), generator=g))  # the answer: 1-4 tokens at the row's end
        labels[r, 55 - 10 - n : 55 - 10] = torch.randint(0, 49152, (n,), generator=g)
    packed = pack_labels(labels, vocab=49152)
    assert set(packed) == {"labels", "label_at"}
    assert torch.equal(unpack_labels(packed, [37, 55, 64]), labels)
    n = labels.numel()
    sent = sum(t.numel() * t.element_size() for t in packed.values())
    assert sent == -(-n // 8) + int((labels != -100).sum()) * 2 < n * 2 / 4
    # a bit that claims a label the frame does not carry, or a mask for another shape: refused
    bad = dict(packed, label_at=packed["label_at"].clone())
    bad["label_at"][0] ^= 1
    with pytest.raises(ShapeMismatch):
        unpack_labels(bad, [37, 55])
    with pytest.raises(ShapeMismatch):
        unpack_labels(packed, [37, 56])
