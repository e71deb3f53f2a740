"""A route refresh asked for by an unknown sender, at most every few seconds.

A handler that takes only peers of some stage (SCAPE: its replicas; tied: the partner stage)
refreshes its routes when a sender is not in them, since that peer may have joined after the last
heartbeat. Unthrottled, every stream from a stranger would cost this node a DHT read: a flood of
streams from minted peer ids would become a flood of DHT traffic.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

ROUTE_RECHECK_S = 2.0  # an unknown sender triggers a route refresh at most this often


class RouteRecheck:
    def __init__(self, refresh: Callable[[], Awaitable[None]], every_s: float = ROUTE_RECHECK_S) -> None:
        self.refresh, self.every_s = refresh, every_s
        self._last = -every_s
        self.refreshes = 0

    async def __call__(self) -> None:
        """Refresh the routes, unless that was done within ``every_s`` seconds."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.refreshes += 1
        await self.refresh()


__all__ = ["ROUTE_RECHECK_S", "RouteRecheck"]
