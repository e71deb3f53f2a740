"""Hole punching: two nodes behind NAT open a direct TCP connection, coordinated over a relay.

A home router that keeps a connection's public port for every destination (endpoint-independent
mapping: most home routers, Linux masquerade) lets a packet in from a peer's public address and
port once a packet went out to it. p2pd dials from the port it listens on (go-libp2p's TCP
reuseport), so each node behind such a router is seen by everyone at one public address, which
the relays report (``seen``). Then, for A (the caller) and B (a peer it has no connection to):

1. A asks one of its relays which public address it sees A at (``seen``);
2. A asks B, over B's relay, to ``prime``: B opens a socket on its own listening port (shared
   with p2pd through SO_REUSEPORT) and starts a connect to A's public address, which opens a
   mapping in B's router for packets from there; B answers with its own public address;
3. A's p2pd dials B's public address. B's router takes A's SYN for a reply to B's and lets it in,
   to B's connecting socket: a TCP simultaneous open, so both ends' sequence numbers are the ones
   the routers tracked. B then splices that connection to its own p2pd's listening port, and the
   two daemons shake hands over it as over any dialled connection (A's p2pd checks B's peer id);
   every stream between A and B rides it from then on (``node.net.paths.Paths`` sees them
   connected). Handing A's SYN to p2pd's listening socket instead does not work: its answer
   carries a sequence number the router never saw, and a Linux router drops it as invalid.

B's SYN itself dies at A's router (a home router drops an unsolicited packet without an answer).
Through a router that gives each destination its own port (a symmetric NAT; Linux ``masquerade
random,fully-random``), B's SYN leaves from a port A never learns and A's dial finds no mapping:
the dial times out, the node says so once, and the relay keeps carrying that pair's streams. So
does a router that answers an unsolicited SYN with a reset (that reset closes B's mapping). A
failed pair is tried again after ``RETRY_S``; a punched connection that dies (the NAT's mapping
lost) leaves the pair on the relay until the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from node.net import rpc
from node.net.caps import Limits
from node.net.reach import tcp_target
from node.net.relay import splice, until_cancelled
from node.net.serve import Stream, serve
from node.net.wire import Wire
from protocol.frames import Frame, MalformedFrame, decode_frame

log = logging.getLogger("node")

PUNCH_HANDLER = "vnode.punch"
DIAL_S = 5.0  # A's dial of B's public address: a SYN that finds no mapping is dropped, not refused
RETRY_S = 120.0  # a pair whose punch failed tries again after this long
PRIME_S = 0.05  # B answers this long after its SYN left
SEEN_EVERY_S = 60.0  # a node asks a relay for its public address this often
QUESTION_BYTES = 1024
# per peer: a "seen" a minute and a "prime" per pair per RETRY_S; a burst for a node with many peers
LIMITS = Limits(per_peer=2, total=8, rate=1.0, burst=8)


def as_maddr(addr: str) -> str:
    """ "HOST:PORT" -> /ip4/HOST/tcp/PORT (MalformedFrame for anything else)."""
    host, _, port = addr.rpartition(":")
    try:
        socket.inet_aton(host)
        if not 0 < int(port) < 65536:
            raise ValueError
    except (OSError, ValueError):
        raise MalformedFrame(f"not an IPv4 HOST:PORT: {addr[:40]!r}") from None
    return f"/ip4/{host}/tcp/{int(port)}"


async def prime(local: tuple[str, int], remote: tuple[str, int], wait_s: float) -> socket.socket | None:
    """Start a connect from ``local`` (this node's listening address, shared with p2pd through
    SO_REUSEPORT) to ``remote``: its SYN opens our router's mapping. The socket once the peer's
    own SYN met it (a simultaneous open), or None when none did within ``wait_s`` or the port
    could not be shared."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(local)
        s.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, remote), wait_s)
        return s
    except (OSError, asyncio.TimeoutError) as e:
        log.debug("hole punch from %s:%d to %s:%d: %s", *local, *remote, type(e).__name__)
        s.close()  # a socket still connecting closes without a reset
        return None


