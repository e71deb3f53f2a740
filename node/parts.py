"""A big pipeline frame over several libp2p streams at once, and its reply over the same streams.

Why: each libp2p (yamux) stream has its own flow-control window, which starts small and grows
once per round trip. When both directions of a link are busy, as a pipeline stage's are, a
window update waits behind the bulk bytes going the other way (round trips of 0.3-1 s at RTT
40 ms), so one 16.8 MB frame on one stream leaves the link idle between windows. Cut into
~1 MiB parts written on parallel streams, the same frame starts with that many windows
(bench/results/linkprobe.md, "parts": RTT 40 ms, 4096-token dense frames both ways, two
frames at a time: 67% of 80 Mbit/s on one stream each, 80% as 16 parts).

The protocol. A frame under ``2 * PART_BYTES`` travels whole, as before. A bigger one is cut
into ``count`` parts; part 0 goes to the forward handler, parts 1.. to ``PART_HANDLER``, each on
its own stream, each message ``MAGIC | token (8) | index (1) | count (1) | bytes`` and sealed
like any message. The receiver joins the parts of one (peer, token), serves the frame, and
writes the reply cut into the same number of parts, each on the stream its request part came
on. An error the receiver meets before the reply (a part missing, a bad frame) goes back
whole on the part-0 stream, and the other streams are closed. Every part names its token,
index and count, so a part of another frame, a duplicate or a gap raises ``MalformedFrame``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from protocol.frames import MAX_FRAME_BYTES, FrameTooLarge, MalformedFrame

PART_HANDLER = "vnode.part"
PART_BYTES = 1 << 20  # the measured size (1 MiB parts: 80%; 4 MiB: 67-71%)
MAX_PARTS = 32  # streams per frame; a frame over 32 MiB gets bigger parts, not more streams
MAGIC = b"VNP1"  # msgpack never starts a frame (a map) with 'V'
TOKEN_BYTES = 8
HEADER_BYTES = len(MAGIC) + TOKEN_BYTES + 2


@dataclass(frozen=True)
class Part:
    token: bytes
    index: int
    count: int
    data: bytes | memoryview  # a view into the message: no copy until the parts are joined


def part_count(nbytes: int) -> int:
    """Streams a frame of ``nbytes`` goes over: one per PART_BYTES, 1 below two parts' worth."""
    return max(1, min(MAX_PARTS, nbytes // PART_BYTES))


def wire_bytes(nbytes: int, count: int, overhead: int) -> int:
    """Bytes on the wire for a frame of ``nbytes`` in ``count`` parts, each sealed (``overhead``)."""
    return nbytes + overhead + (0 if count == 1 else count * (HEADER_BYTES + overhead) - overhead)


def split(data: bytes, token: bytes, count: int) -> list[bytes]:
    """``data`` as ``count`` part messages of near-equal size (the last may be shorter or empty)."""
    step = -(-len(data) // count)
    view = memoryview(data)
    head = MAGIC + token
    return [head + bytes((i, count)) + view[i * step : (i + 1) * step] for i in range(count)]


def parse(msg: bytes) -> Part | None:
    """The part in ``msg``, or None when ``msg`` is a whole frame."""
    if not msg.startswith(MAGIC):
        return None
    if len(msg) < HEADER_BYTES:
        raise MalformedFrame(f"a frame part of {len(msg)} bytes is shorter than its header")
    token, index, count = msg[4:12], msg[12], msg[13]
    if not 2 <= count <= MAX_PARTS or index >= count:
        raise MalformedFrame(f"frame part {index} of {count}: expected 2..{MAX_PARTS} parts")
    return Part(bytes(token), index, count, memoryview(msg)[HEADER_BYTES:])


def join(parts: list[Part], token: bytes, count: int) -> bytes:
    """The frame in ``parts`` (any order): exactly parts 0..count-1 of ``token``."""
    if sorted(p.index for p in parts) != list(range(count)):
        raise MalformedFrame(f"frame parts {sorted(p.index for p in parts)} of {count}")
    if any(p.token != token or p.count != count for p in parts):
        raise MalformedFrame("a frame part of another frame")
    if sum(len(p.data) for p in parts) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame parts exceed the {MAX_FRAME_BYTES}-byte limit")
    return b"".join(p.data for p in sorted(parts, key=lambda p: p.index))


class Assembly:
    """The parts of one frame as they arrive; part streams wait here until the reply is written."""

    def __init__(self, token: bytes, count: int) -> None:
        self.token, self.count = token, count
        self.parts: dict[int, Part] = {}
        self.writers: dict[int, asyncio.StreamWriter] = {}  # parts 1..: the stream each came on
        self.size = 0
        self.complete = asyncio.Event()
        self.claimed = asyncio.Event()  # part 0 (the forward stream) has arrived
        self.done = asyncio.Event()  # reply written (or given up): part streams may close

    def add(self, part: Part, writer: asyncio.StreamWriter | None = None) -> None:
        if part.count != self.count or part.index in self.parts:
            raise MalformedFrame(f"frame part {part.index} of {part.count} twice, or of another count")
        self.size += len(part.data)
        if self.size > MAX_FRAME_BYTES:
            raise FrameTooLarge(f"frame parts exceed the {MAX_FRAME_BYTES}-byte limit")
        self.parts[part.index] = part
        if writer is not None:
            self.writers[part.index] = writer
        if len(self.parts) == self.count:
            self.complete.set()

    def data(self) -> bytes:
        return join(list(self.parts.values()), self.token, self.count)


class Assemblies:
    """Frames being assembled, by (peer, token); at most ``per_peer`` at once for one peer."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._open: dict[tuple[str, bytes], Assembly] = {}

    def __len__(self) -> int:
        return len(self._open)

    def add(self, peer: str, part: Part, writer: asyncio.StreamWriter | None = None) -> Assembly:
        key = (peer, part.token)
        a = self._open.get(key)
        if a is None:
            if sum(1 for p, _ in self._open if p == peer) >= self.per_peer:
                raise MalformedFrame(f"over {self.per_peer} frames in parts at once from this peer")
            a = self._open[key] = Assembly(part.token, part.count)
        a.add(part, writer)
        if part.index == 0:
            a.claimed.set()
        return a

    def close(self, peer: str, a: Assembly) -> None:
        """Forget ``a`` and release its part streams."""
        if self._open.get((peer, a.token)) is a:
            del self._open[(peer, a.token)]
        a.done.set()


__all__ = [
    "MAX_PARTS",
    "PART_BYTES",
    "PART_HANDLER",
    "TOKEN_BYTES",
    "Assemblies",
    "Assembly",
    "Part",
    "join",
    "parse",
    "part_count",
    "split",
    "wire_bytes",
]
