"""LoRA adapters over a frozen base, per stage (``--finetune lora``), with the peft library.

Each stage injects its own adapters (``peft.inject_adapter_in_model``) into the linear layers the
run names (``FinetuneSettings.targets``) and freezes everything else, so the optimizer, the outer
rounds, checkpoints and a joiner's weight pull see the adapters only (they are the stage's
``requires_grad`` parameters).

Same adapters everywhere: peft draws ``lora_A`` from the global RNG, which differs between
processes and stage splits. Here every ``lora_A`` is drawn again from a generator seeded by the
run seed and the module's *whole-model* name (``model.layers.12.self_attn.q_proj``), and
``lora_B`` starts at zero (peft's default: the adapted model starts as the base). Two replicas, or
the same layer in a 2-stage and a 4-stage split, start bit-identical.

The names this module speaks (``adapter_tensors``) are the whole model's, in peft's saved form
(``model.layers.3.mlp.up_proj.lora_A.weight``), so export can merge them onto the base and write
a peft adapter directory without knowing how the run was split.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re

import torch
from torch import nn

from protocol.settings import FinetuneSettings


class _NoKernelsHint(logging.Filter):
    """``import peft`` imports bitsandbytes, whose CPU backend, on a CPU with AVX512-BF16, looks for
    an optional fused 4-bit kernel through the ``kernels`` package (which fetches kernel code from
    the Hugging Face Hub; not a dependency here) and logs a warning when it is absent, on every
    import, NF4 in use or not. Without it bitsandbytes uses its own CPU kernels (``--base-dtype nf4``
    on a CPU still works), so the line, the last one ``make demo`` printed, told users nothing they
    could act on. Only that record of that logger is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# before any import of peft (every one is in this module's functions)
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsHint())

ADAPTER = "default"  # peft's name for the one adapter a stage holds
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_LORA_RE = re.compile(r"^(.+)\.lora_([AB])\.default\.weight$")


class AdapterError(ValueError):
    """A run's adapter settings that cannot apply to this model; the message is one line."""


def targets_of(ft: FinetuneSettings) -> list[str]:
    return [t.strip() for t in ft.targets.split(",") if t.strip()]


def scaling(ft: FinetuneSettings) -> float:
    """peft's update scale alpha / r (plain LoRA, not rsLoRA)."""
    return ft.alpha / ft.rank


def whole_model_name(local: str, start: int) -> str:
    """A stage-local module name -> the whole model's (layer j of a stage that starts at ``start``)."""
    m = _LAYER_RE.match(local)
    if m:
        return f"model.layers.{start + int(m.group(1))}.{m.group(2)}"
    return local if local.startswith("lm_head") else f"model.{local}"


