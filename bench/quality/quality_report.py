"""Tables and plots from bench/results/links.json (written by ``bench.quality.quality``).

    python -m bench.quality.quality_report --out bench/results

Runs at node-packed frames (``--frame-tokens``) get their own tables and ``pareto_frames.png``.
Writes ``pareto.png`` (EM against bytes per token per boundary per direction, log x, one
panel per task), ``loss_<task>.png`` (training loss through the codec and dense eval loss
against step, seed 0) and ``quality_tables.md`` (one markdown table per task), and prints
the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

# DESIGN.md §6/§7 reference run (outside the project: 100 steps, 200 problems, arithmetic).
# Bytes: §7's cost is in bf16-equivalent values, i.e. 2 B each; dense every 5th step is
# amortised as 0.8 * 58 + 0.2 * 1152. EM is the dense-eval figure where §7 gives both.
REFERENCE = [
    ("dense", 1152, 0.90),
    ("M95", 58, 0.00),
    ("M95+AP", 58, 0.00),
    ("M95+dense5", 0.8 * 58 + 0.2 * 1152, 0.70),
    ("PCA58 int8", 60, 0.72),
    ("PCA29 bf16", 58, 0.33),
    ("int4", 306, 0.855),
    ("top-29", 94, 0.005),
]

ORDER = [
    "untrained",
    "dense",
    "m95",
    "m95r",
    "m90",
    "m95+ap",
    "m95+ap5",
    "m95+ap-taurel",
    "m95+dense5",
    "m95+dense10",
    "pca58i8",
    "pca96i8",
    "pca29bf16",
    "pca58i8+warmup10",
    "pca58i8+cooldown4",
    "int4",
    "topk29",
]


def _fmt_seeds(vals: list[float | None], fmt: str) -> str:
    if any(v is None for v in vals):  # not measured (bench.quality.quality --codec-eval off)
        return "–"
    if len(vals) == 1:
        return format(vals[0], fmt)
    return f"{format(statistics.mean(vals), fmt)} ({' / '.join(format(v, fmt) for v in vals)})"


def _mean_or_none(vals: list[float | None]) -> float | None:
    return None if any(v is None for v in vals) else statistics.mean(vals)


def _by_variant_and_steps(runs: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """Runs grouped as seeds of one configuration: a run stopped early (e.g. a warm-up alone) is
    its own group, never averaged with its longer run as if a second seed."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["variant"], r["steps"])].append(r)
    return groups


def tables(runs: list[dict]) -> str:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_task[r["task"]].append(r)
    out = []
    for task, task_runs in by_task.items():
        variants = _by_variant_and_steps(task_runs)
        steps = sorted({r["steps"] for r in task_runs if r["steps"]})
        n_eval = sorted({r["eval_problems"] for r in task_runs})
        out.append(
            f"### Task `{task}` ({'/'.join(map(str, steps))} steps, {'/'.join(map(str, n_eval))} problems)\n"
        )
        out.append(
            "| variant (codec+schedule) | steps | seeds | payload B/token/boundary/dir | "
            "× fewer than dense | basis: one-time (+B/token over this run) | "
            "EM (user gets: dense eval) | EM, codec on | eval loss (dense) | eval loss, codec on | "
            "codec time | filter time | anchor B/token |"
        )
        out.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        keys = sorted(variants, key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), *k))
        for name, n_steps in keys:
            rs = sorted(variants[(name, n_steps)], key=lambda r: r["seed"])
            r0 = rs[0]
            basis = (
                f"{r0['basis_bytes'] / 1e3:.0f} kB (+{r0['basis_bytes_per_token']:.1f})"
                if r0["basis_bytes"]
                else "–"
            )
            anchor = (
                f"{r0['anchor_bytes_per_token'] / 1e3:.0f} k" if r0.get("anchor_bytes_per_token") else "–"
            )
            filt = f"{100 * r0['filter_time_frac']:.0f}%" if r0.get("filter_time_frac") else "–"
            sched = "" if r0["schedule"] == "none" else f" + {r0['schedule']}"
            desc = f"`{name}`: {r0['codec']} {_settings(r0)}{sched}"
            out.append(
                f"| {desc} | {n_steps} | {','.join(str(r['seed']) for r in rs)} | "
                f"{r0['payload_bytes_per_token']:.1f} | "
                f"{r0['dense_bytes_per_token'] / r0['payload_bytes_per_token']:.1f}× | {basis} | "
                f"{_fmt_seeds([r['em_dense_eval'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['em_codec_eval'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['eval_loss'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['eval_loss_codec'] for r in rs], '.3f')} | "
                f"{100 * statistics.mean(r['codec_time_frac'] for r in rs):.1f}% | {filt} | {anchor} |"
            )
        out.append("")
    return "\n".join(out)


