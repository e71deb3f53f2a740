"""The S-stage pipeline, run hop by hop as the nodes run it, equals the whole model."""

import copy

import pytest
import torch

from compression.codec import DenseCodec, LinkContext
from node.dp.strategies import mean_and_clip
from node.dp.tied import partner_gradient, tied_payload
from node.model.loading import load_model, tiny_config
from node.model.stages import IGNORE_INDEX, balance_layers, build_stage, causal_lm_loss, default_stage_ranges
from protocol.frames import Frame, decode_frame, encode_frame


def _reference(model, ids, labels):
    ref = copy.deepcopy(model)
    logits = ref(input_ids=ids).logits
    loss, _ = causal_lm_loss(logits, labels)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _through_wire(t: torch.Tensor, codec, direction: str) -> torch.Tensor:
    """Encode with the codec, cross a real frame encode/decode, decode: what a hop does."""
    ctx = LinkContext()
    payload = codec.encode_forward(t, ctx) if direction == "f" else codec.encode_backward(t, ctx)
    frame = decode_frame(
        encode_frame(Frame(kind="forward", run_id="r", tensors=payload, shape=list(t.shape)))
    )
    dec = codec.decode_forward if direction == "f" else codec.decode_backward
    return dec(frame.tensors, ctx, tuple(t.shape))


def _pipeline(model, ranges, ids, labels, codec):
    pm = copy.deepcopy(model)
    # each stage gets its own copy of the model, as separate processes would
    stages = [build_stage(pm, ranges, i, keep_model=True) for i in range(len(ranges))]
    outs, leaves = [], []
    x = ids
    for i, st in enumerate(stages):
        leaf = None
        if i > 0:
            leaf = _through_wire(x.detach(), codec, "f").requires_grad_(True)
            x = leaf
        y = st(x)
        outs.append(y)
        leaves.append(leaf)
        x = y
    loss, _ = causal_lm_loss(outs[-1], labels)
    loss.backward()
    for i in range(len(stages) - 1, 0, -1):
        g = _through_wire(leaves[i].grad, codec, "b")
        outs[i - 1].backward(g)
    return outs[-1].detach(), loss.detach(), stages


def _over_frame(tensors: dict) -> dict:
    return decode_frame(encode_frame(Frame(kind="tied", run_id="r", step=0, tensors=tensors))).tensors


def _exchange_tied(stages) -> None:
    """What the head and the tail do at their step (node.dp.tied): each adds the other's gradient of the
    tied tensor, sent as the node sends it (the head's rows, the tail's dense gradient) in a frame."""
    emb, lm = stages[0].embed_tokens.weight, stages[-1].lm_head.weight
    to_tail = _over_frame(tied_payload(emb.grad, from_head=True))
    to_head = _over_frame(tied_payload(lm.grad, from_head=False))
    mean_and_clip([emb], 1, None, tied=(emb, partner_gradient(to_head, emb, from_head=False)))
    mean_and_clip([lm], 1, None, tied=(lm, partner_gradient(to_tail, lm, from_head=True)))


def _grads_by_full_name(stages, ranges):
    out = {}
    for st, (start, _end) in zip(stages, ranges):
        for n, p in st.named_parameters():
            if n.startswith("layers."):
                idx, rest = n.split(".", 2)[1:]
                full = f"model.layers.{start + int(idx)}.{rest}"
            elif n.startswith("embed_tokens"):
                full = "model." + n
            elif n.startswith("norm"):
                full = "model." + n
            elif n.startswith("lm_head"):
                full = n
            else:
                continue
            out[full] = out[full] + p.grad if full in out and p.grad is not None else p.grad
    return out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_pipeline_equals_whole_model(n_stages, tie):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=4, tie=tie)).float()
    ids = torch.randint(0, 512, (2, 12))
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    ref_logits, ref_loss, ref_grads = _reference(model, ids, labels)
    ranges = default_stage_ranges(model, n_stages)
    logits, loss, stages = _pipeline(model, ranges, ids, labels, DenseCodec("float32"))
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    if tie and n_stages > 1:
        _exchange_tied(stages)
    grads = _grads_by_full_name(stages, ranges)
    names = {n for n in ref_grads if not (tie and n == "lm_head.weight")}
    assert names <= set(grads) | ({"lm_head.weight"} if tie else set())
    for n in names:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")
    if tie and n_stages > 1:  # the tail's copy took the same summed gradient, bit for bit
        assert torch.equal(grads["lm_head.weight"], grads["model.embed_tokens.weight"])


