"""Temporary bans for peers that keep sending invalid frames.

Pure logic with injectable time (``now`` in seconds of any monotonic clock; defaults to
``time.monotonic()``). A peer collecting ``threshold`` strikes within ``window_s`` seconds
is banned for ``ban_s`` seconds; its strikes are then cleared. ``record_good`` forgives the
oldest strike, so an honest peer with an occasional defect (a NaN after a divergent step, a
frame cut by a dropped connection) is not banned, while one sending mostly garbage is.
Memory is bounded by ``max_peers`` tracked peer ids (bans are kept in preference to strikes).
Not thread-safe: use it from the event loop only.
"""

from __future__ import annotations

import time
from collections import deque


class BanList:
    def __init__(
        self, threshold: int = 5, window_s: float = 60.0, ban_s: float = 300.0, max_peers: int = 10_000
    ):
        if threshold < 1 or window_s <= 0 or ban_s < 0 or max_peers < 1:
            raise ValueError("threshold >= 1, window_s > 0, ban_s >= 0, max_peers >= 1")
        self.threshold = threshold
        self.window_s = float(window_s)
        self.ban_s = float(ban_s)
        self.max_peers = max_peers
        self._strikes: dict[str, deque[float]] = {}
        self._banned: dict[str, float] = {}  # peer -> banned until
        self.bans_total = 0

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else float(now)

    def _expire(self, peer: str, now: float) -> deque[float] | None:
        q = self._strikes.get(peer)
        if q is not None:
            while q and q[0] <= now - self.window_s:
                q.popleft()
            if not q:
                del self._strikes[peer]
                return None
        return q

    def record_bad(self, peer_id, now: float | None = None) -> bool:
        """Count one invalid frame from ``peer_id``; True if this strike bans it."""
        peer, now = str(peer_id), self._now(now)
        if self.is_banned(peer, now):
            return False
        q = self._expire(peer, now)
        if q is None:
            self._make_room(now)
            q = self._strikes[peer] = deque()
        q.append(now)
        if len(q) < self.threshold:
            return False
        del self._strikes[peer]
        self._banned[peer] = now + self.ban_s
        self.bans_total += 1
        return True

    def record_good(self, peer_id, now: float | None = None) -> None:
        """A valid frame from ``peer_id``: forgive its oldest strike."""
        peer, now = str(peer_id), self._now(now)
        q = self._expire(peer, now)
        if q:
            q.popleft()
            if not q:
                del self._strikes[peer]

    def is_banned(self, peer_id, now: float | None = None) -> bool:
        peer, now = str(peer_id), self._now(now)
        until = self._banned.get(peer)
        if until is None:
            return False
        if now >= until:
            del self._banned[peer]
            return False
        return True

    def banned_until(self, peer_id, now: float | None = None) -> float | None:
        return self._banned.get(str(peer_id)) if self.is_banned(peer_id, now) else None

    def strikes(self, peer_id, now: float | None = None) -> int:
        q = self._expire(str(peer_id), self._now(now))
        return len(q) if q else 0

    def banned(self, now: float | None = None) -> list[str]:
        now = self._now(now)
        return [p for p in list(self._banned) if self.is_banned(p, now)]

    def prune(self, now: float | None = None) -> None:
        """Drop expired bans and strikes (done lazily anyway; call it from a periodic loop if you like)."""
        now = self._now(now)
        for p in list(self._banned):
            self.is_banned(p, now)
        for p in list(self._strikes):
            self._expire(p, now)

    def _make_room(self, now: float) -> None:
        if len(self._strikes) + len(self._banned) < self.max_peers:
            return
        self.prune(now)
        while self._strikes and len(self._strikes) + len(self._banned) >= self.max_peers:
            del self._strikes[next(iter(self._strikes))]  # the peer tracked longest
        while len(self._banned) >= self.max_peers:
            del self._banned[min(self._banned, key=self._banned.get)]  # the ban ending soonest

    def __len__(self) -> int:
        return len(self._strikes) + len(self._banned)
