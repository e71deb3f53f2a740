"""All settings of a node in one typed place: every field carries its flag's help (node.argv
builds the CLI and the command lines of other nodes from them; nothing else reads flags).

The run's fields take their defaults from the run record's (``run_opt``: ``protocol.records.RunRecord``
and its typed parts in ``protocol.settings``), so each default is written once; ``run_parts``
turns them into the record's parts.

(Over 400 lines on purpose: one field per setting, each with its flag's help and range; split,
the one typed place for configuration would become several.)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol.records import RunRecord
from protocol.settings import DEFAULT_OUTER_EVERY, PARTS, part_defaults

NET, RUN, NODE = "network", "run", "this node"  # the CLI's flag groups
SUPPRESS = argparse.SUPPRESS  # a flag for the launchers only, hidden from --help


def default_state_dir() -> str:
    return os.environ.get("NODE_STATE_DIR", str(Path.home() / ".local" / "share" / "volunteer-node"))


def opt(
    default: Any = MISSING,
    *,
    help: str,
    group: str,
    factory: Any = MISSING,
    flag: str | None = None,
    choices: tuple | None = None,
    append: bool = False,
    run: str | None = None,
    resolved: bool = False,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
    parse: Any = None,
):
    """A NodeConfig field with its flag: ``flag`` defaults to --field-name; ``append``: repeatable;
    ``run``: the run record field it fills (see ``run_opt``); ``resolved``: left None on the command
    line and resolved after parsing (see node.cli.main).

    What the flag accepts is declared here and checked when the command line is parsed, before
    anything starts (node.argv.field_type: one line naming the flag, exit code 2): ``choices``;
    a number's range, ``min``/``max`` (inclusive) and ``above``/``below`` (exclusive); or
    ``parse``, a function from the flag's text to its value that raises ValueError saying what
    it expects (``stage_spec``)."""
    meta = {"help": help, "group": group, "flag": flag, "choices": choices, "append": append}
    limits = {"min": min, "max": max, "above": above, "below": below, "parse": parse}
    return field(
        default=default,
        default_factory=factory,
        metadata={**meta, **limits, "run": run, "resolved": resolved},
    )


def stage_spec(text: str) -> str:
    """``--stage``: 'auto' or a stage index, refused at parse time rather than after p2pd starts."""
    if text == "auto" or (text.isdigit() and text.isascii()):
        return text if text == "auto" else str(int(text))
    raise ValueError(f"must be auto or a stage index (0, 1, ...), got {text!r}")


def layers_spec(text: str) -> str:
    """``--stage-layers``: contiguous [start, end) layer ranges, ``0-8,8-16,16-30``, checked for form
    here and against the model's layer count when a run starts (``stage_layers``); '' is the default."""
    if text:
        stage_layers(text)
    return text


def stage_layers(text: str, num_layers: int | None = None) -> list[list[int]]:
    """``--stage-layers`` as ranges; ValueError saying what it expects if they are not contiguous
    ranges from layer 0 (and, given ``num_layers``, to the last layer)."""
    try:
        ranges = [[int(a), int(b)] for a, b in (part.split("-") for part in text.split(","))]
    except ValueError:
        raise ValueError(
            f"must be layer ranges START-END,START-END,... (e.g. 0-8,8-16,16-30), got {text!r}"
        ) from None
    ends = [0] + [b for _, b in ranges]
    if any(a != prev or b <= a for (a, b), prev in zip(ranges, ends)):
        raise ValueError(
            f"ranges must start at layer 0, each end where the next starts, none empty; got {text!r}"
        )
    if num_layers is not None and ranges[-1][1] != num_layers:
        raise ValueError(f"{text!r} ends at layer {ranges[-1][1]}, but the model has {num_layers} layers")
    return ranges


_RECORD_DEFAULTS = {f.name: f.default for f in fields(RunRecord) if f.default is not MISSING}


