"""How this node opens a stream to each peer: directly, or through a relay (``node.net.relay``
says why relays exist and how they carry a stream; this module holds the decisions and the wire
header, which the stream opener ``node.net.rpc`` needs without the relay's server side)."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence

from hivemind.p2p import PeerID

from node.net.serve import NotAllowed
from node.net.wire import Wire
from protocol.frames import Frame, MalformedFrame
from protocol.records import MAX_RELAYS

RELAY_HANDLER = "vnode.relay"  # on a relay: "carry this stream to peer t's handler h"
RELAYED_HANDLER = "vnode.relayed"  # on a NAT'd node: "this stream comes from peer f, for handler h"
RELAYS_WANTED = 2  # relays a NAT'd node keeps connections to (one dies: the other still carries)
HEADER_BYTES = 4096
RELAY_DOWN_S = 30.0  # a relay that could not be reached is tried last for this long
RELAY_TRUST_S = 120.0  # a relay of the run is accepted this long after a record last said it relays
MAX_REMEMBERED = 4096  # NAT'd peers whose relays are kept while their record is missing


def choose_relays(candidates: Sequence[str], me: str, k: int = RELAYS_WANTED) -> list[str]:
    """The ``k`` relays a NAT'd node ``me`` keeps, from the public peers that offer to relay.

    Rendezvous hashing: each node ranks every candidate by hash(me, candidate), so the NAT'd nodes
    spread over the relays (no relay is everyone's first), and a node's choice changes only when
    one of its own relays leaves or a new candidate outranks it, not whenever the swarm changes."""

    def rank(c: str) -> bytes:
        return hashlib.blake2b(f"{me}|{c}".encode(), digest_size=8).digest()

    return sorted((c for c in set(candidates) if c != me), key=rank)[:k]


# the outer averager's handlers (node.dp.diloco.matchmaking_prefix + hivemind's servicer names):
# relayed between replicas that reach each other only through a relay (node.dp.relayed_averaging)
OUTER_HANDLER = re.compile(r"vnode_[A-Za-z0-9_-]+_outer_\d+::_OuterAverager\.rpc_[a-z_]+")


def relay_header(kind: str, run_id: str, peer: str, handler: str) -> Frame:
    """The one frame that opens a relayed stream: ``t`` (the target, to a relay) or ``f`` (the
    sender, to the callee), and the handler ``h``."""
    key = "t" if kind == RELAY_HANDLER else "f"
    return Frame(kind="relay", run_id=run_id, meta={key: peer, "h": handler})


def parse_header(frame: Frame, key: str) -> tuple[str, str]:
    peer, handler = frame.meta.get(key), frame.meta.get("h")
    if not (isinstance(peer, str) and 0 < len(peer) < 128 and isinstance(handler, str)):
        raise MalformedFrame(f"a relay header names a peer ({key}) and a handler (h)")
    ours = handler.startswith("vnode.") or OUTER_HANDLER.fullmatch(handler) is not None
    if not ours or handler in (RELAY_HANDLER, RELAYED_HANDLER):
        raise NotAllowed(f"handler {handler!r} cannot be relayed")
    try:
        PeerID.from_base58(peer)
    except Exception:
        raise MalformedFrame(f"relay header peer {peer[:20]!r} is not a peer id") from None
    return peer, handler


class Paths:
    """How this node opens a stream to each peer: directly, or through the peer's relays.

    Refreshed every half heartbeat (``update``) from the stage records and the daemon's list of
    connected peers. A peer behind NAT (record reach ``reverse``) with no connection to us can only
    be reached through a relay; everyone else directly (a dial, or a connection that exists)."""

    def __init__(self, wire: Wire, run_id: str) -> None:
        self.wire, self.run_id = wire, run_id
        self.relays: dict[str, list[str]] = {}  # NAT'd peer -> the relays its record names
        self.connected: set[str] = set()
        self.relayed_streams = 0  # streams this node opened through a relay
        self.relay_failures = 0
        self.down: dict[str, float] = {}  # relay -> when a stream could last not be opened to it

    def update(self, records: Mapping[str, object], connected: set[str]) -> None:
        """A NAT'd peer's relays as its record names them; a peer whose record is missing this time
        (a DHT read that came back short while a relay died, say) or names none keeps the relays
        last seen: dialling a NAT'd peer directly only fails, after a timeout."""
        self.connected = set(connected)
        old, self.relays = self.relays, {}
        for p, r in records.items():
            if getattr(r, "reach", "direct") != "reverse":
                continue
            named = list(getattr(r, "relays", []))[:MAX_RELAYS]
            self.relays[p] = named or old.get(p, [])
        for p, rs in old.items():
            if p not in records and len(self.relays) < MAX_REMEMBERED:
                self.relays[p] = rs

    def via(self, peer: str, now: float | None = None) -> list[str]:
        """The relays to try for ``peer``, in order; [] to open the stream directly."""
        if peer in self.connected or peer not in self.relays:
            return []
        now = time.monotonic() if now is None else now
        down = {r for r, t in self.down.items() if now - t < RELAY_DOWN_S}
        return relay_order(self.relays[peer], self.connected, down)

    def relay_down(self, relay: str, now: float | None = None) -> None:
        """A stream to ``relay`` could not be opened: try it last until it answers again. Until the
        next refresh, the connection list may still name it (a killed relay's connection lingers
        in the daemon); dialling it first would cost every stream a dial timeout."""
        self.down[relay] = time.monotonic() if now is None else now
        self.connected.discard(relay)

    def relay_up(self, relay: str) -> None:
        self.down.pop(relay, None)


def trusted_relays(
    seen: Mapping[str, float], current: Sequence[str], now: float, keep_s: float = RELAY_TRUST_S
) -> dict[str, float]:
    """relay -> when last seen relaying: the ones the run's records name now, and those seen within
    ``keep_s``. Every node accepts relayed streams from these (``RelayedIn``), reachable or not; a
    DHT read that came back short under load, or a relay not ready for a moment, must not turn away
    the streams it carries (the 20-minute volunteer run: hundreds refused as "not a relay")."""
    out = {r: t for r, t in seen.items() if now - t < keep_s}
    out.update({r: now for r in current})
    return out


def relay_order(relays: Sequence[str], connected: set[str], down: set[str]) -> list[str]:
    """Every relay, best first: ones this node holds a connection to, then ones it would dial, and
    ones that failed a moment ago last (still tried: a failure may have been the relay's hiccup)."""
    return sorted(relays, key=lambda r: (r in down, r not in connected))


def connection_kind(me_nat: bool, peer_reach: str, connected: bool, punched: bool, relayed: bool) -> str:
    """direct | reversed | punched | relayed: how streams between this node and a peer travel.
    Reversed: one side is behind NAT and rides the connection it opened to the other."""
    if relayed:
        return "relayed"
    if punched and connected:
        return "punched"
    return "reversed" if me_nat or peer_reach == "reverse" else "direct"


_PATHS: dict[int, Paths] = {}  # id(p2p) -> its Paths: one node, one daemon client


def install(p2p, paths: Paths | None) -> None:
    if paths is None:
        _PATHS.pop(id(p2p), None)
    else:
        _PATHS[id(p2p)] = paths


def paths_of(p2p) -> Paths | None:
    return _PATHS.get(id(p2p))


def is_relayed(p2p) -> Callable[[str], bool]:
    """peer -> whether this node reaches it only through a relay now (routing's discount)."""
    paths = paths_of(p2p)
    return (lambda peer: bool(paths.via(peer))) if paths is not None else (lambda peer: False)


__all__ = [
    "HEADER_BYTES",
    "RELAYED_HANDLER",
    "RELAY_HANDLER",
    "RELAYS_WANTED",
    "Paths",
    "choose_relays",
    "connection_kind",
    "install",
    "is_relayed",
    "parse_header",
    "paths_of",
    "relay_header",
]
