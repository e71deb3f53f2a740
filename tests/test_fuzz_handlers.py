"""Property-based fuzzing of the frame decoder and of a stage's forward handler (CI-sized).

A real tail-stage StageRuntime (tiny:2, no networking) gets random bytes, mutated and
truncated valid frames, huge declared sizes, NaN payloads and wrong shapes/codecs/boundaries
through ``handle_stream`` and ``serve_forward``. Nothing may escape, nothing may hang, known
defects get their typed error code, and hostile sizes cost no memory. The harness lives in
``bench/reliability/fuzz.py`` (which runs the same cases at scale). The runtime defects its first run
found (out-of-range labels, empty dimensions, huge finite values, integer activations) are
fixed and pinned by the tests at the end.
"""

from __future__ import annotations

import asyncio
import random

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.reliability.fuzz import (
    DEFECTS,
    MUTATION_OPS,
    apply_mutations,
    decode_only,
    huge_declared_cases,
    install_capture,
    make_runtime,
    measure_peak,
    pack,
    prefixed,
    run_serve,
    run_stream,
    valid_body,
)
from protocol.frames import decode_frame

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # reproducible in CI; bench/reliability/fuzz.py explores at random
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FRAME_CODES = {"malformed", "too_large", "version", "wrong_run", "dtype", "shape", "non_finite", "range"}
CASE_TIMEOUT = 20.0


def _env(codec: str):
    loop = asyncio.new_event_loop()
    rt = make_runtime(hop_timeout=2.0, codec=codec)
    install_capture()
    main = None if codec == "dense" else rt.linkio.link_in.main
    bases = [pack(valid_body(random.Random(i), codec=main)) for i in range(8)]
    return loop, rt, bases


def _close(env) -> None:
    loop, rt, _ = env
    rt.pool.shutdown(wait=True)
    loop.close()


@pytest.fixture(scope="module")
def env():
    e = _env("dense")
    yield e
    _close(e)


# the default codec (PCA with its fixed basis) and the per-frame-basis lowrank codec: their decoders
# take the mutated payloads (coefficients, block scales, bases) that dense never sees
@pytest.fixture(scope="module", params=["pca", "lowrank"])
def codec_env(request):
    e = _env(request.param)
    yield e
    _close(e)


def _stream(env, wire: bytes, **kw):
    loop, rt, _ = env
    return loop.run_until_complete(run_stream(rt, wire, timeout=CASE_TIMEOUT, **kw))


def _assert_sane(out) -> None:
    """No crash, no hang, always a decodable reply, and a hostile frame's error is a frame error.

    The runtime bugs this fuzzer found (no reply, or ``busy`` for a bad frame) are fixed: either
    outcome now fails, whatever its message (it used to pass when it matched a known bug)."""
    assert out.kind in ("backward", "error"), out
    if out.kind == "error":
        assert out.code in FRAME_CODES, out


mutations = st.lists(
    st.tuples(
        st.integers(0, MUTATION_OPS - 1),
        st.integers(0, 2**32 - 1),
        st.binary(min_size=1, max_size=16),
    ),
    min_size=1,
    max_size=6,
)

# msgpack values shaped like a frame body, to get past the first checks of the decoder
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=64),
)
values = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
frame_keys = st.sampled_from(
    ["v", "k", "run", "step", "mb", "bd", "path", "codec", "seed", "bv", "shape", "t"]
)
tensor_spec = st.fixed_dictionaries(
    {
        "d": st.sampled_from(["float32", "bfloat16", "int16", "int64", "float64", "x"]),
        "s": st.lists(st.integers(-2, 2**31), max_size=5),
        "b": st.binary(max_size=256),
    }
)


# ---------------------------------------------------------------------- the decoder


@FUZZ
@given(st.binary(max_size=2048))
def test_decoder_random_bytes(data):
    out = decode_only(data)
    assert out.kind in ("error", "decoded"), out.detail
    assert out.kind == "decoded" or out.code in FRAME_CODES


@FUZZ
@given(st.integers(0, 7), mutations)
def test_decoder_mutated_valid_frames(env, base, ops):
    out = decode_only(apply_mutations(env[2][base], ops))
    assert out.kind in ("error", "decoded"), out.detail


