"""Hostile input a live node used to mishandle (issue 18): SCAPE inbox, anchor packets, floods, stalls.

Each case drives the real handlers of a real tail-stage ``StageRuntime`` (tiny:2, built by
``bench.reliability.fuzz.make_runtime``, no networking) through in-memory streams, the way libp2p hands
them over: the SCAPE handler, the anchor packet sink and the forward server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import types

import pytest
import torch

import node.stage.server as server_mod
from bench.reliability.fuzz import RUN_ID, FakeWriter, make_runtime, pack, prefixed, valid_body
from node.dp.anchors import PacketSink, factorize
from node.dp.scape import ScapeSync
from node.net.bans import BanList
from protocol.frames import Frame, decode_frame, encode_frame
from protocol.records import StageRecord

STAGE_PEER, STRANGER, ANCHOR = "QmStagePeer", "QmStranger", "QmAnchor"


@pytest.fixture(scope="module")
def rt():
    runtime = make_runtime(hop_timeout=2.0)
    yield runtime
    runtime.pool.shutdown(wait=True)


@pytest.fixture()
def loop(rt):
    lp = asyncio.new_event_loop()
    rt.bans = BanList(threshold=10**9)  # strikes are counted, never turned into a ban here
    rt.routes[1] = {
        STAGE_PEER: StageRecord(circuit="fast", ready=True, inner_step=0),
        ANCHOR: StageRecord(circuit="anchor", ready=True, inner_step=0),
    }
    rt.routes[0] = {STAGE_PEER: StageRecord(circuit="fast", ready=True, inner_step=0)}  # an upstream
    rt.inner_step = 0
    yield lp
    lp.close()


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def _call(handler, peer: str, data: bytes) -> FakeWriter:
    w = FakeWriter()
    await asyncio.wait_for(handler(types.SimpleNamespace(peer_id=peer), _reader(data), w), 20)
    return w


def _reply(w: FakeWriter) -> Frame:
    data = w.reply()
    assert data is not None, "no reply"
    return decode_frame(data, run_id=RUN_ID, check_finite=False)


# ---------------------------------------------------------------------- 1. the SCAPE inbox


def _values(step: int, n: int) -> bytes:
    frame = Frame(
        kind="scape",
        run_id=RUN_ID,
        step=step,
        boundary=1,
        tensors={"v": torch.ones(n, dtype=torch.bfloat16)},
        meta={"phase": "values", "digest": 0, "lineage": "init", "applied": 0},
    )
    return prefixed(encode_frame(frame))


def test_scape_inbox_takes_only_stage_peers_steps_in_window_and_bounded_bytes(rt, loop, caplog):
    async def refresh() -> None:  # the routes the fixture set are the swarm's
        return None

    sync = ScapeSync(rt.ctx, rt.gate, refresh, density=0.1, timeout=1.0)
    caplog.set_level(logging.INFO, logger="node")

    async def main():
        n = sync.numel
        # the finding: one peer, 300 frames for far-future steps; a stranger and a stage peer alike
        for i in range(150):
            await _call(sync.handle, STRANGER, _values(1_000_000 + i, n))
            await _call(sync.handle, STAGE_PEER, _values(1_000_000 + i, n))
        assert not sync.inbox, "frames for far-future steps were kept"
        assert sync.refused == 300 and rt.metrics.refused_messages == 300
        # refused unread costs nothing: no strike; a stage peer's far-future frames strike
        assert rt.bans.strikes(STRANGER) == 0 and rt.bans.strikes(STAGE_PEER) == 150
        assert any("does not serve this stage" in m for m in caplog.messages)
        assert any("outside the window" in m for m in caplog.messages)
        # the stage's own replica, at this node's step: kept (and forgiven a strike)
        await _call(sync.handle, STAGE_PEER, _values(0, n))
        assert STAGE_PEER in sync.inbox[("values", 0)]
        assert rt.bans.strikes(STAGE_PEER) == 149
        # within the window, but past the sender's byte budget: refused
        sync.inbox_bytes_per_peer = 3 * 2 * n
        for step in (1, 2, 3):
            await _call(sync.handle, STAGE_PEER, _values(step, n))
        assert sorted(s for (_, s), got in sync.inbox.items() if STAGE_PEER in got) == [0, 1, 2]
        assert any("inbox would hold" in m for m in caplog.messages)

    loop.run_until_complete(main())


# ---------------------------------------------------------------------- 2. anchor packets


def _packet(rt, step: int, scale: float = 1.0) -> bytes:
    name, p = next((n, p) for n, p in rt.stage.named_parameters() if n.endswith("q_proj.weight"))
    a, b = factorize(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)), 2)
    frame = Frame(
        kind="anchor",
        run_id=RUN_ID,
        step=step,
        tensors={"0.a": (a * scale).to(torch.bfloat16), "0.b": (b * scale).to(torch.bfloat16)},
        meta={"names": name},
    )
    return prefixed(encode_frame(frame))


def test_anchor_packets_only_from_announced_anchors_in_window_and_bounded(rt, loop, caplog):
    sink = PacketSink(rt.ctx, rt.filter)
    caplog.set_level(logging.INFO, logger="node")

    async def main():
        good = _packet(rt, 0)
        cases = [
            (STRANGER, good, "not an announced anchor"),
            (STAGE_PEER, good, "not an announced anchor"),  # a fast replica is no anchor
            (ANCHOR, _packet(rt, 2**64 - 1), "outside the staleness window"),
            (ANCHOR, _packet(rt, 0, scale=1e15), "not finite or above"),
        ]
        for peer, data, why in cases:
            reply = _reply(await _call(sink.handle, peer, data))
            assert reply.kind == "error" and why in reply.meta["message"], (peer, reply.meta)
            assert any(why in m for m in caplog.messages), why
        assert sink.received == 0 and sink.dropped_stale == 0
        assert sink.refused == 4 and rt.bans.strikes(ANCHOR) == 2 and rt.bans.strikes(STRANGER) == 0
        reply = _reply(await _call(sink.handle, ANCHOR, good))
        assert reply.kind == "anchor" and reply.meta["accepted"] == 1 and sink.received == 1

    loop.run_until_complete(main())


# ---------------------------------------------------------------------- 3. floods of streams


def test_streams_over_the_per_peer_bound_get_busy_and_are_counted(rt, loop, caplog):
    caplog.set_level(logging.INFO, logger="node")
    cap = server_mod.MAX_STREAMS_PER_PEER
    flood = cap + 24

    async def main():
        shed0 = rt.metrics.shed_streams
        info = types.SimpleNamespace(peer_id=STAGE_PEER)
        held = [asyncio.StreamReader() for _ in range(cap)]  # open, nothing sent yet
        frame = prefixed(pack(valid_body(random.Random(1))))
        readers = held + [_reader(frame) for _ in range(flood - cap)]
        writers = [FakeWriter() for _ in range(flood)]
        tasks = []
        for r, w in zip(readers, writers):
            tasks.append(asyncio.ensure_future(rt.handle_stream(info, r, w)))
            await asyncio.sleep(0)  # in the order they arrived: the held ones first
        # another peer is not shed because of the flooder
        other = await _call(rt.handle_stream, STRANGER, frame)
        assert _reply(other).kind == "backward"
        await asyncio.wait_for(asyncio.gather(*tasks[cap:]), 20)
        for r in held:
            r.feed_eof()
        await asyncio.wait_for(asyncio.gather(*tasks[:cap]), 20)
        replies = [_reply(w) for w in writers]  # every stream got an answer, none dropped silently
        busy = [f for f in replies if f.meta.get("code") == "busy"]
        assert len(busy) == flood - cap and all("concurrent streams" in f.meta["message"] for f in busy)
        assert rt.metrics.shed_streams - shed0 == flood - cap
        assert any("shedding streams from" in m for m in caplog.messages)

    loop.run_until_complete(main())


# ---------------------------------------------------------------------- 4. stalled and slow streams


def test_idle_streams_close_at_the_idle_deadline_and_slow_senders_get_through(rt, loop, monkeypatch):
    monkeypatch.setattr(server_mod, "IDLE_S", 0.5)
    data = prefixed(pack(valid_body(random.Random(2))))
    info = types.SimpleNamespace(peer_id=STAGE_PEER)

    async def main():
        # stalled after its first bytes: closed at the idle deadline, well before the hop timeout
        idle0 = rt.metrics.idle_streams
        w = FakeWriter()
        t0 = loop.time()
        await asyncio.wait_for(rt.handle_stream(info, _reader(data[:100], eof=False), w), 10)
        reply = _reply(w)
        assert reply.meta["code"] == "busy" and "no bytes for 0.5 s" in reply.meta["message"]
        assert loop.time() - t0 < rt.cfg.hop_timeout and rt.metrics.idle_streams == idle0 + 1
        # a steady sender slower than the hop timeout (2 s) for the whole frame still gets its reply
        r, w = asyncio.StreamReader(), FakeWriter()
        task = asyncio.ensure_future(rt.handle_stream(info, r, w))
        pieces = 12
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            r.feed_data(data[i : i + step])
            await asyncio.sleep(0.25)
        r.feed_eof()
        await asyncio.wait_for(task, 10)
        assert _reply(w).kind == "backward"

    loop.run_until_complete(main())


def test_a_burst_of_streams_over_libp2p_is_answered_every_one(rt, loop):
    """Real p2pd daemons on loopback: 400 concurrent valid frames from one peer (the finding: 300
    got 185 replies, 102 closed, 13 reset). Each now gets a reply: served, or ``busy``, the
    streams past the per-peer bound shed in order and queued past hivemind's accept backlog."""
    from collections import Counter

    from hivemind.p2p import P2P

    from node.net.transport import read_message
    from node.stage.hop import HANDLER

    frame = prefixed(pack(valid_body(random.Random(3))))

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        rt.p2p, rt.server._backlog_checked = srv, False
        shed0 = rt.metrics.shed_streams
        try:
            await srv.add_binary_stream_handler(HANDLER, rt.handle_stream)

            async def one() -> str:
                try:
                    _, r, w = await cli.call_binary_stream_handler(srv.peer_id, HANDLER)
                    w.write(frame)
                    await w.drain()
                    f = decode_frame(await read_message(r, 1 << 26, 60), run_id=RUN_ID, check_finite=False)
                    w.close()
                    return f.kind if f.kind != "error" else f.meta["code"]
                except Exception as e:  # a stream the node dropped
                    return type(e).__name__

            # the first stream raises the accept backlog (node.net.wire.raise_accept_backlog): a node
            # serves streams before any burst reaches it
            assert await one() == "backward"
            got = Counter(await asyncio.wait_for(asyncio.gather(*(one() for _ in range(400))), 120))
            assert set(got) <= {"backward", "busy"} and got["backward"] >= 1, got
            assert rt.metrics.shed_streams - shed0 == got["busy"], got
        finally:
            rt.p2p = None
            await cli.shutdown()
            await srv.shutdown()

    loop.run_until_complete(main())


