"""The stage runtime: the parts of one pipeline stage, composed (docs/ARCHITECTURE.md).

Which room a line belongs in:

* ``node.stage.pipeline``: the walk of one microbatch (head loop, serve forward, the rest of the hops)
* ``node.stage.compute``: the worker thread; all tensor work, codec math and frame (de)serialisation
* ``node.stage.linkio``: the two links; frames built, validated, encoded, decoded; bases
* ``node.stage.hop``: choose a peer, call, retry, watch for peers that left; the routes
* ``node.stage.server``: the forward stream handler, bans, error mapping, byte counting, reply first
* ``node.stage.step``: the step gate and the accumulator
* ``node.dp.strategies``, ``node.dp.scape``: the step strategies (AdamW, anchor; SCAPE)
* ``node.stage.state``: checkpoints of the stateful parts; ``node.stage.metrics``; ``node.lifecycle``
* ``node.stage.context``: what all of them share (run, stage, transport, routes, step counter)

This module only builds them and wires them together.
"""

from __future__ import annotations

import time

import torch

from compression.spectral import SpectralFilter
from node.config import NodeConfig
from node.dp.anchors import AnchorClient, PacketSink
from node.dp.deferred import DeferredOuter
from node.dp.scape import ScapeSync
from node.dp.strategies import AdamWStep, AnchorStep
from node.dp.tied import TiedExchange, tied_parameter
from node.lifecycle import Lifecycle
from node.model.devices import process_memory, with_inflight
from node.model.stages import Stage
from node.stage.compute import Compute
from node.stage.context import StageContext
from node.stage.hop import HANDLER, HopClient, HopFailed, gone_peers
from node.stage.linkio import LinkIO
from node.stage.metrics import Metrics, bytes_per_token, sent_bytes
from node.stage.pipeline import Pipeline
from node.stage.server import ForwardServer
from node.stage.state import StageState
from node.stage.step import Busy, StepGate, Stepper
from node.swarm.weights import WeightServer
from protocol.records import RunRecord

__all__ = ["HANDLER", "Busy", "HopFailed", "StageRuntime", "gone_peers"]

DROP_BACKOFF_S = 1.0  # head: pause after a dropped microbatch (a stage with no live peer fails them all)


