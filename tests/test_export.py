"""`python -m node export`: the exported model computes what the swarm's pipeline computes.

The multi-process test trains a 3-stage tiny model with the real `swarm` (which exports from
the nodes' final checkpoints), restarts the same nodes with `join --resume` so they serve the
trained weights without training further, exports again from those live peers, and compares
both exports tensor by tensor and the exported model's logits with the pipeline's stages.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node.model.checkpoint import load_latest, save_checkpoint
from node.model.loading import load_model, tiny_config
from node.model.stages import build_stage
from node.swarm.export import (
    EXPORT_JSON,
    ExportError,
    StagePart,
    export_from_checkpoints,
    pull_stage,
    write_stages,
)
from tests.conftest import run_swarm, wait_for

RANGES3 = [[0, 2], [2, 3], [3, 4]]  # the default split of tiny:4 into 3 stages (tail carries lm_head)


def pipeline_logits(stages, ids: torch.Tensor) -> torch.Tensor:
    """Logits as the swarm computes them: each stage's forward, one after the other."""
    with torch.no_grad():
        h = ids
        for s in stages:
            h = s(h)
    return h


def stages_from_checkpoints(model_spec: str, ranges, stage_dirs) -> list:
    stages = []
    for i, d in enumerate(stage_dirs):
        base = load_model(model_spec, seed=0)[0]
        s = build_stage(base, ranges, i)
        s.load_state_dict(load_latest(d).stage_state)
        stages.append(s.eval())
    return stages


