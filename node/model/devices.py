"""Which torch device a node computes on."""

from __future__ import annotations

import ctypes
import ctypes.util
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
# What a node's processes hold before any weight: Python with torch, transformers and hivemind
# imported, the DHT process and p2pd (~0.45 GB PSS together in the demo, CPU; by process in
# bench/results/stage_memory.md: p2pd 0.09, DHT process 0.13, torch's shm manager 0.06).
RUNTIME_BYTES = 450 * 10**6
# DiLoCo's averager helper is a fork of the node: it shares the node's pages until the node writes
# them, and what the node writes after the fork is its trained weights (every inner step), so the
# helper keeps their old pages. Frozen weights stay shared. Measured on a 4-stage CPU run
# (stage_memory.md): the helper's PSS 0.59-0.64 GB under full fine-tuning against 0.20-0.24 GB
# under LoRA for the same stage, ~0.4 GB for 100.7 M trained parameters (4.0 B each).
# (Counted until 12/4 as a fixed 0.37 GB: a LoRA replica's estimate was 0.37 GB over.)
AVERAGER_BYTES_PER_PARAM = 4


def layer_activation_values(hidden: int, mlp: int, kv: int) -> int:
    """Values per token that autograd keeps for one Llama-style decoder layer (RMSNorm, GQA
    attention with RoPE, SwiGLU MLP of width ``mlp``; ``kv`` = the k / v projections' width).

    Counted from what each op saves for its backward: each RMSNorm its input and output (2h each),
    RoPE'd q and k (h + kv), SDPA's q, k, v and output (2h + 2kv, its log-sum-exp is per head), o_proj's
    input (h, a copy of the attention output after the head transpose), and the MLP's gate and up
    outputs, SiLU's output and their product (4 mlp): 8h + 3kv + 4 mlp. Measured with
    saved_tensors_hooks on a layer of h 1024, kv 512, mlp 3072: 21.2h against 21.5h counted. The GPT
    figure (34 B per h in 16-bit, Korthikanti et al. 2022) is 17h, a quarter short for SwiGLU."""
    return 8 * hidden + 3 * kv + 4 * mlp


def stage_memory_bytes(
    n_params: int,
    n_layers: int,
    hidden: int,
    vocab: int | None,
    frame_tokens: int,
    max_inflight: int,
    device: torch.device,
    *,
    n_adapters: int | None = None,
    base_bytes: float | None = None,
    outer: bool = False,
    recompute: bool = False,
    mlp: int | None = None,
    kv: int | None = None,
    staged: int = 0,
) -> dict[str, int]:
    """A stage's memory on its device and, apart, on the host.

    Device: with full fine-tuning (``n_adapters`` None) every one of the ``n_params`` weights
    trains; with LoRA the ``n_params`` of the base are frozen at ``base_bytes`` each and the
    ``n_adapters`` adapter parameters train. Trained tensors are fp32 with their gradients and
    AdamW's two moments (16 B each, as ``node.model.loading.weight_dtype`` loads them), 4 B more
    per trained parameter that a step's peak measures beyond them; and the
    activations autograd keeps per in-flight microbatch of ``frame_tokens`` padded tokens
    (``layer_activation_values`` per token and layer, at 2 B under CUDA's bf16 autocast, 4 B on a CPU;
    ``mlp`` and ``kv`` default to a GPT-shaped 4h and h),
    plus the tail's logits. With ``recompute`` (activation checkpointing) a layer keeps only its
    input per microbatch (h values per token) and one layer's activations are live at a time.

    Host: with ``outer`` (DiLoCo rounds with a replica to average with) the outer model, the
    pseudo-gradient and the momentum in fp32 shared memory plus PowerSGD's error feedback, 16 B per
    trained parameter (node.dp.diloco); the larger of a checkpoint's clone of what it saves (the
    trained weights and AdamW's moments, 12 B per trained parameter, plus the outer state, 12
    more), an outer round's copies and ``staged`` (a stage read on the host before it moves to
    the device: an NF4 base at its compute dtype); and the processes' own memory (RUNTIME_BYTES). A lone
    replica builds its outer state only when a partner appears (node.dp.deferred): counted here
    all the same, as the memory it needs then. On a CPU device and host are the same RAM.
    """
    trainable = n_params if n_adapters is None else n_adapters
    frozen = 0 if n_adapters is None else n_params
    weight_bytes = torch.finfo(weight_dtype(device)).bits // 8
    base = weight_bytes if base_bytes is None else base_bytes
    act_bytes = 2 if device.type == "cuda" else 4
    tokens = frame_tokens * max_inflight
    per_layer = layer_activation_values(hidden, mlp or 4 * hidden, kv or hidden) * act_bytes
    if vocab:
        # The tail runs forward, loss and backward of a microbatch in one compute call
        # (node.stage.pipeline), so one microbatch's activations are live there; the others in
        # flight wait as their input frames. lm_head runs only where a label is (Stage.loss): one
        # microbatch's tokens bound its fp32 logits. At the loss's backward four tokens x vocab
        # tensors are alive: log-softmax's saved output, the gradient reaching it, its exp and the
        # logits' gradient (counted as two until 12/4: a LoRA tail of vocab 32000 measured 1.20x).
        live, waiting = frame_tokens, tokens * hidden * act_bytes
        logits = frame_tokens * vocab * 4 * 4
    else:
        live, waiting, logits = tokens, 0, 0
    if recompute:
        activations = n_layers * live * hidden * act_bytes + (live * per_layer if n_layers else 0)
    else:
        activations = n_layers * live * per_layer
    activations += waiting + logits
    # what grows with the in-flight count (a body stage's activations, the tail's waiting frames;
    # not the tail's one live microbatch and its logits): what with_inflight rescales
    scaled = waiting if vocab else activations
    states = int(frozen * base) + trainable * 4 * weight_bytes
    # Measured beyond weights, grads and moments at a node's peak (tests/test_devices.py, a body
    # stage on the CPU with the node's allocator settings): 1.5-7 B per trained parameter, the
    # optimizer step's temporaries and the pages of the first step's moments; 4 B counted.
    step = trainable * 4
    outer_bytes = trainable * 16 if outer else 0
    checkpoint = trainable * 12 + (trainable * 12 if outer else 0)
    # An outer round's copies (node.dp.diloco): the node's d_hat and new theta, the helper's
    # Delta snapshot, its output and, when re-anchoring, theta and momentum: ~24 B per trained
    # parameter at once. Counted as the larger of it and a checkpoint's clone: both are taken
    # between inner steps (only a clone still being written in the background can meet a round).
    round_bytes = trainable * 24 if outer else 0
    runtime = RUNTIME_BYTES + (trainable * AVERAGER_BYTES_PER_PARAM if outer else 0)
    return {
        "states": states,
        "activations": activations,
        "step": step,
        "total": states + activations + step,
        "outer": outer_bytes,
        "checkpoint": checkpoint,
        "round": round_bytes,
        "runtime": runtime,
        "host": outer_bytes + max(checkpoint, round_bytes, staged) + runtime,
        "trainable": trainable,
        "inflight": max_inflight,
        "per_inflight": scaled // max(1, max_inflight),
    }


