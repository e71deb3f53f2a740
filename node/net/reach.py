"""Is this node reachable? Other peers dial its announced addresses back and say (``vnode.dialback``).

A node behind NAT (a home router, no forwarded port) cannot be dialled: its upstream stage's
streams to it would hang. It can still dial out, and libp2p carries streams in both directions on
any connection, whoever opened it: a stream the upstream opens to it rides the connection it
opened (connection reversal, ``node.swarm.reverse``). So a node must know which it is, and asking
itself cannot tell: only another peer can try its addresses.

The dial-back is a plain TCP connect to each announced address, not a libp2p dial: the asker is
already connected to the peer it asks, and libp2p would reuse that connection and answer "reached"
for every node. A connect proves that something accepts on that address (p2pd listens there);
nothing is written, so a stranger can make this node do no more than open and close a bounded
number of TCP connections (``MAX_ADDRS`` per question, ``MAX_AT_ONCE`` questions at once).

``decide`` is the one pure decision: the mode the node runs in, from ``--reachability`` and the
answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from node.net import rpc
from node.net.caps import Limits
from node.net.serve import Stream, serve
from node.net.wire import Wire
from protocol.frames import Frame, MalformedFrame, decode_frame

log = logging.getLogger("node")

DIALBACK_HANDLER = "vnode.dialback"
MAX_ADDRS = 4  # addresses one question may name (a node listens on one or two)
RECHECK_BEATS = 6  # a serving node asks again every this many heartbeats (--reachability auto)
MAX_AT_ONCE = 4  # questions answered at once: the rest wait, each connect is bounded
# each question makes this node open TCP connections for a stranger: a few, rarely, per peer
LIMITS = Limits(per_peer=1, total=MAX_AT_ONCE, rate=0.2, burst=2)
# one TCP connect: a dropped SYN (a NAT's firewall) waits this long, a refusal returns at once
CONNECT_S = 3.0
ASK_S = CONNECT_S * MAX_ADDRS + 10.0  # one question, connects and the stream included
MAX_ASKED = 5  # peers asked at start (Petals asks up to 5)
QUESTION_BYTES = 4096


def tcp_target(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a /ip4|/ip6|/dns*/HOST/tcp/PORT[/...] address, or None for any other."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[3] != "tcp":
        return None
    if parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or not parts[4].isdigit():
        return None
    port = int(parts[4])
    return (parts[2], port) if 0 < port < 65536 else None


async def tcp_reachable(host: str, port: int, timeout: float = CONNECT_S) -> bool:
    """True if a TCP connect to host:port completes within ``timeout``; closed at once."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def question(run_id: str, maddrs: Sequence[str]) -> Frame:
    """A dial-back question: the addresses to try (meta ``a0``.., at most ``MAX_ADDRS``)."""
    meta: dict[str, float | int | str] = {f"a{i}": a for i, a in enumerate(list(maddrs)[:MAX_ADDRS])}
    return Frame(kind="dialback", run_id=run_id, meta=meta)


def addresses_of(frame: Frame) -> list[str]:
    """The addresses a question names; MalformedFrame if it names none or too many, or not as text."""
    addrs = [frame.meta.get(f"a{i}") for i in range(len(frame.meta))]
    if not 0 < len(addrs) <= MAX_ADDRS or not all(isinstance(a, str) and len(a) < 512 for a in addrs):
        raise MalformedFrame(f"a dial-back question names 1 to {MAX_ADDRS} addresses (a0, a1, ...)")
    return addrs


async def answer(addrs: Sequence[str], timeout: float = CONNECT_S) -> list[bool]:
    """Whether each address accepted a TCP connect (an address that is not TCP: False)."""

    async def one(a: str) -> bool:
        target = tcp_target(a)
        return target is not None and await tcp_reachable(*target, timeout)

    return list(await asyncio.gather(*(one(a) for a in addrs)))


