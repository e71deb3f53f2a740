"""Swarm key and bans at the forward handler: what a stranger's frame costs the node."""

import asyncio
import random
import types

import pytest

from bench.reliability.fuzz import FakeWriter, make_runtime, pack, prefixed, valid_body
from node.net.bans import BanList
from node.net.wire import Wire
from protocol.auth import sign
from protocol.frames import decode_frame

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


_LOOP = asyncio.new_event_loop()  # the runtime's asyncio primitives bind to one loop


def _serve(rt, wire_bytes: bytes):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(wire_bytes)
        reader.feed_eof()
        writer = FakeWriter()
        info = types.SimpleNamespace(peer_id="QmStranger")
        await asyncio.wait_for(rt.handle_stream(info, reader, writer), 30)
        return writer.reply()

    return _LOOP.run_until_complete(go())


@pytest.fixture
def keyed_runtime():
    rt = make_runtime()
    rt.wire = Wire(KEY)
    return rt


def test_frame_without_the_key_is_refused_and_told_why(keyed_runtime):
    rt = keyed_runtime
    reply = _serve(rt, prefixed(pack(valid_body(random.Random(0)))))
    frame = decode_frame(reply)  # unsigned, so a keyless sender can read the reason
    assert frame.kind == "error" and frame.meta["code"] == "unauthorized"
    assert rt.metrics.rejected_frames == 1 and rt.metrics.microbatches == 0


def test_frame_signed_with_another_key_is_refused(keyed_runtime):
    rt = keyed_runtime
    reply = _serve(rt, prefixed(sign(OTHER, pack(valid_body(random.Random(1))))))
    assert decode_frame(reply).meta["code"] == "unauthorized"
    assert rt.metrics.microbatches == 0


def test_frame_signed_with_the_key_is_served_and_the_reply_signed(keyed_runtime):
    rt = keyed_runtime
    reply = _serve(rt, prefixed(sign(KEY, pack(valid_body(random.Random(2))))))
    frame = decode_frame(Wire(KEY).open(reply))
    assert frame.kind == "backward"
    assert rt.metrics.microbatches == 1


def test_repeat_offender_is_banned_and_then_costs_nothing():
    rt = make_runtime()
    rt.bans = BanList(threshold=3, window_s=60, ban_s=300)
    bad = prefixed(pack({"v": 1, "k": "forward"}))
    for _ in range(3):
        assert decode_frame(_serve(rt, bad)).kind == "error"
    assert rt.bans.is_banned("QmStranger")
    # banned: even a valid frame gets no reply and no work
    assert _serve(rt, prefixed(pack(valid_body(random.Random(3))))) is None
    assert rt.metrics.microbatches == 0 and rt.metrics.rejected_frames == 3


def test_keyless_node_is_refused_by_a_keyed_swarm_in_one_line(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from protocol.auth import make_swarm_key

    key = tmp_path / "swarm.key"
    make_swarm_key(key)
    ready = tmp_path / "ready.json"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node",
            "join",
            "--model",
            "tiny",
            "--swarm-key",
            str(key),
            "--state-dir",
            str(tmp_path / "a"),
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, "first node did not start"
            time.sleep(0.3)
        info = json.loads(ready.read_text())
        peer = f"{info['maddrs'][0]}/p2p/{info['peer_id']}"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "node",
                "join",
                "--model",
                "tiny",
                "--peers",
                peer,
                "--state-dir",
                str(tmp_path / "b"),
                "--join-timeout",
                "20",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and "--swarm-key" in last, p.stderr
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
