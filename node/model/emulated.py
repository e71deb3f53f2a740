"""Emulated compute: a model whose stages move real-size activations but only *sleep* for the
compute a stated GPU would spend, so a bandwidth-capped swarm on a few CPU cores measures the
network, not the CPUs (bench/network/harness.py, issue 5).

``--model emulate[:HIDDEN[:LAYERS[:US[:VOCAB]]]]`` builds:

* a token embedding (VOCAB x HIDDEN, trainable) on the head, so the head's output is a real
  (batch, tokens, HIDDEN) fp32 activation that the link codec encodes;
* LAYERS decoder layers, each a custom autograd Function that sleeps ``US / 3`` microseconds
  per token in forward and ``2 US / 3`` in backward (training FLOPs split 1:2) and otherwise
  passes the activation through unchanged (a view: no copy, so the CPU stays idle). Each
  layer holds one trainable scalar whose gradient is exact for y = x + (w - stopgrad(w)) e_0:
  the forward value is x, the gradient of w is sum(dL/dy[..., 0]). It trains, it never
  changes what crosses a link;
* a tail "lm_head" that reads the first VOCAB channels, so the tail returns logits of shape
  (batch, tokens, VOCAB) and ``causal_lm_loss`` + backward run through every stage.

The sleeps happen inside the stage's forward and backward, i.e. in the node's compute
thread, exactly where the real model's compute would run. Init is seeded, so every peer
computes the same content hash; the speed figure is part of the config (and so the hash).

Default speed: a Llama-3.2-1B-shaped decoder layer (hidden 2048, 16 layers, ~60.8 M
parameters per layer): 6 * 60.8e6 FLOPs + causal attention 6 * T * h (T = 512) = 0.371 GFLOP
per token per layer, forward + backward, at 40% of the stated GPU's dense BF16 peak: 0.94 us
on an H100 SXM (989.4 TFLOP/s), 5.6 us on an RTX 4090 (165.2). ``--model
emulate:H:L:US:VOCAB:GPU`` names the GPU (default h100).

GPU-side work (issue 16). A node whose model is emulated also gets ``EmulatedCompute`` and
``EmulatedLinkCodec`` (node/stage/emulated.py; node.runtime builds them): the stage's
forward/backward/loss and the codec's dense-side tensor work become sleeps from the cost model
of the GPU here (``codec_gpu_seconds``). bench/results/harness.md writes the derivations out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

EMULATE = "emulate"
DEFAULT_HIDDEN = 2048
DEFAULT_LAYERS = 16
DEFAULT_VOCAB = 256

# Llama-3.2-1B decoder layer: q,o 2048x2048; k,v 2048x512 (8 KV heads of 64); MLP 3 x 2048x8192
LAYER_PARAMS_1B = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
VOCAB_1B = 128256  # Llama-3.2-1B's lm_head rows: the tail's emulated loss pays for them
MFU = 0.40  # a realistic share of peak for a 1B model at 4k-token microbatches


@dataclass(frozen=True)
class Gpu:
    """Datasheet figures of one GPU: what the sleeps are derived from."""

    name: str
    bf16_tflops: float  # dense tensor-core BF16 FLOP/s (no sparsity), 1e12
    fp64_tflops: float  # FP64 tensor-core FLOP/s, 1e12 (the eigensolver)
    hbm_gbps: float  # memory bandwidth, GB/s
    pcie_gbps: float  # host <-> device copies of a payload, GB/s achieved with pinned memory


GPUS = {
    # H100 SXM5 datasheet: 989.4 BF16 (1979 with sparsity), 67 FP64 tensor, 3.35 TB/s HBM3;
    # PCIe Gen5 x16 is 64 GB/s per direction, ~50 achieved
    "h100": Gpu("H100 SXM5", 989.4, 67.0, 3350.0, 50.0),
    # H200 SXM: the H100's compute, 4.8 TB/s HBM3e
    "h200": Gpu("H200 SXM", 989.4, 67.0, 4800.0, 50.0),
    # Ada whitepaper: 165.2 dense BF16 with FP32 accumulate, 1.29 FP64 (1/64 rate), 1008 GB/s;
    # PCIe Gen4 x16 32 GB/s, ~25 achieved
    "rtx4090": Gpu("RTX 4090", 165.2, 1.29, 1008.0, 25.0),
}
DEFAULT_GPU = "h100"

# cost-model constants (stated in bench/results/harness.md)
KERNEL_S = 10e-6  # launch + tail of one small kernel
KERNELS_PER_OP = 3  # e.g. cast, gather, copy
MATMUL_EFF = 0.5  # share of BF16 peak a skinny (T, H) x (H, k) projection reaches
MEM_EFF = 0.8  # share of HBM bandwidth a streaming kernel reaches
SORT_KEYS_PER_S = 5e9  # segmented sort of 32-bit keys (the mask's per-token channel choice)
EIGH_FLOPS = 9.0  # x H^3 for a symmetric eigendecomposition (tridiagonalise + vectors)
EIGH_EFF = 0.1  # share of FP64 peak a 2048 x 2048 eigensolver reaches


def layer_us_per_token(
    layer_params: int = LAYER_PARAMS_1B,
    hidden: int = 2048,
    seq_len: int = 512,
    tflops: float = GPUS[DEFAULT_GPU].bf16_tflops,
    mfu: float = MFU,
) -> float:
    """Microseconds one decoder layer spends per token, forward + backward, at ``mfu`` of ``tflops``."""
    flops = 6 * layer_params + 6 * seq_len * hidden  # dense matmuls + causal attention, fwd+bwd
    return flops / (tflops * 1e12 * mfu) * 1e6


def lm_head_us_per_token(gpu: Gpu, hidden: int = 2048, vocab: int = VOCAB_1B, mfu: float = MFU) -> float:
    """The tail's vocabulary projection and its backward, per token (6 FLOPs per weight)."""
    return 6 * vocab * hidden / (gpu.bf16_tflops * 1e12 * mfu) * 1e6