def _hold(rt, peers: list[str]) -> list:
    """One stream per peer id, open with nothing sent yet: (its reader, its task)."""
    held = [asyncio.StreamReader() for _ in peers]
    tasks = [
        asyncio.ensure_future(rt.handle_stream(types.SimpleNamespace(peer_id=p), r, FakeWriter()))
        for p, r in zip(peers, held)
    ]
    return list(zip(held, tasks))


async def _release(held: list) -> None:
    for r, _ in held:
        r.feed_eof()
    await asyncio.wait_for(asyncio.gather(*(t for _, t in held)), 20)


def test_streams_of_the_stage_before_meet_the_node_wide_bound(rt, loop, monkeypatch):
    """Upstreams known to the routes, many of them: past MAX_STREAMS held at once, the rest are busy."""
    monkeypatch.setattr(server_mod, "MAX_STREAMS", 16)
    frame = prefixed(pack(valid_body(random.Random(4))))
    upstreams = [f"QmUpstream{i}" for i in range(16)]
    rt.routes[0].update({p: StageRecord(circuit="fast", ready=True, inner_step=0) for p in upstreams})

    async def main():
        held = _hold(rt, upstreams)
        await asyncio.sleep(0.1)
        reply = _reply(await _call(rt.handle_stream, STAGE_PEER, frame))
        assert reply.meta.get("code") == "busy" and "16 such streams at once" in reply.meta["message"]
        await _release(held)
        assert _reply(await _call(rt.handle_stream, STAGE_PEER, frame)).kind == "backward"  # room again

    try:
        loop.run_until_complete(main())
    finally:
        for p in upstreams:
            rt.routes[0].pop(p)


