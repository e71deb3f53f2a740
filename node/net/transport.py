"""Length-prefixed messages over libp2p streams, with a size limit and deadlines.

hivemind's ``P2P.receive_raw_data`` trusts the declared length; here the length is checked
against the limit before a single payload byte is read, so a hostile header costs nothing.
"""

from __future__ import annotations

import asyncio

from protocol.frames import FrameTooLarge, MalformedFrame

HEADER_LEN = 8


async def read_message(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
        n = int.from_bytes(header, "big")
        if n > max_bytes:
            raise FrameTooLarge(f"declared message of {n} bytes exceeds the {max_bytes}-byte limit")
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.IncompleteReadError:
        raise MalformedFrame("stream closed mid-message") from None


async def write_message(writer: asyncio.StreamWriter, data: bytes, timeout: float) -> None:
    writer.write(len(data).to_bytes(HEADER_LEN, "big"))
    writer.write(data)
    await asyncio.wait_for(writer.drain(), timeout)


def close_quietly(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:  # the peer may already be gone; nothing to clean up then
        pass
