"""Which torch device a node computes on."""

from __future__ import annotations

import logging

import torch

from node.model.loading import weight_dtype

log = logging.getLogger("node")


def pick_device(choice: str, quiet: bool = False) -> torch.device:
    """auto: CUDA when present, else CPU (with a message); cuda without CUDA falls back the same way.

    Every command picks its device here (join, swarm's nodes, eval, generate), so ``--device cuda``
    on a machine without CUDA means the same everywhere: one warning line, then the CPU. Why a
    fallback rather than a refusal: a volunteer's node is started from a fixed command line (a
    compose file, a unit) that should not stop contributing because a driver went missing, and a
    CPU node still serves a stage correctly, only slower; the warning says so at once. (eval used
    to refuse while join fell back: the same flag meant two things.)"""
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, not {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if choice == "cuda" and not quiet:
        log.warning("--device cuda: CUDA is not available on this machine; falling back to CPU")
    return torch.device("cpu")


# A GPU volunteer's microbatches: 2048 padded tokens. Why: the lowrank link carries a k x H basis
# in every frame, so its bytes per token fall with the frame (k = 80, H = 576: 6.3x fewer than dense
# at 512 tokens, 10.4x at 2048, 11.7x at 4096) and a GPU runs 2048 tokens of a stage in about the
# time of 512; beyond 2048 the gain is small and each hop's frame waits longer on the link.
# A CPU keeps --microbatch examples (a 2048-token microbatch is seconds of compute per stage).
GPU_MICROBATCH_TOKENS = 2048


def default_microbatch_tokens(device: torch.device) -> int:
    return GPU_MICROBATCH_TOKENS if device.type == "cuda" else 0


GIB = 1024**3


def stage_memory_bytes(
    n_params: int,
    n_layers: int,
    hidden: int,
    vocab: int | None,
    frame_tokens: int,
    max_inflight: int,
    device: torch.device,
) -> dict[str, int]:
    """A stage's memory: weights + grads + AdamW's two moments, all in the weights' dtype (fp32, as
    ``node.model.loading.weight_dtype`` loads them: 16 B/param), and the activations autograd keeps per
    in-flight microbatch of ``frame_tokens`` padded tokens (~34·h bytes per token per layer in
    16-bit, doubled in fp32; Korthikanti et al. 2022), plus the tail's logits."""
    act_bytes = 2 if device.type == "cuda" else 4
    tokens = frame_tokens * max_inflight
    activations = n_layers * tokens * 34 * hidden * act_bytes // 2
    if vocab:
        activations += tokens * vocab * 4 * 2  # fp32 logits and their gradient
    weight_bytes = torch.finfo(weight_dtype(device)).bits // 8
    states = n_params * 4 * weight_bytes
    return {"states": states, "activations": activations, "total": states + activations}


def describe_memory(mem: dict[str, int]) -> str:
    return (
        f"~{mem['total'] / GIB:.1f} GiB (weights+grads+AdamW {mem['states'] / GIB:.1f} GiB, "
        f"activations {mem['activations'] / GIB:.1f} GiB)"
    )
