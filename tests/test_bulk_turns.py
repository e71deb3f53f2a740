"""A node writes at most BULK_SLOTS pipeline frames at once (node/net/wire.py).

Frames written all at once share the uplink and finish together, so a pipeline's forwards and
backwards take turns on the link instead of overlapping (bench/results/linkprobe.md). The real
forward server of a tail-stage runtime (bench.reliability.fuzz.make_runtime, tiny:2) answers in-memory
streams here: while every turn is taken its BACKWARD reply waits, an ERROR reply does not, and
the reply goes out once a turn is free. Over real p2pd daemons, a hop (node.stage.hop.HopClient) opens
its stream only on its turn, counts its frame as sent only once written, and completes once it
gets one.
"""

from __future__ import annotations

import asyncio
import random
import types

from bench.reliability.fuzz import RUN_ID, FakeWriter, make_runtime, pack, prefixed, valid_body
from node.net.wire import BULK_SLOTS, Wire
from node.stage.hop import HANDLER, HopClient
from node.stage.metrics import Metrics
from protocol.frames import decode_frame


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


def _kind(w: FakeWriter) -> str | None:
    data = w.reply()
    return None if data is None else decode_frame(data, run_id=RUN_ID, check_finite=False).kind


def _run(rt, coro) -> None:
    """Run ``coro`` on a fresh event loop, then stop the runtime's compute thread."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()
        rt.pool.shutdown(wait=True)


def test_backward_replies_wait_for_a_turn_error_replies_do_not():
    rt = make_runtime(hop_timeout=5.0)
    info = types.SimpleNamespace(peer_id="QmUpstream")
    frame = prefixed(pack(valid_body(random.Random(2))))

    async def main():
        for _ in range(BULK_SLOTS):  # every turn to this peer is taken (other frames to it)
            await rt.wire.bulk("QmUpstream").acquire()
        served = FakeWriter()
        task = asyncio.ensure_future(rt.handle_stream(info, _reader(frame), served))
        # serving a tiny:2 frame takes milliseconds; its reply must still be waiting after 3 s
        done, _ = await asyncio.wait({task}, timeout=3.0)
        assert not done and served.reply() is None
        # an error reply is small and never queues behind the pipeline's frames
        refused = FakeWriter()
        await asyncio.wait_for(rt.handle_stream(info, _reader(prefixed(b"not a frame")), refused), 10)
        assert _kind(refused) == "error"
        # a reply to another peer does not wait behind this one's turns (a stalled peer holds
        # only its own)
        other = FakeWriter()
        await asyncio.wait_for(
            rt.handle_stream(types.SimpleNamespace(peer_id="QmOther"), _reader(frame), other), 10
        )
        assert _kind(other) == "backward"
        rt.wire.bulk("QmUpstream").release()  # one turn frees up: the waiting reply goes out
        await asyncio.wait_for(task, 10)
        assert _kind(served) == "backward"
        for _ in range(BULK_SLOTS - 1):
            rt.wire.bulk("QmUpstream").release()

    _run(rt, main())


def test_a_hop_opens_its_stream_on_its_turn():
    from hivemind.p2p import P2P

    rt = make_runtime(hop_timeout=20.0)
    frame = pack(valid_body(random.Random(3)))
    opened: list[str] = []

    async def serve(info, reader, writer):
        opened.append(str(info.peer_id))
        await rt.handle_stream(info, reader, writer)

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        try:
            await srv.add_binary_stream_handler(HANDLER, serve)
            # the head's side of the hop: its own p2pd and its own Wire (its own turns)
            head = types.SimpleNamespace(
                cfg=rt.cfg,
                peer_id=cli.peer_id.to_base58(),
                p2p=cli,
                wire=Wire(),
                n_stages=2,
                compute=rt.compute,
                metrics=Metrics(),
            )
            hops = HopClient(head, lambda data: decode_frame(data, run_id=RUN_ID, check_finite=False))
            for _ in range(BULK_SLOTS):
                await head.wire.bulk(srv.peer_id.to_base58()).acquire()
            task = asyncio.ensure_future(hops.call_peer(srv.peer_id.to_base58(), frame, 0))
            done, _ = await asyncio.wait({task}, timeout=3.0)
            # no stream yet: one opened now would sit idle and be closed at the handler's IDLE_S;
            # nor is the frame counted as sent while it waits (the harness reads these counts)
            assert not done and not opened
            assert not head.metrics.links
            head.wire.bulk(srv.peer_id.to_base58()).release()
            reply = await asyncio.wait_for(task, 30)
            assert reply.kind == "backward" and len(opened) == 1
            sent = head.metrics.links[(0, "forward")]
            assert (sent.frames, sent.bytes) == (1, len(frame) + head.wire.overhead)
        finally:
            await cli.shutdown()
            await srv.shutdown()

    _run(rt, main())
