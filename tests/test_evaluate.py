"""`python -m node eval` / `generate` against transformers' own generate and loss, and the held-out split."""

import json
import re
import subprocess
import sys

import pytest
import torch

from node.model.data import Example, load_examples
from node.model.evaluate import EvalError, split_heldout


def _tiny_with_tokenizer(path):
    """A random tiny Llama with a real (byte-level BPE) tokenizer, saved as a HF directory; offline."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from node.model.loading import tiny_config

    bpe = ByteLevelBPETokenizer()
    corpus = [f"Q: {a}+{b}=\nA: {a + b}" for a in range(10, 60) for b in range(10, 30)]
    bpe.train_from_iterator(corpus, vocab_size=320, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(3)
    model = LlamaForCausalLM(tiny_config(layers=2, hidden=64, vocab=len(tok))).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def _node(*args):
    p = subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_eval_em_and_loss_match_transformers(tmp_path):
    model, tok = _tiny_with_tokenizer(tmp_path / "m")
    eos = tok.eos_token_id
    prompts = [f"Q: {a}+{b}=\nA:" for a, b in ((12, 14), (33, 21), (50, 19), (41, 11), (27, 28), (15, 16))]
    refs = []
    for p in prompts:  # the reference: transformers' greedy generate
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        refs.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    # half the completions are the model's own greedy answer, half are not
    completions = [r if i % 2 == 0 else r + " 7" for i, r in enumerate(refs)]
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in zip(prompts, completions))
    )
    want_em = sum(r.strip() == c.strip() for r, c in zip(refs, completions)) / len(prompts)

    # the reference loss: transformers' own loss, weighted by each example's labelled tokens
    tot = cnt = 0.0
    for p, c in zip(prompts, completions):
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ci = tok(c, add_special_tokens=False)["input_ids"] + [eos]
        ids = torch.tensor([pi + ci])
        labels = torch.tensor([[-100] * len(pi) + ci])
        with torch.no_grad():
            tot += float(model(input_ids=ids, labels=labels).loss) * len(ci)
        cnt += len(ci)

    line = _node("eval", "--model", str(tmp_path / "m"), "--data", str(data), "--max-new-tokens", "6")
    m = re.search(r"loss ([0-9.]+)\s+exact match ([0-9.]+)", line)
    assert m, line
    assert float(m.group(2)) == pytest.approx(want_em) and 0 < want_em < 1
    assert float(m.group(1)) == pytest.approx(tot / cnt, abs=1e-4)

    said = _node("generate", "--model", str(tmp_path / "m"), "--prompt", prompts[1], "--max-new-tokens", "6")
    assert said.rstrip("\n") == refs[1]


def test_eval_refuses_a_missing_model_in_one_line(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "node", "eval", "--model", str(tmp_path / "nope"), "--data", "arithmetic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr


def test_heldout_is_disjoint_from_training_by_prompt():
    examples = load_examples("arithmetic", seed=0)
    held, train = split_heldout(examples, 200, seed=0)
    held_prompts = {ex.prompt for ex in held}
    assert len(held) == len(held_prompts) == 200
    assert not held_prompts & {ex.prompt for ex in train}
    # nothing else is dropped: every example is either held out (by prompt) or trained on
    assert len(train) == sum(ex.prompt not in held_prompts for ex in examples)
    assert len(train) < len(examples) - 200  # the built-in task repeats problems: copies go too
    assert split_heldout(examples, 200, seed=0)[0] == held  # the same run seed, the same split
    with pytest.raises(EvalError, match="distinct prompts"):
        split_heldout([Example("a", "b"), Example("c", "d")], 2, seed=0)