def test_minted_peer_ids_fill_only_the_visitors_lane(rt, loop):
    """Senders the routes do not show share VISITOR_STREAMS; the stage before's peers are still
    served while that lane is full, and an unknown sender asks for one throttled route refresh."""
    frame = prefixed(pack(valid_body(random.Random(5))))
    lane = server_mod.VISITOR_STREAMS

    async def main():
        rt.server._recheck._last = float("-inf")  # no refresh lately (earlier tests asked for some)
        refreshes = rt.server._recheck.refreshes
        held = _hold(rt, [f"QmMinted{i}" for i in range(lane)])
        await asyncio.sleep(0.1)
        reply = _reply(await _call(rt.handle_stream, STRANGER, frame))
        assert reply.meta.get("code") == "busy" and f"{lane} such streams at once" in reply.meta["message"]
        assert _reply(await _call(rt.handle_stream, STAGE_PEER, frame)).kind == "backward"
        await _release(held)
        assert _reply(await _call(rt.handle_stream, STRANGER, frame)).kind == "backward"  # room again
        # a flood of unknown ids within a second: one refresh, not one each
        assert rt.server._recheck.refreshes - refreshes == 1

    loop.run_until_complete(main())


# ---------------------------------------------------------------------- 5. weight pulls


def _first(w: FakeWriter) -> Frame:
    n = int.from_bytes(w.buf[:8], "big")
    return decode_frame(bytes(w.buf[8 : 8 + n]), run_id=RUN_ID, check_finite=False)


