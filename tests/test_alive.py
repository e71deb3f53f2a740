"""A hop to a peer whose stage record expired goes on if the peer answers, and is given up if not.

A record expires when heartbeats stop reaching the DHT: a cut link, or a link so full that the
heartbeat waits behind the frames (harness, dense with 16 in flight: 55 hops given up on peers
that were serving). Here two real p2pd daemons stand for the head and a tail that takes 3 s to
answer; the expiry is what ``HopClient.refresh_routes`` does when the peer's record is missing.
"""

from __future__ import annotations

import asyncio
import random
import time
import types

import pytest

from bench.reliability.fuzz import RUN_ID, make_runtime, pack, valid_body
from node.net import alive
from node.net.alive import ALIVE_HANDLER, handle_alive
from node.net.wire import Wire
from node.stage.hop import HANDLER, HopClient, HopFailed
from node.stage.metrics import Metrics
from protocol.frames import decode_frame

SLOW_S = 3.0  # the tail answers this long after the frame arrives


def _hop(rt, answer):
    """Run one hop to a slow tail; expire its record 1 s in. ``answer``: the tail's alive handler."""
    from hivemind.p2p import P2P

    frame = pack(valid_body(random.Random(6)))
    out: dict = {}

    async def slow(info, reader, writer):
        await asyncio.sleep(SLOW_S)
        await rt.handle_stream(info, reader, writer)

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        try:
            await srv.add_binary_stream_handler(HANDLER, slow)
            if answer is not None:
                await srv.add_binary_stream_handler(ALIVE_HANDLER, answer)
            head = types.SimpleNamespace(
                cfg=rt.cfg, peer_id=cli.peer_id.to_base58(), p2p=cli, wire=Wire(), n_stages=2,
                compute=rt.compute, metrics=Metrics(),
            )  # fmt: skip
            hops = HopClient(head, lambda data: decode_frame(data, run_id=RUN_ID, check_finite=False))
            peer = srv.peer_id.to_base58()
            t0 = time.monotonic()
            task = asyncio.ensure_future(hops.call_peer(peer, frame, 0))
            await asyncio.sleep(1.0)
            hops._gone.pop(peer)[1].set()  # as refresh_routes does for a peer missing from the DHT
            try:
                out["reply"] = await asyncio.wait_for(task, 30)
            except HopFailed as e:
                out["error"] = str(e)
            out["seconds"] = time.monotonic() - t0
            out["alive"] = head.metrics.expired_but_alive
        finally:
            await cli.shutdown()
            await srv.shutdown()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        rt.pool.shutdown(wait=True)
    return out


def test_a_hop_goes_on_when_the_peer_with_an_expired_record_answers():
    out = _hop(make_runtime(hop_timeout=20.0), handle_alive)
    assert "error" not in out, out.get("error")
    assert out["reply"].kind == "backward" and out["alive"] == 1
    assert out["seconds"] >= SLOW_S


@pytest.mark.parametrize("kind", ["silent", "no handler"])
def test_a_hop_is_given_up_when_the_peer_with_an_expired_record_does_not_answer(monkeypatch, kind):
    monkeypatch.setattr(alive, "ANSWER_S", 1.0)

    async def silent(_info, reader, writer):  # a cut link: the question gets no answer
        await asyncio.sleep(60)

    out = _hop(make_runtime(hop_timeout=20.0), silent if kind == "silent" else None)
    assert "no answer" in out.get("error", ""), out
    assert out["seconds"] < SLOW_S and out["alive"] == 0  # given up before the slow reply came
