"""Command line: join, swarm, status, dashboard, health, prepare-model.

``join``'s flags, and ``swarm``'s run settings, are built from NodeConfig's fields (node/argv.py).
Every flag is checked as it is parsed (a range or choices: the field's metadata in node/config.py,
or ``bounded(...)`` for a subcommand's own flag here); combinations in ``check_run_flags``; each
refusal is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

from node.argv import FlagError, OneLineParser, add_config_args, bounded, config_from_args, flag_type, given
from node.config import NET, NODE, RUN, NodeConfig
from node.inputs import check_ip, check_new_dir, check_new_file, check_run_id

_CFG_DEFAULTS = {f.name: f.default for f in fields(NodeConfig) if not callable(f.default_factory)}
# the codecs each codec-specific flag acts on: given with another codec, it would do nothing
_CODEC_FLAGS = {
    "codec_k": ("pca", "lowrank", "topk", "bottleneck"),
    "lowrank_k_backward": ("lowrank",),
    "lowrank_backward_bits": ("lowrank",),
}
# ... and those refused with another codec only at a value other than their default, since
# bench/network/harness.py pins --mask-rate 0.95 on every node's command line whatever the codec
_CODEC_VALUES = {
    "mask_rate": ("mask",),
    "link": ("lowrank",),
    "pca_dtype": ("pca", "lowrank"),
    **{
        f"lowrank_{s}": ("lowrank",)
        for s in (
            "basis",
            "tiers",
            "backward_tiers",
            "centre",
            "first",
            "fit",
            "entropy",
            "repeats",
            "step",
            "backward_step",
            "basis_step",
            "first_gain",
        )
    },
}
SWARM_EVAL_EVERY = 50  # a local swarm's held-out scoring (join's default is off: it pulls weights)
# the lowrank flags that --lowrank-tiers overrides (its tiers set both directions' directions and bits)
_TIERED_AWAY = ("codec_k", "lowrank_k_backward", "lowrank_backward_bits")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_run_flags(a: argparse.Namespace) -> None:
    """Refuse, in one line, run settings that contradict each other (join and swarm alike); each
    flag's own range was checked as it was parsed (node.argv.field_type)."""
    if a.codec == "subspace" and a.mode != "pretrain":
        raise FlagError(
            "--codec subspace needs --mode pretrain: it is exact only for a model built with the "
            "subspace constraint, and a pretrained model's residual stream is not in span(U)"
        )
    if a.codec == "subspace" and a.subspace_rank < 1:
        raise FlagError("--codec subspace needs --subspace-rank K (numbers per token, 1 <= K < hidden)")
    if a.subspace_rank and a.codec != "subspace":
        raise FlagError("--subspace-rank only applies to --codec subspace")
    if a.dp == "scape" and a.outer_every:
        raise FlagError("--dp scape syncs every inner step; it does not combine with --outer-every")
    for name, codecs in _CODEC_FLAGS.items() | _CODEC_VALUES.items():
        changed = name in _CODEC_FLAGS or getattr(a, name) != _CFG_DEFAULTS[name]
        if name in given(a) and changed and a.codec not in codecs:
            raise FlagError(f"{_flag(name)} does nothing with --codec {a.codec}: it applies to --codec "
                            f"{' / '.join(codecs)}; leave it out")  # fmt: skip
    tiered_away = [n for n in _TIERED_AWAY if n in given(a)]
    if a.codec == "lowrank" and a.lowrank_tiers and tiered_away:  # only if the tiers were given too
        raise FlagError(f"{_flag(tiered_away[0])} does nothing with --lowrank-tiers {a.lowrank_tiers}: the "
                        "tiers set the directions and bits of both directions; leave out one of the two "
                        '(--lowrank-tiers "" codes --codec-k directions at 8 bits)')  # fmt: skip
    if a.lowrank_tiers or a.lowrank_backward_tiers:
        from node.stage.links import parse_tiers

        try:
            for name in ("lowrank_tiers", "lowrank_backward_tiers"):
                if getattr(a, name):
                    parse_tiers(getattr(a, name), _flag(name))
        except ValueError as e:
            raise FlagError(str(e)) from None
    if a.lowrank_backward_tiers and not a.lowrank_tiers:
        raise FlagError(f"--lowrank-backward-tiers {a.lowrank_backward_tiers} needs --lowrank-tiers for the "
                        "forward (a GPU starter's 2048-token frames set 24x8,88x4 by default)")  # fmt: skip
    if a.lowrank_step and (a.lowrank_tiers or a.lowrank_backward_tiers):
        tiers = a.lowrank_tiers or a.lowrank_backward_tiers
        raise FlagError(f"--lowrank-step {a.lowrank_step} and tiers {tiers} both set how the coefficients "
                        "are coded; leave out one of the two")  # fmt: skip
    if a.lowrank_backward_step and not a.lowrank_step:
        raise FlagError(f"--lowrank-backward-step {a.lowrank_backward_step} needs --lowrank-step for the "
                        "forward")  # fmt: skip
    if a.lowrank_basis_step and not a.lowrank_step:
        raise FlagError(f"--lowrank-basis-step {a.lowrank_basis_step} sizes the basis by the coefficients' "
                        "step: add --lowrank-step")  # fmt: skip
    if a.lowrank_basis_step and a.lowrank_basis != "int8":
        raise FlagError(
            f"--lowrank-basis-step quantises an int8 basis; leave out --lowrank-basis {a.lowrank_basis}"
        )
    if a.lowrank_step and a.lowrank_entropy != "on":
        raise FlagError(f"--lowrank-step {a.lowrank_step} leaves the codes' sizes to entropy coding: add "
                        "--lowrank-entropy on")  # fmt: skip
    if a.lowrank_step and a.pca_dtype != "int8":
        raise FlagError(f"--lowrank-step codes int8 steps; leave out --pca-dtype {a.pca_dtype}")
    if a.codec == "lowrank":
        from node.stage.links import codec_settings, forward_frame_tensors
        from protocol.frames import MAX_TENSORS

        n = forward_frame_tensors(codec_settings(config_from_args(a)))
        if n > MAX_TENSORS:
            flags = " ".join(
                f"{_flag(n)} {getattr(a, n)}"
                for n in ("lowrank_tiers", "lowrank_first", "lowrank_entropy", "lowrank_repeats")
            )
            raise FlagError(
                f"{flags}: a forward frame would carry {n} tensors, more than the {MAX_TENSORS} a node "
                "accepts; use fewer tiers or turn one of the others off"
            )
    if a.finetune == "lora":
        # what moves under LoRA is the adapters; these paths move or filter whole weights
        if a.dp == "scape":
            raise FlagError("--finetune lora trains adapters only; --dp scape is built for whole weights: "
                            "use the default --dp diloco")  # fmt: skip
        if getattr(a, "circuit", "fast") == "anchor" or getattr(a, "anchors", 0):
            raise FlagError("--finetune lora does not combine with anchors (their filter acts on whole "
                            "weight gradients); leave out --circuit anchor / --anchors")  # fmt: skip
        if a.mode == "pretrain":
            raise FlagError("--finetune lora adapts a pretrained model; --mode pretrain trains one from "
                            "scratch: use --finetune full")  # fmt: skip
    base = getattr(a, "base_dtype", "auto")
    if base == "nf4":
        from node.model.adapters import nf4_available

        if not nf4_available():
            raise FlagError("--base-dtype nf4 needs the bitsandbytes package: pip install bitsandbytes"
                            "==0.50.2 (the nf4 extra), or pass --base-dtype bf16")  # fmt: skip
    # a joiner learns the run's --finetune from its record (node.join checks it there)
    new_run = not getattr(a, "peers", None) or getattr(a, "new_run", False)
    if base != "auto" and a.finetune != "lora" and new_run:
        raise FlagError(f"--base-dtype {base} is the frozen base's dtype under LoRA adapters: add --finetune "
                        "lora, or leave it out (full fine-tuning trains every weight in fp32)")  # fmt: skip
    layers = getattr(a, "stage_layers", "")
    n_ranges = len(layers.split(",")) if layers else 0
    if layers and n_ranges != a.stages:
        raise FlagError(f"--stage-layers {layers} has {n_ranges} ranges for --stages {a.stages}: give one "
                        "START-END range per stage")  # fmt: skip
    if a.microbatch_tokens and not a.seq_len <= a.microbatch_tokens <= 2**20:
        raise FlagError(
            f"--microbatch-tokens {a.microbatch_tokens} must be 0 or at least --seq-len ({a.seq_len}): "
            "every microbatch holds at least one whole example"
        )


