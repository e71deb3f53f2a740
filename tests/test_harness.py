"""Smoke test of the bandwidth-capped harness (issue 5): two namespaces per run, a few seconds.

A dense and a masked (M95) swarm of a tiny emulated model run side by side, each in its own
namespaces behind a 2 Mbit/s tbf: the cap must hold (wire rate <= 1.1x the cap), the masked
run must move more tokens per second, and no namespace may be left behind. Without root or
network-namespace support the test is skipped with the reason (the one allowed skip).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bench.network.netns import NetnsUnavailable, check_support, leftover_namespaces

FRAME_BYTES = 4 * 64 * 256 * 2  # the smoke's dense bf16 frame: 4 x 64 tokens x hidden 256
MAX_INFLIGHT = 4
SMOKE = [
    "--nodes", "2", "--stages", "2",
    "--model", "emulate:256:2:0",  # hidden 256, 2 layers, no compute sleep
    "--seq-len", "64", "--microbatch", "4", "--batch-tokens", "4096",
    "--max-inflight", str(MAX_INFLIGHT), "--hop-timeout", "30", "--heartbeat", "1",
    "--rate", "2mbit", "--warmup", "2", "--seconds", "6", "--timeout", "100",
    "--skip-tcp-check",
    "--delay-ms", "0",  # no proxy: tests/test_delayproxy.py covers it, and it costs a slow start here
]  # fmt: skip


def _support_reason() -> str | None:
    try:
        check_support()
    except NetnsUnavailable as e:
        return str(e)
    return None


def test_capped_smoke(tmp_path):
    reason = _support_reason()
    if reason:
        print(f"skipping the harness smoke: {reason}")
        pytest.skip(f"harness smoke needs root and network namespaces: {reason}")
    procs = {}
    runs = {"dense": ["--codec", "dense"], "mask": ["--codec", "mask", "--mask-rate", "0.95"]}
    for name, flags in runs.items():
        out = tmp_path / name
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "bench.network.harness", *SMOKE, *flags, "--out", str(out),
             "--results", str(tmp_path / f"{name}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    logs = {}
    for name, p in procs.items():
        try:
            logs[name], _ = p.communicate(timeout=170)
        except subprocess.TimeoutExpired:
            p.terminate()  # the harness tears its namespaces down on SIGTERM
            logs[name], _ = p.communicate(timeout=60)
            pytest.fail(f"{name} harness run timed out:\n{logs[name][-3000:]}")
        assert p.returncode == 0, f"{name}:\n{logs[name][-3000:]}"
    res = {name: json.loads((tmp_path / f"{name}.json").read_text())[-1] for name in procs}
    for name, e in res.items():
        print(
            f"{name}: {e['tokens_per_s']:.0f} tokens/s, frames {e['link_utilisation']:.1%} and wire "
            f"{e['wire_utilisation']:.0%} of the cap, "
            f"{e['bytes_per_token']:.1f} B/token"
        )
        assert e["rate_mbit"] == 2.0
        assert e["wire_utilisation"] is not None, name
        assert e["wire_utilisation"] <= 1.1, (name, e["wire_bytes_per_s"])
        # frame bytes count once written to the stream (node.stage.hop.call_peer, node.stage.server), and a
        # span can end with frames written but not yet on the wire (in p2pd's and the kernel's buffers):
        # at most the head's --max-inflight of them, since a frame unanswered holds a slot, against
        # what the busiest node's own span between its metric writes carries at 2 Mbit/s (6 s: 0.35).
        # A frame counted twice would read 2x. Against a fixed 6 s, a span cut short by metrics written
        # late on a loaded machine read 1.51 (CI, 12/4; metrics now have their own 1 s clock).
        busiest = max(e["egress_frame_bytes_per_s"], key=e["egress_frame_bytes_per_s"].get)
        span = e["egress_window_s"][busiest]
        assert span >= 4, (name, e["egress_window_s"])  # most of the 6 s window
        slack = MAX_INFLIGHT * FRAME_BYTES / (2e6 / 8 * span)
        assert e["link_utilisation"] <= 1 + slack, (name, e["egress_frame_bytes_per_s"], span, slack)
        assert e["tokens_per_s"] > 0, name
    assert res["mask"]["bytes_per_token"] < res["dense"]["bytes_per_token"] / 5
    assert res["mask"]["tokens_per_s"] > res["dense"]["tokens_per_s"], (
        res["mask"]["tokens_per_s"],
        res["dense"]["tokens_per_s"],
    )
    # everything the two harnesses built is gone
    tags = {m for log in logs.values() for m in re.findall(r"\((vnh\d+)-br,", log)}
    assert len(tags) == 2, logs
    left = [n for n in leftover_namespaces() if any(n.startswith(t + "-") for t in tags)]
    assert not left, left


# ------------------------------------------------------------------ pieces that need no namespaces
def test_emulated_model_pipeline_shapes_hash_and_sleep():
    import time

    import torch

    from node.model.emulated import DEFAULT_US, layer_us_per_token, parse_spec
    from node.model.loading import content_hash, load_model
    from node.model.stages import build_stage, default_stage_ranges

    # 0.371 GFLOP per token-layer (Llama-3.2-1B layer, fwd+bwd) at 40% of 989.4 TFLOP/s; 165.2 (RTX 4090)
    assert abs(layer_us_per_token() - 0.371e9 / 395.8e12 * 1e6) < 0.01 and DEFAULT_US == 0.94
    assert abs(layer_us_per_token(tflops=165.2) - 5.6) < 0.05
    assert parse_spec("emulate") == (2048, 16, 0.94, 256, "h100")
    assert parse_spec("emulate:512:4:10:128:rtx4090") == (512, 4, 10.0, 128, "rtx4090")
    with pytest.raises(ValueError):
        parse_spec("emulate:64:2:1:128")  # vocab > hidden
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_spec("emulate:64:2:1:32:tpu")
    m, tok, name = load_model("emulate:128:4:200:64", seed=3)
    assert tok is None and "emulated" in name
    assert content_hash(m) == content_hash(load_model("emulate:128:4:200:64", seed=3)[0])
    assert content_hash(m) != content_hash(load_model("emulate:128:4:100:64", seed=3)[0])
    ranges = default_stage_ranges(m, 2)
    assert ranges == [[0, 2], [2, 4]]
    head, tail = (build_stage(m, ranges, i, keep_model=True) for i in range(2))
    ids = torch.randint(0, 63, (2, 16))
    t0 = time.perf_counter()
    with torch.enable_grad():
        h = head(ids)
        fwd_s = time.perf_counter() - t0
        assert h.shape == (2, 16, 128) and h.dtype == torch.float32
        leaf = h.detach().requires_grad_(True)
        loss, n = tail.loss(leaf, ids)
        assert n == 2 * 15 and torch.isfinite(loss)
        loss.backward()
        h.backward(leaf.grad)
    # 2 layers x 32 tokens x 200 us / 3 in forward = 4.3 ms of sleep
    assert fwd_s >= 2 * 32 * 200e-6 / 3 * 0.9
    assert leaf.grad.shape == h.shape
    assert head.embed_tokens.weight.grad is not None
    assert all(p.grad is not None for p in tail.parameters())


def test_text_data_fills_every_sequence(tmp_path):
    from bench.network.harness import write_text_data
    from node.model.data import ByteTokenizer, load_examples, microbatches

    path = tmp_path / "data.txt"
    write_text_data(path, seq_len=64, chars_per_token=1.0)
    ids, labels = next(microbatches(load_examples(str(path)), ByteTokenizer(256), 4, 64, seed=0))
    assert ids.shape == (4, 64) and (labels != -100).all()


def test_ceilings_topology():
    from bench.network.harness import build_parser, ceilings

    a = build_parser().parse_args(["--nodes", "6", "--stages", "3"])
    a.us_per_token_layer = 5.6
    links = [
        {"boundary": b, "direction": d, "bytes_per_token": 4098.0 if d == "forward" else 4096.0}
        for b in (0, 1)
        for d in ("forward", "backward")
    ]
    c = ceilings(a, links, 80e6, 2048)
    assert round(c["ceiling_tokens_per_s"]) == round(1e7 / 4098)
    # a body uploads forward + backward bytes per token; two bodies share the stage
    assert abs(c["topology_ceiling_tokens_per_s"] - 2 * 1e7 / (4098 + 4096)) < 1
    assert abs(c["compute_ceiling_tokens_per_s"] - 2 / (6 * 5.6e-6)) < 1


def test_topology_sets_notsent_lowat_in_its_namespaces_only():
    """bench.network.linkprobe --notsent-lowat: the sysctl holds in each node namespace, not the host's."""
    import os

    from bench.network.netns import Topology, _run

    reason = _support_reason()
    if reason:
        pytest.skip(f"needs root and network namespaces: {reason}")
    host = open("/proc/sys/net/ipv4/tcp_notsent_lowat").read().strip()
    topo = Topology(2, 80e6, tag=f"{os.getpid() % 100000}l", notsent_lowat=131072)
    try:
        topo.build()
        for i in range(2):
            got = _run(topo.exec_prefix(i) + ["sysctl", "-n", "net.ipv4.tcp_notsent_lowat"]).stdout.strip()
            assert got == "131072", (i, got)
    finally:
        topo.teardown()
    assert open("/proc/sys/net/ipv4/tcp_notsent_lowat").read().strip() == host
    assert not [n for n in leftover_namespaces() if n.startswith(topo.bridge_ns[:-3])]


