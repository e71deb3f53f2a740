"""Command line: join, swarm, status, health, prepare-model.

(Over 400 lines: the flags of every subcommand, each with its help text, which tests/test_join_errors.py
checks; generating them from typed config fields (issue 17's unfinished part) would shrink it.)
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from node.config import NodeConfig

_CFG_DEFAULTS = {f.name: f.default for f in fields(NodeConfig) if not callable(f.default_factory)}


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Settings of a new run (used by the node that starts a swarm; joiners read them from the DHT)."""
    g = p.add_argument_group(
        "run settings (first node only; joiners take them from the swarm, except --model)"
    )
    d = _CFG_DEFAULTS
    g.add_argument(
        "--model",
        default=d["model"],
        help="'bundled' (SmolLM2-135M-Instruct, offline), 'tiny[:LAYERS]' (random init, for tests), a Hub id "
        "(owner/name, fetched once) or a local Llama/Qwen2/Qwen3/Mistral checkpoint; joiners pass the same "
        "--model (the join command the first node prints carries it) (default: %(default)s)",
    )
    g.add_argument(
        "--stages", type=int, default=d["stages"], help="pipeline stages of a new run (default: %(default)s)"
    )
    g.add_argument(
        "--codec",
        default=d["codec"],
        choices=["dense", "mask", "pca", "lowrank", "topk", "int8", "int4", "bottleneck", "subspace"],
        help="pipeline-link codec; 'subspace' needs --mode pretrain and --subspace-rank "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--mode",
        default=d["mode"],
        choices=["finetune", "pretrain"],
        help="finetune: train --model as loaded; pretrain: build a Llama-style model from scratch from "
        "--model's config (tiny[:L[:H]], small, or a checkpoint directory's config.json) with the run "
        "seed, next-token loss on every position (default: %(default)s)",
    )
    g.add_argument(
        "--subspace-rank",
        type=int,
        default=d["subspace_rank"],
        help="--codec subspace: k, the numbers per token each boundary carries (Subspace Networks; "
        "the model is built with the constraint) (default: %(default)s)",
    )
    g.add_argument(
        "--dp",
        default=d["dp"],
        choices=["diloco", "scape"],
        help="data parallelism among replicas of a stage: diloco (outer rounds every --outer-every "
        "steps) or scape (AdamS, sparse sync of --density of the coordinates every inner step) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--density",
        type=float,
        default=d["density"],
        help="--dp scape: share of every tensor's coordinates synchronised per step (default: %(default)s)",
    )
    g.add_argument(
        "--dp-timeout",
        type=float,
        default=d["dp_timeout"],
        help="--dp scape: seconds to wait for the other replicas' step before going on alone "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--mask-rate",
        type=float,
        default=d["mask_rate"],
        help="mask codec: share of hidden channels dropped per token (default: %(default)s)",
    )
    g.add_argument(
        "--mask-rescale",
        action="store_true",
        help="mask codec: scale kept channels by 1/(1-rate) (unbiased; off as in the paper)",
    )
    g.add_argument(
        "--codec-k",
        type=int,
        default=d["codec_k"],
        help="pca/lowrank/topk/bottleneck: coefficients or channels per token (default: %(default)s)",
    )
    g.add_argument(
        "--pca-dtype",
        default=d["pca_dtype"],
        choices=["int8", "bfloat16", "float32"],
        help="pca/lowrank codecs: coefficient dtype; int8 uses per-block scales (default: %(default)s)",
    )
    g.add_argument(
        "--lowrank-basis",
        default=d["lowrank_basis"],
        choices=["bfloat16", "int8", "float32"],
        help="lowrank codec: dtype of the basis each frame carries; int8 uses a bf16 scale per 32 "
        "entries (about half the basis bytes of bfloat16) (default: %(default)s)",
    )
    g.add_argument(
        "--outer-every",
        type=int,
        default=None,
        help="DiLoCo: inner steps between outer rounds in which the replicas of a stage average "
        f"their pseudo-gradients (a stage with one replica skips them); 0 = never (default: "
        f"{d['outer_every']}, 0 with --dp scape)",
    )
    g.add_argument(
        "--powersgd-rank",
        type=int,
        default=d["powersgd_rank"],
        help="rank of the PowerSGD-compressed pseudo-gradients; 0 = uncompressed (default: %(default)s)",
    )
    g.add_argument(
        "--group-size",
        type=int,
        default=d["group_size"],
        help="replicas per gossip group in an outer round (default: %(default)s)",
    )
    g.add_argument(
        "--outer-lr", type=float, default=d["outer_lr"], help="outer Nesterov lr (default: %(default)s)"
    )
    g.add_argument(
        "--outer-momentum",
        type=float,
        default=d["outer_momentum"],
        help="outer Nesterov momentum (default: %(default)s)",
    )
    g.add_argument(
        "--outer-mode",
        default=d["outer_mode"],
        choices=["diloco", "gasloc"],
        help="outer optimizer: DiLoCo's Nesterov, or GASLoC's mixed momentum (default: %(default)s)",
    )
    g.add_argument(
        "--outer-timeout",
        type=float,
        default=d["outer_timeout"],
        help="seconds an outer round may take before it is skipped (default: %(default)s)",
    )
    g.add_argument(
        "--ap-alpha",
        type=float,
        default=d["ap_alpha"],
        help="anchor priors: weight of the raw masked gradient, 1 = filter off (default: %(default)s)",
    )
    g.add_argument(
        "--ap-tau",
        type=float,
        default=d["ap_tau"],
        help="anchor priors: spectral shrinkage d = s/(s+tau) (default: %(default)s)",
    )
    g.add_argument(
        "--ap-beta",
        type=float,
        default=d["ap_beta"],
        help="anchor priors: EMA factor of anchor gradients (default: %(default)s)",
    )
    g.add_argument(
        "--ap-tau-relative",
        action="store_true",
        help="anchor priors: tau relative to the top singular value (deviation from the paper)",
    )
    g.add_argument(
        "--ap-max-staleness",
        type=int,
        default=d["ap_max_staleness"],
        help="drop anchor packets older than this many fast steps (default: %(default)s)",
    )
    g.add_argument(
        "--anchor-pull-every",
        type=int,
        default=d["anchor_pull_every"],
        help="anchors re-pull weights once they are this many fast steps old (default: %(default)s)",
    )
    g.add_argument(
        "--anchor-rank",
        type=int,
        default=d["anchor_rank"],
        help="rank of the gradient factors an anchor sends per matrix (default: %(default)s)",
    )
    g.add_argument(
        "--dense-every",
        type=int,
        default=d["dense_every"],
        help="send every K-th step uncompressed (periodic clean step); 0 = never (default: %(default)s)",
    )
    g.add_argument(
        "--wire-dtype",
        default=d["wire_dtype"],
        choices=["float32", "bfloat16", "float16"],
        help="dtype of dense link payloads (default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d["seed"],
        help="run seed: masks, init of tiny models (default: %(default)s)",
    )
    g.add_argument(
        "--lr", type=float, default=d["lr"], help="inner AdamW learning rate (default: %(default)s)"
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=d["weight_decay"],
        help="AdamW weight decay (default: %(default)s)",
    )
    g.add_argument("--clip", type=float, default=d["clip"], help="gradient-norm clip (default: %(default)s)")
    g.add_argument(
        "--seq-len", type=int, default=d["seq_len"], help="max tokens per sequence (default: %(default)s)"
    )
    g.add_argument(
        "--microbatch",
        type=int,
        default=d["microbatch"],
        help="sequences per microbatch (default: %(default)s)",
    )
    g.add_argument(
        "--batch-tokens",
        type=int,
        default=d["batch_tokens"],
        help="tokens a node accumulates before each inner optimizer step (default: %(default)s)",
    )


