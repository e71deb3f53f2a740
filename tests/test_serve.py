"""node.net.serve over real p2pd daemons on loopback: the server side every stream handler shares.

A refused sender is answered at once and its message never read (a declared 100 MB costs the
8-byte header), a message over its sender's limit is refused by that limit, a good one reaches
the handler, a frame defect is answered with its code and struck, and a banned peer's stream is
closed unanswered and unread.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from node.net import rpc
from node.net.bans import BanList
from node.net.serve import NotAllowed, serve
from node.net.transport import HEADER_LEN
from node.net.wire import Wire
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, decode_frame, encode_frame

RUN = "serve-test"
ANSWER_S = 5.0  # a refusal comes at once; the handler's own deadlines are far longer (IDLE)
IDLE = 60.0


class CountingReader:
    """The stream's reader, noting how many bytes the handler asked for, in each call."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader, self.asked = reader, []

    async def readexactly(self, n: int) -> bytes:
        self.asked.append(n)
        return await self.reader.readexactly(n)

    async def read(self, n: int = -1) -> bytes:
        self.asked.append(n)
        return await self.reader.read(n)


def test_sender_check_limit_and_answers_over_real_streams():
    wire = Wire()
    wire.bans = BanList(threshold=10**9)
    limits: dict[str, int] = {}  # the sender's role: its byte limit; absent: not allowed
    readers: list[CountingReader] = []
    reached: list[bytes] = []  # what the handler got to act on

    def sender(peer: str) -> int:
        if peer not in limits:
            raise NotAllowed(f"{peer[:12]} has no role here")
        return limits[peer]

    async def body(s) -> None:
        data = await s.receive(sender, idle=IDLE)
        reached.append(data)
        req = decode_frame(data, run_id=RUN)
        await s.send(Frame(kind="weights", run_id=RUN, step=req.step + 1, meta={"last": 1}))

    async def handler(info, reader, writer) -> None:
        readers.append(CountingReader(reader))
        await serve(info, readers[-1], writer, wire, body, run_id=RUN, timeout=IDLE, what="test message")

    async def declare(cli, peer: str, n: int) -> Frame:
        """Send only a length header declaring ``n`` bytes; the answer, within ANSWER_S."""
        reader, writer = await rpc.open_stream(cli, peer, "serve.test", 10)
        try:
            writer.write(n.to_bytes(HEADER_LEN, "big"))
            await writer.drain()
            return decode_frame(await wire.recv(reader, 1 << 20, ANSWER_S), run_id=RUN)
        finally:
            writer.close()

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        cli = await P2P.create(initial_peers=[str(a) for a in await srv.get_visible_maddrs()])
        me, peer = cli.peer_id.to_base58(), srv.peer_id.to_base58()
        ask = Frame(kind="weights", run_id=RUN, step=41)
        try:
            await srv.add_binary_stream_handler("serve.test", handler)

            # 1. a sender without a role declares 100 MB (under the frame limit): answered at once,
            # typed, nothing read past the header, no strike (the check costs it nothing)
            assert 100 << 20 < MAX_FRAME_BYTES
            reply = await declare(cli, peer, 100 << 20)
            assert reply.kind == "error" and reply.meta["code"] == "unauthorized", reply.meta
            assert "has no role here" in reply.meta["message"]
            assert readers[-1].asked == [HEADER_LEN] and not reached
            assert wire.bans.strikes(me) == 0

            # 2. the limit is the sender's role's: over it, refused by it before the payload is read
            limits[me] = 1024
            reply = await declare(cli, peer, 2048)
            assert reply.kind == "error" and reply.meta["code"] == "too_large", reply.meta
            assert "1024-byte limit" in reply.meta["message"]
            assert readers[-1].asked == [HEADER_LEN] and not reached
            big = Frame(kind="weights", run_id=RUN, step=1, meta={"pad": "x" * 1500})
            assert len(encode_frame(big)) > 1024
            try:
                await rpc.request(cli, wire, peer, "serve.test", big, 10, RUN)
                raise AssertionError("a message over its sender's limit was taken")
            except (FrameError, OSError) as e:  # refused unread: the reply, or a reset with its payload
                assert not reached, e
            limits[me] = 1 << 20  # a role allowed more takes the same message
            (got,), _, _ = await rpc.request(cli, wire, peer, "serve.test", big, 10, RUN)
            assert got.step == 2 and len(reached) == 1

            # 3. a good message reaches the handler, and its answer comes back
            (got,), _, _ = await rpc.request(cli, wire, peer, "serve.test", ask, 10, RUN)
            assert got.kind == "weights" and got.step == 42
            assert decode_frame(reached[-1], run_id=RUN).step == 41

            # 4. a defect the handler finds is answered with its code and struck; a banned peer's
            # stream is closed, unread and unanswered
            wire.bans = BanList(threshold=1)
            n = len(reached)
            raw = await rpc.send_only(cli, wire, peer, "serve.test", b"not a frame", 10)
            assert raw > 0
            for _ in range(100):  # one-way: wait until the handler has seen it
                if wire.bans.is_banned(me):
                    break
                await asyncio.sleep(0.05)
            assert wire.bans.is_banned(me) and len(reached) == n + 1
            try:
                await rpc.request(cli, wire, peer, "serve.test", ask, ANSWER_S, RUN)
                raise AssertionError("a banned peer was answered")
            except (FrameError, OSError):  # the stream closed without a reply
                pass
            assert readers[-1].asked == [] and len(reached) == n + 1
        finally:
            await cli.shutdown()
            await srv.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_error_reply_codes():
    """The code of each kind of refusal: a frame defect's own, a deadline busy, a bug internal."""
    from node.net.serve import error_reply
    from protocol.frames import MalformedFrame

    assert error_reply(RUN, MalformedFrame("bad")).meta["code"] == "malformed"
    assert error_reply(RUN, asyncio.TimeoutError()).meta["code"] == "busy"
    assert error_reply(RUN, KeyError("x")).meta["code"] == "internal"
    assert error_reply(RUN, RuntimeError("x"), "downstream").meta["code"] == "downstream"