def test_harness_refuses_in_one_line_without_support(monkeypatch, capsys):
    import bench.network.harness as h

    def nope():
        raise h.NetnsUnavailable("network namespaces and tc need root (run as root, e.g. with sudo)")

    monkeypatch.setattr(h, "check_support", nope)
    assert h.main(["--codec", "dense"]) == h.EXIT_UNSUPPORTED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need root" in err[0]


def test_link_cut_summary_from_snapshots():
    """The cut's cost comes from the metric snapshots: rates in each phase, drops, time to serve again."""
    from bench.network.harness import LinkCut

    class Topo:
        n = 3
        calls: list = []

        def set_link(self, i, up):
            self.calls.append((i, up))

    def snap(t):
        # heads complete 2 microbatches/s before the cut (t < 10), 1/s while node 2 is cut off
        # (t 10-30), 2/s after; 3 drops while down; node 2 serves again 4 s after its link is back
        head_done = [2 * t, 20 + (t - 10), 40 + 2 * (t - 30)][(t >= 10) + (t >= 30)]
        return {
            "t": t,
            "metrics": {
                0: {"stage": 0, "microbatches": head_done, "dropped_microbatches": 3 * (t > 12)},
                2: {"stage": 1, "microbatches": 50 + 5 * (t >= 34), "dropped_microbatches": 0},
            },
        }

    topo = Topo()
    cut = LinkCut(topo, node=2, at=10, seconds=20)
    snaps = [snap(t) for t in range(0, 61)]
    for s in snaps:
        cut.step(s, t_first=0)
    assert topo.calls == [(2, False), (2, True)]
    got = cut.summary(snaps, stages=2)
    assert got["seconds_down"] == 20 and got["stage"] == 1 and got["dropped_during"] == 3
    assert got["microbatches_per_s_before"] == 2.0 and got["microbatches_per_s_during"] == 1.0
    assert got["microbatches_per_s_after"] == 2.0 and got["node_served_again_after_s"] == 4


