"""The join flags come from NodeConfig's fields, and config_to_argv writes a config back as them."""

import argparse
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

from compression.codec import LinkContext
from node.argv import config_from_args, config_to_argv, flag_of
from node.cli import build_parser
from node.config import NodeConfig
from node.local.launcher import node_command

# every flag join had before its flags were built from the fields (users' scripts pass them)
JOIN_FLAGS_BEFORE = """
--anchor-pull-every --anchor-rank --announce-maddr --ap-alpha --ap-beta --ap-max-staleness --ap-tau
--ap-tau-relative --batch-tokens --checkpoint-every --circuit --client-mode --clip --codec --codec-k
--data --dense-every --density --device --dp --dp-timeout --group-size --heartbeat --hop-timeout
--host --identity --join-timeout --lowrank-basis --lr --mask-rate --mask-rescale --max-inflight
--max-memory --max-steps --metrics-file --microbatch --mode --model --new-run --no-rebalance
--no-relay --outer-every --outer-lr --outer-mode --outer-momentum --outer-timeout --p2pd-timeout
--pca-dtype --peers --port --powersgd-rank --ready-file --resume --run-id --seed --seq-len --stage
--stages --state-dir --subspace-rank --swarm-key --threads --use-auto-relay --wait-peers
--weight-decay --wire-dtype
""".split()


def _sub(cmd: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[cmd]


def _parse(argv: list[str]) -> NodeConfig:
    return config_from_args(build_parser().parse_args(["join", *argv]))


def test_every_field_has_one_documented_flag_and_every_flag_a_field():
    actions = {a.dest: a for a in _sub("join")._actions if a.dest != "help"}
    names = {f.name for f in fields(NodeConfig)}
    assert set(actions) == names
    for f in fields(NodeConfig):
        a = actions[f.name]
        assert a.option_strings == [flag_of(f)] and a.help and a.help.strip(), f.name
    assert set(JOIN_FLAGS_BEFORE) <= {o for a in actions.values() for o in a.option_strings}


def test_no_flags_is_the_default_config():
    assert _parse([]) == NodeConfig()


def _other(f, value):
    """A valid value of field ``f`` different from ``value``."""
    kind = typing.get_type_hints(NodeConfig)[f.name]
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != value)
    if kind is bool:
        return not value
    if kind is int:
        return value + 3
    if kind is float:  # within the field's declared range (node.config.opt: max, below)
        capped = f.metadata["max"] is not None or f.metadata["below"] is not None
        return (value / 2 if value else 0.25) if capped else value * 2 + 0.5
    if typing.get_origin(kind) is list:
        return ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]
    return {"stage": "1", "stage_layers": "0-1,1-2"}.get(f.name, f"x-{f.name}")


def test_config_to_argv_to_config_is_identity_for_every_non_default():
    defaults = NodeConfig()
    cfg = NodeConfig(**{f.name: _other(f, getattr(defaults, f.name)) for f in fields(NodeConfig)})
    assert all(getattr(cfg, f.name) != getattr(defaults, f.name) for f in fields(NodeConfig))
    assert _parse(config_to_argv(cfg)) == cfg
    # one field at a time too: no flag leans on another's presence
    for f in fields(NodeConfig):
        one = NodeConfig(**{f.name: getattr(cfg, f.name)})
        argv = config_to_argv(one)
        assert _parse(argv) == one, (f.name, argv)
        assert flag_of(f) in argv


def test_defaults_are_left_out_unless_pinned():
    assert config_to_argv(NodeConfig()) == []
    assert config_to_argv(NodeConfig(lr=0.5), names=["seed"]) == []
    assert config_to_argv(NodeConfig(), always=["codec", "seed", "resume"]) == [
        "--codec",
        "lowrank",
        "--seed",
        "0",
    ]
    with pytest.raises(ValueError, match="no NodeConfig fields"):
        config_to_argv(NodeConfig(), always=["codecs"])


