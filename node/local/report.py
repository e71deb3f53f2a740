"""Turn the nodes' metrics into report.json and a loss plot."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from node.stage.metrics import bytes_per_token, sent_bytes


def merge_losses(per_replica: list[list[float]]) -> list[float]:
    """Per-step mean over the tail replicas that reached that step."""
    n = max((len(x) for x in per_replica), default=0)
    out = []
    for i in range(n):
        vals = [x[i] for x in per_replica if len(x) > i]
        out.append(sum(vals) / len(vals))
    return out


def sum_links(metrics: list[dict]) -> list[dict]:
    """Bytes and tokens per (boundary, direction), summed over the nodes that wrote the frames."""
    links: dict[tuple[int, str], dict] = defaultdict(lambda: {"bytes": 0, "tokens": 0, "frames": 0})
    for m in metrics:
        for lk in m["links"]:
            c = links[(lk["boundary"], lk["direction"])]
            for k in ("bytes", "tokens", "frames"):
                c[k] += lk[k]
    return [
        {
            "boundary": b,
            "direction": d,
            **c,
            "bytes_per_token": c["bytes"] / c["tokens"] if c["tokens"] else None,
        }
        for (b, d), c in sorted(links.items())
    ]


def outer_theta_path(m: dict) -> Path:
    """Where a node leaves its outer model on exit (node.lifecycle), from its metrics."""
    return Path(m.get("state_dir", "/nonexistent")) / "outer_theta.safetensors"


def drop_outer_thetas(metrics: list[dict]) -> None:
    """Delete the outer models the nodes left once ``outer_summary`` has read them: a fp32 copy of
    each replicated stage (650 MB in the demo) that nothing reads again."""
    for m in metrics:
        outer_theta_path(m).unlink(missing_ok=True)


def outer_summary(metrics: list[dict]) -> dict:
    """Outer rounds summed over peers, and the largest distance between replicas' outer models
    (read from the ``outer_theta.safetensors`` each node leaves in its state dir)."""
    rounds = [r for m in metrics for r in m.get("outer_rounds", [])]
    dists = []
    thetas: dict[int, list[dict]] = defaultdict(list)
    for m in metrics:
        path = outer_theta_path(m)
        if path.exists():
            from safetensors.torch import load_file

            thetas[m["stage"]].append(load_file(str(path)))
    by_stage: dict[str, float] = {}
    if thetas:
        from compression.outer import param_distance

        for stage, ts in sorted(thetas.items()):
            pair = [param_distance(a, b) for i, a in enumerate(ts) for b in ts[i + 1 :]]
            if pair:
                by_stage[str(stage)] = max(pair)
        dists = list(by_stage.values())
    return {
        "rounds": len([r for r in rounds if not r["skipped"]]),
        "skipped": len([r for r in rounds if r["skipped"]]) + sum(m.get("outer_alone", 0) for m in metrics),
        "bytes": sum(r["bytes_sent"] for r in rounds),
        "dense_bytes": sum(r["dense_bytes"] for r in rounds),
        # rounds whose group shared one lineage: only the compressed pseudo-gradients travel (a group
        # that must first re-anchor drifted replicas also sends theta and momentum densely, once)
        "steady_bytes": sum(r["bytes_sent"] for r in rounds if not r["skipped"] and not r.get("reanchored")),
        "steady_dense_bytes": sum(
            r["dense_bytes"] for r in rounds if not r["skipped"] and not r.get("reanchored")
        ),
        "reanchored": len([r for r in rounds if r.get("reanchored")]),
        "max_replica_distance": max(dists) if dists else None,
        # per stage: a round that failed on one side only (a lost chunk) leaves two replicas apart
        # until their next round re-anchors them, so which stage is apart matters
        "replica_distance": by_stage,
    }


def dp_summary(metrics: list[dict], tokens: int) -> dict:
    """Per-step sparse DP (``--dp scape``): bytes summed over replicas, and whether the replicas of a
    stage held the same parameters after every step they synchronised as one group.

    ``consistency``: per stage, the steps that every replica recorded with a group of all of them,
    and how many of those had bit-identical parameters (a CRC of the flat fp32 vector) everywhere.
    """
    scape = [m for m in metrics if m.get("dp", {}).get("mode") == "scape"]
    if not scape:
        return {"mode": "diloco"}
    by_stage: dict[int, list[dict]] = defaultdict(list)
    for m in scape:
        by_stage[m["stage"]].append(m)
    consistency = {}
    for stage, ms in sorted(by_stage.items()):
        if len(ms) < 2:
            continue
        per = [{r["step"]: r for r in m["dp"]["records"]} for m in ms]
        common = sorted(set.intersection(*(set(p) for p in per)))
        synced = [t for t in common if all(p[t]["group"] == len(ms) for p in per)]
        equal = [t for t in synced if len({p[t]["digest"] for p in per}) == 1]
        # a step some replica took alone (a missed exchange) makes them differ until the next
        # exchange re-anchors them (node/dp/scape.py); steps every replica recorded with the whole
        # group, an adopted state included, must hold the same parameters everywhere
        alone = [t for p in per for t, r in p.items() if r["group"] < len(ms)]
        consistency[str(stage)] = {
            "replicas": len(ms),
            "synced_steps": len(synced),
            "equal_steps": len(equal),
            "first_step_alone": min(alone) if alone else None,
            "reanchored_steps": sorted(
                {t for p in per for t, r in p.items() if r.get("reanchor") == "adopted"}
            ),
        }
    total = sum(m["dp"]["bytes"] for m in scape)
    return {
        "mode": "scape",
        "density": scape[0]["dp"]["density"],
        "bytes": total,
        "values_bytes": sum(m["dp"]["values_bytes"] for m in scape),
        "mask_bytes": sum(m["dp"]["mask_bytes"] for m in scape),
        "bytes_per_token": total / tokens if tokens else None,
        "alone_steps": sum(m["dp"]["alone"] for m in scape),
        "missing": sum(m["dp"]["missing"] for m in scape),
        "mismatched": sum(m["dp"]["mismatched"] for m in scape),
        "reanchors": sum(m["dp"].get("reanchors", 0) for m in scape),
        "anchor_bytes": sum(m["dp"].get("anchor_bytes", 0) for m in scape),
        "consistency": consistency,
    }


def sent_summary(metrics: list[dict], tokens: int) -> dict:
    """What every node of the run sent, by kind (node.stage.metrics.sent_bytes), and per token the
    run trained (each token counted once, at the tail, though every stage carries it)."""
    kinds: dict[str, int] = defaultdict(int)
    for m in metrics:
        for kind, n in sent_bytes(m).items():
            kinds[kind] += n
    return {"bytes": dict(kinds), "tokens": tokens, "per_token": bytes_per_token(kinds, tokens)}


def build_report(metrics: list[dict], n_stages: int, **extra) -> dict:
    # the training loss a user cares about is the fast circuit's; anchors only feed its filter
    tails = [m for m in metrics if m["stage"] == n_stages - 1 and m.get("circuit", "fast") == "fast"]
    fast = [m for m in metrics if m.get("circuit", "fast") == "fast"]
    anchors = [m for m in metrics if m.get("circuit", "fast") == "anchor"]
    stages: dict[str, list[str]] = defaultdict(list)
    for m in metrics:
        stages[str(m["stage"])].append(m["peer_id"])
    return {
        **extra,
        "loss": merge_losses([m["step_losses"] for m in tails]),
        # --eval-every: each tail's live held-out losses, [inner step, loss] (node.stage.heldout)
        "heldout_loss": {m["peer_id"]: m["eval_losses"] for m in tails if m.get("eval_losses")},
        "tokens": sum(m["trained_tokens"] for m in tails),
        "links": sum_links(fast),
        "anchor_links": sum_links(anchors),  # the anchors' own dense pipeline
        "stages": dict(sorted(stages.items())),
        "dropped_microbatches": sum(m["dropped_microbatches"] for m in metrics),
        # hops whose peer's stage record expired mid-hop but which answered, so went on (node/net/alive.py)
        "expired_but_alive": sum(m.get("expired_but_alive", 0) for m in metrics),
        # one-time cost of basis codecs: every basis download that crossed the network
        "basis_bytes": sum(m.get("basis_bytes_fetched", 0) for m in metrics),
        # anchor circuit: gradient packets sent to fast peers, and weight pulls from them
        "anchor_bytes": sum(m.get("anchor_bytes", 0) for m in metrics),
        "anchor_pull_bytes": sum(m.get("anchor_pull_bytes", 0) for m in metrics),
        "anchor_packets_received": sum(m.get("anchor_packets_received", 0) for m in metrics),
        "outer": outer_summary(fast),
        "dp": dp_summary(fast, sum(m["trained_tokens"] for m in tails)),
        "rejected_frames": sum(m["rejected_frames"] for m in metrics),
        "sent": sent_summary(metrics, sum(m["trained_tokens"] for m in tails)),
        "microbatches_per_peer": {m["peer_id"]: m["microbatches"] for m in metrics},
        "nodes": metrics,
    }


def plot_loss(loss: list[float], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(1, len(loss) + 1), loss, lw=1.5)
    ax.set_xlabel("inner step (tail)")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def link_rates(samples: list[tuple[float, dict[str, int]]]) -> dict[str, list[tuple[float, float]]]:
    """Per link ("boundary direction"), bytes/s between consecutive (seconds, cumulative bytes) samples."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        for link in b:
            if t1 > t0:
                out[link].append(((t0 + t1) / 2, (b[link] - a.get(link, 0)) / (t1 - t0)))
    return dict(out)