def run_opt(
    path: str,
    *,
    help: str,
    group: str = RUN,
    resolved: bool = False,
    choices: tuple | None = None,
    **limits: float,
):
    """A field of the run record (``"seed"``) or of one of its parts (``"outer.every"``): the
    default, and a part's choices and range (``protocol.settings._f``), are the record's;
    ``limits`` (min, max, above, below) give a top-level record field's range."""
    part, _, name = path.rpartition(".")
    if part:
        f = {f.name: f for f in fields(PARTS[part])}[name]
        default, choices = f.default, choices or f.metadata["choices"] or None
        limits = {k: f.metadata[k] for k in ("min", "max", "above")} | limits
    else:
        default = _RECORD_DEFAULTS[name]
    return opt(default, help=help, group=group, choices=choices, run=path, resolved=resolved, **limits)


@dataclass
class NodeConfig:
    peers: list[str] = opt(
        factory=list,
        help="multiaddrs of peers already in the swarm (/ip4/HOST/tcp/PORT/p2p/PEER_ID); without it, this "
        "node starts a new swarm",
        group=NET,
    )
    run_id: str = opt("default", help="which run of the swarm to join (default: %(default)s)", group=NET)
    new_run: bool = opt(
        False,
        help="with --peers: start --run-id on that DHT (e.g. a plain hivemind bootstrap peer) instead of "
        "joining it; refused if the run already exists",
        group=NET,
    )  # with --peers: start run_id on that DHT (refused if the run exists)
    stage: str = opt(
        "auto", help="'auto' claims the least-served stage, or a stage index", parse=stage_spec, group=NET
    )  # auto | stage index
    circuit: str = opt(
        "fast",
        help="fast: compressed links and training; anchor: dense, unmasked replica that feeds the fast "
        "peers' spectral filter (default: %(default)s)",
        choices=("fast", "anchor"),
        group=NET,
    )
    host: str = opt(
        "127.0.0.1",
        help="listen address; 0.0.0.0 to accept peers from other machines (default: %(default)s)",
        group=NET,
    )
    port: int = opt(
        0, help="listen TCP port; 0 picks a free one (default: %(default)s)", min=0, max=65535, group=NET
    )
    announce_maddrs: list[str] = opt(
        factory=list,
        help="address others should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT (repeatable)",
        flag="--announce-maddr",
        append=True,
        group=NET,
    )
    identity: str | None = opt(
        None,
        help="private key file for a stable peer id (made 0600 if missing; default: STATE_DIR/identity.key)",
        group=NET,
    )
    swarm_key: str | None = opt(
        None,
        help="file holding the swarm's shared secret (chmod 600; make one with `python -m node keygen "
        "FILE`): only nodes with the key get frames accepted",
        group=NET,
    )  # file with the shared secret; frames without its tag are refused
    client_mode: bool = opt(
        False, help="do not accept incoming DHT connections (behind NAT with no forwarded port)", group=NET
    )
    use_relay: bool = opt(
        True,
        help="disable libp2p circuit relays (on by default: lets peers behind NAT reach each other)",
        flag="--no-relay",
        group=NET,
    )
    use_auto_relay: bool = opt(
        False, help="look for relays automatically and announce relayed addresses (behind NAT)", group=NET
    )
    reachability: str = opt(
        "auto",
        help="auto: peers dial this node back at start and it runs behind-NAT mode if they cannot; "
        "direct: peers can dial it (a public address or a forwarded port); nat: it cannot be dialled, "
        "so it dials the peers that send it work and keeps those connections open (default: "
        "%(default)s)",
        choices=("auto", "direct", "nat"),
        group=NET,
    )  # node.net.reach decides, node.swarm.reverse keeps the connections
    relay_service: bool = opt(
        True,
        help="do not carry streams between peers behind NAT (a reachable node does by default: two "
        "volunteers behind routers can then train next to each other)",
        flag="--no-relay-service",
        group=NET,
    )  # node.net.relay
    relay_rate: float = opt(
        0.0,
        help="cap on the bytes this node relays for others, in Mbit/s, both directions together (0: no "
        "cap; default: %(default)s)",
        min=0.0,
        group=NET,
    )
    p2pd_timeout: float = opt(
        15.0, help="seconds to wait for the p2p daemon to start (default: %(default)s)", above=0, group=NET
    )  # p2pd start-up; the most common failure of hivemind swarms
    join_timeout: float = opt(
        30.0,
        help="seconds to reach the bootstrap peers and read the run (default: %(default)s)",
        above=0,
        group=NET,
    )  # reaching the bootstrap peers and reading the run record
    hop_timeout: float = opt(
        30.0,
        help="seconds one pipeline hop may take before it is retried elsewhere (default: %(default)s)",
        above=0,
        group=NODE,
    )  # one hop's compute + reply, multiplied by the hops still ahead
    model: str = opt(
        "bundled",
        help="'bundled' (SmolLM2-135M-Instruct, offline), 'tiny[:LAYERS]' (random init, for tests), a Hub "
        "id (owner/name, fetched once) or a local Llama/Qwen2/Qwen3/Mistral checkpoint; joiners pass "
        "the same --model (the join command the first node prints carries it) (default: %(default)s)",
        group=RUN,
    )
    stages: int = opt(2, help="pipeline stages of a new run (default: %(default)s)", min=1, max=64, group=RUN)
    stage_layers: str = opt(
        "",
        help="a new run's split by hand, one START-END decoder-layer range per stage, e.g. "
        "0-8,8-16,16-23,23-30 (as many ranges as --stages; default: balanced by estimated cost)",
        parse=layers_spec,
        group=RUN,
    )
    codec: str = opt(
        "lowrank",
        help="pipeline-link codec; 'subspace' needs --mode pretrain and --subspace-rank (default: "
        "%(default)s)",
        choices=("dense", "mask", "pca", "lowrank", "topk", "int8", "int4", "bottleneck", "subspace"),
        group=RUN,
    )
    link: str = opt(
        "auto",
        help="lowrank codec: the link layout, for the lowrank flags left unset: stepped (~20x below dense "
        "at 2048-token frames: --codec-k 112 --lowrank-k-backward 128 --lowrank-step 1 "
        "--lowrank-basis-step 1 --lowrank-first-gain 8 --lowrank-entropy on --lowrank-repeats on), "
        "tiered (24x8,88x4 tiers, ~10x), plain (80 directions at 8 bits); auto = stepped with "
        "--microbatch-tokens >= 2048, else plain (default: %(default)s)",
        choices=("auto", "stepped", "tiered", "plain"),
        group=RUN,
    )  # node.stage.links.pick_link
    wire_dtype: str = opt(
        "bfloat16",
        help="dtype of dense link payloads (default: %(default)s)",
        choices=("float32", "bfloat16", "float16"),
        group=RUN,
    )
    mask_rate: float = opt(
        0.95,
        help="mask codec: share of hidden channels dropped per token (default: %(default)s)",
        min=0,
        below=1,
        group=RUN,
    )
    mask_rescale: bool = opt(
        False, help="mask codec: scale kept channels by 1/(1-rate) (unbiased; off as in the paper)", group=RUN
    )
    codec_k: int = opt(
        0,
        help="pca/lowrank/topk/bottleneck: coefficients or channels per token; 0 = the codec's own "
        "(lowrank 80, pca/topk/bottleneck 96) (default: %(default)s)",
        min=0,
        group=RUN,
    )  # 0: node.stage.links.DEFAULT_K for the codec
    pca_dtype: str = opt(
        "int8",
        help="pca/lowrank codecs: coefficient dtype; int8 uses per-block scales (default: %(default)s)",
        choices=("int8", "bfloat16", "float32"),
        group=RUN,
    )  # pca / lowrank coefficients
    lowrank_basis: str = opt(
        "int8",
        help="lowrank codec: dtype of the basis each frame carries; int8 uses a bf16 scale per 32 entries "
        "(about half the basis bytes of bfloat16) (default: %(default)s)",
        choices=("bfloat16", "int8", "float32"),
        group=RUN,
    )  # lowrank: the per-frame basis' dtype
    lowrank_k_backward: int = opt(
        0,
        help="lowrank codec: directions of the backward (gradient) frames; 0 = the forward's k "
        "(default: %(default)s)",
        min=0,
        group=RUN,
    )  # lowrank: the gradient's own k (its spectrum is flatter than the activations')
    lowrank_backward_bits: int = opt(
        8,
        help="lowrank codec: bits of the backward's coefficients; 4 adds a scale per direction "
        "(default: %(default)s)",
        choices=(4, 8),
        group=RUN,
    )  # lowrank: 4 = twice the gradient directions for the same bytes
    lowrank_tiers: str = opt(
        "",
        help="lowrank codec: coefficient tiers of falling precision, both directions, as DIRSxBITS,... "
        "(e.g. 24x8,88x4: 112 directions for the bytes of 80 at 8 bits; bits 8, 4 or 2); overrides "
        "--codec-k; empty = --codec-k directions at 8 bits (default: 24x8,88x4 with --microbatch-tokens "
        ">= 2048, else empty)",
        group=RUN,
        resolved=True,
    )  # lowrank: more directions at fewer bits past the first few dozen; node.stage.links.lowrank_layout
    lowrank_backward_tiers: str = opt(
        "",
        help="lowrank codec: the backward's own tiers, DIRSxBITS,... (e.g. 12x8,36x4), with "
        "--lowrank-tiers for the forward; empty = the forward's (default: empty)",
        group=RUN,
    )  # each direction its own budget; the 20x link gives the gradient more (bench/results/quality.md)
    lowrank_step: float = opt(
        0.0,
        help="lowrank codec: code both directions' coefficients at one uniform step, this fraction of the "
        "k-th direction's RMS, instead of tiers, so entropy coding gives each direction bits by its energy "
        "(needs --lowrank-entropy on; --codec-k and --lowrank-k-backward set the directions; 1.0 with "
        "--codec-k 112 --lowrank-k-backward 128 --lowrank-basis-step 1 --lowrank-first-gain 8 is the ~20x "
        "link); 0 = off (default: %(default)s)",
        min=0,
        max=64,
        group=RUN,
    )  # lowrank: compression/stepped.py
    lowrank_backward_step: float = opt(
        0.0,
        help="lowrank codec: the backward's own step, with --lowrank-step for the forward; 0 = the "
        "forward's (default: %(default)s)",
        min=0,
        max=64,
        group=RUN,
    )  # lowrank: gradients may take a coarser step than activations
    lowrank_basis_step: float = opt(
        0.0,
        help="lowrank codec: with --lowrank-step, quantise the int8 basis no finer than this times the "
        "coefficients' step over the direction's norm, so weak directions' basis entries take 2-3 bits "
        "instead of 8 (~1/3 of the basis bytes saved at 1.0, the frame's error up ~1%%); 0 = off "
        "(default: %(default)s)",
        min=0,
        max=64,
        group=RUN,
    )  # lowrank: compression.lowrank.LowRankCodec.basis_step
    lowrank_first_gain: float = opt(
        0.0,
        help="lowrank codec: multiply the backward's first position of every sequence by this before "
        "coding and divide after, so the attention sink's small but weighty gradient is kept (8 cuts "
        "the second stage's weight-gradient error ~6x at the same bytes); 0 = off (default: %(default)s)",
        min=0,
        max=1024,
        group=RUN,
    )  # lowrank: compression.lowrank.LowRankCodec.first_gain
    lowrank_centre: str = opt(
        "mean",
        help="lowrank codec: the forward's per-frame centre; median keeps a pretrained LM's few "
        "sink rows from offsetting every other row (default: %(default)s)",
        choices=("mean", "median"),
        group=RUN,
    )  # lowrank: the forward's centre
    lowrank_first: str = opt(
        "shared",
        help="lowrank codec: each sequence's first position (a pretrained LM's attention sink, ~100x "
        "the others' norm) in the frame's shared code, or apart in its own, so the shared basis and "
        "mean fit the other rows (default: apart with --microbatch-tokens >= 2048, else shared)",
        choices=("shared", "apart"),
        group=RUN,
        resolved=True,
    )  # lowrank: the sink position in the shared code or its own; node.stage.links.lowrank_layout
    lowrank_entropy: str = opt(
        "off",
        help="lowrank codec: entropy code the integer fields (int8 basis, 8- and 4-bit codes) with each "
        "frame's own histogram; lossless (the same decoded tensors, 7-13%% fewer bytes at 2048-token "
        "frames) for ~10-17 ms of CPU per frame at each end: for slow links (default: %(default)s)",
        choices=("off", "on"),
        group=RUN,
        resolved=True,
    )  # lowrank: a lossless stage after the codes (compression.entropy); node.stage.links.lowrank_layout
    lowrank_repeats: str = opt(
        "off",
        help="lowrank codec: send a row whose codes repeat an earlier row's (sequences sharing their first "
        "tokens) as an 8-byte reference; lossless, ~1 ms of CPU per 2048-token frame "
        "(default: %(default)s)",
        choices=("off", "on"),
        group=RUN,
        resolved=True,
    )  # lowrank: repeated rows once (compression.repeats); node.stage.links.lowrank_layout
    lowrank_fit: str = opt(
        "all",
        help="lowrank codec: the rows the forward's basis is fitted to: all alike, or loss-share (the "
        "positions the loss reads, e.g. a fine-tuning answer, weighted to half the fit; no extra bytes; "
        "learnt the word task worse in 100-step runs, bench/results/quality.md) (default: %(default)s)",
        choices=("all", "loss-share"),
        group=RUN,
    )  # lowrank: where the forward's basis spends its directions
    calibration_tokens: int = opt(
        2048,
        help="tokens the run's starter uses to fit a basis codec (default: %(default)s)",
        min=1,
        group=RUN,
    )  # tokens the run's starter uses to fit a basis codec
    dense_every: int = run_opt(
        "dense_every",
        help="send every K-th step uncompressed (periodic clean step); 0 = never (default: %(default)s)",
        min=0,
        group=RUN,
    )
    outer_every: int = run_opt(
        "outer.every",
        help="DiLoCo: inner steps between outer rounds in which the replicas of a stage average their "
        "pseudo-gradients (a stage with one replica skips them); 0 = never "
        f"(default: {DEFAULT_OUTER_EVERY}, 0 with --dp scape)",
        resolved=True,
        group=RUN,
    )
    powersgd_rank: int = run_opt(
        "outer.rank",
        help="rank of the PowerSGD-compressed pseudo-gradients; 0 = uncompressed (default: %(default)s)",
        group=RUN,
    )  # 0 = uncompressed pseudo-gradients
    outer_bits: int = run_opt(
        "outer.bits",
        help="bits of the numbers an outer round sends: 32 (fp32), or 8/4 (blockwise, with error "
        "feedback; ~3.9x/7.5x fewer bytes) (default: %(default)s)",
        group=RUN,
    )
    outer_overlap: bool = run_opt(
        "outer.overlap",
        help="inner steps go on while an outer round averages (as Streaming DiLoCo); the round's "
        "update lands a few steps late, on top of what the replica learned meanwhile",
        group=RUN,
    )
    group_size: int = run_opt(
        "outer.group_size",
        help="replicas per gossip group in an outer round (default: %(default)s)",
        group=RUN,
    )
    outer_lr: float = run_opt("outer.lr", help="outer Nesterov lr (default: %(default)s)", group=RUN)
    outer_momentum: float = run_opt(
        "outer.momentum", help="outer Nesterov momentum (default: %(default)s)", group=RUN
    )
    outer_mode: str = run_opt(
        "outer.mode",
        help="outer optimizer: DiLoCo's Nesterov, or GASLoC's mixed momentum (default: %(default)s)",
        group=RUN,
    )
    outer_timeout: float = run_opt(
        "outer.timeout",
        help="seconds an outer round may take before it is skipped (default: %(default)s)",
        group=RUN,
    )
    finetune: str = run_opt(
        "finetune.mode",
        help="full: train every weight of a stage; lora: train LoRA adapters (the peft library) over a "
        "frozen base, so a stage of a large model fits a home GPU and only the adapters travel between "
        "replicas, into checkpoints and out in export (default: %(default)s)",
        group=RUN,
    )
    lora_rank: int = run_opt("finetune.rank", help="--finetune lora: adapter rank r (default: %(default)s)")
    lora_alpha: float = run_opt(
        "finetune.alpha",
        help="--finetune lora: scale alpha (updates scaled by alpha/r) (default: %(default)s)",
    )
    lora_targets: str = run_opt(
        "finetune.targets",
        help="--finetune lora: comma-separated names of the linear layers that get adapters (default: "
        "%(default)s)",
    )
    lora_dropout: float = run_opt(
        "finetune.dropout", help="--finetune lora: dropout on the adapters' input (default: %(default)s)"
    )
    mode: str = run_opt(
        "mode",
        help="finetune: train --model as loaded; pretrain: build a Llama-style model from scratch from "
        "--model's config (tiny[:L[:H]], small, or a checkpoint directory's config.json) with the "
        "run seed, next-token loss on every position (default: %(default)s)",
        choices=("finetune", "pretrain"),
        group=RUN,
    )  # finetune | pretrain (a Llama-style model built from scratch with the run seed)
    subspace_rank: int = opt(
        0,
        help="--codec subspace: k, the numbers per token each boundary carries (Subspace Networks; the "
        "model is built with the constraint) (default: %(default)s)",
        min=0,
        group=RUN,
    )  # --codec subspace: k numbers per token at every boundary (needs pretrain)
    dp: str = run_opt(
        "dp.mode",
        help="data parallelism among replicas of a stage: diloco (outer rounds every --outer-every steps) "
        "or scape (AdamS, sparse sync of --density of the coordinates every inner step) (default: "
        "%(default)s)",
        group=RUN,
    )  # diloco (outer rounds, --outer-every) | scape (sparse sync every inner step)
    density: float = run_opt(
        "dp.density",
        help="--dp scape: share of every tensor's coordinates synchronised per step (default: %(default)s)",
        group=RUN,
    )  # scape: share of each tensor's coordinates synchronised per step
    dp_timeout: float = run_opt(
        "dp.timeout",
        help="--dp scape: seconds to wait for the other replicas' step before going on alone (default: "
        "%(default)s)",
        group=RUN,
    )  # scape: seconds to wait for the other replicas' step before going alone
    ap_alpha: float = run_opt(
        "anchor.alpha",
        help="anchor priors: weight of the raw masked gradient, 1 = filter off (default: %(default)s)",
        group=RUN,
    )
    ap_tau: float = run_opt(
        "anchor.tau", help="anchor priors: spectral shrinkage d = s/(s+tau) (default: %(default)s)", group=RUN
    )
    ap_beta: float = run_opt(
        "anchor.beta", help="anchor priors: EMA factor of anchor gradients (default: %(default)s)", group=RUN
    )
    ap_tau_relative: bool = run_opt(
        "anchor.tau_relative",
        help="anchor priors: tau relative to the top singular value (deviation from the paper)",
        group=RUN,
    )
    ap_max_staleness: int = run_opt(
        "anchor.max_staleness",
        help="drop anchor packets older than this many fast steps (default: %(default)s)",
        group=RUN,
    )
    anchor_pull_every: int = run_opt(
        "anchor.pull_every",
        help="anchors re-pull weights once they are this many fast steps old (default: %(default)s)",
        group=RUN,
    )
    anchor_rank: int = run_opt(
        "anchor.rank",
        help="rank of the gradient factors an anchor sends per matrix (default: %(default)s)",
        group=RUN,
    )
    seed: int = run_opt("seed", help="run seed: masks, init of tiny models (default: %(default)s)", group=RUN)
    lr: float = run_opt("lr", help="inner AdamW learning rate (default: %(default)s)", min=0, group=RUN)
    weight_decay: float = run_opt(
        "weight_decay", help="AdamW weight decay (default: %(default)s)", min=0, group=RUN
    )
    clip: float = run_opt("clip", help="gradient-norm clip (default: %(default)s)", above=0, group=RUN)
    seq_len: int = run_opt(
        "seq_len", help="max tokens per sequence (default: %(default)s)", min=1, max=65536, group=RUN
    )
    microbatch: int = run_opt(
        "microbatch", help="sequences per microbatch (default: %(default)s)", min=1, max=4096, group=RUN
    )
    microbatch_tokens: int = run_opt(
        "microbatch_tokens",
        help="pack each microbatch by tokens: as many examples as fit in this many padded tokens, so "
        "short examples still fill a frame and a per-frame cost (the lowrank basis) is spread over "
        "them; 0 = --microbatch examples each (default: 2048 when the run's first node has a GPU, "
        "0 on a CPU)",
        resolved=True,
        min=0,
        max=2**20,
        group=RUN,
    )  # resolved in node.cli.main: node.model.devices.default_microbatch_tokens
    batch_tokens: int = run_opt(
        "batch_tokens",
        help="tokens a node accumulates before each inner optimizer step (default: %(default)s)",
        min=1,
        group=RUN,
    )
    data: str = opt(
        "arithmetic",
        help="training data for the head: 'arithmetic' (built in) or a .jsonl of {text} / {prompt, "
        "completion} records, or a plain-text file (default: %(default)s)",
        group=NODE,
    )
    device: str = opt(
        "auto",
        help="compute device; auto picks CUDA when present (default: %(default)s)",
        choices=("auto", "cuda", "cpu"),
        group=NODE,
    )
    base_dtype: str = opt(
        "auto",
        help="--finetune lora: the frozen base's dtype on this node; auto = bf16 on CUDA, fp32 on the "
        "CPU (where bf16 matmuls are slower); nf4 = the decoder layers' linear weights in 4 bits "
        "(QLoRA, needs bitsandbytes), the rest as auto; the adapters stay fp32 (default: %(default)s)",
        choices=("auto", "fp32", "bf16", "nf4"),
        group=NODE,
    )
    threads: int = opt(0, help="torch CPU threads, 0 = torch default", min=0, group=NODE)
    max_memory_gb: float = opt(
        0.0,
        help="GiB this node may use: it claims only a stage whose estimate fits, and refuses with a "
        "message when none does; 0 = no limit (default: %(default)s)",
        flag="--max-memory",
        min=0,
        group=NODE,
    )
    max_host_memory_gb: float = opt(
        0.0,
        help="GiB of host RAM this node may use beyond the device's share (outer state, checkpoint "
        "copies; on a CPU node the stage's own memory too): stages whose estimate exceeds it are "
        "not claimed; 0 = no limit (default: %(default)s)",
        flag="--max-host-memory",
        min=0,
        group=NODE,
    )
    recompute_layers: bool = opt(
        False,
        help="activation checkpointing: keep only each layer's input per microbatch in flight and "
        "recompute the layer in backward (about a third more compute, a fraction of the activation "
        "memory: the memory estimate counts it)",
        group=NODE,
    )
    max_inflight: int = opt(
        4, help="cap on microbatches this node holds in flight (default: %(default)s)", min=1, group=NODE
    )
    wait_peers: int = opt(
        0,
        help="head only: wait until this many peers are ready before training (default: %(default)s)",
        min=0,
        group=NODE,
    )  # head: start driving data once this many peers are ready (local swarms)
    max_steps: int = opt(
        0,
        help="leave after this many inner steps; 0 = run until stopped (default: %(default)s)",
        min=0,
        group=NODE,
    )  # stop after this many inner steps (0 = run until stopped)
    state_dir: str = opt(
        factory=default_state_dir,
        help="identity key, checkpoints and health file (default: $NODE_STATE_DIR or "
        "~/.local/share/volunteer-node)",
        group=NODE,
    )
    metrics_file: str | None = opt(None, help="write live metrics as JSON here", group=NODE)
    dashboard: int = opt(
        0,
        help="serve the live dashboard (the swarm as this node sees it) on this TCP port; "
        "0 = off (default: %(default)s)",
        min=0,
        max=65535,
        group=NODE,
    )  # read-only: the page, /api/state and /metrics (node/watch)
    dashboard_host: str = opt(
        "127.0.0.1",
        help="address the dashboard binds; 0.0.0.0 shows it to your network (default: %(default)s)",
        group=NODE,
    )
    checkpoint_every: int = opt(
        50,
        help="inner steps between atomic checkpoints in STATE_DIR/checkpoints (one is also written on "
        "SIGTERM/Ctrl-C); 0 = never (default: %(default)s)",
        min=0,
        group=NODE,
    )  # inner steps between checkpoints (and one at exit); 0 = never
    eval_every: int = opt(
        0,
        help="a tail scores the loss of a small held-out set of --data (examples a head with this "
        "flag above 0 leaves out of its training data) every N of its inner steps, beside training, "
        "and the dashboard charts it; each score pulls the other stages' weights (bf16, adapters only "
        "under LoRA) at most every 20 s, so it is off on a joined node unless asked for and on in "
        "`swarm` (loopback); 0 = off; give every node the same value and --data, as `swarm` does "
        "(default: %(default)s)",
        min=0,
        group=NODE,
    )  # node.stage.heldout: scored in a task and a thread of its own, never in the step
    keep_checkpoints: int = opt(
        2,
        help="complete checkpoints kept per stage; older ones are deleted once a newer one is on disk "
        "(each holds the stage's weights and optimizer state) (default: %(default)s)",
        min=1,
        max=1000,
        group=NODE,
    )  # one is enough to resume (a save is atomic); two survive a newest one that fails to verify
    resume: bool = opt(
        False,
        help="continue from this node's newest complete checkpoint of the run (same stage, weights, "
        "optimizer and filter state, step count)",
        group=NODE,
    )  # continue from this node's newest checkpoint of the run
    ready_file: str | None = opt(
        None, help=SUPPRESS, group=NODE
    )  # written once the stage is claimed (used by `swarm`)
    heartbeat_s: float = opt(
        2.0,
        help="seconds between stage-record heartbeats (default: %(default)s)",
        flag="--heartbeat",
        min=0.1,
        group=NODE,
    )
    rebalance: bool = opt(
        True,
        help="stay on the claimed stage: never move to a stage left empty or far below the others in "
        "throughput (moving is on by default with --stage auto)",
        flag="--no-rebalance",
        group=NODE,
    )  # move to an empty or starved stage when that lifts the bottleneck


def _run_fields() -> list:
    return [f for f in fields(NodeConfig) if f.metadata["run"]]


def run_parts(cfg: NodeConfig) -> dict[str, Any]:
    """The run record's fields that come straight from the config: the typed parts and the scalars."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
    for f in _run_fields():
        part, _, name = f.metadata["run"].rpartition(".")
        (parts[part] if part else top)[name] = getattr(cfg, f.name)
    return {**top, **{name: PARTS[name](**kw) for name, kw in parts.items()}}


# every part field has exactly one config field (a new part field without one fails at import)
for _name, _cls in PARTS.items():
    _mapped = {f.metadata["run"] for f in fields(NodeConfig)} & {f"{_name}.{k}" for k in part_defaults(_cls)}
    assert len(_mapped) == len(part_defaults(_cls)), f"{_name} settings without a NodeConfig field"