def _shared(part: str, name: str) -> property:
    """``runtime.<name>`` reads and sets ``runtime.<part>.<name>``: the attributes callers used before
    the split (join.py, the tests, the benchmarks) stay where they were."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
    )


class StageRuntime(Lifecycle):
    def __init__(
        self,
        cfg: NodeConfig,
        run: RunRecord,
        stage_index: int,
        stage: Stage,
        dht,
        peer_id: str,
        data_stream=None,
        device: torch.device | None = None,
        outer=None,
        deferred_outer: DeferredOuter | None = None,
    ):
        self.cfg, self.run, self.index, self.stage = cfg, run, stage_index, stage
        self.memory_estimate: dict | None = None  # node.model.devices.stage_memory_bytes, set by join
        emulated = getattr(stage.config, "emulate_gpu", None)
        if emulated:  # bench.network.harness: an emulated model's GPU-side work becomes calibrated sleeps
            from node.stage.emulated import EmulatedCompute, emulate_links

            self.compute = EmulatedCompute(stage, device)
        else:
            bf16_base = any(p.dtype == torch.bfloat16 for p in stage.parameters())
            self.compute = Compute(device, cpu_bf16=bf16_base)
        self.metrics = Metrics()
        ctx = self.ctx = StageContext(
            cfg=cfg,
            run=run,
            index=stage_index,
            stage=stage,
            peer_id=peer_id,
            compute=self.compute,
            metrics=self.metrics,
            dht=dht,
        )
        self.peer_id, self.device = peer_id, self.compute.device
        self.n_stages, self.is_head, self.is_tail = ctx.n_stages, ctx.is_head, ctx.is_tail
        self.params = ctx.params
        self.opt = torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        self.gate = StepGate(cfg.max_inflight)
        self.state = StageState(ctx, self.opt)
        self.linkio = LinkIO(run, stage_index, stage.config.vocab_size, peer_id, cfg.circuit == "anchor")
        if emulated:
            emulate_links(self.linkio, emulated)
        self.hops = HopClient(ctx, self.linkio.parse)
        self.maddrs: list[str] = []
        self.outer = outer  # node.dp.diloco.OuterSync when the run averages replicas
        self.anchor = self.filter = self.weight_server = self.packet_sink = self.scape = self.tied = None
        a = run.anchor
        if cfg.circuit == "anchor":
            self.anchor = AnchorClient(ctx, pull_every=a.pull_every, rank=a.rank)
            strategy = AnchorStep(ctx, self.anchor)
        else:
            self.filter = SpectralFilter(
                alpha=a.alpha,
                tau=a.tau,
                beta=a.beta,
                max_staleness=a.max_staleness,
                tau_relative=a.tau_relative,
            )
            self.state.register("filter", self.filter)
            self.weight_server = WeightServer(ctx)
            self.packet_sink = PacketSink(ctx, self.filter)
            tied = tied_parameter(ctx)
            self.tied = (
                None
                if tied is None
                else TiedExchange(ctx, tied, self.hops.deadline(0), self.hops.refresh_routes)
            )
            deferred = None
            if outer is None and deferred_outer is not None:
                deferred = DeferredOuter(deferred_outer.initial, self._outer_built(deferred_outer.build))
            strategy = AdamWStep(ctx, self.gate, self.opt, self.filter, outer, self.tied, deferred)
            # SCAPE: AdamS + a sparse sync with the stage's replicas every step, instead of AdamW
            if run.dp.mode == "scape" and cfg.circuit == "fast":
                self.scape = strategy = ScapeSync(
                    ctx,
                    self.gate,
                    self.hops.refresh_routes,
                    run.dp.density,
                    run.dp.timeout,
                )
                self.state.register("scape", self.scape)
                self.tied = None  # SCAPE's AdamS step does not exchange the tied gradient (not built)
        if outer is not None:
            self.state.register("outer", outer)
        checkpoint = None if self.anchor is not None else (lambda: self.state.checkpoint(wait=False))
        self.stepper = Stepper(ctx, self.gate, strategy, checkpoint)
        self.pipeline = Pipeline(
            ctx, self.gate, self.linkio, self.hops, self.stepper, data_stream, DROP_BACKOFF_S
        )
        self.server = ForwardServer(
            ctx, self.pipeline.serve, self.stepper.step_if_due, self.hops.refresh_routes
        )
        # the entry points others call
        self.serve_forward = self.pipeline.serve_forward
        self.handle_stream = self.server.handle_stream
        self.head_loop = self.pipeline.head_loop
        self.run_microbatch = self.pipeline.run_microbatch
        self.refresh_routes = self.hops.refresh_routes
        self.restore = self.state.restore
        self.checkpoint = self.state.checkpoint
        self.pool, self.ckpt_pool = self.compute.pool, self.state.pool

    # ------------------------------------------------------------ shared state, set from outside
    wire = _shared("ctx", "wire")  # join.py sets the swarm key's Wire after construction
    p2p = _shared("ctx", "p2p")
    dht = _shared("ctx", "dht")
    stop = _shared("ctx", "stop")
    routes = _shared("ctx", "routes")
    inner_step = _shared("ctx", "inner_step")
    bases = _shared("linkio", "bases")
    bans = _shared("server", "bans")
    resumed_from = _shared("state", "resumed_from")
    link_in = _shared("linkio", "link_in")
    link_out = _shared("linkio", "link_out")

    def _outer_built(self, build):
        """``build``, then the runtime's own hold on what it built: the lifecycle (leaving, the
        report's drift, a later join) and the checkpoints see it as if built at the start."""

        def built(theta0):
            outer = build(theta0)
            self.outer = outer
            self.state.register("outer", outer)
            return outer

        return built

    def metrics_dict(self) -> dict:
        out = self._counters()
        sent = sent_bytes(out)  # what this node sent, by kind, and per token it trained
        out["sent"] = {"bytes": sent, "per_token": bytes_per_token(sent, self.metrics.trained_tokens)}
        return out

    def _counters(self) -> dict:
        m, bases = self.metrics, self.bases
        return {
            "peer_id": self.peer_id,
            "stage": self.index,
            "circuit": self.cfg.circuit,
            "role": "head" if self.is_head else "tail" if self.is_tail else "body",
            "inner_step": self.inner_step,
            "step_losses": m.step_losses,
            "eval_every": m.eval_every,  # a tail's held-out loss (node.stage.heldout); 0: not scored
            "eval_losses": [list(x) for x in m.eval_losses],  # [inner step, held-out loss]
            "trained_tokens": m.trained_tokens,
            "microbatches": m.microbatches,
            "dropped_microbatches": m.dropped,
            "held_microbatches": m.held,  # tries that waited for an empty next stage instead of dropping
            "rejected_frames": m.rejected_frames,
            "skipped_steps": m.skipped_steps,
            "basis_bytes_fetched": bases.bytes_fetched if bases else 0,
            "anchor_bytes": self.anchor.packet_bytes if self.anchor else 0,
            "anchor_pull_bytes": self.anchor.pull_bytes if self.anchor else 0,
            "anchor_pulls": self.anchor.pulls if self.anchor else 0,
            "anchor_packets_received": self.packet_sink.received if self.packet_sink else 0,
            "anchor_packets_stale": self.packet_sink.dropped_stale if self.packet_sink else 0,
            "anchor_packets_refused": self.packet_sink.refused if self.packet_sink else 0,
            "shed_streams": m.shed_streams,  # over the per-peer stream bound: answered busy
            "expired_but_alive": m.expired_but_alive,  # a hop's peer lost its record, yet answered
            "idle_streams": m.idle_streams,  # sent nothing within the idle deadline
            "refused_messages": m.refused_messages,  # SCAPE frames refused (stranger, window, budget)
            "filter_s": m.filter_s,
            "tied": {
                "bytes_sent": m.tied_bytes_sent,
                "bytes_received": m.tied_bytes_received,
                "exchanged": m.tied_exchanged,
                "missed": m.tied_missed,
                "unpaired": m.tied_unpaired,
            },
            "state_pull_bytes": m.state_pull_bytes,
            "restarted_empty_stage": m.restarted_empty_stage,
            "outer_rounds": m.outer_rounds,
            "outer_alone": m.outer_alone,
            "dp": self.scape.summary() if self.scape is not None else {"mode": self.run.dp.mode},
            "state_dir": self.cfg.state_dir,
            "checkpoints": m.checkpoints,
            "resumed_from": self.resumed_from,
            "basis_bytes_served": bases.bytes_served if bases else 0,
            # weight snapshots served: joiners, held-out scoring, a live export
            "weights_bytes_served": self.weight_server.bytes_served if self.weight_server else 0,
            "throughput": self.pipeline.throughput,
            "reachability": self.reachability,  # direct | nat (node.net.reach)
            "reverse": {  # behind NAT: connections opened to the peers that call us, and re-opened
                "dials": self.reverser.dials if self.reverser else 0,
                "redials": self.reverser.redials if self.reverser else 0,
                "kept": self.reverser.kept if self.reverser else 0,
                "last_dial": self.reverser.last_dial if self.reverser else 0.0,
            },
            "relay": {  # node.net.relay: streams this node carried for others, and its own relayed ones
                **(self.relay_server.metrics() if self.relay_server else {"relayed_bytes": 0}),
                "serving": self.relay_server is not None and self.reachability == "direct",
                "mine": list(self.my_relays),
                "relayed_out": self.paths.relayed_streams if self.paths else 0,
                "relay_failures": self.paths.relay_failures if self.paths else 0,
                "accepted_in": self.relayed_in.accepted if self.relayed_in else 0,
            },
            "connections": self.connection_kinds(),
            "punch": {  # node.net.punch: direct connections punched to NAT'd peers, and failed tries
                "punched": len(self.punched),
                "failed": self.puncher.failed if self.puncher else 0,
                "public": self.puncher.public if self.puncher else None,
                "spliced": self.puncher.spliced if self.puncher else 0,  # callee side: carried to p2pd
                "spliced_bytes": self.puncher.spliced_bytes if self.puncher else 0,
            },
            "compute_s": self.compute.seconds,
            "device": str(self.compute.device),
            "base": self.base,  # LoRA's frozen base: fp32 | bf16 | nf4 ("" under full fine-tuning)
            "links": m.links_list(),
            "peers": {str(s): sorted(r) for s, r in enumerate(self.routes)},
            "memory": {
                **process_memory(self.compute.device),
                "estimate": self.memory_estimate,
                "peak_inflight": self.gate.peak,
                # the most microbatches whose activations this node held at once, and the same
                # estimate at that count
                "peak_held": self.pipeline.peak_held,
                "estimate_at_peak": (
                    with_inflight(self.memory_estimate, self.pipeline.peak_held)
                    if self.memory_estimate
                    else None
                ),
            },
            "time": time.time(),
        }