def _seed_of(run_seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"lora|{run_seed}|{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def lora_config(ft: FinetuneSettings):
    from peft import LoraConfig

    return LoraConfig(
        r=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout, target_modules=targets_of(ft), bias="none"
    )


def add_adapters(stage: nn.Module, ft: FinetuneSettings, run_seed: int) -> int:
    """Inject seeded LoRA adapters into ``stage`` and freeze the rest; returns the adapter count.

    ``stage`` is a ``node.model.stages.Stage`` (its ``start`` places its layers in the whole
    model). Raises AdapterError when no target module exists in the stage's layers.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    targets = targets_of(ft)
    present = {n.rsplit(".", 1)[-1] for n, m in stage.named_modules() if isinstance(m, nn.Linear)}
    if stage.layers and not set(targets) & present:
        raise AdapterError(
            f"--lora-targets {ft.targets!r} names no linear layer of this model (it has: "
            f"{', '.join(sorted(present))})"
        )
    try:
        inject_adapter_in_model(lora_config(ft), stage)
    except ValueError as e:  # a stage with no target (e.g. a head holding only the embedding)
        if "not found in the base model" not in str(e):
            raise
        return 0
    n = 0
    with torch.no_grad():
        for name, module in stage.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
                continue
            # fp32 over any base (peft gives a bf16 base bf16 adapters): AdamW needs it, and the seeded
            # values must be the same on every node, whatever base dtype each one holds
            module.lora_A[ADAPTER].float()
            module.lora_B[ADAPTER].float()
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            gen = torch.Generator().manual_seed(_seed_of(run_seed, whole_model_name(name, stage.start)))
            # peft's own init of A (kaiming-uniform, a = sqrt(5)), from our generator
            bound = 1.0 / math.sqrt(a.shape[1])
            a.copy_(torch.empty(a.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen))
            b.zero_()
            n += 1
    for pname, p in stage.named_parameters():
        p.requires_grad_(".lora_" in pname)
    return n


def adapter_params(layers: nn.Module, ft: FinetuneSettings) -> int:
    """How many adapter parameters ``add_adapters`` will put into these layers: r x (in + out) per
    targeted linear layer (counted on a meta model before any weight loads)."""
    targets = set(targets_of(ft))
    return sum(
        ft.rank * (m.in_features + m.out_features)
        for name, m in layers.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )


def cast_base(stage: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base's parameters to ``dtype``; the adapters stay fp32 (their optimizer needs it)."""
    for _, p in stage.named_parameters():
        if not p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def base_dtype(choice: str, device: torch.device) -> torch.dtype:
    """``--base-dtype``: auto = bf16 on CUDA (autocast computes in bf16 anyway), fp32 on the CPU.
    With nf4, the dtype of what stays unquantized (norms, embeddings, lm_head) and of the compute."""
    if choice == "bf16" or (choice in ("auto", "nf4") and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


# NF4 (QLoRA; Dettmers et al. 2023) as bitsandbytes stores it: 4 bits a weight, an 8-bit absmax per
# block of 64 and an fp32 scale per 256 blocks of those ("double quantization"): 0.5 + 1/64 + 4/16384 B
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def frozen_bytes_per_param(layers: nn.Module, n_params: int, choice: str, device: torch.device) -> float:
    """Bytes per frozen parameter of a LoRA stage holding ``n_params`` in all, ``layers`` its decoder
    layers (a meta skeleton will do), under ``--base-dtype choice``: with nf4 the layers' linear
    weights at ``NF4_BYTES``, the rest (norms, embeddings, lm_head) at the compute dtype."""
    plain = torch.finfo(base_dtype(choice, device)).bits // 8
    if choice != "nf4":
        return float(plain)
    quantized = sum(m.weight.numel() for m in layers.modules() if type(m) is nn.Linear)
    return (quantized * NF4_BYTES + (n_params - quantized) * plain) / max(n_params, 1)


def nf4_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def quantize_base(stage: nn.Module, compute_dtype: torch.dtype, device: torch.device | None = None) -> int:
    """Every frozen linear layer of the stage's decoder layers (the adapters' base layers among them)
    to NF4 (bitsandbytes ``Linear4bit``), computing in ``compute_dtype``; returns how many.

    Embeddings and lm_head stay at ``compute_dtype`` (QLoRA's practice: they are a small share of a
    large model and the logits are where quantization error costs most). The adapters stay fp32 on
    top: peft's LoRA layer adds its update to whatever its base layer returns. Quantization is
    deterministic per tensor, so every replica and any stage split holds the same base. With
    ``device``, each quantized layer is moved there as it is made (a stage read on the host reaches
    the GPU one layer at a time, never whole at its compute dtype).
    """
    import bitsandbytes as bnb

    count = 0
    for parent in list(stage.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.requires_grad:
                continue
            target = device or child.weight.device
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            weight = child.weight.data.to(compute_dtype)
            q.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, compress_statistics=True, quant_type="nf4"
            )
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(parent, name, q.to(target))  # Params4bit quantizes as it moves to its device
            del child, weight
            count += 1
    return count


def frozen_base(stage: nn.Module) -> str:
    """What the stage holds its frozen base in, as its stage record announces it: ``nf4``, ``bf16``
    or ``fp32`` (its decoder layers' weights); "" when every weight trains (full fine-tuning)."""
    kinds = set()
    for m in stage.layers.modules():
        if type(m).__name__ == "Linear4bit":
            return "nf4"
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter) and not w.requires_grad:
            kinds.add(w.dtype)
    if not kinds:
        return ""
    return "bf16" if torch.bfloat16 in kinds else "fp32"


def is_adapter(local_name: str) -> bool:
    return _LORA_RE.match(local_name) is not None


def by_whole_name(named: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    """A stage's adapter tensors (stage-local peft names) under whole-model names in peft's saved
    form (``model.layers.3.self_attn.q_proj.lora_A.weight``); other tensors are left out."""
    out = {}
    for name, t in named.items():
        m = _LORA_RE.match(name)
        if m:
            out[f"{whole_model_name(m.group(1), start)}.lora_{m.group(2)}.weight"] = t
    return out


def adapter_tensors(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's adapters (live parameters) under whole-model names (``by_whole_name``)."""
    return by_whole_name(dict(stage.named_parameters()), stage.start)


def merge_into(
    state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], ft: FinetuneSettings
) -> int:
    """Add every adapter's update (alpha/r) B A to its base weight in ``state`` (whole-model names).

    Returns how many weights changed. Raises AdapterError for an adapter whose module the model
    lacks or whose pair is incomplete.
    """
    s, n = scaling(ft), 0
    modules = {k[: -len(".lora_A.weight")] for k in adapters if k.endswith(".lora_A.weight")}
    for mod in sorted(modules):
        b = adapters.get(f"{mod}.lora_B.weight")
        w = f"{mod}.weight"
        if b is None or w not in state:
            raise AdapterError(f"adapter {mod} has no {'lora_B' if b is None else 'base weight'}")
        a = adapters[f"{mod}.lora_A.weight"]
        state[w] = (state[w].float() + s * (b.float() @ a.float())).to(state[w].dtype)
        n += 1
    return n


def save_peft_adapter(out, adapters: dict[str, torch.Tensor], ft: FinetuneSettings, base_name: str) -> None:
    """A directory ``peft.PeftModel.from_pretrained(base, out)`` loads (adapter_config.json + safetensors)."""
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = lora_config(ft)
    cfg.base_model_name_or_path = base_name
    cfg.task_type = "CAUSAL_LM"
    cfg.save_pretrained(str(out))
    tensors = {f"base_model.model.{k}": v.detach().float().contiguous().cpu() for k, v in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def moving_parameters(stage: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters training moves: all of them, or the adapters over a frozen base."""
    named = dict(stage.named_parameters())
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    return named if len(trainable) == len(named) else trainable


def trained_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint or a weight pull must carry: the whole state when every weight trains,
    only the trainable tensors (the adapters) over a frozen base, which any node reloads from the
    model itself."""
    named = dict(stage.named_parameters())
    if all(p.requires_grad for p in named.values()):
        return stage.state_dict()
    return {n: p for n, p in named.items() if p.requires_grad}


def load_trained_state(stage: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what ``trained_state`` gave; over a frozen base, exactly the trainable tensors must come."""
    named = dict(stage.named_parameters())
    if all(p.requires_grad for p in named.values()):
        stage.load_state_dict(state)
        return
    want = {n for n, p in named.items() if p.requires_grad}
    if set(state) != want:
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise AdapterError(
            f"the saved adapters do not fit this stage (missing {missing[:2]}, unexpected {extra[:2]}); "
            "was it saved with other --lora-* settings?"
        )
    with torch.no_grad():
        for n in want:
            named[n].copy_(state[n])
