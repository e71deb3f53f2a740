"""node.net.rpc over real p2pd daemons on loopback: replies, streamed replies, error replies, no peer."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2P

from node.net import rpc
from node.net.wire import Wire
from protocol.frames import Frame, FrameError, decode_frame, encode_frame, error_frame

RUN = "rpc-test"


async def _serve(wire: Wire, reader, writer, parts: int) -> None:
    req = decode_frame(await wire.recv(reader, 1 << 20, 10), run_id=RUN)
    if req.kind == "weights" and req.meta.get("fail"):
        await wire.send(writer, encode_frame(error_frame(RUN, FrameError("not today"))), 10)
        return
    for i in range(parts):  # the request's step, doubled, in ``parts`` frames
        t = torch.full((2,), float(req.step * 2 + i))
        last = int(i == parts - 1)
        reply = Frame(kind="weights", run_id=RUN, step=i, tensors={"t": t}, meta={"last": last})
        await wire.send(writer, encode_frame(reply), 10)
    writer.close()


def test_request_reads_one_or_a_stream_of_replies_and_maps_errors():
    wire = Wire()

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        try:
            await srv.add_binary_stream_handler("rpc.one", lambda _i, r, w: _serve(wire, r, w, 1))
            await srv.add_binary_stream_handler("rpc.three", lambda _i, r, w: _serve(wire, r, w, 3))
            peer = srv.peer_id.to_base58()
            ask = Frame(kind="weights", run_id=RUN, step=5)
            (one,), sent, received = await rpc.request(cli, wire, peer, "rpc.one", ask, 10, RUN)
            assert one.tensors["t"].tolist() == [10.0, 10.0]
            assert sent == len(encode_frame(ask)) and received > 8
            frames, _, _ = await rpc.request(cli, wire, peer, "rpc.three", ask, 10, RUN, stream=True)
            assert [f.tensors["t"][0].item() for f in frames] == [10.0, 11.0, 12.0]
            # without ``stream`` only the first of the three is read
            assert len((await rpc.request(cli, wire, peer, "rpc.three", ask, 10, RUN))[0]) == 1
            bad = Frame(kind="weights", run_id=RUN, meta={"fail": 1})
            with pytest.raises(FrameError, match="not today"):
                await rpc.request(cli, wire, peer, "rpc.one", bad, 10, RUN)
            assert await rpc.send_only(cli, wire, peer, "rpc.one", encode_frame(ask), 10) == sent
            # a peer that never answers: one error type, named, within the deadline
            t0 = time.monotonic()
            with pytest.raises(rpc.PeerUnreachable, match="cannot open a stream to"):
                await rpc.request(cli, wire, peer, "rpc.nobody-serves-this", ask, 3, RUN)
            assert time.monotonic() - t0 < 10
            with pytest.raises(rpc.PeerUnreachable):
                await rpc.open_stream(cli, "not-a-peer-id", "rpc.one", 3)
        finally:
            await cli.shutdown()
            await srv.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
