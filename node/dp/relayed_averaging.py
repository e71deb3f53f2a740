"""Outer rounds between replicas that reach each other only through a relay.

Two replicas of a stage behind NATs that cannot be punched (a symmetric NAT on either side) have no
connection to each other; the node carries its own streams between such peers through its relays
(``node/net/relay.py``), but hivemind's averager (matchmaking, all-reduce, state download) opens
its streams through its own daemon client in the helper process, where the daemon can only dial.
This module gives the averager the same relays:

* **caller** (the helper process, ``RelayedDialing``): the helper's daemon client opens a stream
  to a peer that the stage's records name as NAT'd, and that the daemon holds no connection to,
  through one of that peer's relays (``node.net.rpc.open_relayed``: the relay opens
  ``vnode.relayed`` on the peer); hivemind's protobufs then flow as on a direct stream;
* **callee** (the node process, ``forwarder``): the node's ``RelayedIn`` hands a relayed stream
  for one of the averager's handlers to the helper's daemon client exactly as p2pd hands it a
  stream: a connection to the client's listen socket, a ``StreamInfo`` naming the caller and the
  handler, then the bytes both ways.

A relay trusts nothing new: it already carries any handler's stream for the peers of its run,
and the callee accepts relayed streams only from the run's relays (``RelayedIn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import write_pbmsg
from hivemind.proto import p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr

from node.net import paths as routes
from node.net.relay import splice
from node.net.rpc import PeerUnreachable, open_relayed
from node.net.transport import close_quietly
from node.net.wire import Wire
from node.swarm.membership import dht_call, parse_stage_records
from protocol.records import stage_key

log = logging.getLogger("node")

REFRESH_S = 5.0  # how often the helper re-reads its stage's records and the daemon's connections
NO_ADDR = Multiaddr("/ip4/0.0.0.0/tcp/0")  # a relayed stream's StreamInfo has no address of its own


def handler_names(servicer: type, prefix: str) -> list[str]:
    """The stream handlers an averager of ``servicer``'s class registers under ``prefix``."""
    servicer._collect_rpc_handlers()
    return [servicer._get_handle_name(prefix, h.method_name) for h in servicer._rpc_handlers]


class RelayedDialing:
    """In the helper process: ``p2p``'s daemon client opens streams to NAT'd replicas through their
    relays. ``refresh`` keeps the routes (``node.net.paths.Paths``) from the stage's records."""

    def __init__(self, p2p, dht, run_id: str, stage: int, key: bytes | None, timeout: float) -> None:
        self.p2p, self.dht, self.run_id, self.stage, self.timeout = p2p, dht, run_id, stage, timeout
        self.paths = routes.Paths(Wire(key), run_id)
        self.relayed = 0  # streams this helper opened through a relay
        self._direct = p2p._client.stream_open
        p2p._client.stream_open = self.stream_open

    async def stream_open(self, peer_id: PeerID, protocols):
        peer = str(peer_id)
        relays = self.paths.via(peer)
        if not relays:
            return await self._direct(peer_id, protocols)
        failures = []
        for relay in relays:
            try:
                reader, writer = await open_relayed(
                    self.p2p, self.paths, relay, peer, protocols[0], self.timeout
                )
            except Exception as e:  # that relay gone, or it cannot reach the peer: the next one
                failures.append(f"{relay[:12]}: {type(e).__name__}")
                continue
            self.relayed += 1
            return StreamInfo(peer_id, NO_ADDR, protocols[0]), reader, writer
        raise PeerUnreachable(f"cannot reach {peer[:12]} through its relays: {'; '.join(failures)}")

    async def refresh(self) -> None:
        """One refresh: the stage's NAT'd replicas' relays, and the peers the daemon is connected to."""
        found = await dht_call(
            self.dht, "get", stage_key(self.run_id, self.stage), latest=True, timeout=self.timeout
        )
        connected = {str(p.peer_id) for p in await self.p2p.list_peers()}
        self.paths.update(parse_stage_records(found), connected)

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a DHT read that timed out: the routes as they were
                log.debug("outer averager: routes not refreshed: %r", e)
            await asyncio.sleep(REFRESH_S)


def forwarder(listen_path: Callable[[], str]):
    """In the node process: a stream handler that passes a relayed stream to the helper's daemon
    client, whose listen socket ``listen_path()`` names ("" while the helper is starting)."""

    async def forward(info: StreamInfo, reader, writer) -> None:
        path = listen_path()
        if not path:
            close_quietly(writer)
            return
        try:
            r, w = await asyncio.wait_for(asyncio.open_unix_connection(path), 10.0)
        except (OSError, asyncio.TimeoutError) as e:
            log.debug("outer averager not listening at %s: %r", path, e)
            close_quietly(writer)
            return
        pb = p2pd_pb2.StreamInfo(peer=info.peer_id.to_bytes(), addr=info.addr.to_bytes(), proto=info.proto)
        with contextlib.suppress(Exception):
            await write_pbmsg(w, pb)
            await splice((reader, writer), (r, w), lambda n: None, idle=None)
        close_quietly(w)
        close_quietly(writer)

    return forward
