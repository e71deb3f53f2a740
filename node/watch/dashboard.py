"""``python -m node dashboard --peers MADDR``: watch a swarm from outside, as a visitor.

A throwaway DHT identity in client mode (like ``node status``) reads the records; the metrics
streams are asked with the swarm key when the run has one. ``serve_in_node`` is the same
dashboard inside a running node (``join --dashboard PORT``), on that node's DHT and p2p.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import Callable

from node.config import NodeConfig
from node.net.wire import Wire
from node.swarm.membership import JoinError, read_run_record, remove_socket_dir, socket_dir, start_dht
from node.watch.collect import Collector
from node.watch.stream import MetricsServer
from node.watch.web import DashboardServer
from protocol.auth import SwarmKeyError, key_id, load_swarm_key


class DashboardError(RuntimeError):
    """One line saying why the dashboard cannot start."""


def open_server(host: str, port: int, state: Callable[[], dict]) -> DashboardServer:
    try:
        return DashboardServer(host, port, state).start()
    except OSError as e:
        raise DashboardError(f"cannot serve the dashboard on {host}:{port}: {e.strerror or e}") from None


def run_dashboard(args) -> int:
    sockdir = socket_dir(args.run_id)
    dht = None
    try:
        key = load_swarm_key(args.swarm_key) if args.swarm_key else None
        with tempfile.TemporaryDirectory() as tmp:
            cfg = NodeConfig(
                peers=args.peers,
                run_id=args.run_id,
                join_timeout=args.join_timeout,
                client_mode=True,
                state_dir=tmp,
            )  # a throwaway identity: the dashboard is a visitor, not a member
            dht = start_dht(cfg)
            run = read_run_record(dht, args.run_id, timeout=args.join_timeout)
            if run is None:
                raise DashboardError(f"no run {args.run_id!r} found at {args.peers[0]}; check --run-id")
            if run.key_id and (key is None or key_id(key) != run.key_id):
                raise DashboardError(
                    "this swarm only answers holders of its swarm key: pass --swarm-key FILE"
                    if key is None
                    else "--swarm-key is not this swarm's key (fingerprints differ)"
                )
            asyncio.run(_watch(dht, Wire(key), args))
    except (JoinError, DashboardError, SwarmKeyError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dht is not None:
            dht.shutdown()
        remove_socket_dir(sockdir)
    return 0


async def _watch(dht, wire: Wire, args) -> None:
    p2p = await dht.replicate_p2p()
    collector = Collector(dht, p2p, wire, args.run_id)
    server = open_server(args.host, args.port, lambda: collector.state)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"dashboard: {server.url}  (run {args.run_id}; Ctrl-C stops it)", flush=True)
    try:
        await collector.run_until(stop)
    finally:
        server.close()


async def serve_in_node(ctx, metrics: MetricsServer, stop: asyncio.Event) -> None:
    """The dashboard inside a node: its own metrics read directly, the others' over the swarm."""
    collector = Collector(ctx.dht, ctx.p2p, ctx.wire, ctx.run.run_id, own=(ctx.peer_id, metrics))
    server = open_server(ctx.cfg.dashboard_host, ctx.cfg.dashboard, lambda: collector.state)
    print(f"dashboard: {server.url}", flush=True)
    try:
        await collector.run_until(stop)
    finally:
        with contextlib.suppress(Exception):
            server.close()
