"""Messages on libp2p streams, signed with the swarm key when the run has one.

Every handler (forward, basis, weights, anchor) sends and receives through one ``Wire``, so
membership is checked in one place, on raw bytes, before any frame is parsed.
"""

from __future__ import annotations

import asyncio

from node.transport import read_message, write_message
from protocol.auth import HEADER_BYTES, ReplayGuard, Unauthorized, sign, verify


class Wire:
    def __init__(self, key: bytes | None = None):
        self.key = key
        self.replay = ReplayGuard() if key else None

    @property
    def overhead(self) -> int:
        return HEADER_BYTES if self.key else 0

    def seal(self, data: bytes) -> bytes:
        return sign(self.key, data) if self.key else data

    def open(self, data: bytes) -> bytes:
        """The frame bytes inside ``data``; raises Unauthorized when the swarm key does not verify."""
        return verify(self.key, data, replay=self.replay) if self.key else data

    async def send(
        self, writer: asyncio.StreamWriter, data: bytes, timeout: float, sealed: bool = True
    ) -> int:
        out = self.seal(data) if sealed else data
        await write_message(writer, out, timeout)
        return len(out)

    async def recv(self, reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
        return self.open(await read_message(reader, max_bytes + self.overhead, timeout))


__all__ = ["Wire", "Unauthorized"]