def test_a_flooding_peer_is_refused_while_an_honest_peer_is_served():
    """``serve``'s caps over real p2pd: streams past a peer's concurrency bound are answered busy
    unread, the node-wide bound holds against a second and third peer id, a peer over the rate
    is refused, struck and banned, and an honest peer is served throughout."""
    from node.net.caps import Limits

    wire = Wire()
    wire.bans = BanList(threshold=3)
    held = asyncio.Event()  # set: the held streams' bodies finish
    served: list[str] = []
    hold_limits = Limits(per_peer=2, total=4)
    rate_limits = Limits(per_peer=4, total=8, rate=1.0, burst=3)

    async def body(s) -> None:
        req = decode_frame(await s.receive(4096, idle=IDLE), run_id=RUN)
        served.append(s.peer)
        if req.meta.get("hold"):
            await held.wait()
        await s.send(Frame(kind="weights", run_id=RUN, step=req.step, meta={"last": 1}))

    def handler(name: str, limits: Limits):
        async def handle(info, reader, writer) -> None:
            await serve(
                info, reader, writer, wire, body, run_id=RUN, timeout=IDLE, caps=wire.caps(name, limits)
            )

        return handle

    async def ask(cli, peer: str, name: str, hold: bool = False) -> Frame:
        """One request; the reply frame (an error frame for a refusal), within ANSWER_S."""
        reader, writer = await rpc.open_stream(cli, peer, name, 10)
        try:
            await wire.send(
                writer, encode_frame(Frame(kind="weights", run_id=RUN, step=7, meta={"hold": int(hold)})), 10
            )
            return decode_frame(await wire.recv(reader, 1 << 20, ANSWER_S), run_id=RUN)
        finally:
            writer.close()

    async def main():
        srv = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(a) for a in await srv.get_visible_maddrs()]
        flood, flood2, flood3, honest = [await P2P.create(initial_peers=maddrs) for _ in range(4)]
        peer = srv.peer_id.to_base58()
        try:
            await srv.add_binary_stream_handler("serve.hold", handler("serve.hold", hold_limits))
            await srv.add_binary_stream_handler("serve.rate", handler("serve.rate", rate_limits))

            # 1. one peer opens 6 streams it holds: 2 are served, 4 answered busy unread
            tasks = [asyncio.ensure_future(ask(flood, peer, "serve.hold", hold=True)) for _ in range(6)]
            for _ in range(200):
                if len(served) == 2 and sum(t.done() for t in tasks) == 4:
                    break
                await asyncio.sleep(0.05)
            busy = [t.result() for t in tasks if t.done()]
            holding = [t for t in tasks if not t.done()]
            assert len(served) == 2 and len(busy) == 4, (served, busy)
            assert all(f.meta["code"] == "busy" and "concurrent streams" in f.meta["message"] for f in busy)
            # the honest peer is served meanwhile
            assert (await ask(honest, peer, "serve.hold")).kind == "weights"
            # 2. minted ids fill the node-wide bound: a third peer is refused by it, not by its own
            more = [asyncio.ensure_future(ask(flood2, peer, "serve.hold", hold=True)) for _ in range(2)]
            for _ in range(200):
                if len(served) == 5:
                    break
                await asyncio.sleep(0.05)
            third = await ask(flood3, peer, "serve.hold")
            assert third.meta.get("code") == "busy" and "4 such streams at once" in third.meta["message"]
            held.set()
            assert all(f.kind == "weights" for f in await asyncio.gather(*holding, *more))
            assert wire.bans.strikes(flood.peer_id.to_base58()) == 0  # concurrency is not struck

            # 3. a peer over the rate: its burst served, then refused and struck, then banned
            me = flood.peer_id.to_base58()
            replies = []
            for _ in range(8):
                try:
                    replies.append((await ask(flood, peer, "serve.rate")).meta.get("code", "ok"))
                except (FrameError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                    replies.append("closed")  # banned: the stream closed unanswered
            assert replies[:3] == ["ok"] * 3 and replies[3:6] == ["busy"] * 3, replies
            assert replies[6:] == ["closed"] * 2 and wire.bans.is_banned(me), replies
            assert (await ask(honest, peer, "serve.rate")).kind == "weights"
        finally:
            for p in (flood, flood2, flood3, honest, srv):
                await p.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
