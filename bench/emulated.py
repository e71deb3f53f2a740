"""Emulated compute: a model whose stages move real-size activations but only *sleep* for the
compute a stated GPU would spend, so a bandwidth-capped swarm on a few CPU cores measures the
network, not the CPUs (bench/harness.py, issue 5).

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

Default speed: 5.6 us per token per layer (forward + backward) is a Llama-3.2-1B-shaped
decoder layer (hidden 2048, 16 layers, ~60.8 M parameters per layer) trained on an RTX 4090
at 40% of its 165.2 dense BF16 TFLOP/s (FP32 accumulate; NVIDIA Ada GA102 whitepaper):
6 * 60.8e6 FLOPs + causal attention 6 * T * h (T = 512) = 0.371 GFLOP per token per layer,
/ 66 TFLOP/s = 5.6 us. bench/results/harness.md writes the derivation out.
"""

from __future__ import annotations

import time

import torch
from torch import nn

EMULATE = "emulate"
DEFAULT_HIDDEN = 2048
DEFAULT_LAYERS = 16
DEFAULT_VOCAB = 256

# Llama-3.2-1B decoder layer: q,o 2048x2048; k,v 2048x512 (8 KV heads of 64); MLP 3 x 2048x8192
LAYER_PARAMS_1B = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
RTX4090_BF16_TFLOPS = 165.2  # dense tensor FLOP/s, FP32 accumulate (Ada whitepaper)
MFU = 0.40  # a realistic share of peak for a 1B model at 4k-token microbatches


def layer_us_per_token(
    layer_params: int = LAYER_PARAMS_1B,
    hidden: int = 2048,
    seq_len: int = 512,
    tflops: float = RTX4090_BF16_TFLOPS,
    mfu: float = MFU,
) -> float:
    """Microseconds one decoder layer spends per token, forward + backward, at ``mfu`` of ``tflops``."""
    flops = 6 * layer_params + 6 * seq_len * hidden  # dense matmuls + causal attention, fwd+bwd
    return flops / (tflops * 1e12 * mfu) * 1e6


DEFAULT_US = round(layer_us_per_token(), 1)  # 5.6


def parse_spec(spec: str) -> tuple[int, int, float, int]:
    """``emulate[:HIDDEN[:LAYERS[:US[:VOCAB]]]]`` -> (hidden, layers, us per token per layer, vocab)."""
    parts = spec.split(":")
    if parts[0] != EMULATE or len(parts) > 5:
        raise ValueError(f"--model {spec!r}: expected emulate[:HIDDEN[:LAYERS[:US_PER_TOKEN_LAYER[:VOCAB]]]]")
    try:
        hidden = int(parts[1]) if len(parts) > 1 and parts[1] else DEFAULT_HIDDEN
        layers = int(parts[2]) if len(parts) > 2 and parts[2] else DEFAULT_LAYERS
        us = float(parts[3]) if len(parts) > 3 and parts[3] else DEFAULT_US
        vocab = int(parts[4]) if len(parts) > 4 and parts[4] else DEFAULT_VOCAB
    except ValueError:
        raise ValueError(f"--model {spec!r}: HIDDEN, LAYERS and VOCAB are integers, US a number") from None
    if hidden < 1 or layers < 1 or us < 0 or not 2 <= vocab <= hidden:
        raise ValueError(f"--model {spec!r}: need hidden >= 1, layers >= 1, us >= 0, 2 <= vocab <= hidden")
    return hidden, layers, us, vocab


def _sleep(seconds: float) -> None:
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
        _sleep(fwd_s_per_token * tokens)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.bwd_s)
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

    ``weight`` is an empty buffer so node.stages' balancer and memory estimate, which read
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
    """Quacks like a transformers Llama for node.stages (model.model.layers, lm_head, config)."""

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


def emulated_config(hidden: int, layers: int, us: float, vocab: int):
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
    return cfg


def load_emulated(spec: str, seed: int = 0):
    """(model, None, display name) for ``--model emulate:...``; same seed -> same weights."""
    hidden, layers, us, vocab = parse_spec(spec)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        m = EmulatedCausalLM(emulated_config(hidden, layers, us, vocab))
        nn.init.normal_(m.model.embed_tokens.weight, std=1.0)
    finally:
        torch.random.set_rng_state(gen_state)
    return m.float().eval(), None, f"emulated-{layers}x{hidden}-{us:g}us"
