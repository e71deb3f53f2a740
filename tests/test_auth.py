"""Swarm key: only frames signed with the key verify; key files must be private."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from protocol.auth import (
    HEADER_BYTES,
    ReplayGuard,
    SwarmKeyError,
    Unauthorized,
    key_id,
    load_swarm_key,
    make_swarm_key,
    sign,
    verify,
)
from protocol.frames import Frame, FrameError, decode_frame, encode_frame, error_frame

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
NOW = 1_700_000_000.0


def _frame_bytes() -> bytes:
    f = Frame(kind="forward", run_id="r", shape=[1, 2, 4], tensors={"h": torch.ones(1, 2, 4)})
    return encode_frame(f)


def test_signed_frame_verifies_and_decodes():
    data = _frame_bytes()
    signed = sign(KEY, data, now=NOW)
    assert len(signed) == len(data) + HEADER_BYTES
    out = verify(KEY, signed, now=NOW + 1)
    assert out == data
    assert decode_frame(out, run_id="r").shape == [1, 2, 4]


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda s: verify(OTHER, s, now=NOW), id="other-key"),
        pytest.param(lambda s: verify(KEY, s[:-1] + bytes([s[-1] ^ 1]), now=NOW), id="flip-payload"),
        pytest.param(lambda s: verify(KEY, s[:40] + bytes([s[40] ^ 0x80]) + s[41:], now=NOW), id="flip-tag"),
        pytest.param(lambda s: verify(KEY, s[:10] + bytes([s[10] ^ 1]) + s[11:], now=NOW), id="flip-ts"),
        pytest.param(lambda s: verify(KEY, s[: HEADER_BYTES - 5], now=NOW), id="truncated-tag"),
        pytest.param(lambda s: verify(KEY, s[:HEADER_BYTES] + s[HEADER_BYTES + 1 :], now=NOW), id="cut-body"),
        pytest.param(lambda s: verify(KEY, s, now=NOW + 600), id="stale"),
        pytest.param(lambda s: verify(KEY, s, now=NOW - 600), id="future"),
        pytest.param(lambda s: verify(KEY, s[HEADER_BYTES:], now=NOW), id="unsigned"),
        pytest.param(lambda s: verify(KEY, b"", now=NOW), id="empty"),
    ],
)
def test_defects_raise_unauthorized(mutate):
    signed = sign(KEY, _frame_bytes(), now=NOW)
    with pytest.raises(Unauthorized) as ei:
        mutate(signed)
    assert isinstance(ei.value, FrameError) and ei.value.code == "unauthorized"
    assert error_frame("r", ei.value).meta["code"] == "unauthorized"


def test_replay_guard_refuses_a_second_delivery():
    guard = ReplayGuard(max_skew_s=60, max_entries=3)
    frames = [sign(KEY, b"x%d" % i, now=NOW + i) for i in range(6)]
    assert verify(KEY, frames[0], now=NOW, replay=guard) == b"x0"
    with pytest.raises(Unauthorized, match="replayed"):
        verify(KEY, frames[0], now=NOW, replay=guard)
    for f in frames[1:]:
        verify(KEY, f, now=NOW + 5, replay=guard)
    assert len(guard) <= 3
    # forgotten nonces are still refused: the guard's floor moved past them
    for f in frames:
        with pytest.raises(Unauthorized):
            verify(KEY, f, now=NOW + 5, replay=guard)
    # a stranger's bytes never reach the guard
    with pytest.raises(Unauthorized):
        verify(OTHER, sign(KEY, b"y", now=NOW + 6), now=NOW + 6, replay=guard)


def test_key_files(tmp_path):
    path = tmp_path / "swarm.key"
    key = make_swarm_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_swarm_key(path) == key and len(key) == 32
    with pytest.raises(SwarmKeyError, match="already exists"):
        make_swarm_key(path)

    raw = tmp_path / "raw.key"
    raw.write_bytes(os.urandom(48))
    os.chmod(raw, 0o600)
    assert len(load_swarm_key(raw)) == 48

    os.chmod(path, 0o644)
    with pytest.raises(SwarmKeyError, match="chmod 600") as ei:
        load_swarm_key(path)
    assert "\n" not in str(ei.value)
    os.chmod(path, 0o640)
    with pytest.raises(SwarmKeyError, match="chmod 600"):
        load_swarm_key(path)

    short = tmp_path / "short.key"
    short.write_text("ab" * 16 + "\n")
    os.chmod(short, 0o600)
    with pytest.raises(SwarmKeyError, match="at least 32"):
        load_swarm_key(short)
    with pytest.raises(SwarmKeyError, match="does not exist"):
        load_swarm_key(tmp_path / "missing.key")
    assert key_id(key) != key_id(OTHER) and len(key_id(key)) == 12
