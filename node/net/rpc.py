"""One request to a peer's stream handler: open with a deadline, send a frame, read the reply.

The hop client, the anchor circuit, tied gradients, SCAPE and basis fetches (and export) call
peers through these, so a peer that cannot be reached is one error type everywhere
(``PeerUnreachable``, a ``ConnectionError``) and an error reply is a ``FrameError`` carrying
the peer's message. The server side of the same streams is ``node.net.serve``.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from node.net import paths as routes
from node.net.transport import close_quietly
from node.net.wire import Wire
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, decode_frame, encode_frame


class PeerUnreachable(ConnectionError):
    """No stream to the peer could be opened within the deadline."""


async def open_stream(p2p, peer: str, handler: str, timeout: float, direct: bool = False):
    """(reader, writer) of a new stream to ``peer``'s ``handler``; ``PeerUnreachable`` if none opens.

    A peer behind NAT that this node has no connection to is reached through the relays its stage
    record names (``node.net.relay.Paths``), each tried in turn; ``direct`` skips them (a relay's
    own streams)."""
    paths = None if direct else routes.paths_of(p2p)
    relays = paths.via(peer) if paths is not None else []
    if relays:
        failures = []
        for r in relays:
            try:
                return await open_relayed(p2p, paths, r, peer, handler, timeout)
            except Exception as e:  # that relay gone, or it cannot reach the peer: the next one
                failures.append(f"{r[:12]}: {type(e).__name__}: {str(e)[:80]}")
        paths.relay_failures += 1
        raise PeerUnreachable(
            f"cannot reach {peer[:12]} (behind NAT) through its relays: {'; '.join(failures)}"
        )
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), timeout
        )
    except Exception as e:  # p2pd's own errors, the deadline, a malformed peer id
        raise PeerUnreachable(f"cannot open a stream to {peer[:12]}: {type(e).__name__}") from None
    return reader, writer


async def open_relayed(p2p, paths: routes.Paths, relay: str, peer: str, handler: str, timeout: float):
    """(reader, writer) of a stream to ``peer``'s ``handler`` carried by ``relay``; raises
    ``FrameError`` if the relay refused, ``PeerUnreachable`` if the relay cannot be reached."""
    try:
        r, w = await open_stream(p2p, relay, routes.RELAY_HANDLER, timeout, direct=True)
    except PeerUnreachable:
        paths.relay_down(relay)
        raise
    try:
        await paths.wire.send(
            w, encode_frame(routes.relay_header(routes.RELAY_HANDLER, paths.run_id, peer, handler)), timeout
        )
        ack = decode_frame(await paths.wire.recv(r, routes.HEADER_BYTES, timeout), run_id=paths.run_id)
    except BaseException:
        close_quietly(w)
        raise
    if ack.kind == "error" or not ack.meta.get("ok"):
        close_quietly(w)
        raise FrameError(str(ack.meta.get("message", "relay refused")))
    paths.relayed_streams += 1
    paths.relay_up(relay)
    return r, w


async def send_only(p2p, wire: Wire, peer: str, handler: str, data: bytes, timeout: float) -> int:
    """Write one encoded frame and close (the peer answers on a stream of its own); bytes sent."""
    _, writer = await open_stream(p2p, peer, handler, timeout)
    try:
        return await wire.send(writer, data, timeout)
    finally:
        close_quietly(writer)


async def request(
    p2p,
    wire: Wire,
    peer: str,
    handler: str,
    frame: Frame,
    timeout: float,
    run_id: str,
    stream: bool = False,
) -> tuple[list[Frame], int, int]:
    """Send ``frame`` and read the reply: one frame, or with ``stream`` frames until one is marked
    ``last``. Returns (replies, bytes sent, bytes received); an error reply raises ``FrameError``."""
    reader, writer = await open_stream(p2p, peer, handler, timeout)
    out: list[Frame] = []
    received = 0
    try:
        sent = await wire.send(writer, encode_frame(frame), timeout)
        while True:
            data = await wire.recv(reader, MAX_FRAME_BYTES, timeout)
            received += len(data)
            reply = decode_frame(data, run_id=run_id)
            if reply.kind == "error":
                raise FrameError(str(reply.meta.get("message", "error")))
            out.append(reply)
            if not stream or reply.meta.get("last"):
                break
    finally:
        close_quietly(writer)
    return out, sent, received