# ------------------------------------------------------------------ emulated GPU side (issue 16)
def _real_and_emulated(name: str, **kw):
    import torch

    from compression.registry import make_codec
    from node.model.emulated import GPUS
    from node.stage.emulated import EmulatedLinkCodec

    real = make_codec(name, **kw)
    if name == "pca":  # an orthonormal basis of the frame's width
        q, _ = torch.linalg.qr(torch.randn(512, kw["k"], generator=torch.Generator().manual_seed(1)))
        real.set_basis(torch.zeros(512), q, version=3)
    emu = make_codec(name, **kw)
    if name == "pca":
        emu.set_basis(torch.zeros(512), q, version=3)
    return real, EmulatedLinkCodec(emu, GPUS["h100"])


@pytest.mark.parametrize(
    "name,kw",
    [
        ("dense", {}),
        ("mask", {"rate": 0.95}),
        ("pca", {"k": 32, "coeff_dtype": "int8"}),
        ("lowrank", {"k": 16, "coeff_dtype": "int8"}),
        ("lowrank", {"k": 16, "basis_dtype": "int8", "basis_block": 32, "first_apart": True}),
        (  # the long-frame default layout (node.stage.links.lowrank_layout)
            "lowrank",
            {
                "tiers": ((6, 8), (10, 4)),
                "backward_tiers": ((6, 8), (10, 4)),
                "first_apart": True,
                "loss_share": True,
                "basis_dtype": "int8",
                "basis_block": 32,
            },
        ),
    ],
)
def test_emulated_link_sends_the_real_codecs_layout(name, kw):
    """Names, shapes, dtypes and bytes of every emulated payload are the real codec's on the same frame."""
    import torch

    from compression.codec import LinkContext, payload_nbytes
    from protocol.frames import Frame, decode_frame, encode_frame

    real, emu = _real_and_emulated(name, **kw)
    shape = (3, 40, 512)
    read = torch.zeros(shape[:2], dtype=torch.bool)
    read[:, 30:] = True  # the answer's rows: a loss-share fit must not change the layout
    ctx = LinkContext(seed=7, basis_version=3 if name == "pca" else 0, loss_rows=read)
    h = torch.randn(shape)
    for direction in ("forward", "backward"):
        enc_r = real.encode_forward if direction == "forward" else real.encode_backward
        enc_e = emu.encode_forward if direction == "forward" else emu.encode_backward
        want, got = enc_r(h, ctx), enc_e(torch.zeros(()).expand(shape), ctx)
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == {
            k: (tuple(v.shape), v.dtype) for k, v in want.items()
        }, direction
        assert payload_nbytes(got) == payload_nbytes(want)
        # the payload goes through the real frame encoder and its checks
        f = Frame(kind=direction, run_id="r", shape=list(shape), tensors=got)
        back = decode_frame(encode_frame(f), run_id="r")
        dec = emu.decode_forward if direction == "forward" else emu.decode_backward
        x = dec(back.tensors, ctx, shape)
        assert x.shape == shape and set(x.stride()) == {0}  # a stand-in: no (T, H) data behind it
    with pytest.raises(ValueError, match="layout"):
        short = {k: v[..., :-1] if v.dim() else v for k, v in got.items()}
        emu.decode_backward(short, ctx, shape)