def with_inflight(mem: dict[str, int], n: int) -> dict[str, int]:
    """The estimate ``mem`` with ``n`` microbatches in flight instead of its cap.

    The cap (``--max-inflight``) is what a stage may hold, so it is what ``--max-memory`` checks;
    how many it does hold depends on the pipeline (a stage that steps after every microbatch, or
    that shares the upstream's microbatches with a replica, holds fewer). A node reports this at the
    peak its gate counted (node.stage.step.StepGate.peak), beside the checked figure."""
    extra = (max(1, n) - mem["inflight"]) * mem["per_inflight"]
    return {
        **mem,
        "inflight": max(1, n),
        "activations": mem["activations"] + extra,
        "total": mem["total"] + extra,
    }


def describe_memory(mem: dict[str, int]) -> str:
    return (
        f"~{mem['total'] / GIB:.1f} GiB on the device (weights, grads, AdamW {mem['states'] / GIB:.1f} GiB, "
        f"activations {mem['activations'] / GIB:.1f} GiB) + ~{mem['host'] / GIB:.1f} GiB on the host "
        "(outer state, checkpoint or round copies, the processes)"
    )


_STATUS_KEYS = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssShmem": "shmem"}


def process_memory(device: torch.device | None = None) -> dict[str, int]:
    """This process's resident memory (peak, now, shared) in bytes from /proc (Linux; {} elsewhere)
    and, on CUDA, the device's peak allocation: what the estimate is checked against."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS_KEYS:
                    out[_STATUS_KEYS[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if device is not None and device.type == "cuda":
        out["device_peak"] = int(torch.cuda.max_memory_allocated(device))
    return out


# glibc's malloc, when a process frees a block it had mmapped, raises its mmap threshold to that
# block's size (up to 32 MiB): from then on a stage's layer tensors (a few MiB each), the
# checkpoint's clones and start-up's whole-stage loads come from the heap arenas, and when they are
# freed the pages stay with the process (measured in the demo: the starter, which hashes and
# calibrates the whole model, held ~0.9 GB more than the replica of its stage all run long; 0.02 GB
# with this and malloc_trim, bench/results/demo.md). A fixed threshold keeps every block of 1 MiB or
# more in its own mapping, which free() hands back to the OS at once; small objects are unaffected.
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
        return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


def keep_large_blocks_returnable() -> bool:
    """Pin glibc's mmap threshold (see MMAP_THRESHOLD_BYTES); False where libc is not glibc."""
    lib = _libc()
    return bool(lib is not None and lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere): after
    a phase that freed much (start-up's whole-model passes, a checkpoint's clones)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
