"""`python -m node swarm`: N node processes on loopback, one live view, one report.

The first process starts the swarm; each next one joins through it once the previous has
claimed its stage (so `--stage auto` spreads them deterministically). A node that dies is
reported and the run goes on while every stage keeps a live node (`--restart-dead` restarts it
with `--resume`). Nodes die with the launcher, even a SIGKILLed one. After the run every
node is stopped with SIGTERM (SIGKILL to its process group if it hangs) and the report is
built from the metrics files the nodes write. The live dashboard (``node dashboard``) runs beside
them for the run's life (node/local/dashboard.py).

(Over 400 lines: the local launcher, its live view, deaths and restarts, and the end-of-run eval and
export it orchestrates; the report itself is node/local/report.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from node.argv import config_from_args, config_to_argv
from node.local.dashboard import DashboardProcess, start_dashboard
from node.local.memory import PeakMemory
from node.local.report import build_report, drop_outer_thetas, plot_eval, plot_link_rates, plot_loss
from node.model.devices import keep_large_blocks_returnable, return_freed_memory
from node.stage.links import pinned_layout_flags
from node.swarm.membership import parent_death_signal

READY_TIMEOUT_S = 300.0  # first start may convert the bundled model (~20-40 s on 2 cores)
STOP_GRACE_S = 60.0
MEMORY_EVERY_S = 5.0  # how often the nodes' memory (PSS of each process tree) is sampled
MAX_RESTARTS = 3  # --restart-dead: a node that keeps dying is given up after this many restarts


class SwarmError(RuntimeError):
    pass


def _tail(path: Path, n: int = 5) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


def node_command(
    args, i: int, nodedir: Path, run_id: str, peers: list[str], circuit: str = "fast"
) -> list[str]:
    # every node gets the run settings (and the swarm's --data, --device, --max-inflight,
    # --hop-timeout, --swarm-key, --no-rebalance); only the first one's run settings are
    # published, the rest verify the model
    cfg = replace(
        config_from_args(args),
        run_id=run_id,
        state_dir=str(nodedir),
        metrics_file=str(nodedir / "metrics.json"),
        ready_file=str(nodedir / "ready.json"),
        threads=args.threads_per_node,
        heartbeat_s=1.0,
        # a local run's checkpoints serve its export and a --restart-dead resume: the newest is
        # enough (a save is atomic), and a second copy of every node's state doubled its disk use
        keep_checkpoints=1,
        wait_peers=args.nodes + args.anchors * args.stages,
        circuit=circuit,
        peers=list(peers),
    )
    # the lowrank layout as the launcher resolved it: a flag given at its dataclass default (e.g.
    # --lowrank-first shared at 2048-token frames) would otherwise be left out and resolved anew
    return [sys.executable, "-m", "node", "join", *config_to_argv(cfg, always=pinned_layout_flags(cfg))]


def dies_with_launcher() -> Callable[[], None]:
    """A ``preexec_fn``: in the child, before exec, so a killed launcher stops what it started."""
    launcher = os.getpid()

    def preexec() -> None:
        parent_death_signal(signal.SIGTERM)
        if os.getppid() != launcher:  # it died before prctl took effect
            os._exit(1)

    return preexec


def spawn_node(
    args,
    i: int,
    report: Path,
    run_id: str,
    peers: list[str],
    circuit: str = "fast",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start node ``i`` in its own process group and return at once (``poll_ready`` says when it
    has claimed a stage). ``extra`` flags go after the swarm's own; ``env`` adds variables."""
    nodedir = report / "nodes" / str(i)
    nodedir.mkdir(parents=True, exist_ok=True)
    for stale in ("ready.json", "metrics.json"):
        (nodedir / stale).unlink(missing_ok=True)
    log = open(nodedir / "node.log", "w")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    try:
        return subprocess.Popen(
            node_command(args, i, nodedir, run_id, peers, circuit) + list(extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            preexec_fn=dies_with_launcher(),
        )
    finally:
        log.close()  # the child holds its own copy


def poll_ready(proc: subprocess.Popen, i: int, report: Path) -> dict | None:
    """Node ``i``'s ready record once it has claimed a stage, None while it starts; SwarmError if it died."""
    nodedir = report / "nodes" / str(i)
    if (nodedir / "ready.json").exists():
        return json.loads((nodedir / "ready.json").read_text())
    if proc.poll() is not None:
        raise SwarmError(
            f"node {i} exited with code {proc.returncode} before claiming a stage:\n"
            f"{_tail(nodedir / 'node.log')}"
        )
    return None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a node and everything it started (its process group), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def start_node(
    args,
    i: int,
    report: Path,
    run_id: str,
    peers: list[str],
    circuit: str = "fast",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen, dict]:
    """Start node ``i`` and wait until it has claimed a stage; a node that fails to is killed."""
    proc = spawn_node(args, i, report, run_id, peers, circuit, extra, env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready = poll_ready(proc, i, report)
            if ready is not None:
                return proc, ready
            time.sleep(0.2)
        raise SwarmError(
            f"node {i} did not claim a stage within {READY_TIMEOUT_S:.0f}s; "
            f"see {report / 'nodes' / str(i) / 'node.log'}"
        )
    except BaseException:  # the caller never got the process: do not leave it behind
        kill_group(proc)
        raise


def stop_nodes(procs: list[subprocess.Popen], stages: list[int]) -> None:
    """SIGTERM stage by stage from the head, so no node loses the peers its in-flight work needs."""
    deadline = time.monotonic() + STOP_GRACE_S
    for s in sorted(set(stages)):
        group = [p for p, st in zip(procs, stages) if st == s]
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in group:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        # a node that ignored SIGTERM, and anything it started (DHT process, p2pd), goes with its group
        kill_group(p)


def read_metrics(report: Path, n: int) -> list[dict]:
    out = []
    for i in range(n):
        path = report / "nodes" / str(i) / "metrics.json"
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def tail_steps(metrics: list[dict], n_stages: int) -> int:
    fast_tails = (m for m in metrics if m["stage"] == n_stages - 1 and m.get("circuit", "fast") == "fast")
    return max((m["inner_step"] for m in fast_tails), default=0)


def progress(metrics: list[dict], nodes: int, n_stages: int, steps: int) -> str:
    """What the swarm is doing, in the words a user watching it needs. Before the first step there is
    no loss to show (a demo used to print ``loss nan`` for its first 30-40 s): say what it waits for."""
    serving = {m["stage"] for m in metrics}
    missing = [s for s in range(n_stages) if s not in serving]
    losses = [m["step_losses"][-1] for m in metrics if m["step_losses"]]
    done = tail_steps(metrics, n_stages)
    if losses:
        return f"step {done}/{steps}  loss {losses[-1]:.3f}"
    if not metrics:
        return f"starting: {nodes} nodes loading their stages' weights; no step yet"
    if missing:
        which = f"stage{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        return f"waiting for stages: {len(metrics)}/{nodes} nodes serving, {which} not yet"
    return f"every stage served ({len(metrics)}/{nodes} nodes); the first step is under way"


def _table(metrics: list[dict], steps: int, n_stages: int, t0: float):
    from rich.table import Table

    done = tail_steps(metrics, n_stages)
    tokens = sum(m["trained_tokens"] for m in metrics if m["stage"] == n_stages - 1)
    el = time.monotonic() - t0
    table = Table(
        title=f"step {done}/{steps}  tokens {tokens}  {tokens / max(el, 1e-9):.0f} tok/s  {el:.0f}s"
    )
    for col in ("node", "stage", "role", "step", "loss", "tok/s (compute)", "sent MB", "dropped"):
        table.add_column(col)
    for m in sorted(metrics, key=lambda m: (m["stage"], m["peer_id"])):
        sent = sum(lk["bytes"] for lk in m["links"]) / 1e6
        loss = f"{m['step_losses'][-1]:.3f}" if m["step_losses"] else "-"
        table.add_row(
            m["peer_id"][-8:],
            str(m["stage"]),
            m["role"],
            str(m["inner_step"]),
            loss,
            f"{m['throughput']:.0f}",
            f"{sent:.2f}",
            str(m["dropped_microbatches"]),
        )
    return table


def link_totals(metrics: list[dict]) -> dict[str, int]:
    """Bytes each link has carried so far, "boundary direction" -> bytes (fast circuit)."""
    from node.local.report import sum_links

    fast = [m for m in metrics if m.get("circuit", "fast") == "fast"]
    return {f"{lk['boundary']} {lk['direction']}": lk["bytes"] for lk in sum_links(fast)}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def check_inputs(args) -> None:
    """What the flags name, checked before any node starts: otherwise a bad --data is found by the
    head only after it claimed stage 0, and shows here as a node that died."""
    from node.model.data import DataError, check_data
    from node.model.loading import ModelError, check_model
    from protocol.auth import SwarmKeyError, load_swarm_key

    if args.nodes < args.stages:
        raise SwarmError(
            f"--nodes {args.nodes} cannot serve --stages {args.stages}: need at least one node per stage"
        )
    try:
        check_model(args.model, args.mode)
        check_data(args.data)
        if args.swarm_key:
            load_swarm_key(args.swarm_key)
    except (ModelError, DataError, SwarmKeyError) as e:
        raise SwarmError(str(e)) from None


def run_swarm(args) -> int:
    try:
        check_inputs(args)
    except SwarmError as e:  # nothing started, no report written
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # same clean stop as Ctrl-C
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    run_id = f"local-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen] = []
    stages: list[int] = []
    t_start = time.monotonic()
    status = 0
    held = before = None
    dashboard = None
    published: dict | None = None  # the codec the run record carries (node 0's ready file)
    rates: list[tuple[float, dict]] = []
    memory = PeakMemory()
    keep_large_blocks_returnable()  # the launcher loads the whole model twice (--eval, --export)
    try:
        if args.eval:
            held, before = prepare_eval(args, report)  # also points args.data at the training split
            return_freed_memory()  # the base model it scored stays freed while the swarm runs
        print(
            f"starting {args.nodes} nodes ({args.stages} stages, {args.model}) - logs in {report}/nodes",
            flush=True,
        )
        proc, ready = start_node(args, 0, report, run_id, [])
        published = ready.get("codec")
        procs.append(proc)
        stages.append(ready["stage"])
        bootstrap = [a for a in ready["maddrs"] if "127.0.0.1" in a] or ready["maddrs"]
        peers = [f"{bootstrap[0]}/p2p/{ready['peer_id']}" if "/p2p/" not in bootstrap[0] else bootstrap[0]]
        print(f"  node 0 -> stage {ready['stage']}  {peers[0]}", flush=True)
        # from the first node on: the dashboard's events then show the others joining
        dashboard = start_dashboard(args, report, run_id, peers, dies_with_launcher())
        for i in range(1, args.nodes):
            proc, ready = start_node(args, i, report, run_id, peers)
            procs.append(proc)
            stages.append(ready["stage"])
            print(f"  node {i} -> stage {ready['stage']}", flush=True)
        for j in range(args.anchors * args.stages):
            i = args.nodes + j
            proc, ready = start_node(args, i, report, run_id, peers, circuit="anchor")
            procs.append(proc)
            stages.append(ready["stage"])
            print(f"  node {i} -> stage {ready['stage']} (anchor)", flush=True)
        status = watch(args, report, procs, stages, run_id, t_start, rates, memory, dashboard)
    except KeyboardInterrupt:
        print("interrupted; stopping the swarm", flush=True)
        status = 130
    except SwarmError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    finally:
        stop_nodes(procs, stages + [len(stages)] * (len(procs) - len(stages)))
        if dashboard is not None:  # after the nodes: it shows them leaving
            stop_nodes([dashboard.proc], [0])
    metrics = read_metrics(report, len(procs))
    rep = build_report(
        metrics,
        args.stages,
        run_id=run_id,
        model=args.model,
        codec=args.codec,
        codec_settings=published,
        elapsed_s=time.monotonic() - t_start,
    )
    drop_outer_thetas(metrics)  # build_report has read them for the replica distance
    model_line = ""
    if status == 0 and (args.eval or args.export):
        rep["eval"], model_line = finish_model(args, report, run_id, held, before)
    rep["link_rates"] = rates
    rep["memory"] = memory.as_dict()
    plot_link_rates(rates, report / "links.png")
    if rep.get("eval"):
        plot_eval(rep["eval"], report / "eval.png")
    (report / "report.json").write_text(json.dumps(rep, indent=1))
    if rep["loss"]:
        plot_loss(
            rep["loss"], report / "loss.png", title=f"{args.model}, {args.stages} stages, {args.nodes} nodes"
        )
    loss = f"loss {rep['loss'][0]:.3f} -> {rep['loss'][-1]:.3f}" if rep["loss"] else "no step taken"
    print(
        f"report: {report / 'report.json'}  steps {len(rep['loss'])}  {loss}  "
        f"tokens {rep['tokens']}  dropped {rep['dropped_microbatches']}",
        flush=True,
    )
    print(outer_line(rep.get("outer") or {}), flush=True)
    if memory.total:
        print(
            f"memory: the {len(procs)} nodes held {memory.total / 1e9:.1f} GB together at their peak "
            f"(PSS; largest node {max(memory.per_node.values()) / 1e9:.1f} GB)",
            flush=True,
        )
    if args.export and rep.get("eval") and "error" not in rep["eval"]:
        freed = prune_checkpoints(report, len(procs))
        print(
            f"removed the nodes' checkpoints ({freed / 1e9:.2f} GB): the export holds the model", flush=True
        )
    if model_line:  # the held-out line last: what a demo user looks for
        print(model_line, flush=True)
    return status


def prune_checkpoints(report: Path, n: int) -> int:
    """Delete the nodes' checkpoints once the export is written; the bytes freed. A local run's id
    is new each time, so nothing resumes from them, and they were most of a demo's disk (2.5 GB a
    node, full fine-tuning of the bundled model). Without --export they stay: they are then the
    only way to the model (``node export --checkpoints DIR/nodes``)."""
    import shutil

    freed = 0
    for i in range(n):
        ckpts = report / "nodes" / str(i) / "checkpoints"
        if ckpts.is_dir():
            freed += sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
            shutil.rmtree(ckpts, ignore_errors=True)
    return freed


# ---------------------------------------------------------------------- --eval / --export


def prepare_eval(args, report: Path) -> tuple[list, dict]:
    """Hold out ``args.eval`` problems of the run's data, train on the rest, score the base model.

    The nodes get ``--data report/data/train.jsonl``: the held-out prompts are not in it, so
    the head can never draw them (``split_heldout`` removes every copy of a held-out prompt).
    """
    from node.model.data import DataError, load_examples
    from node.model.evaluate import (
        EvalError,
        completion_budget,
        evaluate,
        load_for_eval,
        split_heldout,
        write_jsonl,
    )

    if args.mode != "finetune":
        raise SwarmError("--eval and --export apply to fine-tuning runs (--mode finetune)")
    try:
        held, train = split_heldout(load_examples(args.data, seed=args.seed), args.eval, args.seed)
    except (DataError, EvalError) as e:
        raise SwarmError(str(e)) from None
    data = report / "data"
    data.mkdir(exist_ok=True)
    write_jsonl(held, data / "heldout.jsonl")
    write_jsonl(train, data / "train.jsonl")
    args.data = str((data / "train.jsonl").absolute())
    model, tok = load_for_eval(args.model, args.device, args.seed)
    t0 = time.monotonic()
    before = evaluate(model, tok, held, completion_budget(tok, held))
    print(
        f"held out {len(held)} problems (trained on the other {len(train)} examples); before training: "
        f"loss {before['loss']:.3f}, exact match {_em(before['em'])} ({time.monotonic() - t0:.0f}s)",
        flush=True,
    )
    return held, before


def _em(em: float | None) -> str:
    return "n/a" if em is None else f"{em:.2f}"


def finish_model(
    args, report: Path, run_id: str, held: list | None, before: dict | None, dirs: list[Path] | None = None
) -> tuple[dict, str]:
    """Export from the nodes' final checkpoints (under ``dirs``, default ``report/nodes``), then score
    the exported model on the held-out set.

    From checkpoints rather than live peers: the nodes keep training until they are stopped,
    so stages pulled one after the other would each be caught mid-run, while the checkpoint
    every node writes on SIGTERM (head first, after its in-flight microbatches) holds its
    stage after the last step it took, which nothing changes afterwards. (Stages step on
    their own token counts, so their inner steps may differ; ``stages`` in the result says.)
    """
    import shutil
    import tempfile

    from node.model.evaluate import completion_budget, evaluate, load_for_eval
    from node.swarm.export import ExportError, export_from_checkpoints

    out = (
        Path(args.export) if args.export else Path(tempfile.mkdtemp(dir=report, prefix=".eval-model-")) / "m"
    )
    try:
        done = export_from_checkpoints(
            out, [str(d) for d in dirs or [report / "nodes"]], run_id, args.model, args.seed, replace=True
        )
    except ExportError as e:
        return {"error": str(e)}, f"export failed: {e}"
    result: dict = {"export": str(out) if args.export else None, "stages": done.info["stages"]}
    lines = [f"exported to {out}"] if args.export else []
    if done.info["embeddings"] == "untied":
        lines.append("the head's and tail's embedding copies differ: exported untied, as the swarm computes")
    if args.export:
        # a bash $'...' string, so the prompt's newline survives a copy-paste
        prompt = (held[0].prompt if held else "Hello").replace("\\", "\\\\").replace("'", "\\'")
        prompt = prompt.replace("\n", "\\n")
        lines.append(f"talk to it: python -m node generate --model {out} --prompt $'{prompt}'")
    if held:
        model, tok = load_for_eval(str(out), args.device)
        after = evaluate(model, tok, held, completion_budget(tok, held))
        result.update(
            n=len(held),
            loss_before=before["loss"],
            loss_after=after["loss"],
            em_before=before["em"],
            em_after=after["em"],
        )
        lines.append(
            f"exact match on {len(held)} held-out problems: {_em(before['em'])} -> {_em(after['em'])}  "
            f"(loss {before['loss']:.3f} -> {after['loss']:.3f})"
        )
    if not args.export:
        shutil.rmtree(out.parent, ignore_errors=True)
    return result, "\n".join(lines)


def outer_line(outer: Mapping) -> str:
    """The demo's last line: whether replicas of a stage averaged, and how far apart they ended."""
    dist = outer.get("max_replica_distance")
    return (
        f"outer rounds {outer.get('rounds', 0)} ({outer.get('skipped', 0)} skipped or alone)  "
        f"replica distance {'-' if dist is None else f'{dist:.3g}'}"
    )


def _live_peers(report: Path, procs: list[subprocess.Popen], exclude: int) -> list[str]:
    """Bootstrap addresses of the nodes still alive (a restarted node may have been the first)."""
    out = []
    for i, p in enumerate(procs):
        ready = report / "nodes" / str(i) / "ready.json"
        if i == exclude or p.poll() is not None or not ready.exists():
            continue
        r = json.loads(ready.read_text())
        a = next((m for m in r["maddrs"] if "127.0.0.1" in m), r["maddrs"][0])
        out.append(a if "/p2p/" in a else f"{a}/p2p/{r['peer_id']}")
    return out


def _keep_life(report: Path, i: int, life: int) -> None:
    """Keep a dead node's log and metrics (a restart writes fresh ones) as node.N.log, metrics.N.json."""
    d = report / "nodes" / str(i)
    for name, kept in (("node.log", f"node.{life}.log"), ("metrics.json", f"metrics.{life}.json")):
        if (d / name).exists():
            os.replace(d / name, d / kept)


def handle_deaths(
    args,
    report: Path,
    procs: list[subprocess.Popen],
    stages: list[int],
    run_id: str,
    restarts: dict[int, int],
) -> None:
    """Report each node that died since the last look; restart it (``--restart-dead``), or go on
    while every stage still has a live node. SwarmError when a stage is left with none."""
    for i, p in enumerate(procs):
        if p.poll() is None:
            ready = report / "nodes" / str(i) / "ready.json"
            if restarts.get(i, 0) > 0 and ready.exists():  # a restart without a checkpoint may move
                stages[i] = json.loads(ready.read_text())["stage"]
            continue
        if restarts.get(i, 0) < 0:  # already reported and given up
            continue
        print(
            f"node {i} (stage {stages[i]}) died (code {p.returncode}); last lines:\n"
            f"{_tail(report / 'nodes' / str(i) / 'node.log', 3)}",
            flush=True,
        )
        n = restarts.get(i, 0)
        peers = _live_peers(report, procs, exclude=i)
        if args.restart_dead and n < MAX_RESTARTS and peers:
            _keep_life(report, i, n)
            procs[i] = spawn_node(args, i, report, run_id, peers, extra=["--resume"])
            restarts[i] = n + 1
            print(f"  restarting node {i} with --resume ({n + 1}/{MAX_RESTARTS})", flush=True)
        else:
            restarts[i] = -1  # reported once; the run goes on without it
    alive = {st for p, st in zip(procs, stages) if p.poll() is None}
    empty = sorted(set(range(args.stages)) - alive)
    if empty:
        raise SwarmError(
            f"stage {empty[0]} has no live node left"
            + ("" if args.restart_dead else "; pass --restart-dead to restart dead nodes with --resume")
        )


def watch(
    args,
    report: Path,
    procs: list[subprocess.Popen],
    stages: list[int],
    run_id: str,
    t_start: float,
    rates: list | None = None,
    memory: PeakMemory | None = None,
    dashboard: DashboardProcess | None = None,
) -> int:
    """Live view until the tail reaches ``args.steps``; appends (time, link bytes) samples to ``rates``,
    samples the nodes' memory into ``memory`` and prints ``dashboard``'s URL once it serves."""
    t0 = time.monotonic()
    interactive = sys.stdout.isatty()
    live = None
    if interactive:
        from rich.live import Live

        live = Live(refresh_per_second=2)
        live.start()
    last_print = last_memory = 0.0
    restarts: dict[int, int] = {}  # node -> restarts so far; -1 once given up
    try:
        while True:
            if memory is not None and time.monotonic() - last_memory >= MEMORY_EVERY_S:
                memory.sample([p.pid if p.poll() is None else None for p in procs])
                last_memory = time.monotonic()
            if dashboard is not None:
                dashboard.check()
            metrics = read_metrics(report, len(procs))
            done = tail_steps(metrics, args.stages)
            if rates is not None and metrics and (not rates or time.monotonic() - t0 - rates[-1][0] >= 2.0):
                rates.append((time.monotonic() - t0, link_totals(metrics)))
            if live is not None and metrics:
                live.update(_table(metrics, args.steps, args.stages, t0))
            elif time.monotonic() - last_print > 10:
                line = progress(metrics, len(procs), args.stages, args.steps)
                print(f"  {line}  {time.monotonic() - t0:.0f}s", flush=True)
                last_print = time.monotonic()
            if done >= args.steps:
                return 0
            handle_deaths(args, report, procs, stages, run_id, restarts)
            if time.monotonic() - t_start > args.timeout:
                raise SwarmError(f"the swarm did not reach {args.steps} steps within {args.timeout:.0f}s")
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()