def add_node_args(p: argparse.ArgumentParser) -> None:
    d = _CFG_DEFAULTS
    g = p.add_argument_group("this node")
    g.add_argument(
        "--data",
        default=d["data"],
        help="training data for the head: 'arithmetic' (built in) or a .jsonl of {text} / "
        "{prompt, completion} records, or a plain-text file (default: %(default)s)",
    )
    g.add_argument(
        "--device",
        default=d["device"],
        choices=["auto", "cuda", "cpu"],
        help="compute device; auto picks CUDA when present (default: %(default)s)",
    )
    g.add_argument("--threads", type=int, default=d["threads"], help="torch CPU threads, 0 = torch default")
    g.add_argument(
        "--max-memory",
        dest="max_memory_gb",
        type=float,
        default=d["max_memory_gb"],
        help="GiB this node may use: it claims only a stage whose estimate fits, and refuses "
        "with a message when none does; 0 = no limit (default: %(default)s)",
    )
    g.add_argument(
        "--max-inflight",
        type=int,
        default=d["max_inflight"],
        help="cap on microbatches this node holds in flight (default: %(default)s)",
    )
    g.add_argument(
        "--max-steps",
        type=int,
        default=d["max_steps"],
        help="leave after this many inner steps; 0 = run until stopped (default: %(default)s)",
    )
    g.add_argument(
        "--hop-timeout",
        type=float,
        default=d["hop_timeout"],
        help="seconds one pipeline hop may take before it is retried elsewhere (default: %(default)s)",
    )
    g.add_argument(
        "--heartbeat",
        dest="heartbeat_s",
        type=float,
        default=d["heartbeat_s"],
        help="seconds between stage-record heartbeats (default: %(default)s)",
    )
    g.add_argument(
        "--no-rebalance",
        dest="rebalance",
        action="store_false",
        default=None,
        help="stay on the claimed stage: never move to a stage left empty or far below the others "
        "in throughput (moving is on by default with --stage auto)",
    )
    g.add_argument(
        "--state-dir",
        default=None,
        help="identity key, checkpoints and health file "
        "(default: $NODE_STATE_DIR or ~/.local/share/volunteer-node)",
    )
    g.add_argument("--metrics-file", default=None, help="write live metrics as JSON here")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d["checkpoint_every"],
        help="inner steps between atomic checkpoints in STATE_DIR/checkpoints (one is also "
        "written on SIGTERM/Ctrl-C); 0 = never (default: %(default)s)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from this node's newest complete checkpoint of the run (same stage, "
        "weights, optimizer and filter state, step count)",
    )
    g.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    g.add_argument(
        "--wait-peers",
        type=int,
        default=d["wait_peers"],
        help="head only: wait until this many peers are ready before training (default: %(default)s)",
    )


