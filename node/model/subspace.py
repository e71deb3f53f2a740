"""The Subspace Networks model surgery (DESIGN.md 4.4): a Llama-style causal LM constrained so
that its residual stream is always ``T[tok] + span(U)``.

The math (U, T, the constrained layers, the exact boundary codec) is ``compression/subspace.py``;
this module reaches into a transformers model (duck-typed: ``model.model.{embed_tokens, layers}``,
each layer with ``self_attn.o_proj`` and ``mlp.down_proj``) to put those layers in.
"""

from __future__ import annotations

import torch
from torch import nn

from compression.subspace import (
    DEFAULT_T_STD,
    SubspaceEmbedding,
    SubspaceLinear,
    subspace_basis,
    token_table,
)


def constrain_llama_(
    model: nn.Module, u: torch.Tensor, t: torch.Tensor, unconstrained_last: int = 0
) -> nn.Module:
    """Impose the subspace constraint on a (fresh) Llama-style causal LM in place.

    Replaces ``model.model.embed_tokens`` by a ``SubspaceEmbedding`` and the ``o_proj`` and
    ``down_proj`` of every decoder layer but the last ``unconstrained_last`` by
    ``SubspaceLinear``, each initialised with the projection of the dense weights it
    replaces. Tied input/output embeddings are refused (the head would share E's shape).
    """
    inner = model.model
    layers = inner.layers
    if not 0 <= unconstrained_last <= len(layers):
        raise ValueError(f"unconstrained_last must lie in [0, {len(layers)}]")
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None and out_emb.weight is inner.embed_tokens.weight:
        raise ValueError("tied word embeddings are not supported here: set tie_word_embeddings=False")
    if u.shape[0] != inner.embed_tokens.embedding_dim or t.shape != inner.embed_tokens.weight.shape:
        raise ValueError("U / T do not match the model's hidden size and vocabulary")
    inner.embed_tokens = SubspaceEmbedding.from_embedding(inner.embed_tokens, u, t)
    for layer in list(layers)[: len(layers) - unconstrained_last]:
        layer.self_attn.o_proj = SubspaceLinear.from_linear(layer.self_attn.o_proj, u)
        layer.mlp.down_proj = SubspaceLinear.from_linear(layer.mlp.down_proj, u)
    return model


def build_subspace_model(
    config, k: int, seed: int, unconstrained_last: int = 0, t_std: float = DEFAULT_T_STD
) -> nn.Module:
    """A fresh ``LlamaForCausalLM(config)`` with the subspace constraint (``constrain_llama_``).

    Initial weights come from torch's RNG seeded with ``seed`` inside ``fork_rng``, so the
    global RNG state is unchanged and every peer builds the same model. U and T come from
    ``subspace_basis(seed, H, k)`` and ``token_table(seed, V, H, t_std)``.
    """
    from transformers import LlamaForCausalLM

    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("set tie_word_embeddings=False for a subspace model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    u = subspace_basis(seed, config.hidden_size, k)
    t = token_table(seed, config.vocab_size, config.hidden_size, t_std)
    return constrain_llama_(model, u, t, unconstrained_last=unconstrained_last)


def residual_at(model: nn.Module, input_ids: torch.Tensor, boundary: int) -> torch.Tensor:
    """The residual stream after ``boundary`` decoder layers (0: the embedding output).

    Captured with a forward hook during a plain ``model(input_ids)`` call.
    """
    inner = model.model
    if not 0 <= boundary <= len(inner.layers):
        raise ValueError(f"boundary must lie in [0, {len(inner.layers)}]")
    module = inner.embed_tokens if boundary == 0 else inner.layers[boundary - 1]
    seen: list[torch.Tensor] = []

    def hook(_mod, _inp, out):
        seen.append(out[0] if isinstance(out, tuple) else out)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        handle.remove()
    return seen[0]