@FUZZ
@given(
    st.dictionaries(frame_keys, values, max_size=12),
    st.dictionaries(st.text(max_size=6), tensor_spec, max_size=3),
    st.booleans(),
)
def test_decoder_structured_garbage(fields, tensors, with_valid_header):
    body = dict(valid_body(random.Random(0))) if with_valid_header else {}
    body.update(fields)
    body["t"] = tensors
    out = decode_only(msgpack.packb(body, use_bin_type=True))
    assert out.kind in ("error", "decoded"), out.detail


# ---------------------------------------------------------------------- the handler


@FUZZ
@given(st.sampled_from(sorted(DEFECTS)), st.integers(0, 2**32 - 1))
def test_handler_known_defects_get_their_code(env, name, seed):

    _, rt, _ = env
    build, expected = DEFECTS[name]
    rejected = rt.metrics.rejected_frames
    out = _stream(env, build(random.Random(seed)))
    _assert_sane(out)
    assert out.label in expected, f"{name}: {out.label} {out.detail}"
    if out.kind == "error" and out.code in FRAME_CODES:
        assert rt.metrics.rejected_frames == rejected + 1


def _mutated_frame_is_handled(env, base: int, ops, mutate_prefix: bool) -> None:
    wire = prefixed(apply_mutations(env[2][base], ops))
    if mutate_prefix:
        wire = apply_mutations(wire, ops[:1])
    _assert_sane(_stream(env, wire))


@FUZZ
@given(st.integers(0, 7), mutations, st.booleans())
def test_handler_mutated_frames(env, base, ops, mutate_prefix):
    _mutated_frame_is_handled(env, base, ops, mutate_prefix)


@FUZZ
@given(st.binary(max_size=512))
def test_handler_random_bytes(env, data):
    out = _stream(env, data)
    _assert_sane(out)
    assert out.kind == "error"


def test_codec_frames_the_fuzzer_starts_from_are_served(codec_env):
    """The unmutated frames of each codec get a backward reply: mutations start from valid frames."""
    loop, rt, bases = codec_env
    for wire in bases:
        out = loop.run_until_complete(run_stream(rt, prefixed(wire), timeout=CASE_TIMEOUT))
        assert out.kind == "backward" and not out.poisoned and not out.nonfinite_reply, out


@FUZZ
@given(st.integers(0, 7), mutations, st.booleans())
def test_handler_mutated_frames_of_other_codecs(codec_env, base, ops, mutate_prefix):
    _mutated_frame_is_handled(codec_env, base, ops, mutate_prefix)


@FUZZ
@given(st.integers(0, 7), mutations)
def test_serve_forward_on_decoded_mutations_of_other_codecs(codec_env, base, ops):
    loop, rt, bases = codec_env
    out = loop.run_until_complete(run_serve(rt, apply_mutations(bases[base], ops), timeout=CASE_TIMEOUT))
    _assert_sane(out)
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in rt.params)


@FUZZ
@given(st.integers(0, 7), st.data())
def test_codec_payload_tensors_of_the_wrong_size_or_shape_are_frame_errors(codec_env, base, data):
    """Payload tensors that are self-consistent on the wire (bytes match the declared shape) but not
    what the codec sent: cut, grown, or reshaped. The decoder must refuse them typed, not crash."""
    loop, rt, bases = codec_env
    body = msgpack.unpackb(bases[base], raw=False)
    names = sorted(k for k in body["t"] if k != "labels")
    name = data.draw(st.sampled_from(names))
    spec = dict(body["t"][name])
    item = {"bfloat16": 2, "float32": 4, "float16": 2, "int8": 1, "int16": 2, "int32": 4}[spec["d"]]
    n = len(spec["b"]) // item
    how = data.draw(st.sampled_from(["cut", "grow", "reshape"]))
    if how == "cut":
        m = data.draw(st.integers(0, max(n - 1, 0)))
        spec["b"], spec["s"] = spec["b"][: m * item], [m]
    elif how == "grow":
        extra = data.draw(st.integers(1, 64))
        spec["b"], spec["s"] = spec["b"] + bytes(extra * item), [n + extra]
    else:
        spec["s"] = [1, n] if len(spec["s"]) != 2 or spec["s"][0] != 1 else [n]
    body["t"][name] = spec
    out = _stream(codec_env, prefixed(pack(body)))
    _assert_sane(out)
    assert out.kind == "error" or how == "reshape", out  # a cut or grown payload never decodes


