"""Is a peer whose DHT record expired still there? One byte on a stream of its own answers it.

A stage record expires when its node's heartbeats stop reaching the DHT. A cut link does that,
but so does a saturated one: the heartbeat waits behind the frames on the same connections
(harness, 16 dense 4096-token frames in flight per head at 80 Mbit/s: 55 hops given up on peers
that were serving, 16 microbatches dropped). So an expired record is a reason to ask, not a
verdict: the hop gives up only if the peer does not answer within ``ANSWER_S``.

The answer is not signed: the libp2p connection already authenticates the peer id, and a byte
carries nothing a stranger could forge for another peer.
"""

from __future__ import annotations

import asyncio

from node.net.caps import Limits
from node.net.rpc import open_stream
from node.net.serve import Stream, serve
from node.net.transport import close_quietly
from node.net.wire import Wire

ALIVE_HANDLER = "vnode.alive"
ANSWER_S = 10.0  # behind saturated links a small message waits seconds (dense@16: 5 s was too short)
# asked once per expired record and hop (node.stage.hop): an honest node asks a few times a second
LIMITS = Limits(per_peer=4, total=64, rate=5.0, burst=10)
_YES = b"\x01"
_ANYONE = Wire()  # no key, no bans: the answer of a node that was not given its own wire


async def handle_alive(
    stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, wire: Wire | None = None
) -> None:
    """The answer: one byte, nothing read. ``wire``: the node's, for its ban list and bounds."""
    wire = _ANYONE if wire is None else wire
    await serve(
        stream_info,
        reader,
        writer,
        wire,
        _yes,
        run_id="",
        timeout=ANSWER_S,
        what="alive question",
        answer=False,
        strikes=False,
        caps=wire.caps(ALIVE_HANDLER, LIMITS),
    )


async def _yes(s: Stream) -> None:
    s.answered = True  # one raw byte, not a frame: the asker gave up if it cannot be written
    s.writer.write(_YES)
    await asyncio.wait_for(s.writer.drain(), s.timeout)


async def answers(p2p, peer: str, timeout: float | None = None) -> bool:
    """True if ``peer`` answers on a new stream within ``timeout`` seconds (``ANSWER_S``), opening
    the stream included: a cut link may hang in either."""
    timeout = ANSWER_S if timeout is None else timeout

    async def ask() -> bool:
        reader, writer = await open_stream(p2p, peer, ALIVE_HANDLER, timeout)
        try:
            return await reader.read(1) == _YES
        finally:
            close_quietly(writer)

    try:
        return await asyncio.wait_for(ask(), timeout)
    except Exception:  # the deadline, no such handler, a reset
        return False


__all__ = ["ALIVE_HANDLER", "ANSWER_S", "answers", "handle_alive"]
