"""LoRA adapters per stage (node/model/adapters.py) against whole-model peft, the independent reference.

The pipeline's stages each inject their own adapters; peft's ``get_peft_model`` adapts the whole
model at once. With the same adapter values (nonzero B, so the adapters matter), the split
pipeline must compute the whole model's logits and the same adapter gradients; the seeded init
must not depend on the split; the frozen base must not move; merged weights and the peft adapter
directory must compute what the pipeline computes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from node.model.adapters import (
    AdapterError,
    adapter_tensors,
    add_adapters,
    merge_into,
    save_peft_adapter,
)
from node.model.loading import load_model
from node.model.stages import build_stage
from protocol.settings import FinetuneSettings

FT = FinetuneSettings(mode="lora", rank=4, alpha=8.0)
RANGES = [[0, 1], [1, 3], [3, 4]]


def _base(tie: bool = False):
    from transformers import LlamaForCausalLM

    from node.model.loading import tiny_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(tie=tie)).eval()


def _reference(base):
    """Whole-model peft with random nonzero adapters; returns the peft model and its adapters by name."""
    from peft import get_peft_model

    from node.model.adapters import lora_config

    ref = get_peft_model(copy.deepcopy(base), lora_config(FT))
    return ref, _random_adapters(ref)


def _random_adapters(ref) -> dict[str, torch.Tensor]:
    """Nonzero adapters (so they matter) on a whole-model peft model, by peft's saved names
    (base_model.model.<whole-model module>.lora_A.weight, less the prefix)."""
    gen = torch.Generator().manual_seed(7)
    values = {}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                values[name.replace("base_model.model.", "", 1).replace(".default", "")] = p.detach().clone()
    return values


def _worst_grad_gap(stages, ref) -> float:
    """After both backwards: the largest difference between the stages' adapter gradients and the
    reference's, which must name the same adapters."""
    ref_grads = {
        n.replace("base_model.model.", "", 1).replace(".default", ""): p.grad
        for n, p in ref.named_parameters()
        if "lora_" in n
    }
    ours = {n: p.grad for s in stages for n, p in adapter_tensors(s).items()}
    assert set(ours) == set(ref_grads)
    return max(float((ours[n] - ref_grads[n]).abs().max()) for n in ours)


def _stages(base, ranges, values=None, seed=0):
    stages = []
    for i in range(len(ranges)):
        s = build_stage(copy.deepcopy(base), ranges, i)
        add_adapters(s, FT, seed)
        if values is not None:
            with torch.no_grad():
                for name, p in adapter_tensors(s).items():
                    p.copy_(values[name])
        stages.append(s)
    return stages


def _frozen_bytes(stage) -> str:
    """sha256 over the names and bytes of a stage's frozen (non-adapter) parameters."""
    import hashlib

    h = hashlib.sha256()
    for n, p in sorted(stage.named_parameters()):
        if not p.requires_grad:
            h.update(n.encode() + p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pipeline_loss(stages, ids):
    h = ids
    for s in stages:
        h = s(h)
    return h, torch.nn.functional.cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1))


