"""Property-based fuzzing of the frame decoder and of a stage's forward handler (CI-sized).

A real tail-stage StageRuntime (tiny:2, no networking) gets random bytes, mutated and
truncated valid frames, huge declared sizes, NaN payloads and wrong shapes/codecs/boundaries
through ``handle_stream`` and ``serve_forward``. Nothing may escape, nothing may hang, known
defects get their typed error code, and hostile sizes cost no memory. The harness lives in
``bench/fuzz.py`` (which runs the same cases at scale). The runtime defects its first run
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

from bench.fuzz import (
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

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # reproducible in CI; bench/fuzz.py explores at random
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FRAME_CODES = {"malformed", "too_large", "version", "wrong_run", "dtype", "shape", "non_finite", "range"}
CASE_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def env():

    loop = asyncio.new_event_loop()
    rt = make_runtime(hop_timeout=2.0)
    install_capture()
    bases = [pack(valid_body(random.Random(i))) for i in range(8)]
    yield loop, rt, bases
    rt.pool.shutdown(wait=True)
    loop.close()


def _stream(env, wire: bytes, **kw):
    loop, rt, _ = env
    return loop.run_until_complete(run_stream(rt, wire, timeout=CASE_TIMEOUT, **kw))


def _assert_sane(out) -> None:
    """No crash, no hang, a decodable reply; a missing reply only for a known runtime bug."""
    assert out.kind not in ("escaped", "hang", "bad_reply"), out
    if out.kind == "no_reply":
        assert out.bug is not None, f"handler swallowed an unknown exception without replying: {out.detail}"
    if out.kind == "error":
        assert out.code in FRAME_CODES or (out.code == "busy" and out.bug), out


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


@FUZZ
@given(st.integers(0, 7), mutations, st.booleans())
def test_handler_mutated_frames(env, base, ops, mutate_prefix):
    wire = prefixed(apply_mutations(env[2][base], ops))
    if mutate_prefix:
        wire = apply_mutations(wire, ops[:1])
    _assert_sane(_stream(env, wire))


@FUZZ
@given(st.binary(max_size=512))
def test_handler_random_bytes(env, data):
    out = _stream(env, data)
    _assert_sane(out)
    assert out.kind == "error"


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