def test_weight_pulls_members_one_each_and_all_visitors_one_budget(rt, loop):
    """A member of the stage (a record in its routes) is served; every visitor (an export, a
    stranger, a minted id) shares one pull at a time and one small burst, node-wide."""
    ask = prefixed(encode_frame(Frame(kind="weights", run_id=RUN_ID)))
    ws = rt.weight_server

    async def main():
        # a visitor holds the one visitor slot (its request not sent yet): another id is busy
        r, w = asyncio.StreamReader(), FakeWriter()
        holder = asyncio.ensure_future(ws.handle(types.SimpleNamespace(peer_id="QmVisitor0"), r, w))
        await asyncio.sleep(0.05)
        other = _first(await _call(ws.handle, "QmVisitor1", ask))
        assert other.meta.get("code") == "busy" and "1 such streams at once" in other.meta["message"]
        # a member is served meanwhile, and again and again (no rate: it is one of us)
        for _ in range(4):
            assert _first(await _call(ws.handle, STAGE_PEER, ask)).kind == "weights"
        r.feed_data(ask)
        r.feed_eof()
        await asyncio.wait_for(holder, 20)
        assert _first(w).kind == "weights"
        # the visitors' burst (3, the holder's included), then refused by rate, whoever asks
        got = [_first(await _call(ws.handle, f"QmVisitor{i}", ask)) for i in range(2, 6)]
        assert [f.kind for f in got[:2]] == ["weights"] * 2, [f.meta for f in got]
        assert all(f.meta.get("code") == "busy" and "requests/s" in f.meta["message"] for f in got[2:])

    loop.run_until_complete(main())
