"""One poll of the swarm every ``POLL_S``: the DHT's records, then every peer's metrics stream.

The result (``Collector.state``) is replaced whole after each poll, never changed in place, so
the HTTP threads (``node.watch.web``) read it without a lock. A peer that does not answer in
``ASK_S``, answers garbage or too much, or refuses us is listed as unreachable with the reason;
the poll goes on with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from node.net.wire import Wire
from node.swarm.membership import dht_call, read_stage_records
from node.watch.state import EVENTS_KEPT, Rates, Seen, build_state, diff_events, seen
from node.watch.stream import MetricsError, MetricsServer, fetch, parse_reply
from protocol.records import RecordError, RunRecord, run_key

log = logging.getLogger("node")

POLL_S = 2.0  # the page polls every 2 s too: fresher data would not be seen
ASK_S = 5.0  # a peer's metrics: a loaded node answers in well under a second; a dead one never


class Collector:
    """Polls run ``run_id`` through ``dht`` and ``p2p``. ``own``: (peer id, metrics server) of the
    node serving the dashboard, whose reply is read directly (p2pd opens no stream to itself)."""

    def __init__(
        self,
        dht,
        p2p,
        wire: Wire,
        run_id: str,
        own: tuple[str, MetricsServer] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht, self.p2p, self.wire, self.run_id, self.own = dht, p2p, wire, run_id, own
        self.clock = clock
        self.run: RunRecord | None = None
        self.events: list[dict] = []
        self._seen: Seen | None = None
        self._known: set[str] = set()
        self.rates = Rates()  # each node's trained tokens/s, from its own counter
        self.state: dict = build_state(None, [], {}, {}, [], clock())
        self.polls = 0

    async def _run_record(self) -> RunRecord | None:
        found = await dht_call(self.dht, "get", run_key(self.run_id), latest=True, timeout=ASK_S)
        if found is None:
            return self.run  # expired after the last node left: keep describing the run it was
        try:
            return RunRecord.from_dict(found.value)
        except RecordError as e:
            log.info("the run record is invalid: %s", e)
            return self.run

    async def _metrics(self, peer: str) -> dict | str:
        """The peer's metrics, or why they could not be read."""
        try:
            if self.own is not None and peer == self.own[0]:
                return parse_reply(self.own[1].reply(), self.run_id)
            return await asyncio.wait_for(fetch(self.p2p, self.wire, peer, self.run_id, ASK_S), ASK_S)
        except MetricsError as e:
            return f"bad metrics reply: {e}"[:200]
        except asyncio.TimeoutError:
            return f"no answer within {ASK_S:g} s"
        except Exception as e:  # cannot open a stream, reset, refused: the peer is unreachable
            return f"{type(e).__name__}: {e}"[:200]

    async def poll(self) -> dict:
        self.run = await self._run_record()
        t = self.clock()
        stages = []
        if self.run is not None:
            stages = await read_stage_records(self.dht, self.run_id, len(self.run.stages), ASK_S)
        peers = sorted({pid for s in stages for pid in s})
        answers = await asyncio.gather(*(self._metrics(p) for p in peers))
        nodes = {p: a for p, a in zip(peers, answers) if isinstance(a, dict)}
        unreachable = {p: a for p, a in zip(peers, answers) if isinstance(a, str)}
        now = seen(stages)
        self.events = (self.events + diff_events(self._seen, now, t, self._known))[-EVENTS_KEPT:]
        self._seen = now
        self._known |= now.keys()
        rates = self.rates.update(nodes)
        self.state = build_state(self.run, stages, nodes, unreachable, self.events, t, rates)
        self.polls += 1
        return self.state

    async def run_until(self, stop: asyncio.Event, every: float = POLL_S) -> None:
        while not stop.is_set():
            try:
                await self.poll()
            except Exception as e:  # a DHT hiccup: the page keeps the last state and says when it was
                log.info("dashboard poll failed: %s: %s", type(e).__name__, e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