def codec_gpu_seconds(
    codec_id: str, op: str, rows: int, hidden: int, payload_bytes: int, gpu: Gpu, k: int
) -> float:
    """Seconds the GPU side of one codec operation takes: ``op`` is 'encode' or 'decode'.

    Memory: the fp32 (rows, hidden) side is read (encode) or written (decode), the payload
    written or read, at MEM_EFF of HBM; FLOPs: a projection onto k directions (pca, lowrank),
    lowrank's Gram matrix and eigendecomposition per encode; the mask's per-token channel
    choice as a sort of rows x hidden keys; the payload crosses PCIe; a few kernel launches.
    """
    hbm = rows * hidden * 4 + payload_bytes
    t = KERNELS_PER_OP * KERNEL_S + hbm / (gpu.hbm_gbps * 1e9 * MEM_EFF)
    t += payload_bytes / (gpu.pcie_gbps * 1e9)
    mm = gpu.bf16_tflops * 1e12 * MATMUL_EFF
    if codec_id in ("pca", "lowrank"):
        t += 2 * rows * hidden * k / mm
    if codec_id == "lowrank" and op == "encode":
        t += 2 * rows * hidden * hidden / mm + EIGH_FLOPS * hidden**3 / (gpu.fp64_tflops * 1e12 * EIGH_EFF)
    if codec_id == "mask":
        t += rows * hidden / SORT_KEYS_PER_S
    return t


DEFAULT_US = round(layer_us_per_token(), 2)  # 0.94 (H100 SXM)