def test_swarm_node_command_carries_the_swarm_settings():
    args = build_parser().parse_args(
        [
            "swarm",
            "--nodes",
            "2",
            "--model",
            "tiny:2",
            "--stages",
            "1",
            "--codec",
            "mask",
            "--mask-rate",
            "0.5",
        ]
        + ["--dp", "scape", "--lr", "0.01", "--hop-timeout", "7", "--no-rebalance", "--data", "stdlib"]
    )
    cmd = node_command(args, 0, Path("/tmp/n0"), "rid", ["/ip4/127.0.0.1/tcp/9"], "anchor")
    assert cmd[1:4] == ["-m", "node", "join"]
    cfg = _parse(cmd[4:])
    assert (cfg.model, cfg.stages, cfg.codec, cfg.mask_rate, cfg.dp, cfg.lr) == (
        "tiny:2",
        1,
        "mask",
        0.5,
        "scape",
        0.01,
    )
    # --dp scape without --outer-every: the node resolves it to 0 (not DiLoCo's 10 next to scape)
    assert "--outer-every" not in cmd
    assert (cfg.hop_timeout, cfg.rebalance, cfg.data, cfg.circuit, cfg.run_id) == (
        7.0,
        False,
        "stdlib",
        "anchor",
        "rid",
    )
    assert (cfg.state_dir, cfg.metrics_file, cfg.peers) == (
        "/tmp/n0",
        "/tmp/n0/metrics.json",
        ["/ip4/127.0.0.1/tcp/9"],
    )
    assert (cfg.heartbeat_s, cfg.wait_peers, cfg.threads) == (1.0, 2, 1)
    assert all(f.default is not MISSING or f.default_factory is not MISSING for f in fields(NodeConfig))


def test_lowrank_tiers_flag_is_checked_and_reaches_the_codec():
    from compression.registry import make_codec
    from node.cli import FlagError, check_run_flags
    from node.stage.links import codec_settings

    args = build_parser().parse_args(["join", "--lowrank-tiers", "24x3,88x4"])
    with pytest.raises(FlagError, match="--lowrank-tiers '24x3,88x4': expected DIRSxBITS"):
        check_run_flags(args)
    cfg = _parse(["--lowrank-tiers", "24x8,88x4", "--lowrank-centre", "median"])
    desc = codec_settings(cfg)
    assert desc["tiers"] == desc["backward_tiers"] == [[24, 8], [88, 4]] and desc["centre"] == "median"
    codec = make_codec(desc.pop("codec"), **desc)
    assert codec.frame_bytes(2048, 576, "forward") == make_codec(
        "lowrank", tiers=((24, 8), (88, 4)), centre="median", basis_dtype="int8", basis_block=32
    ).frame_bytes(2048, 576, "forward")


def test_lowrank_settings_whose_frames_a_node_would_refuse_are_refused_at_the_flags():
    """Three tiers, the first positions apart and both lossless stages write more tensors per
    forward frame than a receiver accepts: every microbatch would be refused, so the flags are.
    The count is checked against the receiver itself: a real word-sized frame of each setting,
    its sparse labels in, through protocol.frames."""
    from node.cli import FlagError
    from node.stage.links import build_codec, codec_settings
    from protocol.frames import Frame, MalformedFrame, decode_frame, encode_frame, pack_labels

    lossless = ["--lowrank-first", "apart", "--lowrank-entropy", "on", "--lowrank-repeats", "on"]

    def frame(desc: dict) -> bytes:
        h = torch.randn(8, 29, 576, generator=torch.Generator().manual_seed(1))
        labels = torch.full((8, 29), -100)
        labels[:, -3:] = 7  # the answers: a few labelled positions per sequence (sparse layout)
        payload = build_codec(desc).encode_forward(h, LinkContext())
        tensors = {**payload, **pack_labels(labels, 49152)}
        return encode_frame(Frame("forward", "r", codec="lowrank", shape=[8, 29, 576], tensors=tensors))

    with pytest.raises(FlagError, match="would carry 18 tensors, more than the 16") as e:
        _checked(["join", "--lowrank-tiers", "12x8,36x4,40x2", *lossless])
    assert "\n" not in str(e.value)
    refused = codec_settings(_parse(["--lowrank-tiers", "12x8,36x4,40x2", *lossless]))
    with pytest.raises(MalformedFrame, match="tensors must be a small map"):
        decode_frame(frame(refused))
    # two tiers with the same stages fit, and so do three tiers without them
    for flags in (["--lowrank-tiers", "16x8,64x4", *lossless], ["--lowrank-tiers", "12x8,36x4,40x2"]):
        assert decode_frame(frame(codec_settings(_checked(["join", *flags])))).kind == "forward"