def add_network_args(p: argparse.ArgumentParser) -> None:
    d = _CFG_DEFAULTS
    g = p.add_argument_group("network")
    g.add_argument(
        "--peers",
        nargs="*",
        default=[],
        help="multiaddrs of peers already in the swarm (/ip4/HOST/tcp/PORT/p2p/PEER_ID); "
        "without it, this node starts a new swarm",
    )
    g.add_argument(
        "--run-id", default=d["run_id"], help="which run of the swarm to join (default: %(default)s)"
    )
    g.add_argument(
        "--new-run",
        action="store_true",
        help="with --peers: start --run-id on that DHT (e.g. a plain hivemind bootstrap peer) instead "
        "of joining it; refused if the run already exists",
    )
    g.add_argument(
        "--circuit",
        default=d["circuit"],
        choices=["fast", "anchor"],
        help="fast: compressed links and training; anchor: dense, unmasked replica that feeds "
        "the fast peers' spectral filter (default: %(default)s)",
    )
    g.add_argument(
        "--stage", default=d["stage"], help="'auto' claims the least-served stage, or a stage index"
    )
    g.add_argument(
        "--host",
        default=d["host"],
        help="listen address; 0.0.0.0 to accept peers from other machines (default: %(default)s)",
    )
    g.add_argument(
        "--port",
        type=int,
        default=d["port"],
        help="listen TCP port; 0 picks a free one (default: %(default)s)",
    )
    g.add_argument(
        "--announce-maddr",
        dest="announce_maddrs",
        action="append",
        default=[],
        help="address others should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT (repeatable)",
    )
    g.add_argument(
        "--identity",
        default=None,
        help="private key file for a stable peer id (made 0600 if missing; default: STATE_DIR/identity.key)",
    )
    g.add_argument(
        "--swarm-key",
        default=None,
        help="file holding the swarm's shared secret (chmod 600; make one with `python -m node "
        "keygen FILE`): only nodes with the key get frames accepted",
    )
    g.add_argument(
        "--client-mode",
        action="store_true",
        help="do not accept incoming DHT connections (behind NAT with no forwarded port)",
    )
    g.add_argument(
        "--no-relay",
        dest="use_relay",
        action="store_false",
        help="disable libp2p circuit relays (on by default: lets peers behind NAT reach each other)",
    )
    g.add_argument(
        "--use-auto-relay",
        action="store_true",
        help="look for relays automatically and announce relayed addresses (behind NAT)",
    )
    g.add_argument(
        "--p2pd-timeout",
        type=float,
        default=d["p2pd_timeout"],
        help="seconds to wait for the p2p daemon to start (default: %(default)s)",
    )
    g.add_argument(
        "--join-timeout",
        type=float,
        default=d["join_timeout"],
        help="seconds to reach the bootstrap peers and read the run (default: %(default)s)",
    )


