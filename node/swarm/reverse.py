"""Connection reversal: a node behind NAT dials the peers that must call it, and keeps those
connections open, so their streams to it ride connections it opened.

Measured in network namespaces (masquerading gateway whose forward chain drops everything inbound
but established/related; docs/ARCHITECTURE.md "Behind NAT"): once the node behind NAT has dialled
a public peer, that peer opens streams to it by peer id over the same connection, at once, and the
idle connection stayed up (p2pd's connection manager trims only above its high-water mark, and
yamux pings it). What no single connection survives is the NAT losing its mapping (a router
reboot, a flushed conntrack table, the uplink bounced): the public side's next packet is answered
with a reset, the node's own packets are dropped as invalid, and nobody could dial the node again.
Left alone, a run whose tail is behind NAT stopped for good after such a reset (every microbatch
dropped at the head, the tail's record expired).

So every half heartbeat (``keep``), for each peer ``routing.must_call_me`` names:

* not connected: dial it at the addresses its stage record announces;
* connected, and a stream from it began within the last half beat (``Wire.heard``): nothing to do;
* connected but quiet: ask it "are you there?" on a new stream (``net/alive``, which rides the
  same connection) within one beat (at least a second); no answer: the connection is dead (its
  mapping is gone), so close it and dial again.

A node whose NAT mapping was lost thus dials again within about two heartbeats of the loss: half
a beat until its loop next runs, half a beat until a busy peer's last stream is old enough, one
beat of probe. (In namespaces, heartbeat 1 s: the head completed microbatches again 3-4 s after
the gateway's uplink bounced, its own back-off after a drop included; tests/test_nat.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from node.net.alive import ANSWER_S, answers
from node.net.reach import addresses_for, tcp_target
from node.net.wire import Wire

log = logging.getLogger("node")

DIAL_S = 10.0  # one dial: a peer that takes longer is tried again next beat
WARN_EVERY_S = 60.0  # one line per peer that cannot be dialled, per this many seconds


def dialable(maddrs: list[str]) -> list[str]:
    """The TCP addresses of a stage record's ``maddrs``, without their /p2p/ part (p2pd's connect
    takes the peer id apart and refuses an address that repeats it)."""
    out = []
    for a in maddrs:
        base = a.split("/p2p/")[0]
        if tcp_target(base) is not None and base not in out:
            out.append(base)
    return out


def dialback_questions(peers: Mapping[str, Sequence[str]], own: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Dial-back questions (node.net.reach.ask_many): each peer (id -> the addresses it is known
    by), in a stable order, asked about those of our addresses ``own`` it can usefully dial."""
    mine = dialable(list(own))
    return [(p, addresses_for(mine, dialable(list(a)))) for p, a in sorted(peers.items())]


class Reverser:
    """The connections a node behind NAT keeps to the peers that call it (the module docstring)."""

    def __init__(
        self,
        p2p,
        wire: Wire,
        beat_s: float,
        probe: Callable[[object, str, float], Awaitable[bool]] = answers,
    ) -> None:
        self.p2p, self.wire, self.beat_s, self.probe = p2p, wire, beat_s, probe
        self.probe_s = min(max(beat_s, 1.0), ANSWER_S)  # a beat, but at least a second
        self.dials = 0  # connections opened (the first one to each peer included)
        self.redials = 0  # dead connections closed and opened again
        self.kept = 0  # peers that call us connected after the last beat
        self.last_dial = 0.0  # wall-clock time of the last connection opened (metrics, tests)
        self._warned: dict[str, float] = {}

    async def connected(self) -> set[str]:
        return {info.peer_id.to_base58() for info in await self.p2p.list_peers()}

    async def keep(self, targets: Mapping[str, list[str]]) -> set[str]:
        """One beat: each of ``targets`` (peer id -> announced maddrs) connected and alive, or
        dialled; returns the peers connected after it."""
        now = await self.connected()
        ok = await asyncio.gather(*(self._keep_one(p, a, p in now) for p, a in sorted(targets.items())))
        kept = {p for p, good in zip(sorted(targets), ok) if good}
        self.kept = len(kept)
        return kept

    async def _keep_one(self, peer: str, maddrs: list[str], connected: bool) -> bool:
        if connected:
            quiet = not self.wire.heard_within(peer, self.beat_s / 2)
            if not quiet or await self.probe(self.p2p, peer, self.probe_s):
                return True
            # connected in p2pd's view, yet silent: the NAT lost the mapping under it
            log.warning("the connection to %s stopped answering; dialling it again", peer[:12])
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.p2p._client.disconnect(PeerID.from_base58(peer)), DIAL_S)
            self.redials += 1
        return await self._dial(peer, maddrs)

    async def _dial(self, peer: str, maddrs: list[str]) -> bool:
        addrs = dialable(maddrs)
        try:
            # hivemind's P2P has no public connect; its daemon client does (p2pd's CONNECT)
            await asyncio.wait_for(
                self.p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(a) for a in addrs]), DIAL_S
            )
        except Exception as e:  # unreachable, refused, the deadline: again next beat
            now = time.monotonic()
            if now - self._warned.get(peer, float("-inf")) >= WARN_EVERY_S:
                self._warned[peer] = now
                log.warning(
                    "behind NAT, cannot open a connection to %s at %s (%s): it cannot send this node work "
                    "until one opens",
                    peer[:12],
                    " ".join(addrs) or "no address",
                    type(e).__name__,
                )
            return False
        self.dials += 1
        self.last_dial = time.time()
        self._warned.pop(peer, None)
        log.info("behind NAT: connected to %s, a peer that calls this node", peer[:12])
        return True


__all__ = ["Reverser", "dialable"]