def test_backward_tiers_give_the_backward_its_own_budget_as_the_bench_measured_it():
    """The 20x candidate of bench/results/quality.md is what these flags make a node run: its
    description equals the bench variant's, and the backward frame costs what that variant's does."""
    from bench.quality.quality_codecs import build_codec as bench_codec
    from bench.quality.quality_tasks import VARIANTS
    from node.cli import FlagError
    from node.stage.links import build_codec, codec_settings

    flags = ["--lowrank-tiers", "16x8,64x4", "--lowrank-backward-tiers", "12x8,36x4"]
    lossless = ["--lowrank-entropy", "on", "--lowrank-repeats", "on"]
    desc = codec_settings(_checked(["join", "--microbatch-tokens", "2048", *flags, *lossless]))
    bench = bench_codec(VARIANTS["lowrankt16-64a-b12-36+er"])
    assert desc == {**bench.describe(), "k": desc["k"]}  # k: unused where tiers set the directions
    assert desc["tiers"] == [[16, 8], [64, 4]] and desc["backward_tiers"] == [[12, 8], [36, 4]]
    node = build_codec(desc)
    for direction in ("forward", "backward"):
        assert node.frame_bytes(2030, 576, direction, 70) == bench.frame_bytes(2030, 576, direction, 70)
    assert node.frame_bytes(2030, 576, "backward", 70) < 0.7 * node.frame_bytes(2030, 576, "forward", 70)
    with pytest.raises(FlagError, match="needs --lowrank-tiers for the forward"):
        _checked(["join", "--microbatch-tokens", "0", "--lowrank-backward-tiers", "12x8,36x4"])
    with pytest.raises(FlagError, match="--lowrank-backward-tiers '12x3': expected DIRSxBITS"):
        _checked(["join", "--microbatch-tokens", "2048", "--lowrank-backward-tiers", "12x3"])


def test_a_uniform_step_link_is_what_the_bench_measured_and_its_contradictions_are_refused():
    """``--lowrank-step`` with its k's makes a node run the bench's stepped variant (its description
    equal, its frames equal byte for byte on a word-shaped frame); the flags that contradict it, or
    leave its codes unsized, are refused in one line."""
    from bench.quality.quality_codecs import build_codec as bench_codec
    from bench.quality.quality_tasks import VARIANTS
    from node.cli import FlagError
    from node.stage.links import build_codec, codec_settings

    step = ["--codec-k", "104", "--lowrank-k-backward", "64", "--lowrank-step", "1"]
    lossless = ["--lowrank-entropy", "on", "--lowrank-repeats", "on"]
    plain_basis = ["--lowrank-basis-step", "0", "--lowrank-first-gain", "0"]  # the variant has neither
    desc = codec_settings(_checked(["join", "--microbatch-tokens", "2048", *step, *lossless, *plain_basis]))
    bench = bench_codec(VARIANTS["lowrankq104-64s1a+er"])
    assert desc == bench.describe() and "tiers" not in desc
    node = build_codec(desc)
    h = torch.randn(70, 29, 576, generator=torch.Generator().manual_seed(4)) * torch.logspace(1, -1, 576)
    for enc in ("encode_forward", "encode_backward"):
        a, b = getattr(node, enc)(h, LinkContext()), getattr(bench, enc)(h, LinkContext())
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), enc
    assert codec_settings(_checked(["join", "--microbatch-tokens", "2048", *step, *lossless,
                                    "--lowrank-backward-step", "2"]))["backward_step"] == 2.0  # fmt: skip
    for flags, says in (
        ([*step], "add --lowrank-entropy on"),
        ([*step, *lossless, "--lowrank-tiers", "24x8,88x4"], "leave out one of the two"),
        ([*lossless, "--lowrank-backward-step", "2"], "needs --lowrank-step"),
        (["--codec", "dense", "--lowrank-step", "1"], "does nothing with --codec dense"),
        ([*step, *lossless, "--pca-dtype", "bfloat16"], "codes int8 steps"),
    ):
        with pytest.raises(FlagError, match=says) as e:
            _checked(["join", "--microbatch-tokens", "0", *flags])  # no layout fills in the gap
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("k_backward", [96, 128])
def test_a_stepped_basis_with_gained_sinks_is_what_the_bench_measured_and_needs_its_step(k_backward):
    """``--lowrank-basis-step`` and ``--lowrank-first-gain`` make a node run the bench's
    ``lowrankq112-96s1v1g8a+er`` and ``lowrankq112-128s1v1g8a+er`` (frames equal byte for byte,
    both directions); a basis step with no coefficient step to size it by, or on a basis that is
    not int8, is refused in one line."""
    from bench.quality.quality_codecs import build_codec as bench_codec
    from bench.quality.quality_tasks import VARIANTS
    from node.cli import FlagError
    from node.stage.links import build_codec, codec_settings

    step = ["--codec-k", "112", "--lowrank-k-backward", str(k_backward), "--lowrank-step", "1"]
    more = ["--lowrank-basis-step", "1", "--lowrank-first-gain", "8"]
    lossless = ["--lowrank-entropy", "on", "--lowrank-repeats", "on"]
    desc = codec_settings(_checked(["join", "--microbatch-tokens", "2048", *step, *more, *lossless]))
    bench = bench_codec(VARIANTS[f"lowrankq112-{k_backward}s1v1g8a+er"])
    assert desc == bench.describe()
    node = build_codec(desc)
    h = torch.randn(70, 29, 576, generator=torch.Generator().manual_seed(4)) * torch.logspace(1, -1, 576)
    for enc in ("encode_forward", "encode_backward"):
        a, b = getattr(node, enc)(h, LinkContext()), getattr(bench, enc)(h, LinkContext())
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), enc
    for flags, says in (
        ([*lossless, "--lowrank-basis-step", "1"], "add --lowrank-step"),
        (
            [*step, *lossless, "--lowrank-basis-step", "1", "--lowrank-basis", "bfloat16"],
            "quantises an int8 basis",
        ),
        (["--codec", "dense", "--lowrank-first-gain", "8"], "does nothing with --codec dense"),
    ):
        with pytest.raises(FlagError, match=says) as e:
            _checked(["join", "--microbatch-tokens", "0", *flags])  # no layout fills in the gap
        assert "\n" not in str(e.value)