def frame_tables(runs: list[dict]) -> str:
    """Runs at node-packed frames (``--frame-tokens``): bytes all-in, with the share of a
    link-held basis's updates and first full basis shown separately."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], r["frame_tokens"], r["steps"], r["variant"])].append(r)
    out = []
    for task in sorted({k[0] for k in groups}):
        out.append(f"### Task `{task}` at node-packed frames\n")
        out.append(
            "| variant | frame tokens (T, mean) | steps | seeds | B/token/boundary/dir all-in (× fewer) | "
            "of which basis updates | of which first full basis | EM (dense eval) | EM, codec on | "
            "eval loss (dense) | eval loss, codec on | codec time | updates per link (fwd / bwd) |"
        )
        out.append("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        keys = sorted((k for k in groups if k[0] == task), key=lambda k: (k[1], k[2], k[3] != "dense", k[3]))
        for key in keys:
            rs = sorted(groups[key], key=lambda r: r["seed"])
            r0, lb = rs[0], rs[0].get("link_basis")
            bpt = statistics.mean(r["bytes_per_token"] for r in rs)
            upd = full = ups = "–"
            if lb:
                upd = f"{statistics.mean(r['link_basis']['update_bytes_per_token'] for r in rs):.1f}"
                full = f"{statistics.mean(r['link_basis']['full_basis_bytes_per_token'] for r in rs):.1f}"
                pb = r0["link_basis"]["per_boundary"]
                ups = " / ".join(
                    f"{statistics.mean(b[d]['updates'] for b in pb):.0f}" for d in ("forward", "backward")
                )
            out.append(
                f"| `{key[3]}` | {key[1]} ({r0['tokens_per_frame']:.0f}) | {key[2]} | "
                f"{','.join(str(r['seed']) for r in rs)} | "
                f"{bpt:.1f} ({r0['dense_bytes_per_token'] / bpt:.1f}×) | "
                f"{upd} | {full} | {_fmt_seeds([r['em_dense_eval'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['em_codec_eval'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['eval_loss'] for r in rs], '.3f')} | "
                f"{_fmt_seeds([r['eval_loss_codec'] for r in rs], '.3f')} | "
                f"{100 * statistics.mean(r['codec_time_frac'] for r in rs):.1f}% | {ups} |"
            )
        out.append("")
    return "\n".join(out)


def frame_plots(runs: list[dict], out: Path) -> Path:
    """One Pareto panel per task: EM (dense eval, filled; codec on, hollow) against all-in bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in runs:
            if r["task"] == task:
                groups[(r["variant"], r["frame_tokens"], r["steps"])].append(r)
        for (name, t, steps), g in sorted(groups.items()):
            x = statistics.mean(r["bytes_per_token"] for r in g)
            em = statistics.mean(r["em_dense_eval"] for r in g)
            emc = _mean_or_none([r["em_codec_eval"] for r in g])
            ax.scatter([x], [em], s=50, marker="*" if name == "dense" else "o", zorder=3)
            if name != "dense" and emc is not None:
                ax.scatter([x], [emc], s=30, facecolors="none", edgecolors="k", zorder=3)
                ax.plot([x, x], [em, emc], color="0.7", lw=0.8, zorder=1)
            ax.annotate(
                f"{name} T={t} ({steps} steps)",
                (x, em),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
            if name == "dense":
                ax.axhline(0.9 * em, color="g", ls=":", lw=0.8, label=f"0.9 × dense EM (T={t})")
        ax.axvline(1152 / 10, color="r", ls="--", lw=0.8, label="10× fewer bytes than dense bf16")
        ax.axvline(1152 / 20, color="m", ls="--", lw=0.8, label="20×")
        ax.set_xscale("log")
        ax.set_xlim(40, 1600)
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlabel("bytes per token per boundary per direction, all basis bytes included")
        ax.set_ylabel("exact match (filled: dense eval; hollow: codec on)")
        ax.set_title(f"{task}: node-packed frames, 4 stages")
        ax.legend(fontsize=7, loc="lower left")  # the >= 10x points sit top left
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "pareto_frames.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def finetune_table(runs: list[dict]) -> str:
    """LoRA against full fine-tuning (issue 32): runs that record what they trained, one row per
    task, mode, learning rate and link, EM per seed with the weights run dense."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], r["finetune"], r["lr"], r["codec"], r["steps"])].append(r)
    out = [
        "| task | fine-tuning | lr | link | steps | seeds | EM per seed (dense weights) | EM mean | "
        "eval loss mean | trained parameters | s/step |",
        "|---|---|---:|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for (task, mode, lr, codec, steps), g in sorted(groups.items()):
        g = sorted(g, key=lambda r: r["seed"])
        out.append(
            f"| {task} | {mode} | {lr:g} | {codec} | {steps} | {','.join(str(r['seed']) for r in g)} | "
            f"{' / '.join(format(r['em_dense_eval'], '.3f') for r in g)} | "
            f"{statistics.mean(r['em_dense_eval'] for r in g):.3f} | "
            f"{statistics.mean(r['eval_loss'] for r in g):.3f} | {g[0]['trained_params'] / 1e6:.2f} M | "
            f"{statistics.mean(r['step_time_s'] for r in g):.1f} |"
        )
    return "\n".join(out) + "\n"


def finetune_plot(runs: list[dict], out: Path) -> Path:
    """Held-out loss (32 problems, weights run dense) against step, one panel per task: full
    fine-tuning and LoRA at each learning rate, seed 0 solid, other seeds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    configs = sorted({(r["finetune"], r["lr"]) for r in runs})
    colour = {c: f"C{i}" for i, c in enumerate(configs)}
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in runs if r["task"] == task]
        mine.sort(key=lambda r: (r["finetune"], r["lr"], r["seed"]))
        for r in mine:
            c = (r["finetune"], r["lr"])
            xs, ys = zip(*r["eval_loss_curve"])
            ax.plot(
                xs,
                ys,
                color=colour[c],
                ls="-" if r["seed"] == 0 else "--",
                label=f"{c[0]} lr {c[1]:g} seed {r['seed']} (EM {r['em_dense_eval']:.2f})",
            )
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (32 problems)")
        ax.set_title(f"{task}: LoRA r16 vs full, 16-problem frames")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "lora_vs_full.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _settings(r: dict) -> str:
    hidden = ("codec", "scale_dtype") if r["codec"] == "lowrank" else ("codec", "basis_dtype", "scale_dtype")
    s = {k: v for k, v in r["codec_settings"].items() if k not in hidden}
    return " ".join(f"{k}={v}" for k, v in s.items())