def test_bans_on_a_peer_sending_garbage_is_cut_off_and_others_still_served():
    """With the node's real ban list: after its threshold of invalid frames a peer's streams close
    unanswered (it costs nothing more), while another peer's valid frame is still served."""
    import types

    from bench.reliability.fuzz import FakeWriter

    loop = asyncio.new_event_loop()
    rt = make_runtime(hop_timeout=2.0, codec="pca", bans=True)
    try:
        good = pack(valid_body(random.Random(0), codec=rt.linkio.link_in.main))
        outs = [_stream((loop, rt, None), prefixed(b"garbage" * 3)) for _ in range(rt.bans.threshold)]
        assert all(o.kind == "error" and o.code == "malformed" for o in outs), outs
        assert rt.bans.is_banned("QmFuzzPeer")
        banned = _stream((loop, rt, None), prefixed(good))  # even a valid frame: no work, no reply
        assert banned.kind == "no_reply", banned

        async def from_other_peer():
            reader = asyncio.StreamReader()
            reader.feed_data(prefixed(good))
            reader.feed_eof()
            writer = FakeWriter()
            await rt.handle_stream(types.SimpleNamespace(peer_id="QmHonestPeer"), reader, writer)
            return decode_frame(writer.reply(), run_id="r").kind

        assert loop.run_until_complete(from_other_peer()) == "backward"
    finally:
        rt.pool.shutdown(wait=True)
        loop.close()


@FUZZ
@given(st.integers(0, 7), mutations)
def test_serve_forward_on_decoded_mutations(env, base, ops):
    loop, rt, bases = env
    out = loop.run_until_complete(run_serve(rt, apply_mutations(bases[base], ops), timeout=CASE_TIMEOUT))
    _assert_sane(out)


def test_huge_declared_sizes_cost_no_memory(env):
    loop, rt, _ = env
    for name, wire in huge_declared_cases():
        out, peak = measure_peak(lambda w=wire: run_stream(rt, w, timeout=CASE_TIMEOUT), loop)
        assert out.kind == "error" and out.code in ("too_large", "malformed", "shape"), (name, out)
        assert peak < 4 * 2**20, f"{name}: peak {peak} bytes"


def test_slow_sender_is_cut_off_by_the_deadline(env):
    loop, rt, bases = env
    wire = prefixed(bases[0])
    old = rt.cfg.hop_timeout
    rt.cfg.hop_timeout = 0.3
    try:
        out = _stream(env, wire[: len(wire) // 2], eof=False)  # never sends the rest, never closes
    finally:
        rt.cfg.hop_timeout = old
    assert out.kind == "error" and out.code == "busy" and out.seconds < 5, out


# ---------------------------------------------------------------------- known runtime bugs (pinned)


def _bug_case(env, name, seed=1):

    return _stream(env, DEFECTS[name][0](random.Random(seed)))


def test_bug_labels_out_of_range_get_an_error_reply(env):
    out = _bug_case(env, "labels_out_of_range")
    assert out.kind == "error" and out.code in FRAME_CODES, out


@pytest.mark.parametrize("name", ["zero_seq", "zero_batch"])
def test_bug_empty_dimensions_are_shape_errors(env, name):
    out = _bug_case(env, name)
    assert out.label == "error:shape", out


def test_bug_huge_values_do_not_poison_gradients(env):
    _, rt, _ = env
    outs = [_bug_case(env, "huge_finite_values", seed) for seed in range(4)]
    assert all(not o.poisoned and not o.nonfinite_reply for o in outs), outs
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in rt.params)


def test_bug_integer_activations_are_refused(env):
    out = _bug_case(env, "integer_activations")
    assert out.label == "error:dtype", out