def test_lowrank_first_flag_reaches_the_codec():
    from compression.registry import make_codec
    from node.stage.links import codec_settings

    desc = codec_settings(_parse(["--lowrank-first", "apart"]))
    assert desc["first_apart"] is True
    assert "first_apart" not in codec_settings(_parse(["--lowrank-first", "shared"]))
    assert make_codec(desc.pop("codec"), **desc).first_apart


def _resolved(argv: list[str]) -> NodeConfig:
    from node.cli import resolve_defaults

    args = build_parser().parse_args(["join", *argv])
    resolve_defaults(args)
    return config_from_args(args)


def test_lowrank_layout_follows_the_frames_the_starter_sends():
    """Long frames (a GPU starter's 2048 tokens) get the stepped ~20x link, the bench's
    ``lowrankq112-128s1v1g8a+er``; ``--link tiered`` keeps the tiers and the sink apart, >= 10x;
    short frames keep the plain 80 directions; a flag the user gives wins."""
    from bench.quality.quality_codecs import build_codec as bench_codec
    from bench.quality.quality_tasks import VARIANTS
    from compression.registry import make_codec
    from node.stage.links import codec_settings

    # its bytes are the entropy coder's, so its ratio is the bench's measured one on real frames (20-24x,
    # bench/results/quality.md), not a bound of the frame's shape
    long = codec_settings(_resolved(["--microbatch-tokens", "2048"]))
    assert long == bench_codec(VARIANTS["lowrankq112-128s1v1g8a+er"]).describe()
    tiered = codec_settings(_resolved(["--microbatch-tokens", "2048", "--link", "tiered"]))
    assert tiered["tiers"] == tiered["backward_tiers"] == [[24, 8], [88, 4]]
    assert tiered["first_apart"] is True and not {"loss_share", "step", "entropy"} & set(tiered)
    codec = make_codec(tiered.pop("codec"), **tiered)
    for direction in ("forward", "backward"):
        assert codec.frame_bytes(70 * 29, 576, direction, sequences=70) / (70 * 29) <= 2 * 576 / 10
    # an emulated model's links cannot size entropy-coded frames (node.stage.emulated): tiered
    emulated = codec_settings(
        _resolved(["--microbatch-tokens", "2048", "--model", "emulate:2048:8:0.94:256:h100"])
    )
    assert emulated["tiers"] == [[24, 8], [88, 4]] and "entropy" not in emulated
    short = codec_settings(_resolved(["--microbatch-tokens", "0"]))
    assert short == codec_settings(NodeConfig()) and short["k"] == 80
    assert not {"tiers", "first_apart", "loss_share", "step", "entropy"} & set(short)
    assert codec_settings(_resolved(["--microbatch-tokens", "0", "--link", "stepped"]))["step"] == 1.0
    mine = codec_settings(
        _resolved(["--microbatch-tokens", "2048", "--lowrank-first", "shared", "--lowrank-fit", "loss-share"])
    )
    assert (
        "first_apart" not in mine and mine["loss_share"] is True and mine["k"] == 112 and mine["step"] == 1.0
    )
    # flags only another layout honours pick it: tiers, entropy coding off, fixed-bit codes
    picked = {
        ("--lowrank-tiers", "12x8,36x4"): "tiers",
        ("--lowrank-entropy", "off"): "tiers",
        ("--lowrank-backward-bits", "4"): "backward_bits",
    }
    for flags, key in picked.items():
        desc = codec_settings(_checked(["join", "--microbatch-tokens", "2048", *flags]))
        assert key in desc and "step" not in desc, flags