def test_codec_gpu_seconds_h100_figures():
    """Hand-derived H100 SXM figures for one 4096-token frame of width 2048 (bench/results/harness.md)."""
    from node.model.emulated import GPUS, codec_gpu_seconds

    g = GPUS["h100"]
    rows, hidden = 4096, 2048
    dense_payload = rows * hidden * 2  # bf16
    # 3 launches x 10 us + (33.55 MB fp32 + 16.78 MB bf16) / (0.8 x 3.35 TB/s) + 16.78 MB / 50 GB/s
    assert codec_gpu_seconds("dense", "encode", rows, hidden, dense_payload, g, 0) == pytest.approx(
        30e-6 + 18.78e-6 + 335.5e-6, rel=2e-3
    )
    # mask: + 8.39 M keys / 5e9 keys/s = 1.678 ms of per-token channel choice
    m = rows * 102 * 2
    assert codec_gpu_seconds("mask", "decode", rows, hidden, m, g, 0) == pytest.approx(
        30e-6 + (33.55e6 + m) / 2.68e12 + m / 50e9 + 1.678e-3, rel=2e-3
    )
    # lowrank encode: + Gram 2 x 4096 x 2048^2 = 34.4 GFLOP at 494.7 TFLOP/s + 9 x 2048^3 FP64 at 6.7 TFLOP/s
    lr = codec_gpu_seconds("lowrank", "encode", rows, hidden, 0, g, 96)
    want = 30e-6 + 12.5e-6 + 1.61e9 / 494.7e12 + 34.36e9 / 494.7e12 + 77.3e9 / 6.7e12
    assert lr == pytest.approx(want, rel=5e-3)


def test_emulated_compute_sleeps_and_builds_no_activation():
    import time

    import torch

    from node.model.loading import load_model
    from node.model.stages import build_stage, default_stage_ranges
    from node.stage.emulated import EmulatedCompute

    m, _, _ = load_model("emulate:2048:4:50:256:h100", seed=0)
    ranges = default_stage_ranges(m, 2)
    head, tail = (build_stage(m, ranges, i, keep_model=True) for i in range(2))
    ch, ct = EmulatedCompute(head), EmulatedCompute(tail)
    ids = torch.randint(0, 255, (2, 100))
    t0 = time.perf_counter()
    y, leaf = ch.forward(head, ids, True)
    fwd = time.perf_counter() - t0
    assert leaf is None and y.shape == (2, 100, 2048) and set(y.stride()) == {0}
    assert fwd >= 200 * 2 * 50e-6 / 3  # 200 tokens x 2 layers x 50 us / 3
    labels = ids.clone()
    labels[0, :10] = -100
    loss, n, g = ct.tail(tail, y, labels, False)
    assert n == 2 * 99 - 9 and g.shape == y.shape and set(g.stride()) == {0}
    assert ch.backward(y, g, None) is None
    assert all(p.grad is not None for p in head.parameters())


