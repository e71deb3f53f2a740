"""A node loads only its stage's tensors from a checkpoint, for every architecture it splits.

References are independent of the stage loader: the whole model comes from transformers'
own ``from_pretrained`` of the same files; hashes are checked by changing a file's tensor.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.config import NodeConfig
from node.join import stage_memory
from node.model.loading import ModelError, bundled_dir, open_model, resolve_model_path, tiny_config
from node.model.stages import IGNORE_INDEX, causal_lm_loss, default_stage_ranges
from protocol.records import RecordError, RunRecord

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _config(arch: str):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama-tied":
        return tiny_config(layers=4, tie=True)
    if arch == "qwen2":  # layers 2..3 slide a 4-token window, 0..1 attend fully
        return Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    if arch == "qwen3":
        return Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False)
    if arch == "mistral":  # every layer slides a 4-token window
        return MistralConfig(**SMALL, sliding_window=4)
    raise ValueError(arch)


def _save(arch: str, path: Path, dtype=torch.float32) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch)).to(dtype)
    model.save_pretrained(path, max_shard_size="150KB")  # several shards and an index json
    return path


def _whole(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _grads_by_checkpoint_name(stages, ranges) -> dict[str, torch.Tensor]:
    """Each stage's gradients under the whole model's names; a tied embedding sums head and tail."""
    out: dict[str, torch.Tensor] = {}
    for st, (start, _end) in zip(stages, ranges):
        for n, p in st.named_parameters():
            if n.startswith("layers."):
                idx, rest = n.split(".", 2)[1:]
                full = f"model.layers.{start + int(idx)}.{rest}"
            elif n.startswith(("embed_tokens", "norm")):
                full = "model." + n
            else:
                full = n
            if full == "lm_head.weight" and st.config.tie_word_embeddings:
                full = "model.embed_tokens.weight"
            out[full] = out[full] + p.grad if full in out else p.grad
    return out


def _run_pipeline(stages, ids, labels):
    x, outs, leaves = ids, [], []
    for i, st in enumerate(stages):
        leaf = x.detach().requires_grad_(True) if i else None
        y = st(leaf if i else x)
        outs.append(y)
        leaves.append(leaf)
        x = y
    loss, _ = causal_lm_loss(outs[-1], labels)
    loss.backward()
    for i in range(len(stages) - 1, 0, -1):
        outs[i - 1].backward(leaves[i].grad)
    return outs[-1].detach()


@pytest.mark.parametrize("arch", ["llama-tied", "qwen2", "qwen3", "mistral"])
def test_stages_loaded_from_checkpoint_equal_whole_model(arch, tmp_path):
    path = _save(arch, tmp_path / arch, dtype=torch.bfloat16 if arch == "qwen3" else torch.float32)
    assert (path / "model.safetensors.index.json").exists()
    source = open_model(str(path))
    ranges = default_stage_ranges(source.skeleton, 3)
    stages = [source.load_stage(ranges, i, torch.device("cpu")) for i in range(3)]
    for st in stages:
        assert all(p.dtype == torch.float32 and not p.is_meta for p in st.parameters())
    whole = _whole(path)
    ids = torch.randint(0, 512, (2, 12))  # longer than the 4-token sliding windows
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    ref_logits = whole(input_ids=ids).logits
    ref_loss, _ = causal_lm_loss(ref_logits, labels)
    ref_loss.backward()
    logits = _run_pipeline(stages, ids, labels)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=0, atol=1e-5)
    grads = _grads_by_checkpoint_name(stages, ranges)
    ref = {n: p.grad for n, p in whole.named_parameters()}
    assert set(ref) <= set(grads)
    for n, g in ref.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")


def test_stage_hash_covers_only_the_stage_tensors(tmp_path):
    path = _save("llama-tied", tmp_path / "m")
    ranges = [[0, 2], [2, 4]]
    model_hash, before = open_model(str(path)).run_hashes(ranges)
    assert open_model(str(path)).run_hashes(ranges) == (model_hash, before)  # deterministic
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index["model.layers.3.mlp.up_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.3.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    changed, after = open_model(str(path)).run_hashes(ranges)
    assert after[0] == before[0] and after[1] != before[1] and changed != model_hash
    # the tied tail serves the embedding as lm_head: an embedding change is the tail's too
    emb = path / index["model.embed_tokens.weight"]
    tensors = load_file(emb)
    tensors["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, emb, metadata={"format": "pt"})
    third = open_model(str(path)).run_hashes(ranges)[1]
    assert third[0] != after[0] and third[1] != after[1]


def test_memory_is_estimated_from_the_config_alone(tmp_path):
    path = _save("qwen2", tmp_path / "m")
    source = open_model(str(path))
    assert all(p.is_meta for p in source.skeleton.parameters())  # no weight was read
    run = RunRecord(
        run_id="r", model_name="m", model_hash="h", num_layers=4, hidden=64, stages=[[0, 2], [2, 4]]
    )
    cfg = NodeConfig()
    for device in (torch.device("cpu"), torch.device("cuda")):
        assert stage_memory(cfg, run, source.skeleton, device) == stage_memory(cfg, run, _whole(path), device)


def test_run_record_stage_hashes_are_validated():
    base = RunRecord(
        run_id="r", model_name="m", model_hash="h", num_layers=4, hidden=64, stages=[[0, 2], [2, 4]]
    ).to_dict()
    assert RunRecord.from_dict({**base, "stage_hashes": ["a" * 32, "b" * 32]}).stage_hashes[1] == "b" * 32
    for bad in (["a" * 32], ["a" * 32, 7], ["a" * 32, "short"], "a" * 64):
        with pytest.raises(RecordError):
            RunRecord.from_dict({**base, "stage_hashes": bad})


def _fake_hub_snapshot(home: Path, repo: str, checkpoint: Path) -> Path:
    """What huggingface_hub's cache holds after a download: blobs behind a snapshot folder and refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in checkpoint.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snap


