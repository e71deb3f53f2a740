"""A stage's life: start from the swarm's weights, register handlers, heartbeat, leave cleanly.

``serve`` is the order of events: bases, weights (a joiner starts from its peers', an anchor
from a fast peer's), handlers, the first stage record, the heartbeat, the head's loop; on
SIGTERM or ``max_steps``, announce ``ready=False`` before answering stops, answer the streams in
progress (a body or tail: within one upstream hop deadline, new work turned away), let the
head's microbatches finish within their hop deadlines, take the final checkpoint, write
metrics and health.

``Lifecycle`` is the base of ``node.runtime.StageRuntime``, which composes the parts it
names below; this module only sequences them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from compression.spectral import SpectralFilter
from node.dp.anchors import ANCHOR_HANDLER, AnchorClient, PacketSink
from node.dp.scape import SCAPE_HANDLER, ScapeSync
from node.dp.strategies import AdamWStep
from node.dp.tied import TIED_HANDLER, TiedExchange
from node.net import paths as routes
from node.net import relay
from node.net.alive import ALIVE_HANDLER, handle_alive
from node.net.punch import PUNCH_HANDLER, Puncher
from node.net.reach import DIALBACK_HANDLER, RECHECK_BEATS, DialBack, ask_many, rechecked, tcp_target
from node.net.wire import raise_accept_backlog
from node.stage.basis import HANDLER as BASIS_HANDLER
from node.stage.context import StageContext
from node.stage.hop import HANDLER, HopClient
from node.stage.linkio import LinkIO
from node.stage.metrics import write_json_atomic
from node.stage.pipeline import Pipeline
from node.stage.server import ForwardServer
from node.stage.state import StageState
from node.stage.step import StepGate
from node.stop_signal import StopRequest
from node.swarm.health import write_health
from node.swarm.membership import store_stage_record
from node.swarm.rebalance import Rebalancer, choose_move, filler_rank, is_empty, move_reason
from node.swarm.reverse import Reverser, dialback_questions
from node.swarm.routing import fast_peers_of_stage, must_call_me, relays_of
from node.swarm.weights import WEIGHTS_HANDLER, WeightServer, pull_weights
from node.watch.dashboard import DashboardError, serve_in_node
from node.watch.probe import Probe
from node.watch.stream import METRICS_HANDLER, MetricsServer
from protocol.records import STAGE_RECORD_BEATS, StageRecord

log = logging.getLogger("node")


# nodes that could fill an empty stage re-check it this many record lifetimes apart, in filler_rank's order
FILLER_SPACING_BEATS = 2
JOIN_REREADS = 3  # extra reads of a stage that looks empty in a run that has trained (_join_from_peers)
METRICS_EVERY_S = 1.0  # the metrics file (--metrics-file) is rewritten this often


def _run_has_trained(routes: list[dict[str, StageRecord]]) -> bool:
    """Some live peer of any stage has taken an inner step."""
    return any(r.inner_step > 0 for stage in routes for r in stage.values())


class Lifecycle:
    # the parts, composed by StageRuntime
    ctx: StageContext
    gate: StepGate
    linkio: LinkIO
    hops: HopClient
    pipeline: Pipeline
    server: ForwardServer
    state: StageState
    maddrs: list[str]
    anchor: AnchorClient | None
    filter: SpectralFilter | None
    weight_server: WeightServer | None
    metrics_server: MetricsServer  # vnode.metrics, registered when serving starts
    packet_sink: PacketSink | None
    scape: ScapeSync | None
    tied: TiedExchange | None
    outer: object | None  # node.dp.diloco.OuterSync
    rebalancer: Rebalancer | None = None
    # rebalancing (node.swarm.rebalance): the stages this node may move to (None: it stays), and the verdict
    move_allowed: set[int] | None = None
    move_to: int | None = None  # set when the node left its stage to serve this one
    terminated = False  # SIGINT/SIGTERM: the process stops, whatever move_to says
    # direct: peers dial us; nat: we dial the peers that call us (node.net.reach decides, join sets it)
    reachability: str = "direct"
    reverser: Reverser | None = None  # behind NAT: the connections kept to those peers
    # how streams to each peer are opened: directly or through its relays (node.net.relay)
    paths: routes.Paths | None = None
    relay_server: relay.RelayServer | None = None  # a reachable node carries streams for NAT'd ones
    relayed_in: relay.RelayedIn | None = None  # streams our relays carry to us
    _relays_seen: dict = {}  # relay -> when a record last named it (node.net.paths.trusted_relays)
    my_relays: list[str] = []  # behind NAT: the relays this node keeps connections to
    puncher: Puncher | None = None  # hole punching between NAT'd peers (node.net.punch)
    _punching: asyncio.Task | None = None
    stop_request: StopRequest | None = None  # a signal that came while the node started (join)
    base: str = ""  # the frozen base's dtype under LoRA (node.model.adapters.frozen_base), for the record

    def metrics_dict(self) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------ the stage record
    def stage_record(self, ready: bool = True) -> StageRecord:
        return StageRecord(
            circuit=self.ctx.cfg.circuit,
            throughput=round(self.pipeline.throughput, 3),
            queue=self.gate.inflight,
            inner_step=self.ctx.inner_step,
            ready=ready,
            maddrs=self.maddrs,
            reach="reverse" if self.reachability == "nat" else "direct",
            relays=list(self.my_relays) if self.reachability == "nat" else [],
            relay=self.relay_server is not None and self.reachability == "direct",
            base=self.base,
        )

    async def publish(self, ready: bool = True, timeout: float | None = None) -> bool:
        """Our stage record: ready peers get routed to; a leaving node publishes ready=False first.
        False when no DHT peer took it."""
        ctx = self.ctx
        return await store_stage_record(
            ctx.dht,
            ctx.run.run_id,
            ctx.index,
            ctx.peer_id,
            self.stage_record(ready),
            timeout=timeout or ctx.cfg.hop_timeout,
        )

    async def heartbeat_loop(self) -> None:
        ctx = self.ctx
        unstored = 0  # beats in a row whose record no DHT peer took: routing cannot see us
        while not ctx.stop.is_set():
            try:
                stored = await self.publish()
            except Exception as e:
                log.info("heartbeat failed: %s", e)
                stored = False
            unstored = 0 if stored else unstored + 1
            if unstored == STAGE_RECORD_BEATS:  # once per outage: our record has expired by now
                log.warning(
                    "our stage record was not stored for %d heartbeats: no DHT peer took it, so no "
                    "peer routes work to this node until one does",
                    unstored,
                )
            await self.hops.refresh_routes()
            await self.maybe_move()
            if self.linkio.bases is not None:
                try:
                    await self.linkio.bases.announce()
                except Exception as e:
                    log.info("basis announce failed: %s", e)
            self.write_health(serving=True)
            try:
                await asyncio.wait_for(ctx.stop.wait(), ctx.cfg.heartbeat_s)
            except asyncio.TimeoutError:
                pass

    async def keep_reversed(self) -> set[str]:
        """Behind NAT: one beat of ``Reverser.keep`` over the peers that call this node, at the
        addresses their records announce; the peers connected after it."""
        ctx = self.ctx
        callers = must_call_me(ctx.routes, ctx.index, ctx.peer_id, ctx.cfg.circuit, ctx.run.tied)
        candidates = relays_of(ctx.routes, ctx.peer_id)
        chosen = routes.choose_relays(candidates, ctx.peer_id)
        # a caller behind NAT cannot be dialled: it reaches us through our relays instead
        records = {p: r for stage in ctx.routes for p, r in stage.items()}
        targets = {p for p in callers if p in records and records[p].reach == "direct"} | set(chosen)
        kept = await self.reverser.keep({p: records[p].maddrs for p in targets if p in records})
        # announced as soon as chosen: a record without relays would have callers dial us directly
        mine = [r for r in chosen if r in kept] or chosen
        if mine != self.my_relays:
            log.info("behind NAT: relays %s", " ".join(r[:12] for r in mine) or "none reachable")
            self.my_relays = mine
        if self.puncher is not None and (self._punching is None or self._punching.done()):
            self._punching = asyncio.create_task(self.punch(records))
        return kept

    async def punch(self, records: dict) -> None:
        """Behind NAT: learn our public address from a relay, then try to punch a direct connection
        to each NAT'd peer we call and are not connected to (node.net.punch; replicas: the lower id
        calls). In a task of its own: a dial that finds no mapping takes seconds."""
        ctx, puncher = self.ctx, self.puncher
        try:
            await puncher.learn_public(self.my_relays)
            callees = set(ctx.routes[ctx.index + 1]) if ctx.index + 1 < len(ctx.routes) else set()
            callees |= {p for p in ctx.routes[ctx.index] if p > ctx.peer_id}
            for p in sorted(callees):
                r = records.get(p)
                if r is not None and r.reach == "reverse" and r.ready and self.paths.via(p):
                    await puncher.attempt(p)
        except Exception as e:  # the daemon busy: the next beat tries again
            log.info("hole punching failed: %s", e)

    @property
    def punched(self) -> set[str]:
        return self.puncher.punched if self.puncher is not None else set()

    def connection_kinds(self) -> dict[str, str]:
        """Peer id -> how this node talks to it (direct, reversed, punched, relayed), for the
        neighbouring stages' and its own stage's peers (metrics, status, the dashboard)."""
        if self.paths is None:
            return {}
        ctx, out = self.ctx, {}
        for s in (ctx.index - 1, ctx.index, ctx.index + 1):
            if 0 <= s < len(ctx.routes):
                for p, r in ctx.routes[s].items():
                    if p != ctx.peer_id:
                        out[p] = routes.connection_kind(
                            self.reachability == "nat", r.reach, p in self.paths.connected,
                            p in self.punched, bool(self.paths.via(p)),
                        )  # fmt: skip
        return out

    async def refresh_paths(self, p2p) -> None:
        """The connected peers and the NAT'd peers' relays, for ``node.net.rpc`` (node.net.routes.Paths)."""
        if self.paths is None:
            return
        connected = {info.peer_id.to_base58() for info in await p2p.list_peers()}
        if self.puncher is not None:  # a punched connection that died: its peer is relayed again
            self.puncher.punched &= connected
        self.paths.update({p: r for stage in self.ctx.routes for p, r in stage.items()}, connected)

    async def reverse_loop(self) -> None:
        """``keep_reversed`` every half heartbeat (node.swarm.reverse says why), on the routes the
        heartbeat refreshed (a loop of its own: a dead connection's probe and dial must not hold
        the heartbeat up), then the paths to peers (``refresh_paths``), for every node. Reversal
        is idle while the node is reachable (a re-check may change that)."""
        ctx = self.ctx
        while not ctx.stop.is_set():
            if self.relayed_in is not None:  # any relay of the run, for every node (RelayedIn says why)
                self._relays_seen = routes.trusted_relays(
                    self._relays_seen, relays_of(ctx.routes, ctx.peer_id), time.monotonic()
                )
                self.relayed_in.relays = set(self._relays_seen)
            if self.reverser is not None:
                try:
                    await self.keep_reversed()
                except Exception as e:  # the daemon busy or restarting: again next beat
                    log.info("keeping the reversed connections failed: %s", e)
            try:
                await self.refresh_paths(ctx.p2p)
            except Exception as e:
                log.info("refreshing the paths to peers failed: %s", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), ctx.cfg.heartbeat_s / 2)

    async def recheck_reachability(self, p2p) -> None:
        """One re-check (``--reachability auto``): the addresses the daemon now sees announced from
        the next record on, and the ready peers asked to dial them back; a node whose NAT went
        away or appeared (a new network, a router restart) switches, reversing or not."""
        ctx = self.ctx
        seen = [str(a) for a in await p2p.get_visible_maddrs()]
        if seen and sorted(seen) != sorted(self.maddrs):
            log.info("announced addresses now %s (were %s)", seen, self.maddrs)
            self.maddrs = seen
        peers = {
            p: r.maddrs for stage in ctx.routes for p, r in stage.items() if r.ready and p != ctx.peer_id
        }
        answers = await ask_many(p2p, ctx.wire, dialback_questions(peers, self.maddrs), ctx.run.run_id)
        change = rechecked(self.reachability, answers)
        if change is None:
            return
        self.reachability, why = change
        log.warning("reachability now %s (%s)", self.reachability, why)
        self.reverser = Reverser(p2p, ctx.wire, ctx.cfg.heartbeat_s) if self.reachability == "nat" else None
        await self.publish()

    async def recheck_loop(self, p2p) -> None:
        """``recheck_reachability`` every RECHECK_BEATS heartbeats, for the node's life."""
        ctx = self.ctx
        while not ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), RECHECK_BEATS * ctx.cfg.heartbeat_s)
            if ctx.stop.is_set():
                return
            try:
                await self.recheck_reachability(p2p)
            except Exception as e:  # the daemon busy: the next re-check asks again
                log.info("reachability re-check failed: %s", e)

    async def maybe_move(self) -> None:
        """Every few beats: if another stage needs this node more (``choose_move``), leave for it.

        The move is decided twice, around a random wait, on fresh records: a replica of this stage
        that saw the same need may have claimed it meanwhile. Sets ``move_to`` and stops serving;
        ``node.join`` then serves the new stage in this process.
        """
        ctx, rb = self.ctx, self.rebalancer
        if rb is None or ctx.stop.is_set() or not rb.due(time.monotonic()):
            return
        circuit = ctx.cfg.circuit
        target = choose_move(ctx.routes, ctx.index, ctx.peer_id, circuit, self.move_allowed)
        if target is None:
            return
        # decide again after one stage-record lifetime (plus jitter): a stage that only looked empty
        # because its peers' heartbeats ran late on a loaded machine shows them again by then, a
        # dead peer's record stays gone (a fresh-clone run under load saw a 2+2 swarm become 1+3)
        recheck_s = rb.jitter() + STAGE_RECORD_BEATS * ctx.cfg.heartbeat_s
        if is_empty(ctx.routes, target, circuit):
            # an empty stage draws every node that can spare itself: one at a time, in an agreed
            # order, each after the one before could have claimed it (two record lifetimes apart)
            rank = filler_rank(ctx.routes, target, ctx.peer_id, circuit)
            recheck_s += rank * FILLER_SPACING_BEATS * STAGE_RECORD_BEATS * ctx.cfg.heartbeat_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ctx.stop.wait(), recheck_s)
        if ctx.stop.is_set():
            return
        await self.hops.refresh_routes()
        if choose_move(ctx.routes, ctx.index, ctx.peer_id, circuit, self.move_allowed) != target:
            return
        log.warning(
            "moving from stage %d to stage %d: %s",
            ctx.index,
            target,
            move_reason(ctx.routes, target, circuit),
        )
        self.move_to = target
        ctx.stop.set()

    def _on_signal(self) -> None:
        self.terminated = True
        self.ctx.stop.set()
        if self.outer is not None:  # a lonely round would hold the leave up to --outer-timeout
            self.outer.abort()

    def write_health(self, serving: bool) -> None:
        ctx = self.ctx
        try:
            write_health(
                ctx.cfg.state_dir,
                {
                    "serving": serving,
                    "stage": ctx.index,
                    "peer_id": ctx.peer_id,
                    "inner_step": ctx.inner_step,
                    "state": "serving" if serving else "stopped",
                },
            )
        except OSError as e:
            log.debug("could not write the health file: %s", e)

    def write_metrics(self) -> None:
        if self.ctx.cfg.metrics_file:
            write_json_atomic(self.ctx.cfg.metrics_file, self.metrics_dict())

    async def metrics_loop(self) -> None:
        """The metrics file on its own clock: written after each heartbeat's DHT calls, it went
        seconds stale on a loaded machine, and a rate read between two snapshots covered a span
        shorter than the reader's (the harness's frame rate, CI 12/4)."""
        while not self.ctx.stop.is_set():
            self.write_metrics()
            try:
                await asyncio.wait_for(self.ctx.stop.wait(), METRICS_EVERY_S)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ serving
    async def serve(self, p2p) -> None:
        """Register the handlers, heartbeat, drive data (head), until stopped."""
        ctx = self.ctx
        ctx.p2p = p2p
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        if self.stop_request is not None and self.stop_request.requested:
            self.terminated = True  # it came before the loop owned the signals: nothing served yet
            return
        bases = self.linkio.bases
        if bases is not None:
            bases.wire = ctx.wire
            await bases.start(p2p)
            await self.linkio.install_bases()
        if self.anchor is not None:
            await self._first_pull()
        else:
            await self._join_from_peers()
            await p2p.add_binary_stream_handler(WEIGHTS_HANDLER, self.weight_server.handle)
            await p2p.add_binary_stream_handler(ANCHOR_HANDLER, self.packet_sink.handle)
        if self.scape is not None:
            await p2p.add_binary_stream_handler(SCAPE_HANDLER, self.scape.handle)
        if self.tied is not None:
            await p2p.add_binary_stream_handler(TIED_HANDLER, self.tied.handle)

        async def alive(info, reader, writer) -> None:  # with the node's wire (set by join): its bans
            await handle_alive(info, reader, writer, wire=ctx.wire)

        await p2p.add_binary_stream_handler(ALIVE_HANDLER, alive)
        # anchors hold stale copies of the fast weights: not replicas whose drift the dashboard shows
        probe = Probe(ctx.stage, ctx.run.seed, ctx.index) if self.anchor is None else None
        self.metrics_server = MetricsServer(
            self.metrics_dict, ctx.wire, ctx.run.run_id, ctx.cfg.hop_timeout, probe
        )
        await p2p.add_binary_stream_handler(METRICS_HANDLER, self.metrics_server.handle)
        await p2p.add_binary_stream_handler(DIALBACK_HANDLER, DialBack(ctx.wire, ctx.run.run_id).handle)
        self.paths = routes.Paths(ctx.wire, ctx.run.run_id)
        routes.install(p2p, self.paths)
        if ctx.cfg.relay_service:  # announced (StageRecord.relay) only while this node is reachable
            self.relay_server = relay.RelayServer(
                p2p, ctx.wire, ctx.run.run_id, ctx.cfg.hop_timeout, ctx.cfg.relay_rate * 1e6
            )
            await p2p.add_binary_stream_handler(routes.RELAY_HANDLER, self.relay_server.handle)
        self.relayed_in = relay.RelayedIn(
            p2p, ctx.wire, ctx.run.run_id, ctx.cfg.hop_timeout, set(),
            more=lambda: self.outer.relayed_handlers() if self.outer is not None else {},
        )  # fmt: skip
        await p2p.add_binary_stream_handler(routes.RELAYED_HANDLER, self.relayed_in.handle)
        port = next((t[1] for t in map(tcp_target, self.maddrs) if t is not None), ctx.cfg.port)
        self.puncher = Puncher(p2p, ctx.wire, ctx.run.run_id, (ctx.cfg.host, port), ctx.cfg.hop_timeout)
        await p2p.add_binary_stream_handler(PUNCH_HANDLER, self.puncher.handle)
        await p2p.add_binary_stream_handler(HANDLER, self.server.handle_stream)
        raise_accept_backlog(p2p)  # before the first burst of streams, not at the first stream served
        if self.reachability == "nat":  # connected to those who call us before they route to us
            self.reverser = Reverser(p2p, ctx.wire, ctx.cfg.heartbeat_s)
            await self.hops.refresh_routes()
            await self.keep_reversed()
        await self.refresh_paths(p2p)
        await self.publish()
        if self.move_allowed is not None:  # the dwell counts from now: a joiner first fills its stage
            self.rebalancer = Rebalancer(time.monotonic(), ctx.cfg.heartbeat_s)
        tasks = [asyncio.create_task(self.heartbeat_loop())]
        if ctx.cfg.metrics_file:
            tasks.append(asyncio.create_task(self.metrics_loop()))
        if ctx.cfg.dashboard:
            tasks.append(asyncio.create_task(self._dashboard()))
        tasks.append(asyncio.create_task(self.reverse_loop()))  # the paths to peers, NAT or not
        if ctx.cfg.reachability == "auto":
            tasks.append(asyncio.create_task(self.recheck_loop(p2p)))
        if ctx.cfg.max_steps and ctx.inner_step >= ctx.cfg.max_steps:  # resumed at its last step
            log.info("already at --max-steps %d: nothing to train", ctx.cfg.max_steps)
            ctx.stop.set()
        if ctx.is_head and not ctx.stop.is_set():
            await self.wait_for_pipeline()
            tasks.append(asyncio.create_task(self.pipeline.head_loop()))
        await ctx.stop.wait()
        await self._leave(p2p, tasks)

    async def _leave(self, p2p, tasks: list[asyncio.Task]) -> None:
        ctx = self.ctx
        log.info("leaving the swarm")
        # announce we are gone before we stop answering, so routing stops choosing us
        try:
            await self.publish(ready=False, timeout=5.0)
        except Exception:
            pass
        if not ctx.is_head and not await self.finish_inflight():
            log.warning("streams still in progress after the upstream hop deadline; leaving anyway")
        for t in tasks:
            try:
                await asyncio.wait_for(t, timeout=self.hops.deadline(0) + 10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
        if isinstance(self.stepper.strategy, AdamWStep):
            with contextlib.suppress(Exception):
                await self.stepper.strategy.land_round()
        if ctx.cfg.checkpoint_every and self.anchor is None:
            try:
                await asyncio.wait_for(self.state.checkpoint(wait=True), 120)
            except Exception as e:
                log.warning("final checkpoint failed: %s", e)
        if self.outer is not None:  # the replicas' shared outer model, for the report's drift figure
            with contextlib.suppress(Exception):
                await ctx.compute(self._save_theta)
        self.write_metrics()
        self.write_health(serving=False)
        # a node that moves registers its handlers again for the new stage, in this process
        handlers = [
            HANDLER,
            ALIVE_HANDLER,
            METRICS_HANDLER,
            DIALBACK_HANDLER,
            routes.RELAYED_HANDLER,
            PUNCH_HANDLER,
        ]
        handlers += [routes.RELAY_HANDLER] if self.relay_server is not None else []
        routes.install(p2p, None)
        if self.move_to is not None:
            handlers += [WEIGHTS_HANDLER, ANCHOR_HANDLER, SCAPE_HANDLER, BASIS_HANDLER, TIED_HANDLER]
        for name in handlers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(p2p.remove_binary_stream_handler(name), 5.0)
        ctx.compute.shutdown()
        self.state.pool.shutdown(wait=True)

    async def _dashboard(self) -> None:
        """``--dashboard PORT``: the page for as long as this stage is served; a port that cannot
        be bound costs the dashboard, never the node."""
        try:
            await serve_in_node(self.ctx, self.metrics_server, self.ctx.stop)
        except DashboardError as e:
            log.warning("%s; the node goes on without it", e)

    async def finish_inflight(self) -> bool:
        """Answer the microbatches upstream is waiting for, within the deadline of a hop into us.

        Streams that start from now on are turned away (``busy``: upstream retries them on another
        replica), so the wait is bounded; False if one was still being served at the deadline.
        """
        self.server.leaving = True
        return await self.server.drain(self.hops.deadline(self.ctx.index - 1))

    def _save_theta(self) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in self.outer.theta_global().items()},
            os.path.join(self.ctx.cfg.state_dir, "outer_theta.safetensors"),
        )

    async def _join_from_peers(self) -> None:
        """A node joining a stage that others already train starts from their current weights.

        With outer rounds that is the replicas' shared outer state (theta_global, momentum,
        PowerSGD Q), not one peer's local weights: those would count its local progress twice.
        """
        ctx = self.ctx
        await self.hops.refresh_routes()
        for _ in range(JOIN_REREADS):
            if fast_peers_of_stage(ctx) or not _run_has_trained(ctx.routes):
                break
            # The run has trained, yet this stage looks empty: more likely its replicas' records
            # were missed (a late heartbeat under load, a DHT miss) than the stage truly empty, and
            # a replica that starts from the initial weights silently trains a model of its own.
            await asyncio.sleep(min(ctx.cfg.heartbeat_s, 3.0))
            await self.hops.refresh_routes()
        if not fast_peers_of_stage(ctx) and _run_has_trained(ctx.routes):
            # every replica of the stage left (killed, moved): there is nobody to take its weights
            # from, and starting silently would hide that the stage's progress since its last
            # checkpoint is lost (the volunteer-internet bench's emptied stage did so)
            ctx.metrics.restarted_empty_stage = True
            start = (
                f"its checkpoint at inner step {ctx.inner_step}" if ctx.inner_step else "the model's weights"
            )
            log.warning(
                "stage %d has no live replica in a run that has trained: this node serves it from %s; "
                "what the stage's replicas trained since their last checkpoint is lost (a replica that "
                "comes back with its --state-dir resumes its checkpoint)",
                ctx.index,
                start,
            )
        if fast_peers_of_stage(ctx) and self.outer is not None:
            ok = await ctx.compute(self.outer.load_state_from_peers, ctx.cfg.join_timeout)
            log.info("outer state %s from the stage's replicas", "loaded" if ok else "not available")
        elif self.scape is not None and not any(r.inner_step for r in fast_peers_of_stage(ctx).values()):
            # SCAPE keeps replicas bit-identical: peers that have not stepped hold exactly the weights we
            # built (same model hash), and a bf16 copy of them would make this replica differ from step 0
            log.info("the stage's replicas have not stepped yet; starting from the same initial weights")
        elif fast_peers_of_stage(ctx):
            pulled = await pull_weights(ctx)
            if pulled is None:
                log.warning(
                    "could not pull the current weights of stage %d; starting from the checkpoint", ctx.index
                )
            else:
                ctx.metrics.state_pull_bytes += pulled[1]
                if self.scape is not None:  # bf16 weights without m and e: re-anchored at the first step
                    self.scape.joined()
                    ctx.inner_step = max(ctx.inner_step, pulled[0])

    async def _first_pull(self) -> None:
        """An anchor starts from a fast peer's current weights, not the pretrained ones."""
        ctx = self.ctx
        while not ctx.stop.is_set():
            await self.hops.refresh_routes()
            if self.anchor.fast_peers() and await self.anchor.pull():
                return
            log.info("anchor waiting for a fast peer of stage %d to pull weights from", ctx.index)
            try:
                await asyncio.wait_for(ctx.stop.wait(), 2.0)
            except asyncio.TimeoutError:
                pass

    async def wait_for_pipeline(self) -> None:
        """The head waits until every stage has a ready peer, with a progress line."""
        ctx = self.ctx
        last = 0.0
        while not ctx.stop.is_set():
            await self.hops.refresh_routes()
            missing = [
                s
                for s in range(1, ctx.n_stages)
                if not any(r.ready and r.circuit == ctx.cfg.circuit for r in ctx.routes[s].values())
            ]
            ready = sum(r.ready for stage in ctx.routes for r in stage.values())
            if not missing and ready >= ctx.cfg.wait_peers:
                return
            if time.monotonic() - last > 10:
                log.info(
                    "waiting for peers: stages without one %s, %d/%d ready",
                    missing,
                    ready,
                    ctx.cfg.wait_peers,
                )
                last = time.monotonic()
            await asyncio.sleep(1.0)
