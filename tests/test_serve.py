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
