"""A big frame travels in parts over several streams, and its reply comes back the same way.

node/parts.py cuts a frame over 2 MiB into ~1 MiB parts, each on its own libp2p stream, so a
frame starts with that many flow-control windows (bench/results/linkprobe.md). Here the part
size is lowered so that a frame of the tiny model goes in parts. The reference is a second,
identical tail runtime that gets the same frame whole: the reply in parts must equal it byte
for byte. A frame whose parts never all arrive is answered ``busy``, whole, and leaves nothing
held; parts that do not belong together are refused.
"""

from __future__ import annotations

import asyncio
import random
import types

import pytest

from bench.fuzz import RUN_ID, FakeWriter, make_runtime, pack, prefixed, valid_body
from node import parts
from node.hop import HANDLER, HopClient
from node.parts import PART_HANDLER, Part
from node.wire import Wire
from protocol.frames import FrameTooLarge, MalformedFrame, decode_frame


def test_split_then_join_gives_the_frame_back_in_any_order():
    data = bytes(random.Random(0).randbytes(10_001))
    token = b"\x01" * parts.TOKEN_BYTES
    got = [parts.parse(m) for m in parts.split(data, token, 7)]
    assert [p.index for p in got] == list(range(7)) and all(p.count == 7 for p in got)
    assert parts.join(got[::-1], token, 7) == data
    assert parts.parse(pack({"v": 1})) is None  # a whole frame (a msgpack map) is not a part


def test_parts_that_do_not_make_one_frame_are_refused():
    token, other = b"\x01" * 8, b"\x02" * 8
    got = [parts.parse(m) for m in parts.split(b"x" * 300, token, 3)]
    with pytest.raises(MalformedFrame):  # a gap
        parts.join(got[:2], token, 3)
    with pytest.raises(MalformedFrame):  # a part twice
        parts.join([got[0], got[1], got[1]], token, 3)
    with pytest.raises(MalformedFrame):  # a part of another frame
        parts.join([got[0], got[1], Part(other, 2, 3, b"x")], token, 3)
    for bad in (parts.MAGIC + token + bytes((3, 3)), parts.MAGIC + token + bytes((0, 1)), parts.MAGIC):
        with pytest.raises(MalformedFrame):  # index past count, a single part, a cut header
            parts.parse(bad)
    a = parts.Assemblies(per_peer=1)
    a.add("QmA", got[0])
    with pytest.raises(MalformedFrame):  # the same part again
        a.add("QmA", got[0])
    with pytest.raises(MalformedFrame):  # a second frame at once over the per-peer bound
        a.add("QmA", Part(other, 1, 3, b"x"))
    a.add("QmB", Part(other, 1, 3, b"x"))  # another peer has its own bound
    big = Part(token, 1, 3, memoryview(bytes(8)))
    with pytest.raises(FrameTooLarge):
        assembly = parts.Assembly(token, 3)
        assembly.size = parts.MAX_FRAME_BYTES - 4
        assembly.add(big)


def _run(rts, coro) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()
        for rt in rts:
            rt.pool.shutdown(wait=True)


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


def test_a_frame_in_parts_gets_the_reply_the_whole_frame_gets(monkeypatch):
    from hivemind.p2p import P2P

    rt, reference = make_runtime(hop_timeout=20.0), make_runtime(hop_timeout=20.0)
    frame = pack(valid_body(random.Random(4), batch=4, seq=16))
    monkeypatch.setattr(parts, "PART_BYTES", len(frame) // 5)  # 5 parts of this small frame
    assert parts.part_count(len(frame)) == 5
    streams = {"forward": 0, "part": 0}

    async def forward(info, reader, writer):
        streams["forward"] += 1
        await rt.handle_stream(info, reader, writer)

    written: list[int] = []  # reply bytes written on each part stream

    class Counting:
        def __init__(self, writer):
            self.writer, self.n = writer, 0
            written.append(0)
            self.slot = len(written) - 1

        def write(self, data):
            written[self.slot] += len(data)
            self.writer.write(data)

        def __getattr__(self, name):
            return getattr(self.writer, name)

    async def part(info, reader, writer):
        streams["part"] += 1
        await rt.handle_part(info, reader, Counting(writer))

    async def main():
        whole = FakeWriter()  # the reference: the same frame, whole, to an identical tail
        info = types.SimpleNamespace(peer_id="QmUpstream")
        await asyncio.wait_for(reference.handle_stream(info, _reader(prefixed(frame)), whole), 30)
        expected = decode_frame(whole.reply(), run_id=RUN_ID, check_finite=False)
        assert expected.kind == "backward"

        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        try:
            await srv.add_binary_stream_handler(HANDLER, forward)
            await srv.add_binary_stream_handler(PART_HANDLER, part)
            head = types.SimpleNamespace(
                cfg=rt.cfg,
                peer_id=cli.peer_id.to_base58(),
                p2p=cli,
                wire=Wire(),
                n_stages=2,
                compute=rt.compute,
            )
            hops = HopClient(head, lambda data: decode_frame(data, run_id=RUN_ID, check_finite=False))
            reply = await asyncio.wait_for(hops.call_peer(srv.peer_id.to_base58(), frame, 0), 60)
        finally:
            await cli.shutdown()
            await srv.shutdown()
        assert streams == {"forward": 1, "part": 4}
        # the reply came back in parts too, each on the stream its request part came on
        assert len(written) == 4 and all(n > parts.HEADER_BYTES + 8 for n in written), written
        assert reply.kind == "backward" and reply.microbatch == expected.microbatch
        assert reply.tensors.keys() == expected.tensors.keys()
        for name, t in expected.tensors.items():
            assert reply.tensors[name].dtype == t.dtype and bool((reply.tensors[name] == t).all()), name
        assert len(rt.server.assemblies) == 0  # nothing held once the reply is out

    _run([rt, reference], main())


def test_a_frame_missing_a_part_is_answered_busy_and_nothing_is_held():
    rt = make_runtime(hop_timeout=1.0)
    frame = pack(valid_body(random.Random(5)))
    token = b"\x07" * parts.TOKEN_BYTES
    msgs = parts.split(frame, token, 3)

    async def main():
        info = types.SimpleNamespace(peer_id="QmUpstream")
        second = FakeWriter()  # part 1 arrives; part 2 never does
        held = asyncio.ensure_future(rt.handle_part(info, _reader(prefixed(msgs[1])), second))
        first = FakeWriter()
        await asyncio.wait_for(rt.handle_stream(info, _reader(prefixed(msgs[0])), first), 10)
        reply = decode_frame(first.reply(), run_id=RUN_ID, check_finite=False)
        assert reply.kind == "error" and reply.meta["code"] == "busy", reply.meta
        assert "1 of 3" not in reply.meta["message"] and "2 of 3" in reply.meta["message"]
        await asyncio.wait_for(held, 5)  # the part stream is let go, with no reply written on it
        assert second.closed and second.reply() is None
        assert len(rt.server.assemblies) == 0

    _run([rt], main())