class Puncher:
    """Both halves for one node: the ``vnode.punch`` handler and the caller's attempts."""

    def __init__(self, p2p, wire: Wire, run_id: str, listen: tuple[str, int], timeout: float) -> None:
        self.p2p, self.wire, self.run_id, self.listen, self.timeout = p2p, wire, run_id, listen, timeout
        self.public: str | None = None  # our public HOST:PORT, as a relay last saw it
        self.punched: set[str] = set()
        self.failed = 0
        self.next_try: dict[str, float] = {}
        self._warned: set[str] = set()
        self._seen_at = float("-inf")
        self._tasks: set[asyncio.Task] = set()
        self.spliced = 0  # punched connections this node carries to its p2pd (the callee's side)
        self.spliced_bytes = 0

    # ------------------------------------------------------------------ the handler
    async def handle(self, stream_info, reader, writer) -> None:
        async def body(s: Stream) -> None:
            q = decode_frame(await s.receive(QUESTION_BYTES), run_id=self.run_id)
            op = q.meta.get("op")
            if op == "seen":  # the address this stream's connection comes from
                seen = tcp_target(str(stream_info.addr))
                meta = {"a": f"{seen[0]}:{seen[1]}"} if seen else {}
            elif op == "prime" and self.public:
                target = tcp_target(as_maddr(str(q.meta.get("a", ""))))
                task = asyncio.create_task(self._prime_and_splice(target, s.peer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(PRIME_S)  # the SYN is out before the caller dials
                meta = {"a": self.public}
            else:
                meta = {}
            await s.send(Frame(kind="punch", run_id=self.run_id, meta=meta))

        await until_cancelled(
            serve(
                stream_info, reader, writer, self.wire, body, run_id=self.run_id, timeout=self.timeout,
                what="punch request", caps=self.wire.caps(PUNCH_HANDLER, LIMITS), strikes=False,
            )
        )  # fmt: skip

    async def _prime_and_splice(self, target: tuple[str, int], caller: str) -> None:
        """B's side of step 3: wait for the caller's SYN, then carry that connection to our p2pd."""
        s = await prime(self.listen, target, DIAL_S + 2.0)
        if s is None:
            return
        host = "127.0.0.1" if self.listen[0] in ("0.0.0.0", "") else self.listen[0]
        try:
            outside = await asyncio.open_connection(sock=s)
            inside = await asyncio.wait_for(asyncio.open_connection(host, self.listen[1]), DIAL_S)
        except Exception as e:
            log.info("punched connection from %s:%d not handed to p2pd: %s", *target, e)
            s.close()
            return
        self.spliced += 1

        def count(n: int) -> None:
            self.spliced_bytes += n

        self.punched.add(caller)  # a relayed stream names its true caller (node.net.relay.RelayedIn)
        try:
            await splice(outside, inside, count, idle=None)  # for the connection's life
        finally:
            self.punched.discard(caller)

    async def _ask(self, peer: str, meta: dict) -> str | None:
        replies, _, _ = await rpc.request(
            self.p2p, self.wire, peer, PUNCH_HANDLER, Frame(kind="punch", run_id=self.run_id, meta=meta),
            self.timeout, self.run_id,
        )  # fmt: skip
        a = replies[0].meta.get("a")
        return a if isinstance(a, str) else None

    async def learn_public(self, relays: list[str]) -> str | None:
        """Our public HOST:PORT as the first relay that answers sees it (None: none answered);
        asked again every ``SEEN_EVERY_S`` (a router's public address rarely changes)."""
        now = time.monotonic()
        if self.public and now - self._seen_at < SEEN_EVERY_S:
            return self.public
        self._seen_at = now
        for r in relays:
            with contextlib.suppress(Exception):
                seen = await self._ask(r, {"op": "seen"})
                if seen:
                    self.public = seen
                    return seen
        return None

    # ------------------------------------------------------------------ the caller
    async def attempt(self, peer: str) -> bool:
        """Steps 2-3 of the module docstring with ``peer`` (over its relay); True if a direct
        connection to it is open now."""
        now = time.monotonic()
        if now < self.next_try.get(peer, 0.0) or not self.public:
            return False
        self.next_try[peer] = now + RETRY_S
        theirs = None
        try:
            theirs = await self._ask(peer, {"op": "prime", "a": self.public})
            if not theirs:
                raise ConnectionError("it did not prime (no public address known to it yet)")
            await asyncio.wait_for(
                self.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(as_maddr(theirs))]), DIAL_S
            )
        except Exception as e:
            self.failed += 1
            if peer not in self._warned:
                self._warned.add(peer)
                log.warning(
                    "could not punch a direct connection to %s (at %s: %s): a relay carries its streams "
                    "(a router that gives each destination its own port, a symmetric NAT, cannot be "
                    "punched); trying again every %.0fs",
                    peer[:12], theirs or "?", type(e).__name__ if not str(e) else str(e)[:80], RETRY_S,
                )  # fmt: skip
            return False
        self.punched.add(peer)
        self._warned.discard(peer)
        log.info("punched a direct connection to %s at %s: its streams leave the relay", peer[:12], theirs)
        return True


__all__ = ["PUNCH_HANDLER", "Puncher", "as_maddr", "prime"]