def run_arg_flags(args: argparse.Namespace) -> list[str]:
    """The run-settings flags of ``args`` as a command line (the swarm passes them to every node)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_run_args(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest)
        if value is None:  # not given and resolved by the node itself (--outer-every)
            continue
        if isinstance(action, argparse._StoreTrueAction):
            out += [action.option_strings[0]] if value else []
        else:
            out += [action.option_strings[0], str(value)]
    return out


class FlagError(ValueError):
    """A combination of run flags that cannot work; the message is one line saying why."""


def check_run_flags(a: argparse.Namespace) -> None:
    """Refuse, in one line, run settings that contradict each other (join and swarm alike)."""
    if a.codec == "subspace" and a.mode != "pretrain":
        raise FlagError(
            "--codec subspace needs --mode pretrain: it is exact only for a model built with the "
            "subspace constraint, and a pretrained model's residual stream is not in span(U)"
        )
    if a.codec == "subspace" and a.subspace_rank < 1:
        raise FlagError("--codec subspace needs --subspace-rank K (numbers per token, 1 <= K < hidden)")
    if a.subspace_rank and a.codec != "subspace":
        raise FlagError("--subspace-rank only applies to --codec subspace")
    if not 0.0 < a.density <= 1.0:
        raise FlagError(f"--density must lie in (0, 1], got {a.density}")
    if a.dp == "scape" and a.outer_every:
        raise FlagError("--dp scape syncs every inner step; it does not combine with --outer-every")
    if a.dp_timeout <= 0:
        raise FlagError("--dp-timeout must be > 0")


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    cfg = NodeConfig()
    for f in fields(NodeConfig):
        if hasattr(a, f.name) and getattr(a, f.name) is not None:
            setattr(cfg, f.name, getattr(a, f.name))
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m node",
        description="Volunteer training node: join a swarm "
        "that trains a language model pipeline-parallel over libp2p.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    j = sub.add_parser("join", help="start a swarm, or join one with --peers, and train a stage")
    add_network_args(j)
    add_run_args(j)
    add_node_args(j)

    s = sub.add_parser("swarm", help="run a local swarm of N node processes on loopback and write a report")
    s.add_argument("--nodes", type=int, default=3, help="fast node processes (default: %(default)s)")
    s.add_argument(
        "--anchors",
        type=int,
        default=0,
        help="anchor nodes per stage, started after the fast nodes (default: %(default)s)",
    )
    s.add_argument(
        "--steps", type=int, default=30, help="inner steps of the tail stage to train (default: %(default)s)"
    )
    s.add_argument("--report", default="runs/swarm", help="report directory (default: %(default)s)")
    s.add_argument(
        "--timeout", type=float, default=1800, help="give up after this many seconds (default: %(default)s)"
    )
    s.add_argument(
        "--threads-per-node", type=int, default=1, help="torch threads per node (default: %(default)s)"
    )
    add_run_args(s)
    s.set_defaults(run_arg_flags=run_arg_flags)  # node.swarm rebuilds node commands with it: no import circle
    s.add_argument("--data", default=_CFG_DEFAULTS["data"], help="training data for the head stage(s)")
    s.add_argument(
        "--device",
        default=_CFG_DEFAULTS["device"],
        choices=["auto", "cuda", "cpu"],
        help="where every node computes; auto = cuda if present (default: %(default)s)",
    )
    s.add_argument(
        "--max-inflight",
        type=int,
        default=_CFG_DEFAULTS["max_inflight"],
        help="microbatches a head keeps in the pipeline at once (default: %(default)s)",
    )
    s.add_argument(
        "--hop-timeout",
        type=float,
        default=_CFG_DEFAULTS["hop_timeout"],
        help="seconds for one hop's compute and reply, times the hops ahead (default: %(default)s)",
    )
    s.add_argument("--swarm-key", default=None, help="swarm key file given to every node")
    s.add_argument(
        "--no-rebalance",
        dest="rebalance",
        action="store_false",
        default=None,
        help="every node stays on the stage it claimed (passed to each node's join)",
    )
    s.add_argument(
        "--restart-dead",
        action="store_true",
        help="restart a node that dies with --resume (its checkpoint, then the stage's current "
        "weights); without it the run goes on while every stage keeps a live node",
    )
    add_swarm_model_out_args(s)

    st = sub.add_parser("status", help="print a swarm's run, stages and peers from the DHT")
    st.add_argument("--peers", nargs="+", required=True, help="multiaddr(s) of any peer in the swarm")
    st.add_argument("--run-id", default="default", help="which run to show (default: %(default)s)")
    st.add_argument(
        "--join-timeout",
        type=float,
        default=_CFG_DEFAULTS["join_timeout"],
        help="seconds to reach the peers and read the run (default: %(default)s)",
    )
    st.add_argument("--json", action="store_true", help="print JSON")

    h = sub.add_parser(
        "health", help="exit 0 if the local node is alive and serving (for container healthchecks)"
    )
    h.add_argument("--state-dir", default=None, help="the node's state directory (default: the node's)")

    sub.add_parser("prepare-model", help="convert the bundled SmolLM2-135M into the local cache (once)")

    k = sub.add_parser("keygen", help="create a swarm key file (32 random bytes, mode 0600)")
    k.add_argument("path", help="where to write the key")
    add_model_out_commands(sub)
    return p


# ---------------------------------------------------------------------- export / eval / generate


def add_model_out_commands(sub) -> None:
    """`export`, `eval`, `generate`: the trained model leaves the swarm (node/export.py, node/evaluate.py)."""
    e = sub.add_parser(
        "export",
        help="write the swarm's model as one Hugging Face checkpoint, from live peers or checkpoints",
    )
    e.add_argument("--out", required=True, help="directory to create (written elsewhere, then renamed)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--peers", nargs="+", help="multiaddr(s) of any peer: pull every stage from a live peer")
    src.add_argument(
        "--checkpoints",
        nargs="+",
        metavar="DIR",
        help="nodes' state or checkpoint directories: assemble offline from their newest checkpoints",
    )
    e.add_argument("--run-id", default=None, help="the run (default: 'default' with --peers; the one found)")
    e.add_argument("--swarm-key", default=None, help="the swarm's key file, when it has one (--peers)")
    e.add_argument(
        "--model",
        default=None,
        help="the run's base model (bundled, tiny[:L[:H]] or a directory); default: from the run record "
        "(--peers) or bundled (--checkpoints)",
    )
    e.add_argument("--seed", type=int, default=0, help="--checkpoints of a tiny model: its run seed")
    e.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per network wait (default: %(default)s)"
    )
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    for name, helptext in (
        ("eval", "eval loss and greedy exact match of a model on prompt/completion data"),
        ("generate", "print a model's greedy completion of a prompt"),
    ):
        g = sub.add_parser(name, help=helptext)
        g.add_argument(
            "--model", required=True, help="an exported directory, any local HF checkpoint, or bundled"
        )
        if name == "eval":
            g.add_argument(
                "--data", required=True, help="arithmetic, or a .jsonl of {prompt, completion}/{text}"
            )
            g.add_argument("--limit", type=int, default=0, help="score the first N examples only; 0 = all")
        else:
            g.add_argument("--prompt", required=True, help="the text to continue")
        g.add_argument(
            "--max-new-tokens", type=int, default=32, help="generation budget (default: %(default)s)"
        )
        g.add_argument(
            "--device",
            default="auto",
            choices=["auto", "cuda", "cpu"],
            help="where the model runs; auto = cuda if present (default: %(default)s)",
        )
        g.add_argument("--seed", type=int, default=0, help="built-in data / tiny models: seed (default: 0)")


def add_swarm_model_out_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--eval",
        type=int,
        default=0,
        metavar="N",
        help="hold out N problems of --data (never trained on), score them before training and after "
        "the last step (default: off)",
    )
    s.add_argument(
        "--export", default=None, metavar="DIR", help="write the trained model to DIR at the end (HF format)"
    )


def run_model_out_command(args) -> int:
    if args.cmd == "eval":
        from node.evaluate import run_eval

        return run_eval(args)
    if args.cmd == "generate":
        from node.evaluate import run_generate

        return run_generate(args)
    from node.export import ExportError, export_from_checkpoints, export_from_peers

    try:
        if args.peers:
            done = export_from_peers(
                args.out,
                args.peers,
                args.run_id or "default",
                args.swarm_key,
                args.model,
                args.timeout,
                replace=args.force,
            )
        else:
            done = export_from_checkpoints(
                args.out,
                args.checkpoints,
                args.run_id,
                args.model or "bundled",
                args.seed,
                replace=args.force,
            )
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe_export(done.info, args.out))
    return 0


def describe_export(info: dict, out: str) -> str:
    steps = ", ".join(f"stage {s['index']} step {s['inner_step']}" for s in info["stages"])
    line = f"exported run {info['run_id']} to {out} ({steps})"
    if info["embeddings"] == "untied":
        line += (
            "\nthe head's and the tail's copies of the tied embedding differ after training: "
            "exported untied (tie_word_embeddings=False), as the swarm computes"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "transformers", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not args.verbose else logging.INFO)
    if args.cmd in ("join", "swarm"):
        if args.outer_every is None:  # DiLoCo rounds by default; SCAPE syncs every step instead
            args.outer_every = 0 if args.dp == "scape" else _CFG_DEFAULTS["outer_every"]
        try:
            check_run_flags(args)
        except FlagError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        if args.cmd == "join":
            from node.join import run_join

            return run_join(config_from_args(args))
        if args.cmd == "swarm":
            from node.swarm import run_swarm

            return run_swarm(args)
        if args.cmd == "status":
            from node.status import run_status

            return run_status(args)
        if args.cmd == "health":
            from node.health import run_health

            return run_health(args.state_dir)
        if args.cmd == "keygen":
            from protocol.auth import key_id, make_swarm_key

            key = make_swarm_key(args.path)
            print(f"swarm key {key_id(key)} written to {args.path}; give it to every node as --swarm-key")
            return 0
        if args.cmd in ("export", "eval", "generate"):
            return run_model_out_command(args)
        if args.cmd == "prepare-model":
            from node.model import prepare_bundled

            print(prepare_bundled())
            return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # one line naming the cause; --verbose shows the traceback
        if args.verbose:
            raise
        print(
            f"error: {type(e).__name__}: {e}".splitlines()[0] + "  (run with -v for details)", file=sys.stderr
        )
        return 2
    return 1