def test_dp_bytes_per_token_of_a_1b_stage():
    """PowerSGD rank 16 of Llama-3.2-1B over 3 stages (6, 6, 4 layers; embedding and lm_head at the ends).

    Per layer r(m+n): q, o 16 x 4096; k, v 16 x 2560; gate, up, down 16 x 10240; two norms 2048 dense
    = 708,608 numbers; embedding / lm_head 16 x (128256 + 2048) = 2,084,864. All stages: 15,507,456
    fp32 numbers = 62.03 MB per round, sent once in an all-reduce of 2, per 10 x 262,144 tokens.
    """
    from bench.network.harness_report import dp_bytes_per_token

    assert dp_bytes_per_token() == pytest.approx(15_507_456 * 4 / 2_621_440, rel=1e-9)
    # rounds half as often: half the bytes; a group of 4 moves 2 x 3/4 of its vector per round
    assert dp_bytes_per_token(outer_every=20) == pytest.approx(dp_bytes_per_token() / 2)
    assert dp_bytes_per_token(group=4) == pytest.approx(1.5 * dp_bytes_per_token())


def test_emulated_model_calibrates_a_pca_basis():
    """The starter fits the PCA bases stage by stage on the emulated model (the default codec's path)."""
    import torch

    from node.model.loading import open_model
    from node.stage.basis import calibrate_stagewise

    source = open_model("emulate:256:4:0:64:h100")
    ranges = [[0, 2], [2, 4]]
    ids = torch.randint(0, 63, (2, 32))
    ((mean, v),) = calibrate_stagewise(
        lambda i: source.load_stage(ranges, i, torch.device("cpu"), torch.float32),
        ranges,
        [(ids, ids)],
        16,
        pad_id=-1,
    )
    assert mean.shape == (256,) and v.shape == (256, 16)
    torch.testing.assert_close(v.T @ v, torch.eye(16), atol=1e-4, rtol=0)


def test_emulated_links_refuse_the_entropy_stage_in_one_line():
    """Coded sizes depend on values an emulated stage never computes: refused at start, not at the
    first frame."""
    with pytest.raises(ValueError, match="--lowrank-entropy on") as e:
        _real_and_emulated("lowrank", k=16, basis_dtype="int8", basis_block=32, entropy=True)
    assert "\n" not in str(e.value)
    _real_and_emulated("lowrank", k=16, basis_dtype="int8", basis_block=32, repeats=True)  # sizes bounded


def test_outer_sweep_plans_one_run_per_mode_with_its_flags():
    from bench.network.harness import build_parser, build_plan, outer_rounds

    a = build_parser().parse_args(
        [
            "--codec",
            "dense",
            "--outer-sweep",
            "off,rounds,overlap8",
            "--outer-every",
            "4",
            "--node-args",
            "--x 1",
        ]
    )
    plan = build_plan(a)  # --codec's run, once per outer mode (no run with the node's defaults)
    assert [over["outer"] for _, _, over in plan] == ["off", "rounds", "overlap8"]
    assert [over["node_args"] for _, _, over in plan] == [
        "--x 1 --outer-every 0",
        "--x 1 --outer-every 4",
        "--x 1 --outer-every 4 --outer-overlap --outer-bits 8",
    ]
    with pytest.raises(ValueError, match="unknown outer mode 'sometimes'"):
        build_plan(build_parser().parse_args(["--outer-sweep", "sometimes"]))
    done = {"skipped": False, "seconds": 3.0, "bytes_sent": 10, "overlapped": True}
    skipped = {"skipped": True, "seconds": 9.0, "bytes_sent": 2}
    got = outer_rounds([{"outer_rounds": [done, skipped]}, {"outer_rounds": [dict(done, seconds=5.0)]}, {}])
    assert got == {"committed": 2, "skipped": 1, "overlapped": 2, "mean_seconds": 4.0, "bytes_sent": 22}