def test_swarm_nodes_keep_the_layout_the_launcher_resolved():
    """``swarm --microbatch-tokens 2048 --lowrank-first shared``: the flag equals the dataclass default,
    yet each node must not resolve it anew to the long-frame 'apart'."""
    from node.cli import resolve_defaults
    from node.stage.links import codec_settings

    argv = [
        "swarm",
        "--nodes",
        "2",
        "--model",
        "tiny:2",
        "--microbatch-tokens",
        "2048",
        "--lowrank-first",
        "shared",
    ]
    args = build_parser().parse_args(argv)
    resolve_defaults(args)
    cmd = node_command(args, 0, Path("/tmp/n0"), "rid", [])
    node = build_parser().parse_args(cmd[3:])
    resolve_defaults(node)
    desc = codec_settings(config_from_args(node))
    assert "first_apart" not in desc and desc["k"] == 112 and desc["step"] == 1.0
    # every link the launcher resolves reaches its nodes as it resolved it
    for link in ("stepped", "tiered", "plain"):
        args = build_parser().parse_args([*argv, "--link", link])
        resolve_defaults(args)
        node = build_parser().parse_args(node_command(args, 0, Path("/tmp/n0"), "rid", [])[3:])
        resolve_defaults(node)
        assert codec_settings(config_from_args(node)) == codec_settings(config_from_args(args)), link


def _checked(argv: list[str]) -> NodeConfig:
    """``argv`` as ``node.cli.main`` takes it: parsed, resolved, its combination checked."""
    from node.cli import check_run_flags, resolve_defaults

    args = build_parser().parse_args(argv)
    resolve_defaults(args)
    check_run_flags(args)
    return config_from_args(args)


