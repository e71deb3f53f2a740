"""How many streams a handler serves at once, and how fast one sender may open them (pure).

A peer id costs nothing to mint, so a bound per peer alone stops one careless sender, not an
attacker: every handler also has a node-wide bound (``total``), and the expensive ones (a weight
pull clones and sends the whole stage) a per-sender rate. ``Caps.hold(key)`` is the one decision:
it admits a stream (release it by leaving the ``with``) or raises ``OverCap``, whose message says
which bound and what to do. ``key`` is usually the sender's peer id; a handler may pass a role
instead (every stranger of the weight server shares one key, so strangers together get one pull
at a time however many ids they mint).

Going over a concurrency bound is not struck: an honest upstream with many microbatches in flight
does it under load, and it is told ``busy`` (try another replica). Going over the rate is struck
(``OverCap.strike``): no honest node asks that often, and enough strikes ban it (``node.net.bans``).

Time is injectable (``now``, seconds of any monotonic clock). Memory is bounded by ``max_peers``
tracked keys. Not thread-safe: use it from the event loop only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from protocol.frames import FrameError


class OverCap(FrameError):
    """A stream over one of a handler's bounds: answered ``busy`` before its request is read."""

    code = "busy"

    def __init__(self, message: str, strike: bool) -> None:
        super().__init__(message)
        self.strike = strike  # the rate was exceeded: the sender's fault, counted towards a ban


@dataclass(frozen=True)
class Limits:
    """A handler's bounds. ``rate`` 0: no rate bound."""

    per_peer: int  # streams one key may have served at once
    total: int  # streams the handler serves at once, every key together
    rate: float = 0.0  # streams one key may open per second, sustained
    burst: float = 1.0  # ... and in a row after a quiet spell (the token bucket's depth)
    who: str = "this peer"  # what one key is, in a refusal (a role's shared key: its name)

    def __post_init__(self) -> None:
        if self.per_peer < 1 or self.total < self.per_peer or self.rate < 0 or self.burst < 1:
            raise ValueError("per_peer >= 1, total >= per_peer, rate >= 0, burst >= 1")


class Caps:
    """One handler's bounds in force: streams held per key and in all, a token bucket per key."""

    def __init__(self, limits: Limits, max_peers: int = 10_000) -> None:
        self.limits = limits
        self.max_peers = max_peers
        self.active = 0
        self._held: dict[str, int] = {}
        self._tokens: dict[str, tuple[float, float]] = {}  # key -> (tokens left, when counted)
        self.refused = 0

    @contextlib.contextmanager
    def hold(self, key: str, now: float | None = None) -> Iterator[None]:
        """Admit one stream of ``key`` for the ``with`` block, or raise ``OverCap``."""
        self.admit(key, now)
        try:
            yield
        finally:
            self.release(key)

    def admit(self, key: str, now: float | None = None) -> None:
        """Count one stream of ``key`` as served (``release`` it when done), or raise ``OverCap``.
        The concurrency bounds are checked first: a refused stream costs the sender no token."""
        lim = self.limits
        if self.active >= lim.total:  # first: a key shared by a role is told the node is full
            self.refused += 1
            raise OverCap(f"this node serves {lim.total} such streams at once; try another replica", False)
        if self._held.get(key, 0) >= lim.per_peer:
            self.refused += 1
            why = f"over {lim.per_peer} concurrent streams from {lim.who}; try another replica"
            raise OverCap(why, False)
        if lim.rate > 0:
            now = time.monotonic() if now is None else float(now)
            tokens, then = self._tokens.get(key, (lim.burst, now))
            tokens = min(lim.burst, tokens + (now - then) * lim.rate)
            if tokens < 1:
                self.refused += 1
                self._tokens[key] = (tokens, now)
                raise OverCap(f"over {lim.rate:g} requests/s from {lim.who}; slow down", True)
            self._make_room(key)
            self._tokens[key] = (tokens - 1, now)
        self._held[key] = self._held.get(key, 0) + 1
        self.active += 1

    def release(self, key: str) -> None:
        self.active -= 1
        n = self._held[key] - 1
        if n:
            self._held[key] = n
        else:
            del self._held[key]

    def _make_room(self, key: str) -> None:
        # a full bucket is what an unknown key starts with, so forgetting the oldest loses little
        while key not in self._tokens and len(self._tokens) >= self.max_peers:
            del self._tokens[next(iter(self._tokens))]


__all__ = ["Caps", "Limits", "OverCap"]