def _offline_env(home: Path) -> dict:
    # a closed loopback port: no request can leave, whatever network the machine has
    return {**os.environ, "HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}


def test_model_resolution_local_bundled_and_cached_hub(tmp_path):
    ckpt = _save("llama-tied", tmp_path / "ckpt")
    assert resolve_model_path(str(ckpt)) == str(ckpt)
    assert resolve_model_path("bundled") == str(bundled_dir())
    assert (bundled_dir() / "config.json").exists()
    snap = _fake_hub_snapshot(tmp_path / "hf", "acme/tiny-llama", ckpt)
    code = (
        "import torch; from node.model.loading import open_model; s = open_model('acme/tiny-llama'); "
        "st = s.load_stage([[0, 2], [2, 4]], 1, torch.device('cpu')); "
        "print(s.path, s.name, sum(p.numel() for p in st.parameters()))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path / "hf"),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    path, name, n = p.stdout.split()
    assert Path(path).resolve() == snap.resolve() and name == "acme/tiny-llama"
    whole = _whole(ckpt)
    want = sum(
        p.numel()
        for n_, p in whole.named_parameters()
        if n_.startswith(("model.layers.2.", "model.layers.3."))
    )
    assert int(n) == want + 64 + 512 * 64  # two layers, the final norm, the (tied) lm_head


def test_uncached_hub_model_offline_is_one_line(tmp_path):
    env = _offline_env(tmp_path / "hf")
    p = subprocess.run(
        [sys.executable, "-m", "node", "join", "--model", "acme/not-cached", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error:")
        and "acme/not-cached" in last
        and "cannot reach the Hugging Face Hub" in last
    )
    assert "hf download acme/not-cached" in last  # the fix
    q = subprocess.run(
        [sys.executable, "-c", "from node.model.loading import open_model; open_model('acme/not-cached')"],
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert q.returncode != 0 and "HF_HUB_OFFLINE is set" in q.stderr.strip().splitlines()[-1]


def test_a_checkpoint_without_safetensors_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    with pytest.raises(ModelError, match="no safetensors"):
        open_model(str(tmp_path))


def test_bundled_model_two_stages_equal_whole_ci_sized():
    """The split of the model users get, each stage loaded as a node loads it (the default suite's
    counterpart of tests/test_stages.py's slow bundled test: two stages, one short input)."""
    from node.model.loading import load_model

    source = open_model("bundled")
    ranges = default_stage_ranges(source.skeleton, 2)
    stages = [source.load_stage(ranges, i, torch.device("cpu")) for i in range(2)]
    whole, tok, _ = load_model("bundled")  # transformers' own from_pretrained of the same files
    ids = torch.tensor([tok("Q: 12+34=\nA: 46")["input_ids"]])
    ref_logits = whole(input_ids=ids).logits
    causal_lm_loss(ref_logits, ids)[0].backward()
    logits = _run_pipeline(stages, ids, ids)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=0, atol=1e-4)
    grads = _grads_by_checkpoint_name(stages, ranges)
    ref = dict(whole.named_parameters())
    last = whole.config.num_hidden_layers - 1
    for n in (
        "model.embed_tokens.weight",  # tied: the head's lookup and the tail's lm_head together
        "model.layers.0.self_attn.q_proj.weight",
        f"model.layers.{ranges[1][0]}.mlp.gate_proj.weight",
        f"model.layers.{last}.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(grads[n], ref[n].grad, rtol=1e-3, atol=1e-6, msg=f"gradient of {n}")


@pytest.mark.slow  # writes a 1.9 GB checkpoint and starts 6 processes: ~4 min on 2 shared cores
def test_a_node_serving_one_of_four_stages_peaks_below_half_the_fp32_model(tmp_path):
    from bench.memory.stage_memory import big_config, measure, write_random_checkpoint

    full = write_random_checkpoint(tmp_path / "ckpt", big_config(24))
    assert full >= 1e9
    res = measure(tmp_path / "ckpt")
    bare = res["bare_torch_peak"]
    for i, s in enumerate(res["stages"]):
        assert s["peak"] - bare < 0.5 * full, f"stage {i}: {(s['peak'] - bare) / full:.0%} of the model"
    assert res["starter_hashing"]["peak"] - bare < 0.5 * full


# slow (~55 s, real joins on a checkpoint); the stage hashes are unit-tested above
@pytest.mark.slow
def test_a_joiner_verifies_only_the_stage_it_serves(tmp_path):
    """Real `node join` processes on a checkpoint: a joiner whose copy differs in stage 1 may serve
    stage 0, is refused stage 1 in one line, and one whose config differs is refused outright."""
    import shutil
    import signal

    ours = _save("llama-tied", tmp_path / "ours")
    theirs = tmp_path / "theirs"
    shutil.copytree(ours, theirs)
    index = json.loads((theirs / "model.safetensors.index.json").read_text())["weight_map"]
    shard = theirs / index["model.layers.3.mlp.up_proj.weight"]  # the last layer: always the tail's
    tensors = load_file(shard)
    tensors["model.layers.3.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    other_config = tmp_path / "other-config"
    shutil.copytree(ours, other_config)
    cfg = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))

    def join(*args, state):
        cmd = [sys.executable, "-m", "node", "join", "--codec", "dense", "--state-dir", str(tmp_path / state)]
        # output to files, never a pipe that fills up; the child keeps its own copies of the handles
        with open(tmp_path / f"{state}.out", "w") as out, open(tmp_path / f"{state}.err", "w") as err:
            return subprocess.Popen([*cmd, *args], stdout=out, stderr=err, text=True)

    def text(state, kind="err"):
        return (tmp_path / f"{state}.{kind}").read_text()

    ready = tmp_path / "ready.json"
    starter = join(
        "--model", str(ours), "--stages", "2", "--stage", "1", "--ready-file", str(ready), state="s"
    )
    procs = [starter]
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert starter.poll() is None and time.monotonic() < deadline, text("s")[-2000:]
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        peers = [a if "/p2p/" in a else f"{a}/p2p/{info['peer_id']}" for a in info["maddrs"]]
        common = ["--peers", *peers, "--join-timeout", "60"]
        refused = join(*common, "--model", str(theirs), "--stage", "1", state="j1")
        wrong_config = join(*common, "--model", str(other_config), "--stage", "0", state="j2")
        accepted = join(*common, "--model", str(theirs), "--stage", "0", state="j3")
        procs += [refused, wrong_config, accepted]
        for p, state, needle in (
            (refused, "j1", "weights of stage 1 differ"),
            (wrong_config, "j2", "differs from the run's"),
        ):
            p.wait(timeout=120)
            err = text(state)
            assert p.returncode == 2 and "Traceback" not in err, err[-2000:]
            assert needle in err.strip().splitlines()[-1]
        deadline = time.monotonic() + 120
        while "serves stage 0" not in text("j3", "out"):  # printed once it verified and claimed its stage
            assert accepted.poll() is None and time.monotonic() < deadline, text("j3")[-2000:]
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
