"""bench/quality/quality.py scores a run with the node's own evaluation: on a tiny random Llama split in
stages, 10 steps dense and through the default link, its exact match and eval loss are what
``node.model.evaluate`` computes on the trained whole model."""

import pytest
import torch

from bench.quality.quality import trial
from bench.quality.quality_pipeline import PipelineLM
from bench.quality.quality_report import tables
from bench.quality.quality_tasks import VARIANTS, Setup
from node.model.evaluate import completion_budget, evaluate, exact_match

DEFAULT_LINK = "lowrank80i8b8k32"  # a new run's codec on short frames (node.stage.links)
TINY = Setup(model="tiny:4:128", ranges=((0, 1), (1, 2), (2, 4)), batch=8, seq_len=48, calib_examples=16)


def test_the_bench_default_link_is_the_nodes():
    from bench.quality.quality_codecs import build_codec
    from node.config import NodeConfig
    from node.stage.links import codec_settings

    assert build_codec(VARIANTS[DEFAULT_LINK]).describe() == codec_settings(NodeConfig())


@pytest.mark.parametrize("variant", ["dense", DEFAULT_LINK, "lora-0.001-lowrank80"])
def test_bench_scores_equal_the_nodes_evaluation(variant):
    torch.set_num_threads(1)
    t = trial(VARIANTS[variant], "arithmetic", seed=0, steps=10, n_eval=12, log_every=10, setup=TINY)
    rec = t.record
    assert rec["steps_codec"] == 10 and rec["tokens_trained"] > 0
    assert rec["frame_bytes_per_token"]["fwd"] > rec["payload_bytes_per_token"] > 0  # header and labels too
    budget = completion_budget(t.tok, t.evals)
    node = evaluate(t.model.eval(), t.tok, t.evals, max_new_tokens=budget)  # the whole model, KV cache
    assert node["n"] == len(t.evals) == 12
    assert rec["eval_loss"] == pytest.approx(node["loss"], rel=0, abs=1e-6)
    assert rec["em"] == pytest.approx(node["em"], rel=0, abs=1e-6) and rec["em_dense_eval"] == rec["em"]
    # a random model's EM is 0 either way; its greedy completions, which EM compares, are not empty
    # and are the same text through the bench's stages as through the whole model
    bench_outs = exact_match(PipelineLM(t.pipe), t.tok, t.evals, budget)[1]
    assert bench_outs == exact_match(t.model, t.tok, t.evals, budget)[1] and all(bench_outs)
    if variant != "dense":  # the codec-on numbers went through the link
        assert rec["eval_loss_codec"] != rec["eval_loss"]


def test_a_lora_run_trains_the_adapters_only():
    """The bench's LoRA variant trains the node's seeded adapters (node.model.adapters) and leaves
    every base weight as loaded; what it reports as trained is what moved."""
    from node.model.loading import load_model

    torch.set_num_threads(1)
    lora = VARIANTS["lora-0.001-lowrank80"]
    t = trial(lora, "arithmetic", seed=0, steps=4, n_eval=2, log_every=4, setup=TINY, codec_eval=False)
    torch.manual_seed(0)  # trial seeds before it loads, so this is the same random base
    base = dict(load_model(TINY.model)[0].named_parameters())
    moved, kept = 0, 0
    for name, p in t.model.named_parameters():
        if ".lora_" in name:
            moved += p.numel()
            if ".lora_B." in name:  # B starts at zero (the adapted model starts as the base)
                assert p.abs().max() > 0, f"{name} never trained"
        else:
            src = base[name.replace(".base_layer.", ".")]
            assert torch.equal(p, src), f"base weight {name} changed"
            kept += 1
    assert t.record["finetune"] == "lora" and t.record["trained_params"] == moved > 0
    assert kept == len(base)
    # scored with the weights run dense only (--codec-eval off): the link's figures are absent, not 0
    assert t.record["em_codec_eval"] is None and t.record["eval_loss_codec"] is None
    assert "| – |" in tables([t.record])


def test_the_lossless_stages_learn_the_same_and_are_charged_what_they_send():
    """``+er`` (entropy coding and repeated rows on the lowrank link) decodes bit-identically, so a
    run through it is the run without it, step for step; its bytes are the payloads as sent (the
    codec's frame_bytes is only their upper bound), and fewer than without the stages."""
    torch.set_num_threads(1)
    kw = dict(seed=0, steps=3, n_eval=4, log_every=3, setup=TINY, codec_eval=False)
    plain = trial(VARIANTS["lowrankt24-88a"], "arithmetic", **kw).record
    lossless = trial(VARIANTS["lowrankt24-88a+er"], "arithmetic", **kw).record
    assert lossless["train_loss_curve"] == plain["train_loss_curve"]
    assert lossless["eval_loss"] == plain["eval_loss"]
    counted = lossless["counted_bytes_per_token"]
    assert lossless["payload_bytes_per_token"] == pytest.approx((counted["fwd"] + counted["bwd"]) / 2)
    assert lossless["payload_bytes_per_token"] < plain["payload_bytes_per_token"]
    assert plain["payload_bytes_per_token"] == pytest.approx(
        (plain["counted_bytes_per_token"]["fwd"] + plain["counted_bytes_per_token"]["bwd"]) / 2, rel=1e-9
    )