class DialBack:
    """The server side of ``vnode.dialback`` for one node (its wire: swarm key and bans)."""

    def __init__(self, wire: Wire, run_id: str, connect_s: float = CONNECT_S) -> None:
        self.wire, self.run_id, self.connect_s = wire, run_id, connect_s
        self.turns = asyncio.Semaphore(MAX_AT_ONCE)

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read the question, connect to each address, answer ``r0``.. = 1 or 0."""
        await serve(
            stream_info, reader, writer, self.wire, self._body, run_id=self.run_id, timeout=ASK_S,
            what="dial-back question", caps=self.wire.caps(DIALBACK_HANDLER, LIMITS),
        )  # fmt: skip

    async def _body(self, s: Stream) -> None:
        addrs = addresses_of(decode_frame(await s.receive(QUESTION_BYTES), run_id=self.run_id))
        async with self.turns:
            ok = await answer(addrs, self.connect_s)
        meta: dict[str, float | int | str] = {f"r{i}": int(x) for i, x in enumerate(ok)}
        await s.send(Frame(kind="dialback", run_id=self.run_id, meta=meta))


async def ask(
    p2p, wire: Wire, peer: str, run_id: str, maddrs: Sequence[str], timeout: float = ASK_S
) -> bool | None:
    """Whether ``peer`` reached any of ``maddrs``; None if it did not answer (gone, an older node, a
    plain hivemind bootstrap without the handler)."""
    try:
        replies, _, _ = await rpc.request(
            p2p, wire, peer, DIALBACK_HANDLER, question(run_id, maddrs), timeout, run_id
        )
    except Exception as e:  # unreachable, no such handler, an error reply: no answer, not a "no"
        log.debug("dial-back question to %s unanswered: %s", peer[:12], e)
        return None
    return any(replies[0].meta.get(f"r{i}") == 1 for i in range(min(len(maddrs), MAX_ADDRS)))


def is_loopback(maddr: str) -> bool:
    target = tcp_target(maddr)
    return target is not None and (target[0].startswith("127.") or target[0] in ("::1", "localhost"))


def addresses_for(own: Sequence[str], peer: Sequence[str]) -> list[str]:
    """Which of our addresses a peer known at ``peer`` (its maddrs) can usefully dial back: a
    loopback address only when the peer is on loopback too. From another machine, 127.0.0.1 is
    that machine's own loopback, where a node listening on the same port would answer for us."""
    local = bool(peer) and all(is_loopback(a) for a in peer)
    return [a for a in own if local or not is_loopback(a)]


async def ask_many(
    p2p, wire: Wire, questions: Sequence[tuple[str, Sequence[str]]], run_id: str, timeout: float = ASK_S
) -> list[bool | None]:
    """``ask`` up to ``MAX_ASKED`` (peer, addresses) at once; their answers in order. A peer with no
    address to try (ours are all loopback, it is not) is a "no" without a question."""

    async def one(peer: str, addrs: Sequence[str]) -> bool | None:
        return await ask(p2p, wire, peer, run_id, addrs, timeout) if addrs else False

    return list(await asyncio.gather(*(one(p, a) for p, a in questions[:MAX_ASKED])))


def rechecked(current: str, answers: Sequence[bool | None]) -> tuple[str, str] | None:
    """(mode, why) a serving node switches to after a re-check, or None to stay as it is. Only
    answers count: peers that did not answer say nothing about our address (a busy swarm, an
    older node), so silence never flips a node behind NAT back to direct."""
    if all(a is None for a in answers):
        return None
    mode, why = decide("auto", answers, True)
    return (mode, why) if mode != current else None


def decide(mode: str, answers: Sequence[bool | None], has_peers: bool) -> tuple[str, str]:
    """(``direct`` | ``nat``, why) for ``--reachability`` ``mode`` and the dial-back answers.

    * ``direct``/``nat`` as configured: the volunteer knows (a forwarded port; a test).
    * ``auto`` with no peers: the node starts the swarm, so it is the bootstrap others dial:
      direct (if it is not, nobody can join it, and the joiner's error names the address).
    * ``auto``: direct when at least half of the peers that answered reached an address (Petals'
      rule: one peer on the same LAN reaches what the rest cannot); nat when they answered and
      fewer did;
    * ``auto`` and nobody answered (the bootstrap is a plain hivemind peer, an older node, or
      still loading and without the handler): direct, as before this check existed, and said in
      the log: a local swarm's nodes start together, and would all reverse for nothing.
    """
    if mode in ("direct", "nat"):
        return mode, f"--reachability {mode}"
    if not has_peers:
        return "direct", "this node starts the swarm"
    said = [a for a in answers if a is not None]
    if not said:
        return "direct", "no peer answered a dial-back question; pass --reachability nat behind NAT"
    yes = sum(said)
    if 2 * yes >= len(said):
        return "direct", f"{yes} of {len(said)} peers reached its announced address"
    return "nat", f"{len(said) - yes} of {len(said)} peers could not reach its announced address"


__all__ = [
    "DIALBACK_HANDLER",
    "DialBack",
    "answer",
    "ask",
    "rechecked",
    "addresses_for",
    "ask_many",
    "decide",
    "is_loopback",
    "tcp_reachable",
    "tcp_target",
]