def exported_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported (sharded) checkpoint, by name."""
    out = {}
    for shard in sorted(
        set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    ):
        out.update(load_file(str(path / shard)))
    return out


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids=ids).logits


def _join(nodedir: Path, run_id: str, peers: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "node", "join", "--model", "tiny:4", "--stages", "3", "--codec", "dense"]
    cmd += ["--run-id", run_id, "--state-dir", str(nodedir), "--resume", "--threads", "1", "--heartbeat", "1"]
    cmd += ["--wait-peers", "99", "--metrics-file", str(nodedir / "live-metrics.json")]
    cmd += ["--ready-file", str(nodedir / "live-ready.json")] + (["--peers", *peers] if peers else [])
    log = open(nodedir / "live.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", "export", *args], capture_output=True, text=True, timeout=240
    )


# slow (~60 s: a swarm, then its nodes restarted to serve): the export's assembly is tested in
# process below (checkpoints and stages vs the pipeline), the launcher's export in test_demo_path.py
@pytest.mark.slow
def test_export_from_checkpoints_and_live_peers_equal_the_pipeline(tmp_path):
    from node.local.launcher import kill_group

    rep_dir = tmp_path / "swarm"
    ck_out = tmp_path / "from-checkpoints"
    # no --export: the launcher would delete the checkpoints once it wrote one, and they are resumed
    # below (the launcher's own export is tests/test_demo_path.py)
    rep = run_swarm(rep_dir, "--model", "tiny:4", "--stages", "3", "--nodes", "3", "--steps", "4")
    run_id = rep["run_id"]
    p = _export("--checkpoints", str(rep_dir / "nodes"), "--model", "tiny:4", "--out", str(ck_out))
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads((ck_out / EXPORT_JSON).read_text())
    assert info["run_id"] == run_id and [s["layers"] for s in info["stages"]] == RANGES3
    assert all(s["inner_step"] > 0 for s in info["stages"])  # trained weights, not the initial ones

    nodes = sorted((rep_dir / "nodes").iterdir())
    stage_of = {json.loads((n / "ready.json").read_text())["stage"]: n for n in nodes}
    stage_dirs = [stage_of[i] / "checkpoints" / run_id / f"stage-{i}" for i in range(3)]
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    want = pipeline_logits(stages_from_checkpoints("tiny:4", RANGES3, stage_dirs), ids)
    got = _hf_logits(ck_out, ids)
    assert (got - want).abs().max() <= 1e-5

    # the same nodes again, serving their trained stages (the head never starts: --wait-peers 99)
    procs = []
    try:
        procs.append(_join(nodes[0], run_id, []))
        ready = wait_for(
            lambda: _read(nodes[0] / "live-ready.json"), 120, "the first node to claim its stage"
        )
        peer = [a for a in ready["maddrs"] if "127.0.0.1" in a][0]
        peer = peer if "/p2p/" in peer else f"{peer}/p2p/{ready['peer_id']}"
        procs += [_join(n, run_id, [peer]) for n in nodes[1:]]
        for n in nodes:
            wait_for(lambda n=n: (n / "live-metrics.json").exists(), 180, f"{n.name} to serve")
        live_out = tmp_path / "from-peers"
        p = _export("--peers", peer, "--run-id", run_id, "--out", str(live_out))
        assert p.returncode == 0, p.stderr[-2000:]
        a, b = exported_tensors(ck_out), exported_tensors(live_out)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
        live_info = json.loads((live_out / EXPORT_JSON).read_text())
        assert [s["inner_step"] for s in live_info["stages"]] == [s["inner_step"] for s in info["stages"]]

        # the tail leaves: its stage has no live peer, and the export says so in one line
        tail = procs[nodes.index(stage_of[2])]
        tail.send_signal(signal.SIGTERM)
        tail.wait(timeout=60)
        p = _export("--peers", peer, "--run-id", run_id, "--out", str(tmp_path / "none"))
        assert p.returncode == 2
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]  # p2pd logs its own lines
        assert errors == [p.stderr.splitlines()[-1]], p.stderr[-1000:]
        assert errors[0].startswith("error: stage 2 (layers 3..3) has no live peer"), p.stderr[-1000:]
        assert "Traceback" not in p.stderr and not (tmp_path / "none").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------- in process


def _trained_stages(model, ranges, seed=0):
    """The stages of ``model`` with weights moved off the initial ones (as training would)."""
    g = torch.Generator().manual_seed(seed)
    stages = [build_stage(model, ranges, i, keep_model=True) for i in range(len(ranges))]
    with torch.no_grad():
        for s in stages:
            for p in s.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return stages


def _save(stages, root: Path, model_hash: str, run_id="r1", only=None) -> list[Path]:
    dirs = []
    for i, s in enumerate(stages):
        if only is not None and i not in only:
            continue
        d = root / f"node{i}" / "checkpoints" / run_id / f"stage-{i}"
        counters = {"inner_step": 7 + i, "run_id": run_id, "stage": i, "model_hash": model_hash}
        save_checkpoint(d, stage_state=s.state_dict(), optimizer_state={}, counters=counters)
        dirs.append(d)
    return dirs


@pytest.fixture
def tiny_ckpts(tmp_path):
    from node.model.loading import open_model

    model = load_model("tiny:4", seed=0)[0]
    h = open_model("tiny:4", seed=0).run_hashes(RANGES3)[0]  # the run record's model hash
    stages = _trained_stages(model, RANGES3)
    return stages, h, tmp_path


def test_tied_embeddings_export_tied_when_equal_and_untied_when_not(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from node.model.loading import ModelSource

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tie=True)).eval()
    ranges = [[0, 2], [2, 4]]
    ids = torch.randint(0, 500, (2, 16))
    for differ in (False, True):
        stages = [build_stage(model, ranges, i, keep_model=True) for i in range(2)]
        if differ:  # the head's copy trained apart from the tail's
            with torch.no_grad():
                stages[0].embed_tokens.weight.add_(0.05)
        parts = [
            StagePart(i, *ranges[i], 1, dict(s.named_parameters()), "test") for i, s in enumerate(stages)
        ]
        path = tmp_path / str(differ)
        path.mkdir()
        tied = write_stages(path, parts, ModelSource("tiny", model.config, model=model), None)
        out = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert tied is not differ and out.config.tie_word_embeddings is not differ
        assert ("lm_head.weight" in exported_tensors(path)) is differ  # a tied model stores it once
        shared = out.lm_head.weight.data_ptr() == out.model.embed_tokens.weight.data_ptr()
        assert shared is not differ
        with torch.no_grad():
            assert (out(input_ids=ids).logits - pipeline_logits(stages, ids)).abs().max() <= 1e-5


def test_corrupted_checkpoint_is_refused_in_one_line(tiny_ckpts, capsys):
    from node.cli import main

    stages, h, tmp = tiny_ckpts
    dirs = _save(stages, tmp / "ck", h)
    ckpt = next(dirs[1].glob("ckpt-*"))
    raw = bytearray((ckpt / "weights.safetensors").read_bytes())
    raw[-5] ^= 0x01
    (ckpt / "weights.safetensors").write_bytes(bytes(raw))
    rc = main(["export", "--checkpoints", str(tmp / "ck"), "--model", "tiny:4", "--out", str(tmp / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "sha256 mismatch" in err and "stage-1" in err
    assert not (tmp / "out").exists()


@pytest.mark.parametrize("only,missing", [({0, 2}, "stage 1 of run r1"), ({0, 1}, "stage 2 or later")])
def test_missing_stage_on_disk(tiny_ckpts, only, missing):
    stages, h, tmp = tiny_ckpts
    _save(stages, tmp / "ck", h, only=only)
    with pytest.raises(ExportError, match=rf"no checkpoint of {missing}"):
        export_from_checkpoints(tmp / "out", [str(tmp / "ck")], model="tiny:4")
    assert not (tmp / "out").exists()


def test_interrupted_export_leaves_no_directory(tiny_ckpts, monkeypatch):
    stages, h, tmp = tiny_ckpts
    _save(stages, tmp / "ck", h)
    rename = os.rename

    def interrupt(src, dst):  # Ctrl-C with everything written, just before the rename into place
        if Path(src).name.startswith(".out.tmp-"):
            assert (Path(src) / "model.safetensors.index.json").exists()
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(os, "rename", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_from_checkpoints(tmp / "out", [str(tmp / "ck")], model="tiny:4")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp.iterdir()) == ["ck"]  # neither out nor its temporary sibling

    # a SIGKILLed export leaves only its hidden temporary directory; the next export removes it
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp / f".out.tmp-{dead.pid}-0123abcd"
    stale.mkdir()
    done = export_from_checkpoints(tmp / "out", [str(tmp / "ck")], model="tiny:4")
    assert sorted(p.name for p in tmp.iterdir()) == ["ck", "out"]
    assert [s["inner_step"] for s in done.info["stages"]] == [7, 8, 9]
    ids = torch.randint(0, 500, (1, 10))
    assert (_hf_logits(tmp / "out", ids) - pipeline_logits(stages, ids)).abs().max() <= 1e-5


class _FlipOneByte:
    """A link that corrupts one payload byte of the last (digest-carrying) weights frame in transit."""

    def __init__(self, wire):
        self.wire = wire

    async def send(self, writer, data, timeout):
        if len(data) > 4096:  # a weights frame; flip the low bit of a byte in its tensor data
            data = bytearray(data)
            data[len(data) // 2] ^= 0x01
            data = bytes(data)
        return await self.wire.send(writer, data, timeout)

    async def recv(self, *a):
        return await self.wire.recv(*a)

    def caps(self, *a):
        return self.wire.caps(*a)


def test_live_pull_checks_the_digest_over_real_streams():
    """The real WeightServer over real libp2p: an intact pull is exact fp32, a flipped byte is refused."""
    from hivemind.p2p import P2P

    from node.net.wire import Wire
    from node.swarm.export import _Visitor
    from node.swarm.weights import WEIGHTS_HANDLER, WeightServer
    from protocol.frames import FrameError

    model = load_model("tiny:4", seed=0)[0]
    stage = _trained_stages(model, RANGES3)[1]

    async def main():
        async def compute(fn, *args):
            return fn(*args)

        rt = types.SimpleNamespace(
            wire=Wire(),
            cfg=types.SimpleNamespace(hop_timeout=20.0),
            run=types.SimpleNamespace(run_id="t"),
            compute=compute,
            stage=stage,
            inner_step=5,
            routes=[{}, {}],  # the export is no member of the stage: a visitor
            index=1,
        )
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            await server.add_binary_stream_handler(WEIGHTS_HANDLER, WeightServer(rt).handle)
            peer = server.peer_id.to_base58()
            step, named, _ = await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
            assert step == 5 and named.keys() == dict(stage.named_parameters()).keys()
            assert all(
                named[k].dtype == torch.float32 and torch.equal(named[k], p)
                for k, p in stage.named_parameters()
            )
            rt.wire = _FlipOneByte(Wire())
            with pytest.raises(ExportError, match="stage 1 from peer .*: weights digest mismatch"):
                await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
            # an export is a visitor: all visitors together get a burst of 3 pulls, then busy (a
            # stranger cannot keep the node cloning and sending its stage)
            rt.wire = Wire()
            await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
            await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
            await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
            refused = "busy: over 0.05 requests/s from peers without a record of this stage; slow down"
            with pytest.raises(FrameError, match=refused):
                await pull_stage(_Visitor(client, Wire(), "t"), peer, 1, 20.0)
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


@pytest.mark.slow
def test_bundled_export_equals_the_pipeline(tmp_path):
    rep_dir, out = tmp_path / "swarm", tmp_path / "model"
    rep = run_swarm(
        rep_dir,
        "--model",
        "bundled",
        "--stages",
        "2",
        "--nodes",
        "2",
        "--steps",
        "2",
        timeout=1200,
    )
    # from the nodes' checkpoints (swarm --export deletes them once its export is written)
    p = _export("--checkpoints", str(rep_dir / "nodes"), "--model", "bundled", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads((out / EXPORT_JSON).read_text())
    ranges = [s["layers"] for s in info["stages"]]
    nodes = sorted((rep_dir / "nodes").iterdir())
    stage_of = {json.loads((n / "ready.json").read_text())["stage"]: n for n in nodes}
    dirs = [stage_of[i] / "checkpoints" / rep["run_id"] / f"stage-{i}" for i in range(2)]
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    want = pipeline_logits(stages_from_checkpoints("bundled", ranges, dirs), ids)
    assert (_hf_logits(out, ids) - want).abs().max() <= 1e-5


_EXPORT_PEAK = """
import sys, torch
from pathlib import Path
from node.model.adapters import add_adapters, adapter_tensors
from node.model.loading import open_model
from node.model.stages import build_stage, default_stage_ranges
from node.swarm.export import StagePart, write_stages
from protocol.settings import FinetuneSettings
ckpt, out, n_stages = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
ft = FinetuneSettings(mode="lora", rank=4)
source = open_model(str(ckpt))
ranges = default_stage_ranges(source.skeleton, n_stages)
parts = []
for i, (a, b) in enumerate(ranges):  # adapters only, as a LoRA run's checkpoints hold them
    stage = build_stage(source._meta_model(), ranges, i)  # shapes only
    add_adapters(stage, ft, 0)
    named = {n: torch.full(p.shape, 0.01) for n, p in stage.named_parameters() if ".lora_" in n}
    parts.append(StagePart(i, a, b, 1, named, "test"))
    del stage
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak from here on: the export's
write_stages(out, parts, source, ft, shard_bytes=8 << 20)
peak = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
print(peak - base)
"""


def test_a_lora_export_holds_one_stage_of_the_base_at_a_time(tmp_path):
    """The merged checkpoint is written stage by stage from the model's files: the export's peak
    memory is about one stage of the fp32 base, not the whole model (which it used to load, and
    then clone, before merging)."""
    from transformers import LlamaConfig

    from bench.memory.stage_memory import write_random_checkpoint

    config = LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    model_bytes = write_random_checkpoint(tmp_path / "base", config, shard_bytes=64 << 20)
    (tmp_path / "out").mkdir()
    p = subprocess.run(
        [sys.executable, "-c", _EXPORT_PEAK, str(tmp_path / "base"), str(tmp_path / "out"), "12"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    peak = int(p.stdout.split()[-1])
    # 12 stages of a layer each (13 MB; the head and tail with their 16 MB embeddings): the largest
    # stage read (its file's pages count while they are mapped: twice a stage) and merged, and one
    # shard's write, within half the model; loading the whole base was more than all of it
    assert peak < model_bytes / 2, (peak >> 20, model_bytes >> 20)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)  # a whole, loadable model
