"""``/metrics``: the dashboard's state as Prometheus text (``prometheus-client``), for Grafana.

One sample per node and counter, labelled by peer id, stage and role, so a scrape of one
dashboard sees the whole swarm it polls. Counters only ever rise within a node's life; a
restarted node starts them again at zero, which Prometheus' ``rate()`` treats as a reset.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the format generate_latest writes, which every Prometheus reads

# (metric name, the node's metrics key, help): cumulative counts of one node's life
COUNTERS = (
    ("vnode_trained_tokens", "trained_tokens", "tokens this node trained (a tail: the loss's tokens)"),
    ("vnode_microbatches", "microbatches", "microbatches this node computed"),
    ("vnode_dropped_microbatches", "dropped_microbatches", "microbatches that could not complete"),
    ("vnode_rejected_frames", "rejected_frames", "frames refused as invalid"),
    ("vnode_skipped_steps", "skipped_steps", "inner steps skipped (non-finite gradients)"),
    ("vnode_outer_rounds_committed", "outer_committed", "DP outer rounds averaged with replicas"),
    ("vnode_outer_rounds_skipped", "outer_skipped", "DP outer rounds skipped or taken alone"),
    ("vnode_outer_bytes", "outer_bytes", "bytes this node sent in outer rounds"),
    ("vnode_relayed_bytes", "relayed_bytes", "bytes this node relayed between peers behind NAT"),
    ("vnode_sent_bytes", "sent_bytes", "bytes this node sent, every kind it counts"),
    ("vnode_compute_seconds", "compute_s", "seconds of tensor work on the compute thread"),
)
GAUGES = (
    ("vnode_inner_step", "inner_step", "inner optimizer steps taken"),
    ("vnode_throughput_tokens_per_second", "throughput", "tokens/s this node measured for its compute"),
    ("vnode_memory_rss_bytes", "memory_rss", "resident memory of the node process"),
)


class _State(Collector):
    def __init__(self, state: dict) -> None:
        self.state = state

    def collect(self):
        nodes: dict = self.state.get("nodes", {})
        labels = ["peer", "stage", "role"]

        def values(m: dict) -> list[str]:
            return [m["peer_id"], str(m["stage"]), m["role"]]

        for name, key, doc in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            for m in nodes.values():
                c.add_metric(values(m), m[key])
            yield c
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for m in nodes.values():
                g.add_metric(values(m), m[key])
            yield g
        loss = GaugeMetricFamily("vnode_loss", "a tail's loss at its last inner step", labels=labels)
        for m in nodes.values():
            if m["losses"]:
                loss.add_metric(values(m), m["losses"][-1])
        yield loss
        held = GaugeMetricFamily(
            "vnode_heldout_loss", "a tail's latest held-out loss (--eval-every)", labels=labels
        )
        for m in nodes.values():
            if m.get("eval_losses"):
                held.add_metric(values(m), m["eval_losses"][-1])
        yield held
        link = ["peer", "boundary", "direction"]
        sent = CounterMetricFamily(
            "vnode_link_bytes", "bytes this node wrote on a pipeline link", labels=link
        )
        tokens = CounterMetricFamily("vnode_link_tokens", "tokens those bytes carried", labels=link)
        for m in nodes.values():
            for lk in m["links"]:
                key = [m["peer_id"], str(lk["boundary"]), lk["direction"]]
                sent.add_metric(key, lk["bytes"])
                tokens.add_metric(key, lk["tokens"])
        yield sent
        yield tokens
        up = GaugeMetricFamily(
            "vnode_peer_reachable", "1 if the peer answered its metrics stream", labels=["peer", "stage"]
        )
        for stage in self.state.get("stages", []):
            for p in stage["peers"]:
                up.add_metric([p["peer"], str(stage["index"])], 1.0 if p["reachable"] else 0.0)
        yield up
        neck = self.state.get("bottleneck")
        if neck is not None:
            yield GaugeMetricFamily(
                "vnode_bottleneck_stage", "the stage with the least throughput", value=neck
            )


def render(state: dict) -> bytes:
    """Prometheus text exposition of ``state`` (``node.watch.state.build_state``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_State(state))
    return generate_latest(registry)
