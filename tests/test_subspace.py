"""Subspace Networks (compression/subspace.py; the model: node/model/subspace.py): basis, codec
exactness, gradients, bytes, model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from compression import subspace as sub
from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.registry import make_codec
from compression.subspace import (
    MissingTokensError,
    SubspaceCodec,
    fingerprint,
    subspace_basis,
    subspace_residual_error,
    token_table,
)
from node.model.subspace import build_subspace_model, residual_at

H, K, V = 32, 4, 300
CTX = LinkContext(seed=1)


def _tiny_config(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def test_basis_orthonormal_deterministic_and_rng_untouched():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    u1 = subspace_basis(7, H, K)
    t1 = token_table(7, V, H)
    codec = SubspaceCodec(k=K, seed=7, vocab=V, hidden=H)
    assert torch.equal(torch.random.get_rng_state(), state), "global RNG was touched"

    sub._basis_cached.cache_clear()
    sub._table_cached.cache_clear()
    torch.manual_seed(999)  # a different global state must not matter
    u2, t2 = subspace_basis(7, H, K), token_table(7, V, H)
    assert torch.equal(u1, u2) and torch.equal(t1, t2) and torch.equal(codec.u, u1)
    eye = (u1.double().T @ u1.double()).sub(torch.eye(K, dtype=torch.float64)).abs().max()
    assert eye < 1e-6
    assert not torch.allclose(u1, subspace_basis(8, H, K))
    assert torch.linalg.matrix_rank(t1.double()) == H  # high rank: full rank min(V, H)


def test_basis_same_in_another_process():
    code = (
        "from compression.subspace import subspace_basis, token_table, fingerprint;"
        f"print(fingerprint(subspace_basis(7, {H}, {K}), token_table(7, {V}, {H})))"
    )
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == fingerprint(subspace_basis(7, H, K), token_table(7, V, H))


def _in_span_activations(seed: int, tokens: torch.Tensor, u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coeff = torch.randn(*tokens.shape, u.shape[1], generator=g)
    return coeff @ u.T + t[tokens]


def test_roundtrip_exact_in_span_and_projection_outside():
    codec = SubspaceCodec(k=K, seed=3, vocab=V, hidden=H, wire_dtype="float32")
    u, t = subspace_basis(3, H, K), token_table(3, V, H)
    tokens = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    x = _in_span_activations(1, tokens, u, t)
    rebuilt = codec.decode_forward(codec.encode_forward_with_tokens(x, tokens, CTX), CTX, tuple(x.shape))
    assert torch.allclose(rebuilt, x, atol=1e-6, rtol=0)

    bf16 = SubspaceCodec(k=K, seed=3, vocab=V, hidden=H)
    approx = bf16.decode_forward(bf16.encode_forward_with_tokens(x, tokens, CTX), CTX, tuple(x.shape))
    assert ((approx - x).norm(dim=-1) / (x - t[tokens]).norm(dim=-1)).max() < 1e-2  # bf16 rounding of c

    y = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2))  # not in the subspace
    proj = codec.decode_forward(codec.encode_forward_with_tokens(y, tokens, CTX), CTX, tuple(y.shape))
    ref = t[tokens] + (y - t[tokens]) @ (u @ u.T)
    assert torch.allclose(proj, ref, atol=1e-5)
    assert not torch.allclose(proj, y, atol=1e-2)


def test_payload_bytes_per_token():
    codec = SubspaceCodec(k=K, seed=3, vocab=V, hidden=H)
    tokens = torch.randint(0, V, (3, 7))
    h = torch.randn(3, 7, H)
    fwd = codec.encode_forward_with_tokens(h, tokens, CTX)
    bwd = codec.encode_backward(torch.randn(3, 7, H), CTX)
    assert payload_nbytes(fwd) == 2 * (K + 1) * 21 == codec.bytes_per_token(H) * 21
    assert payload_nbytes(bwd) == 2 * K * 21 == codec.backward_bytes_per_token() * 21
    assert fwd["tok"].dtype == torch.int16 and fwd["c"].dtype == torch.bfloat16

    big = SubspaceCodec(k=K, seed=3, vocab=70_000, hidden=H)
    ids = torch.tensor([[0, 69_999, 40_000]])
    p = big.encode_forward_with_tokens(torch.randn(1, 3, H), ids, CTX)
    assert p["tok"].dtype == torch.int32 and big.bytes_per_token(H) == 2 * K + 4
    edge = SubspaceCodec(k=K, seed=3, vocab=65_536, hidden=H)  # ids up to 65535 still fit 2 bytes
    ids = torch.tensor([[0, 32_767, 32_768, 65_535]])
    p = edge.encode_forward_with_tokens(torch.randn(1, 4, H), ids, CTX)
    assert p["tok"].dtype == torch.int16
    assert torch.equal(edge.tokens_from_payload(p), ids.reshape(-1))


def test_token_ids_required_one_shot_and_validated():
    codec = SubspaceCodec(k=K, seed=3, vocab=V, hidden=H)
    h, tokens = torch.randn(1, 4, H), torch.randint(0, V, (1, 4))
    with pytest.raises(MissingTokensError):
        codec.encode_forward(h, CTX)
    codec.set_tokens(tokens)
    codec.encode_forward(h, CTX)
    with pytest.raises(MissingTokensError):  # consumed: never silently reused
        codec.encode_forward(h, CTX)
    with pytest.raises(ValueError):
        codec.encode_forward_with_tokens(h, torch.full((1, 4), V), CTX)
    bad = codec.encode_forward_with_tokens(h, tokens, CTX)
    bad["tok"] = torch.full_like(bad["tok"], V)
    with pytest.raises(ValueError):
        codec.decode_forward(bad, CTX, tuple(h.shape))


def test_upstream_gradients_match_explicit_projection():
    """k-number backward through the codec == plain autograd through T + (h − T) U Uᵀ."""
    u, t = subspace_basis(5, H, K), token_table(5, V, H)
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(2, 6, H, generator=gen)
    tokens = torch.randint(0, V, (2, 6), generator=gen)
    w_down = torch.randn(H, generator=gen)
    w0 = torch.randn(H, H, generator=gen) / H**0.5

    def upstream_grad(through_codec: bool) -> torch.Tensor:
        w = w0.clone().requires_grad_(True)
        h = torch.tanh(z @ w) + t[tokens]
        if through_codec:
            codec = SubspaceCodec(k=K, seed=5, vocab=V, hidden=H, wire_dtype="float32")
            codec.set_tokens(tokens)
            x = apply_link(h, codec, CTX)
        else:
            x = t[tokens] + (h - t[tokens]) @ (u @ u.T)
        (torch.sin(x) @ w_down).sum().backward()
        return w.grad

    ref, got = upstream_grad(False), upstream_grad(True)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    # the projection matters here (h is not in the subspace): the dense gradient differs
    w = w0.clone().requires_grad_(True)
    (torch.sin(torch.tanh(z @ w) + t[tokens]) @ w_down).sum().backward()
    assert not torch.allclose(w.grad, ref, atol=1e-3)


def test_built_model_residual_in_subspace_and_exact_boundary():
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    model = build_subspace_model(_tiny_config(), k=K, seed=11).float()
    assert torch.equal(torch.random.get_rng_state(), state)
    u, t = subspace_basis(11, H, K), token_table(11, V, H)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))

    for boundary in (0, 2, 4):
        assert subspace_residual_error(residual_at(model, ids, boundary), ids, u, t) < 1e-5
    from transformers import LlamaForCausalLM

    dense = LlamaForCausalLM(_tiny_config()).float()
    assert subspace_residual_error(residual_at(dense, ids, 2), ids, u, t) > 0.1  # the check can fail
    loose = build_subspace_model(_tiny_config(), k=K, seed=11, unconstrained_last=1).float()
    assert subspace_residual_error(residual_at(loose, ids, 3), ids, u, t) < 1e-5
    assert subspace_residual_error(residual_at(loose, ids, 4), ids, u, t) > 0.1

    # boundary after layer 2 with the k-number codec (fp32 wire) vs the plain model: same loss,
    # same gradients for every parameter (upstream ones get the projected gradient U Uᵀ g)
    def grads(with_codec: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        handle = None
        if with_codec:
            codec = SubspaceCodec(k=K, seed=11, vocab=V, hidden=H, wire_dtype="float32")

            def hook(_m, _inp, out):
                codec.set_tokens(ids)
                if isinstance(out, tuple):
                    return (apply_link(out[0], codec, CTX), *out[1:])
                return apply_link(out, codec, CTX)

            handle = model.model.layers[1].register_forward_hook(hook)
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            if handle is not None:
                handle.remove()
        named = model.named_parameters()
        return float(loss.detach()), {n: p.grad.clone() for n, p in named if p.grad is not None}

    loss_ref, g_ref = grads(False)
    loss_got, g_got = grads(True)
    assert abs(loss_ref - loss_got) < 1e-5
    upstream = [n for n in g_ref if n.startswith(("model.embed_tokens", "model.layers.0", "model.layers.1"))]
    assert "model.embed_tokens.E" in upstream and len(upstream) > 5
    for n in g_ref:
        scale = g_ref[n].abs().max().clamp_min(1e-12)
        assert (g_got[n] - g_ref[n]).abs().max() / scale < 1e-4, n


def test_model_parameters_are_the_subspace_ones():
    model = build_subspace_model(_tiny_config(layers=2), k=K, seed=2)
    names = dict(model.named_parameters())
    assert names["model.embed_tokens.E"].shape == (V, K)
    assert names["model.layers.0.self_attn.o_proj.Z"].shape == (K, H)
    assert names["model.layers.1.mlp.down_proj.Z"].shape == (K, 2 * H)
    assert not any(n.endswith(".U") or n.endswith(".T") for n in model.state_dict())  # rebuilt from seed
    with pytest.raises(ValueError):
        cfg = _tiny_config(layers=2)
        cfg.tie_word_embeddings = True
        build_subspace_model(cfg, k=K, seed=2)


def test_registry_builds_from_describe():
    codec = make_codec("subspace", k=K, seed=9, vocab=V, hidden=H)
    desc = codec.describe()
    again = make_codec(desc["codec"], **{k: v for k, v in desc.items() if k != "codec"})
    assert isinstance(again, SubspaceCodec)
    assert fingerprint(again.u, again.t) == fingerprint(codec.u, codec.t)