def plot_link_rates(samples: list[tuple[float, dict[str, int]]], path: Path) -> None:
    """Bytes per second on each pipeline link over the run (fast circuit, both directions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for link, pts in sorted(link_rates(samples).items()):
        b, d = link.split()
        ax.plot([t for t, _ in pts], [r / 1e3 for _, r in pts], lw=1.2, label=f"boundary {b} {d}")
    ax.set_xlabel("seconds since the swarm started training")
    ax.set_ylabel("kB/s")
    ax.set_title("bytes per second on each link", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_eval(ev: dict, path: Path) -> None:
    """Held-out exact match and loss, before training and after the last step (``swarm --eval``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "loss_before" not in ev:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(6, 3), dpi=120)
    labels = ["before", "after"]
    em = [ev["em_before"] or 0.0, ev["em_after"] or 0.0]
    a1.bar(labels, em, color=["#999", "#2a7"])
    a1.set_ylim(0, 1)
    a1.set_title(f"exact match, {ev['n']} held-out", fontsize=9)
    a2.bar(labels, [ev["loss_before"], ev["loss_after"]], color=["#999", "#27a"])
    a2.set_title("held-out loss", fontsize=9)
    for ax, vals in ((a1, em), (a2, [ev["loss_before"], ev["loss_after"]])):
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