def plots(runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    tasks = sorted({r["task"] for r in runs if r["steps"]})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 5.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rs = [r for r in runs if r["task"] == task and r["steps"]]
        groups = _by_variant_and_steps(rs)
        n_step_counts = Counter(name for name, _ in groups)
        for (variant, n_steps), g in groups.items():
            name = variant if n_step_counts[variant] == 1 else f"{variant} {n_steps} steps"
            x = g[0]["payload_bytes_per_token"]
            if g[0]["basis_bytes"]:  # the one-time basis, amortised over this short run's tokens
                ax.plot(
                    [x, g[0]["bytes_per_token"]],
                    [statistics.mean(r["em_dense_eval"] for r in g)] * 2,
                    color="0.4",
                    lw=2,
                    alpha=0.5,
                    zorder=1,
                )
            em = statistics.mean(r["em_dense_eval"] for r in g)
            emc = _mean_or_none([r["em_codec_eval"] for r in g])
            ref = variant in ("dense", "m95", "m95+ap")
            ax.scatter([x], [em], s=70 if ref else 40, marker="*" if ref else "o", zorder=3)
            if variant != "dense" and emc is not None:
                ax.scatter([x], [emc], s=30, facecolors="none", edgecolors="k", zorder=3)
                ax.plot([x, x], [em, emc], color="0.7", lw=0.8, zorder=1)
            ax.annotate(
                f"{name} ({len(g)} seed{'s' if len(g) > 1 else ''})",
                (x, em),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        if task == "arithmetic":
            ax.scatter(
                [b for _, b, _ in REFERENCE],
                [e for _, _, e in REFERENCE],
                marker="x",
                color="0.5",
                label="DESIGN §6-7 reference run (100 steps)",
                zorder=2,
            )
        ax.axvline(1152 / 10, color="r", ls="--", lw=0.8, label="10× fewer bytes than dense bf16")
        dense = [r["em_dense_eval"] for r in rs if r["variant"] == "dense"]
        if dense:
            d = statistics.mean(dense)
            ax.axhline(0.9 * d, color="g", ls=":", lw=0.8, label="0.9 × dense EM")
        ax.set_xscale("log")
        ax.set_xlim(40, 1600)
        ax.set_xlabel(
            "bytes per token per boundary per direction (payload; grey bar: + basis amortised over run)"
        )
        ax.set_ylabel("exact match (filled: dense eval = what a user gets; hollow: codec on)")
        steps = sorted({r["steps"] for r in rs})
        ax.set_title(f"{task}: {'/'.join(map(str, steps))} steps, batch 16, 4 stages")
        ax.set_ylim(-0.03, 1.0)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "pareto.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)

    for task in tasks:
        rs = [r for r in runs if r["task"] == task and r["steps"] and r["seed"] == 0]
        rs.sort(key=lambda r: ORDER.index(r["variant"]) if r["variant"] in ORDER else len(ORDER))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
        for a in (a1, a2):
            a.set_prop_cycle(color=plt.cm.tab20.colors)
        for r in rs:
            a1.plot(
                range(1, len(r["train_loss_curve"]) + 1), r["train_loss_curve"], lw=0.9, label=r["variant"]
            )
            xs, ys = zip(*r["eval_loss_curve"]) if r["eval_loss_curve"] else ((), ())
            a2.plot(xs, ys, marker="o", ms=3, lw=0.9, label=r["variant"])
        a1.set_title(f"{task}: training loss as computed through the codec")
        a2.set_title(f"{task}: eval loss, dense (no codec), 32 held-out problems")
        for a in (a1, a2):
            a.set_xlabel("step")
            a.set_yscale("log")
            a.grid(alpha=0.3)
        a2.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        p = out / f"loss_{task}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    every = json.loads((out / "links.json").read_text())
    runs = [r for r in every if not r.get("frame_tokens")]  # 16 examples per step (sessions 1-3)
    framed = [r for r in every if r.get("frame_tokens")]
    md = tables(runs)
    if framed:
        md += "\n" + frame_tables(framed)
    # LoRA against full fine-tuning: the runs that record what they trained (issue 32 on)
    tuned = [r for r in runs if "finetune" in r and r["steps"]]
    if tuned:
        md += "\n### LoRA against full fine-tuning\n\n" + finetune_table(tuned)
    (out / "quality_tables.md").write_text(md + "\n")
    print(md)
    written = (plots(runs, out) if runs else []) + ([frame_plots(framed, out)] if framed else [])
    for p in written + ([finetune_plot(tuned, out)] if tuned else []):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