def check_command_paths(a: argparse.Namespace) -> None:
    """What a subcommand writes or names, checked before it starts (``join``'s own: node.join's
    check_inputs): an output inside a file, a run id that is not a name, a listen address that is
    not one. These used to fail as an exception's name, ``swarm --export`` only after the run."""
    if getattr(a, "run_id", None) is not None and a.cmd != "join":
        check_run_id(a.run_id)
    if a.cmd == "swarm":
        check_new_dir("--report", a.report, may_exist=True)
        if a.export:
            check_new_dir("--export", a.export, may_exist=True)  # replaced at the end of the run
    elif a.cmd == "export":
        check_new_dir("--out", a.out, may_exist=False, force=a.force)
    elif a.cmd == "keygen":
        check_new_file("keygen", a.path, may_exist=False)
    elif a.cmd == "health" and a.state_dir and os.path.exists(a.state_dir) and not os.path.isdir(a.state_dir):
        raise FlagError(
            f"--state-dir {a.state_dir} is a file, not a directory; pass the node's state directory"
        )
    elif a.cmd == "dashboard":
        check_ip("--host", a.host, v4_only=False)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m node",
        description="Volunteer training node: join a swarm "
        "that trains a language model pipeline-parallel over libp2p.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    j = sub.add_parser("join", help="start a swarm, or join one with --peers, and train a stage")
    for group in (NET, RUN, NODE):
        add_config_args(j, group)

    s = sub.add_parser("swarm", help="run a local swarm of N node processes on loopback and write a report")
    s.add_argument(
        "--nodes", type=bounded(int, min=1), default=3, help="fast node processes (default: %(default)s)"
    )
    s.add_argument(
        "--anchors",
        type=bounded(int, min=0),
        default=0,
        help="anchor nodes per stage, started after the fast nodes (default: %(default)s)",
    )
    s.add_argument(
        "--steps",
        type=bounded(int, min=1),
        default=30,
        help="inner steps of the tail stage to train (default: %(default)s)",
    )
    s.add_argument("--report", default="runs/swarm", help="report directory (default: %(default)s)")
    s.add_argument(
        "--timeout",
        type=bounded(float, above=0),
        default=1800,
        help="give up after this many seconds (default: %(default)s)",
    )
    s.add_argument(
        "--threads-per-node",
        type=bounded(int, min=0),
        default=1,
        help="torch threads per node (default: %(default)s)",
    )
    add_config_args(s, RUN)
    s.add_argument("--data", default=_CFG_DEFAULTS["data"], help="training data for the head stage(s)")
    s.add_argument(
        "--device",
        default=_CFG_DEFAULTS["device"],
        choices=["auto", "cuda", "cpu"],
        help="where every node computes; auto = cuda if present (default: %(default)s)",
    )
    s.add_argument(
        "--max-inflight",
        type=flag_type("max_inflight"),
        default=_CFG_DEFAULTS["max_inflight"],
        help="microbatches a head keeps in the pipeline at once (default: %(default)s)",
    )
    s.add_argument(
        "--eval-every",
        type=flag_type("eval_every"),
        default=SWARM_EVAL_EVERY,
        metavar="N",
        help="the tail scores a small held-out set every N of its inner steps, for the dashboard (it "
        "pulls the other stages' weights, free on loopback); 0 = off (default: %(default)s)",
    )
    s.add_argument(
        "--hop-timeout",
        type=flag_type("hop_timeout"),
        default=_CFG_DEFAULTS["hop_timeout"],
        help="seconds for one hop's compute and reply, times the hops ahead (default: %(default)s)",
    )
    s.add_argument("--swarm-key", default=None, help="swarm key file given to every node")
    s.add_argument(
        "--base-dtype",
        default=_CFG_DEFAULTS["base_dtype"],
        choices=["auto", "fp32", "bf16", "nf4"],
        help="--finetune lora: every node's frozen base; nf4 = 4-bit linear weights (QLoRA, needs "
        "bitsandbytes) (default: %(default)s)",
    )
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
    s.add_argument(
        "--dashboard",
        dest="dashboard_port",  # not NodeConfig's `dashboard`: the nodes must not each serve one
        type=bounded(int, min=-1, max=65535),
        default=8080,
        metavar="PORT",
        help="serve the live dashboard on 127.0.0.1:PORT for the run's life; 0 = any free port, "
        "-1 = none (default: %(default)s)",
    )
    add_swarm_model_out_args(s)

    st = sub.add_parser("status", help="print a swarm's run, stages and peers from the DHT")
    st.add_argument("--peers", nargs="+", required=True, help="multiaddr(s) of any peer in the swarm")
    st.add_argument("--run-id", default="default", help="which run to show (default: %(default)s)")
    st.add_argument(
        "--join-timeout",
        type=flag_type("join_timeout"),
        default=_CFG_DEFAULTS["join_timeout"],
        help="seconds to reach the peers and read the run (default: %(default)s)",
    )
    st.add_argument("--json", action="store_true", help="print JSON")

    d = sub.add_parser("dashboard", help="serve a live web dashboard and Prometheus metrics of a swarm")
    d.add_argument("--peers", nargs="+", required=True, help="multiaddr(s) of any peer in the swarm")
    d.add_argument("--run-id", default="default", help="which run to show (default: %(default)s)")
    d.add_argument(
        "--port", type=bounded(int, min=0, max=65535), default=8080, help="TCP port; 0 = any free one "
        "(default: %(default)s)"
    )  # fmt: skip
    d.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 shows it to your network (default: %(default)s)",
    )
    d.add_argument("--swarm-key", default=None, help="the swarm's key file, when it has one")
    d.add_argument(
        "--join-timeout",
        type=flag_type("join_timeout"),
        default=_CFG_DEFAULTS["join_timeout"],
        help="seconds to reach the peers and read the run (default: %(default)s)",
    )

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
    """`export`, `eval`, `generate`: the trained model leaves the swarm.

    (node/swarm/export.py, node/model/evaluate.py)
    """
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
    e.add_argument(
        "--seed", type=flag_type("seed"), default=0, help="--checkpoints of a tiny model: its run seed"
    )
    e.add_argument(
        "--timeout",
        type=bounded(float, above=0),
        default=60.0,
        help="seconds per network wait (default: %(default)s)",
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
            g.add_argument(
                "--limit",
                type=bounded(int, min=0),
                default=0,
                help="score the first N examples only; 0 = all",
            )
        else:
            g.add_argument("--prompt", required=True, help="the text to continue")
        g.add_argument(
            "--max-new-tokens",
            type=bounded(int, min=1),
            default=32,
            help="generation budget (default: %(default)s)",
        )
        g.add_argument(
            "--device",
            default="auto",
            choices=["auto", "cuda", "cpu"],
            help="where the model runs; auto = cuda if present (default: %(default)s)",
        )
        g.add_argument(
            "--seed",
            type=bounded(int, min=0),
            default=0,
            help="built-in data / tiny models: seed (default: 0)",
        )


def add_swarm_model_out_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--eval",
        type=bounded(int, min=0),
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
        from node.model.evaluate import run_eval

        return run_eval(args)
    if args.cmd == "generate":
        from node.model.evaluate import run_generate

        return run_generate(args)
    from node.swarm.export import ExportError, export_from_checkpoints, export_from_peers

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


def resolve_defaults(args: argparse.Namespace) -> None:
    """The run flags whose default depends on others, filled in where the user left them unset."""
    if args.outer_every is None:  # DiLoCo rounds by default; SCAPE syncs every step instead
        args.outer_every = 0 if args.dp == "scape" else _CFG_DEFAULTS["outer_every"]
    if args.microbatch_tokens is None:  # by the device: only the run's first node's counts
        from node.model.devices import default_microbatch_tokens, pick_device

        # quiet: the node warns once about --device cuda without CUDA, when it picks its device
        args.microbatch_tokens = default_microbatch_tokens(pick_device(args.device, quiet=True))
    from node.stage.links import LAYOUT_FLAGS, lowrank_layout

    # by the frames it sends, and the flags the user gave win; another codec ignores the layout
    # (its flags stay at their defaults)
    if args.codec != "lowrank":
        return
    asked = (*LAYOUT_FLAGS, "lowrank_backward_bits", "pca_dtype", "lowrank_basis")
    mine = {n: getattr(args, n) for n in asked if n in given(args)}
    emulated = str(args.model or "").startswith("emulate:")  # node.stage.emulated: no entropy coding
    for name, value in lowrank_layout(args.microbatch_tokens, args.link, mine, emulated).items():
        setattr(args, name, value)  # "link" too: auto becomes the layout's name


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except FlagError as e:  # a flag refused as it was parsed: nothing has started
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "transformers", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not args.verbose else logging.INFO)
    if args.cmd in ("join", "swarm"):
        resolve_defaults(args)
    try:
        if args.cmd in ("join", "swarm"):
            check_run_flags(args)
        check_command_paths(args)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "join":
            from node.join import run_join

            return run_join(config_from_args(args))
        if args.cmd == "swarm":
            from node.local.launcher import run_swarm

            return run_swarm(args)
        if args.cmd == "status":
            from node.swarm.status import run_status

            return run_status(args)
        if args.cmd == "dashboard":
            from node.watch.dashboard import run_dashboard

            return run_dashboard(args)
        if args.cmd == "health":
            from node.swarm.health import run_health

            return run_health(args.state_dir)
        if args.cmd == "keygen":
            from protocol.auth import SwarmKeyError, key_id, make_swarm_key

            try:
                key = make_swarm_key(args.path)
            except SwarmKeyError as e:  # made meanwhile by another process
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"swarm key {key_id(key)} written to {args.path}; give it to every node as --swarm-key")
            return 0
        if args.cmd in ("export", "eval", "generate"):
            return run_model_out_command(args)
        if args.cmd == "prepare-model":
            from node.model.loading import prepare_bundled

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