def parse_spec(spec: str) -> tuple[int, int, float, int, str]:
    """``emulate[:HIDDEN[:LAYERS[:US[:VOCAB[:GPU]]]]]`` -> (hidden, layers, us/token/layer, vocab, gpu)."""
    parts = spec.split(":")
    if parts[0] != EMULATE or len(parts) > 6:
        raise ValueError(
            f"--model {spec!r}: expected emulate[:HIDDEN[:LAYERS[:US_PER_TOKEN_LAYER[:VOCAB[:GPU]]]]]"
        )
    gpu = parts[5] if len(parts) > 5 and parts[5] else DEFAULT_GPU
    if gpu not in GPUS:
        raise ValueError(f"--model {spec!r}: unknown GPU {gpu!r}; choose from {', '.join(GPUS)}")
    try:
        hidden = int(parts[1]) if len(parts) > 1 and parts[1] else DEFAULT_HIDDEN
        layers = int(parts[2]) if len(parts) > 2 and parts[2] else DEFAULT_LAYERS
        us = float(parts[3]) if len(parts) > 3 and parts[3] else DEFAULT_US
        vocab = int(parts[4]) if len(parts) > 4 and parts[4] else DEFAULT_VOCAB
    except ValueError:
        raise ValueError(f"--model {spec!r}: HIDDEN, LAYERS and VOCAB are integers, US a number") from None
    if hidden < 1 or layers < 1 or not (math.isfinite(us) and us >= 0) or not 2 <= vocab <= hidden:
        raise ValueError(f"--model {spec!r}: need hidden >= 1, layers >= 1, us >= 0, 2 <= vocab <= hidden")
    return hidden, layers, us, vocab, gpu


def sleep_for(seconds: float) -> None:
    """Sleep to a deadline (time.sleep releases the GIL: the event loop keeps serving)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    while True:
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


class _EmulatedCompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, fwd_s_per_token: float, bwd_s_per_token: float):
        tokens = x.numel() // x.shape[-1]
        ctx.bwd_s = bwd_s_per_token * tokens
        sleep_for(fwd_s_per_token * tokens)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sleep_for(ctx.bwd_s)
        # y = x + (w - stopgrad(w)) * e_0: the value is x; dL/dw = sum of dL/dy over channel 0
        gw = grad[..., 0].sum().reshape(1).to(torch.float32)
        return grad, gw, None, None


class EmulatedLayer(nn.Module):
    def __init__(self, us_per_token: float):
        super().__init__()
        self.us_per_token = us_per_token
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor, **_ignored) -> torch.Tensor:
        us = self.us_per_token * 1e-6
        return _EmulatedCompute.apply(hidden, self.w, us / 3.0, 2.0 * us / 3.0)


class EmulatedHead(nn.Module):
    """Logits = the first VOCAB channels of the hidden state (no weights: the tail trains its layers').

    ``weight`` is an empty buffer so node.model.stages' balancer and memory estimate, which read
    ``get_output_embeddings().weight.numel()``, see no lm_head cost (the stages split the layers
    evenly); the lm_head compute of a real 1B model is not emulated (see the report).
    """

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.register_buffer("weight", torch.zeros(0), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., : self.vocab]


class _NoRotary(nn.Module):
    def forward(self, hidden, pos):
        return None


class _Inner(nn.Module):
    def __init__(self, hidden: int, layers: int, us: float, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(EmulatedLayer(us) for _ in range(layers))
        self.norm = nn.Identity()
        self.rotary_emb = _NoRotary()


class EmulatedCausalLM(nn.Module):
    """Quacks like a transformers Llama for node.model.stages (model.model.layers, lm_head, config)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = _Inner(
            config.hidden_size, config.num_hidden_layers, config.emulate_us_per_token_layer, config.vocab_size
        )
        self.lm_head = EmulatedHead(config.vocab_size)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head


def emulated_config(hidden: int, layers: int, us: float, vocab: int, gpu: str = DEFAULT_GPU):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=1 << 16,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    cfg.emulate_us_per_token_layer = float(us)  # part of to_dict(), hence of the content hash
    cfg.emulate_gpu = gpu
    return cfg


def load_emulated(spec: str, seed: int = 0):
    """(model, None, display name) for ``--model emulate:...``; same seed -> same weights."""
    hidden, layers, us, vocab, gpu = parse_spec(spec)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        m = EmulatedCausalLM(emulated_config(hidden, layers, us, vocab, gpu))
        nn.init.normal_(m.model.embed_tokens.weight, std=1.0)
    finally:
        torch.random.set_rng_state(gen_state)
    return m.float().eval(), None, f"emulated-{layers}x{hidden}-{us:g}us-{gpu}"