def test_bf16_wire_is_close_but_not_exact(tiny_model):
    ids = torch.randint(0, 512, (2, 12))
    ref_logits, _, _ = _reference(tiny_model, ids, ids)
    ranges = default_stage_ranges(tiny_model, 2)
    logits, _, _ = _pipeline(tiny_model, ranges, ids, ids, DenseCodec("bfloat16"))
    err = (logits - ref_logits).abs().max().item()
    assert 0 < err < 0.05


def test_balance_layers_minimises_the_largest_stage():
    costs = [1.0] * 8
    assert balance_layers(costs, 2) == [[0, 4], [4, 8]]
    # a heavy tail (lm_head) gets fewer layers
    r = balance_layers(costs, 2, tail_extra=4.0)
    assert r == [[0, 6], [6, 8]]
    for n in range(1, 9):
        r = balance_layers(costs, n)
        assert len(r) == n and r[0][0] == 0 and r[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
    with pytest.raises(ValueError):
        balance_layers(costs, 9)


@pytest.mark.slow
def test_bundled_model_two_stages_equal_whole():
    model, tok, _ = load_model("bundled")
    ids = torch.tensor([tok("Q: 12+34=\nA: 46")["input_ids"]])
    ref_logits, ref_loss, ref_grads = _reference(model, ids, ids)
    ranges = default_stage_ranges(model, 2)
    logits, loss, stages = _pipeline(model, ranges, ids, ids, DenseCodec("float32"))
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    grads = _grads_by_full_name(stages, ranges)
    for n in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-3, atol=1e-6)


def test_tail_loss_on_labelled_positions_equals_full_loss(tiny_model):
    ranges = default_stage_ranges(tiny_model, 2)
    tail_a = build_stage(tiny_model, ranges, 1, keep_model=True)
    tail_b = copy.deepcopy(tail_a)
    x = torch.randn(3, 10, 64)
    labels = torch.randint(0, 512, (3, 10))
    labels[:, :6] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, n_ref = causal_lm_loss(tail_a(xa), labels)
    got, n = tail_b.loss(xb, labels)
    assert n == n_ref == 2 * 4
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    ref.backward()
    got.backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-7)
    for (name, pa), (_, pb) in zip(tail_a.named_parameters(), tail_b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_recomputed_layers_give_the_same_gradients_and_keep_only_their_inputs():
    """--recompute-layers: the same loss and gradients, and autograd keeps a fraction of the bytes."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=4, hidden=64)).eval()
    stage = build_stage(model, [[0, 1], [1, 4]], 1)
    x = torch.randn(2, 16, 64)

    def run(recompute: bool):
        stage.recompute = recompute
        stage.zero_grad(set_to_none=True)
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        leaf = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage(leaf)
        kept = sum(saved)
        y.square().mean().backward()
        return kept, leaf.grad, {n: p.grad.clone() for n, p in stage.named_parameters()}

    full_bytes, gx, grads = run(False)
    kept_bytes, gx2, grads2 = run(True)
    assert torch.allclose(gx, gx2, atol=1e-6)
    assert all(torch.allclose(grads[n], grads2[n], atol=1e-6) for n in grads)
    assert kept_bytes < full_bytes / 4, (kept_bytes, full_bytes)