def test_split_lora_pipeline_matches_whole_model_peft():
    base = _base()
    ref, values = _reference(base)
    stages = _stages(base, RANGES, values)
    assert sum(len(adapter_tensors(s)) for s in stages) == len(values) == 4 * 7 * 2
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, loss = _pipeline_loss(stages, ids)
    want = ref(input_ids=ids).logits
    assert (logits - want).abs().max() <= 1e-5
    ref_loss = torch.nn.functional.cross_entropy(
        want[:, :-1].reshape(-1, want.shape[-1]), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    ref_loss.backward()
    worst = _worst_grad_gap(stages, ref)
    assert worst <= 1e-4, worst
    # every adapter takes part
    assert all(float(p.grad.abs().max()) > 0 for st in stages for p in adapter_tensors(st).values())
    # only the adapters train: every other parameter is frozen and gets no gradient
    for s in stages:
        for n, p in s.named_parameters():
            assert p.requires_grad == (".lora_" in n), n
            assert p.requires_grad or p.grad is None, n


def test_seeded_init_is_the_same_in_any_split_and_starts_as_the_base():
    base = _base()
    two = {n: p for s in _stages(base, [[0, 2], [2, 4]], seed=5) for n, p in adapter_tensors(s).items()}
    three = {n: p for s in _stages(base, RANGES, seed=5) for n, p in adapter_tensors(s).items()}
    other = {n: p for s in _stages(base, RANGES, seed=6) for n, p in adapter_tensors(s).items()}
    assert set(two) == set(three)
    assert all(torch.equal(two[n], three[n]) for n in two)
    a = "model.layers.2.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(three[a], other[a])  # the run seed matters
    assert not torch.equal(three[a], three["model.layers.3.self_attn.q_proj.lora_A.weight"])  # and the name
    assert all(float(three[n].detach().abs().max()) == 0 for n in three if n.endswith("lora_B.weight"))
    ids = torch.randint(0, 512, (1, 9))
    logits, _ = _pipeline_loss(_stages(base, RANGES, seed=5), ids)
    assert (logits - base(input_ids=ids).logits).abs().max() <= 1e-5  # B = 0: the base model


def test_training_moves_only_the_adapters_and_merged_weights_compute_the_pipeline(tmp_path):
    base = _base()
    stages = _stages(base, RANGES, seed=3)
    frozen = [_frozen_bytes(s) for s in stages]
    params = [p for s in stages for p in s.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        _, loss = _pipeline_loss(stages, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    adapters = {n: p.detach() for s in stages for n, p in adapter_tensors(s).items()}
    assert any(float(v.abs().max()) > 0 for n, v in adapters.items() if n.endswith("lora_B.weight"))
    # the base under the adapters is bit-identical to what it was (content hash over the frozen tensors)
    assert [_frozen_bytes(s) for s in stages] == frozen
    with torch.no_grad():
        logits, _ = _pipeline_loss(stages, ids)
        state = {k: v.clone() for k, v in base.state_dict().items()}
        assert merge_into(state, adapters, FT) == 4 * 7
        merged = copy.deepcopy(base)
        merged.load_state_dict(state)
        assert (merged(input_ids=ids).logits - logits).abs().max() <= 1e-5
    # the peft directory loads onto the base with peft itself and computes the same logits
    from peft import PeftModel

    save_peft_adapter(tmp_path / "adapter", adapters, FT, "tiny")
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - logits).abs().max() <= 1e-5


def test_a_target_the_model_lacks_is_refused_in_one_line():
    base = _base()
    stage = build_stage(copy.deepcopy(base), RANGES, 1)
    with pytest.raises(AdapterError, match="names no linear layer"):
        add_adapters(stage, FinetuneSettings(mode="lora", targets="qkv_proj"), 0)


def test_the_bundled_shape_of_a_tied_model_keeps_its_embedding_frozen():
    base = _base(tie=True)
    head, tail = _stages(base, [[0, 2], [2, 4]])
    assert not head.embed_tokens.weight.requires_grad and not tail.lm_head.weight.requires_grad
    assert torch.equal(head.embed_tokens.weight, tail.lm_head.weight)


def test_a_lora_stage_serves_and_loads_its_adapters_only_in_fp32():
    import types

    from node.swarm.weights import WeightServer, _load_weights

    base = _base()
    served, joiner = _stages(base, [[0, 2], [2, 4]], seed=1)[1], _stages(base, [[0, 2], [2, 4]], seed=2)[1]
    with torch.no_grad():
        for p in adapter_tensors(served).values():
            p.add_(0.5)
    step, named = WeightServer(types.SimpleNamespace(stage=served, inner_step=9))._snapshot(torch.bfloat16)
    assert step == 9 and set(named) == {n for n, p in served.named_parameters() if p.requires_grad}
    assert all(t.dtype == torch.float32 for t in named.values())
    _load_weights(joiner, named)
    ours, theirs = adapter_tensors(served), adapter_tensors(joiner)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_the_estimate_counts_what_a_lora_stage_allocates():
    """The device estimate's states (frozen base at its dtype, adapters + grads + AdamW in fp32)
    against the bytes a real LoRA stage holds after an AdamW step, for an fp32 and a bf16 base."""
    from node.model.adapters import adapter_params, cast_base
    from node.model.devices import stage_memory_bytes

    base = _base()
    for dtype in (torch.float32, torch.bfloat16):
        stage = build_stage(copy.deepcopy(base), RANGES, 1)
        n_params = sum(p.numel() for p in stage.parameters())
        predicted = adapter_params(stage.layers, FT)
        add_adapters(stage, FT, 0)
        cast_base(stage, dtype)
        trained = [p for p in stage.parameters() if p.requires_grad]
        assert sum(p.numel() for p in trained) == predicted
        opt = torch.optim.AdamW(trained)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            stage(torch.randn(1, 5, 64)).float().sum().backward()
        opt.step()
        held = [*stage.parameters(), *(p.grad for p in trained)]
        held += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        used = sum(t.numel() * t.element_size() for t in held)
        est = stage_memory_bytes(
            n_params, 2, 64, None, 1, 1, torch.device("cpu"),
            n_adapters=predicted, base_bytes=torch.finfo(dtype).bits // 8,
        )  # fmt: skip
        assert est["states"] == used, (dtype, est["states"], used)
        full = stage_memory_bytes(n_params, 2, 64, None, 1, 1, torch.device("cpu"))
        assert est["states"] < full["states"] / (2.5 if dtype == torch.float32 else 4)


@pytest.mark.slow
def test_bundled_model_split_lora_matches_whole_model_peft():
    model = load_model("bundled")[0]
    ref, values = _reference(model)
    stages = _stages(model, [[0, 10], [10, 20], [20, 30]], values)
    ids = torch.randint(0, 49152, (1, 16))
    with torch.no_grad():
        logits, _ = _pipeline_loss(stages, ids)
        assert (logits - ref(input_ids=ids).logits).abs().max() <= 1e-4


def _qlora_reference(base, tmp_path):
    """transformers' own 4-bit loading (BitsAndBytesConfig, NF4 with double quantization, fp32
    compute) of the saved base, adapted by peft as a whole model with random nonzero adapters."""
    from peft import get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from node.model.adapters import lora_config

    base.save_pretrained(tmp_path / "base")
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    q = LlamaForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map="cpu")
    ref = get_peft_model(q, lora_config(FT))
    # in training mode, as a stage trains: in eval mode on a CPU with AVX512-BF16, bitsandbytes
    # repacks the weights for a bf16 inference kernel (2e-3 off fp32 compute; no dropout here)
    ref.train()
    return ref, _random_adapters(ref)


def test_nf4_base_split_pipeline_matches_transformers_qlora(tmp_path):
    """--base-dtype nf4: each stage quantizes its own layers, and the split pipeline computes what
    transformers' 4-bit model under whole-model peft computes (logits, adapter gradients)."""
    from node.model.adapters import quantize_base

    base = _base()
    ref, values = _qlora_reference(base, tmp_path)
    stages = _stages(base, RANGES, values)
    fp32_logits, _ = _pipeline_loss(stages, torch.arange(12).view(1, 12))
    quantized = [quantize_base(s, torch.float32) for s in stages]
    assert quantized == [7, 14, 7]  # every projection of every layer, the adapters' base layers too
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, loss = _pipeline_loss(stages, ids)
    want = ref(input_ids=ids).logits
    assert (logits - want).abs().max() <= 1e-5
    # and the quantization is real: 4-bit weights move the logits off the fp32 base's
    nf4_logits, _ = _pipeline_loss(stages, torch.arange(12).view(1, 12))
    assert (nf4_logits - fp32_logits).abs().max() > 1e-2
    ref_loss = torch.nn.functional.cross_entropy(
        want[:, :-1].reshape(-1, want.shape[-1]), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    ref_loss.backward()
    assert _worst_grad_gap(stages, ref) <= 1e-4
    # the adapters are what trains; the 4-bit weights are frozen buffers of bytes
    for s in stages:
        assert {n for n, p in s.named_parameters() if p.requires_grad} == set(
            n for n in dict(s.named_parameters()) if ".lora_" in n
        )


def test_the_estimate_counts_what_an_nf4_stage_holds():
    """The bytes an NF4 stage's frozen base really holds (the packed weights, both levels of
    absmax, the codebooks, and the norms in fp32) against the estimate's states for it."""
    import bitsandbytes as bnb
    from transformers import LlamaForCausalLM

    from node.model.adapters import adapter_params, frozen_bytes_per_param, quantize_base
    from node.model.devices import stage_memory_bytes
    from node.model.loading import tiny_config

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_config(hidden=512, layers=2)).eval()
    stage = build_stage(base, [[0, 2]], 0)
    skeleton = copy.deepcopy(stage.layers)
    n_params = sum(p.numel() for p in stage.layers.parameters())
    predicted = adapter_params(stage.layers, FT)
    add_adapters(stage, FT, 0)
    quantize_base(stage, torch.float32)
    held = 0
    for m in stage.layers.modules():
        for p in m.parameters(recurse=False):
            if not p.requires_grad:
                held += p.numel() * p.element_size()
        if isinstance(m, bnb.nn.Linear4bit):  # not peft's wrapper, whose .weight is its base's
            qs = m.weight.quant_state
            held += sum(
                t.numel() * t.element_size() for t in (qs.absmax, qs.code, qs.state2.absmax, qs.state2.code)
            )
    per = frozen_bytes_per_param(skeleton, n_params, "nf4", torch.device("cpu"))
    est = stage_memory_bytes(
        n_params, 2, 512, None, 1, 1, torch.device("cpu"), n_adapters=predicted, base_bytes=per
    )
    frozen_est = est["states"] - predicted * 16
    assert abs(frozen_est - held) <= 0.01 * held, (frozen_est, held)
    assert held < 0.16 * 4 * n_params  # 4-bit: under a sixth of the fp32 base


def test_a_tied_lora_run_exchanges_nothing_and_a_full_one_does():
    """Under LoRA the tied embedding/lm_head is frozen in both copies, so the run record a starter
    publishes for a tied model asks for no tied exchange (0 tied bytes); full fine-tuning of the
    same model does."""
    from node.config import NodeConfig
    from node.join import new_run_record

    base = _base(tie=True)
    full = new_run_record(NodeConfig(stages=2), base, "tiny", "h")
    lora = new_run_record(NodeConfig(stages=2, finetune="lora"), base, "tiny", "h")
    assert full.tied and not lora.tied
    assert lora.finetune.mode == "lora"
