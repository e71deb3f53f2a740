"""Plots of bench/results/harness.json: tokens/s vs the link ceiling per codec, and the rate sweep.

python -m bench.network.harness --plot-only          # redraw from the committed results
"""

from __future__ import annotations

import json
from pathlib import Path

ORDER = ["dense", "M90", "M95", "M95+anchors", "pca", "lowrank"]


def _latest(entries: list[dict], **match) -> dict[str, dict]:
    """The newest entry per label among those matching every key=value (later entries win)."""
    out: dict[str, dict] = {}
    for e in entries:
        if all(e.get(k) == v for k, v in match.items()):
            out[e["label"]] = e
    return out


def plot_codecs(entries: list[dict], path: Path, rate_mbit: float = 80.0, hidden: int = 2048) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _latest(entries, rate_mbit=rate_mbit, mode="emulated", hidden=hidden)
    labels = [x for x in ORDER if x in rows] + sorted(set(rows) - set(ORDER))
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    xs = range(len(labels))
    measured = [rows[x]["tokens_per_s"] for x in labels]
    ceiling = [rows[x]["ceiling_tokens_per_s"] or 0 for x in labels]
    compute = [rows[x].get("compute_ceiling_tokens_per_s") or 0 for x in labels]
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured tokens/s", color="#3b75af")
    ax.bar(
        [x + 0.2 for x in xs], ceiling, width=0.4, label="link ceiling 10^7/(B per token)", color="#c9c9c9"
    )
    if any(compute):
        ax.axhline(compute[0], color="#d62728", ls="--", lw=1, label="emulated-GPU compute ceiling")
    for x, m, c in zip(xs, measured, ceiling):
        ax.text(x - 0.2, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=7)
        ax.text(x + 0.2, c, f"{c:,.0f}", ha="center", va="bottom", fontsize=7, color="#555")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens / s (log)")
    any_row = rows[labels[0]]
    ax.set_title(
        f"{any_row['nodes']} nodes, {any_row['stages']} stages, {rate_mbit:g} Mbit/s per link, "
        f"hidden {hidden}, emulated",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(entries: list[dict], path: Path, hidden: int = 2048) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[float, dict]] = {}
    for e in entries:
        if e.get("mode") == "emulated" and e.get("hidden") == hidden and e["label"] in ("dense", "M95"):
            series.setdefault(e["label"], {})[e["rate_mbit"]] = e
    if not series or max(len(s) for s in series.values()) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    colors = {"dense": "#3b75af", "M95": "#e07b39"}
    for label, by_rate in sorted(series.items()):
        rates = sorted(by_rate)
        ax.plot(
            rates,
            [by_rate[r]["tokens_per_s"] for r in rates],
            "o-",
            color=colors.get(label),
            label=f"{label} measured",
        )
        ax.plot(
            rates,
            [by_rate[r]["ceiling_tokens_per_s"] for r in rates],
            "--",
            color=colors.get(label),
            alpha=0.6,
            label=f"{label} link ceiling",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate, Mbit/s (tbf, each direction)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"rate sweep, hidden {hidden}, emulated compute", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency(rows: dict[tuple, dict], path: Path) -> Path | None:
    """tokens/s against RTT (dense, M95) and against M95's microbatches in flight, at 80 Mbit/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.network.harness_report import MAIN, _pick

    lat = {lab: sorted(_pick(rows, lab, 80.0, None, n), key=lambda e: e["rtt_ms"]) for lab, n in MAIN[:2]}
    inf = sorted(_pick(rows, "M95", 80.0, 40.0), key=lambda e: e["max_inflight"])
    if not any(len(v) > 1 for v in lat.values()) and len(inf) < 2:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120)
    for lab, es in lat.items():
        a1.plot([e["rtt_ms"] for e in es], [e["tokens_per_s"] for e in es], "o-", label=lab)
    a1.set_xlabel("round-trip time, ms (delay proxy)")
    a1.set_ylabel("tokens / s")
    a1.set_yscale("log")
    a1.set_title("latency, 80 Mbit/s", fontsize=9)
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3, which="both")
    a2.plot([e["max_inflight"] for e in inf], [e["tokens_per_s"] for e in inf], "o-", color="#e07b39")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("M95 microbatches in flight per node")
    a2.set_ylabel("tokens / s")
    a2.set_title("in flight needed to hide RTT 40 ms", fontsize=9)
    a2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_all(results: Path, outdir: Path) -> list[Path]:
    """The plots of issue 16's entries (those with ``rtt_ms``): codecs, rate sweep, latency."""
    from bench.network.harness_report import MAIN, _pick, latest

    rows = latest(json.loads(results.read_text()))
    main = [e for lab, n in MAIN for e in _pick(rows, lab, 80.0, 40.0, n)]
    rate = [e for e in _pick(rows, None, None, 40.0) if e["rate_mbit"] != 80.0 or e in main]
    done = [
        plot_codecs(main, outdir / "harness_codecs_80mbit.png"),
        plot_sweep(rate, outdir / "harness_rate_sweep.png"),
        plot_latency(rows, outdir / "harness_latency.png"),
    ]
    return [p for p in done if p is not None]