@pytest.mark.parametrize(
    "flags, key, value",
    [
        (["--codec-k", "64"], "k", 64),
        (["--codec-k", "80"], "k", 80),  # given at the codec's own k: still given, still wins
        (["--lowrank-k-backward", "128"], "k_backward", 128),
        (["--lowrank-backward-bits", "4"], "backward_bits", 4),
    ],
)
def test_a_k_flag_given_at_long_frames_wins_over_the_resolved_tiers(flags, key, value):
    """At 2,048-token frames the tiers are filled in and would override k: a k flag the user gives
    clears them instead, in join and in every node a swarm starts."""
    from node.stage.links import codec_settings

    for cmd in ("join", "swarm"):
        args = ["swarm", "--nodes", "2", "--model", "tiny:2"] if cmd == "swarm" else ["join"]
        if cmd == "swarm":
            from node.cli import resolve_defaults

            parsed = build_parser().parse_args([*args, "--microbatch-tokens", "2048", *flags])
            resolve_defaults(parsed)
            node = node_command(parsed, 0, Path("/tmp/n0"), "rid", [])[3:]
            desc = codec_settings(_checked(node))
        else:
            desc = codec_settings(_checked([*args, "--microbatch-tokens", "2048", *flags]))
        assert "tiers" not in desc and desc[key] == value, (cmd, desc)
    # left out: the stepped link of long frames
    assert codec_settings(_checked(["join", "--microbatch-tokens", "2048"]))["k_backward"] == 128


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lowrank-tiers", "24x8,88x4", "--codec-k", "64"], "--codec-k does nothing with --lowrank-tiers"),
        (["--lowrank-tiers", "24x8", "--lowrank-k-backward", "9"], "--lowrank-k-backward does nothing with"),
        (["--lowrank-tiers", "24x8", "--lowrank-backward-bits", "4"], "--lowrank-backward-bits does nothing"),
        (["--codec", "dense", "--codec-k", "64"], "--codec-k does nothing with --codec dense"),
        (["--codec", "mask", "--codec-k", "64"], "--codec-k does nothing with --codec mask"),
        (
            ["--codec", "pca", "--lowrank-k-backward", "9"],
            "--lowrank-k-backward does nothing with --codec pca",
        ),
        (["--codec", "topk", "--lowrank-backward-bits", "8"], "--lowrank-backward-bits does nothing with"),
        (["--codec", "dense", "--mask-rate", "0.9"], "--mask-rate does nothing with --codec dense"),
        (["--codec", "int8", "--pca-dtype", "float32"], "--pca-dtype does nothing with --codec int8"),
        (["--codec", "pca", "--lowrank-tiers", "24x8"], "--lowrank-tiers does nothing with --codec pca"),
        (["--codec", "dense", "--lowrank-first", "apart"], "--lowrank-first does nothing with --codec dense"),
    ],
)
def test_a_flag_its_setting_ignores_is_refused_in_one_line(flags, match):
    from node.cli import FlagError

    with pytest.raises(FlagError, match=match) as e:
        _checked(["join", *flags])
    assert "\n" not in str(e.value)


def test_a_value_flag_at_its_default_with_another_codec_is_taken():
    """bench/network/harness.py pins --mask-rate 0.95 for every codec: at the default it changes nothing."""
    assert _checked(["join", "--codec", "dense", "--mask-rate", "0.95"]).codec == "dense"
    assert _checked(["join", "--codec", "mask", "--mask-rate", "0.9"]).mask_rate == 0.9
    # another codec at long frames: no lowrank layout resolved, so a swarm's nodes are not refused
    from node.cli import resolve_defaults

    parsed = build_parser().parse_args(["swarm", "--codec", "dense", "--microbatch-tokens", "2048"])
    resolve_defaults(parsed)
    assert _checked(node_command(parsed, 0, Path("/tmp/n0"), "rid", [])[3:]).codec == "dense"


def test_codec_k_flags_of_the_codecs_they_act_on_are_taken():
    from node.stage.links import codec_settings

    assert codec_settings(_checked(["join", "--codec", "pca", "--codec-k", "58"]))["k"] == 58
    assert codec_settings(_checked(["join", "--lowrank-tiers", "", "--codec-k", "64"]))["k"] == 64


def test_stage_layers_set_a_new_runs_split_and_bad_ones_are_refused_in_one_line():
    """``--stage-layers`` (a split by hand, e.g. the quality bench's) reaches the run record; a
    split that is not contiguous, does not cover the model or has the wrong count is one line."""
    from node.cli import FlagError
    from node.join import run_stages
    from node.model.loading import load_model
    from node.swarm.membership import JoinError

    model = load_model("tiny:6")[0]
    assert run_stages(_checked(["join", "--stages", "3", "--stage-layers", "0-1,1-5,5-6"]), model) == [
        [0, 1],
        [1, 5],
        [5, 6],
    ]
    balanced = run_stages(_checked(["join", "--stages", "3"]), model)
    assert balanced != [[0, 1], [1, 5], [5, 6]] and len(balanced) == 3  # the flag, not the default
    with pytest.raises(JoinError, match="ends at layer 5, but the model has 6 layers"):
        run_stages(_checked(["join", "--stages", "2", "--stage-layers", "0-2,2-5"]), model)
    with pytest.raises(FlagError, match="has 2 ranges for --stages 3"):
        _checked(["join", "--stages", "3", "--stage-layers", "0-2,2-6"])
    for bad in ("0-2,3-6", "1-3,3-6", "0-2,2-2", "0-2;2-6", "a-b"):
        with pytest.raises(FlagError, match="--stage-layers") as e:
            build_parser().parse_args(["join", "--stage-layers", bad])
        assert "\n" not in str(e.value)
