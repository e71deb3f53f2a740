"""The node's memory estimate for a Llama-3.1-8B-shaped model, full fine-tuning against LoRA (QLoRA too).

    python -m bench.memory.memory_table --out bench/results

Nothing is loaded: the model is built on the meta device and every figure is what
``node.join.stage_memory`` (``node.model.devices.stage_memory_bytes``) tells a node before it
claims a stage, for a GPU node (bf16 autocast, 2,048-token frames, 4 in flight, DiLoCo on with a
replica), with and without ``--recompute-layers``, the frozen base in bf16 or NF4. Writes its
table into ``stage_memory.md`` (in place of the one an earlier run wrote).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from node.config import NodeConfig, run_parts
from node.join import stage_memory
from node.model.devices import GIB
from node.model.stages import default_stage_ranges
from protocol.records import RunRecord


def llama_8b_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


_BASE = {"auto": "bf16", "nf4": "nf4"}  # a GPU node's frozen base under each --base-dtype
HEADING = "## The estimate for a Llama-3.1-8B shape, full fine-tuning against LoRA (issue 32)"


def rows(model, n_stages: int) -> list[str]:
    ranges = default_stage_ranges(model, n_stages)
    out = []
    for finetune, recompute, base in (
        ("full", False, "auto"),
        ("lora", False, "auto"),
        ("lora", True, "auto"),
        ("lora", True, "nf4"),
    ):
        cfg = NodeConfig(
            finetune=finetune, recompute_layers=recompute, microbatch_tokens=2048, base_dtype=base
        )
        run = RunRecord(
            run_id="m", model_name="llama-3.1-8b-shape", model_hash="", num_layers=32, hidden=4096,
            stages=ranges, **run_parts(cfg),
        )  # fmt: skip
        mem = stage_memory(cfg, run, model, torch.device("cuda"))
        body = max(range(n_stages), key=lambda i: mem[i]["total"] if 0 < i < n_stages - 1 else -1)
        for i in sorted({0, body, n_stages - 1}):
            m = mem[i]
            out.append(
                f"| {n_stages} | {i} ({ranges[i][0]}-{ranges[i][1] - 1}) | {finetune}"
                f"{' + recompute' if recompute else ''} | {'-' if finetune == 'full' else _BASE[base]} | "
                f"{m['trainable'] / 1e6:,.1f} M | "
                f"{m['states'] / GIB:.1f} | {m['activations'] / GIB:.1f} | **{m['total'] / GIB:.1f}** | "
                f"{m['host'] / GIB:.2f} |"
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    a = p.parse_args(argv)
    model = llama_8b_shape()
    lines = [
        HEADING,
        "",
        "`python -m bench.memory.memory_table --out bench/results`: what a GPU node's estimate says "
        "before it",
        "claims a stage (hidden 4096, 32 layers, MLP 14336, vocab 128256; bf16 autocast; under LoRA r = 16",
        "on q, k, v, o, gate, up, down a frozen base in bf16, or with `--base-dtype nf4` its decoder",
        "layers' linear weights in 4-bit NF4, 0.52 B each; 2,048-token frames, 4 in flight; DiLoCo on",
        "with a replica). Device = weights + the trained tensors' grads and AdamW + the step's",
        "temporaries + activations; host = DiLoCo's outer state + the larger of a checkpoint's clone",
        "and a round's copies + the processes' own memory. Head, the largest body stage, tail.",
        "",
        "| stages | stage (layers) | fine-tuning | base | trained params | weights+optimizer GiB | "
        "activations GiB | device GiB | host GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in (4, 8):
        lines += rows(model, n)
    text = "\n".join(lines) + "\n"
    print(text)
    path = Path(a.out) / "stage_memory.md"
    path.write_text(replace_section(path.read_text() if path.exists() else "", HEADING, text))
    return 0


def replace_section(doc: str, heading: str, text: str) -> str:
    """``doc`` with its section under ``heading`` (up to the next ``## ``) replaced by ``text``,
    or ``text`` appended when it has none."""
    start = doc.find(heading)
    if start < 0:
        return doc.rstrip("\n") + "\n\n" + text
    end = doc.find("\n## ", start + len(heading))
    rest = "" if end < 0 else doc[end + 1 :]
    return doc[:start] + text + ("\n" + rest if rest else "")


if __name__ == "__main__":
    raise SystemExit(main())
