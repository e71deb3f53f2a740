"""`python -m node eval` and `python -m node generate`: score or talk to a model, locally.

The model is an exported directory (``python -m node export``), any local Hugging Face
checkpoint, ``bundled`` (SmolLM2-135M-Instruct before training) or ``tiny[:L[:H]]``.
Examples are the project's own (``node.model.data``): the built-in tasks or a JSONL file.

* loss: the mean next-token loss over the labelled tokens, as the swarm trains it
  (completion tokens and the closing EOS for prompt/completion data; every token for text).
* exact match (prompt/completion data only): greedy decoding of up to ``max_new_tokens``
  tokens after the prompt, stopped at EOS; a hit when the decoded text equals the
  completion, both stripped of surrounding whitespace.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from node.model.data import ByteTokenizer, DataError, Example, _encode, collate, load_examples, tokenize
from node.model.loading import ModelError, load_model
from node.model.stages import causal_lm_loss


class EvalError(RuntimeError):
    """A one-line reason evaluation could not run, with the fix."""


def load_for_eval(spec: str, device: str = "cpu", seed: int = 0):
    """(model in eval mode on ``device``, tokenizer) of ``spec``; a byte tokenizer when it has none."""
    if (
        spec not in ("bundled", "tiny")
        and not spec.startswith("tiny:")
        and not Path(spec, "config.json").exists()
    ):
        raise EvalError(
            f"--model {spec}: not a model directory (no config.json); pass an exported DIR or bundled"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the result lines
    try:
        model, tok, _ = load_model(spec, seed=seed)
    except ModelError as e:
        raise EvalError(str(e)) from None
    return model.to(pick(device)).eval(), tok or ByteTokenizer(model.config.vocab_size)


def pick(device: str) -> torch.device:
    """The device eval, generate and swarm's --eval run on: as a node picks its own
    (``node.model.devices.pick_device``; --device cuda without CUDA falls back with a warning)."""
    from node.model.devices import pick_device

    return pick_device(device)


def decode(tok, ids: list[int]) -> str:
    if isinstance(tok, ByteTokenizer):  # ids below 256 are the bytes themselves
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return tok.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def eval_loss(model, tok, examples: list[Example], seq_len: int = 256, batch: int = 16) -> float:
    """Token-weighted mean loss over ``examples`` (right-padded batches, as the swarm's data)."""
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    dev = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        ids, labels = collate([tokenize(tok, ex, seq_len) for ex in examples[i : i + batch]], pad)
        logits = model(input_ids=ids.to(dev)).logits
        loss, n = causal_lm_loss(logits, labels.to(dev))
        total += float(loss) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Greedy continuation of ``prompt_ids`` with the KV cache, stopped at ``eos`` (not included)."""
    dev = next(model.parameters()).device
    x = torch.tensor([prompt_ids], device=dev)
    out: list[int] = []
    cache = None
    for _ in range(max_new_tokens):
        res = model(input_ids=x, cache=cache, use_cache=True)  # transformers 5: `cache`, not past_key_values
        cache = res.cache
        nxt = int(res.logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        x = torch.tensor([[nxt]], device=dev)
    return out


def exact_match(model, tok, examples: list[Example], max_new_tokens: int) -> tuple[float, list[str]]:
    """Share of prompt/completion examples whose greedy completion equals theirs; and the completions."""
    outs = [
        decode(tok, greedy(model, _encode(tok, ex.prompt), max_new_tokens, tok.eos_token_id))
        for ex in examples
    ]
    hits = sum(o.strip() == ex.completion.strip() for o, ex in zip(outs, examples))
    return hits / max(len(examples), 1), outs


def evaluate(model, tok, examples: list[Example], max_new_tokens: int = 16) -> dict:
    """``{"n", "loss", "em"}``; ``em`` is None when the examples have no completions."""
    scored = [ex for ex in examples if ex.completion]
    em = exact_match(model, tok, scored, max_new_tokens)[0] if scored else None
    return {"n": len(examples), "loss": eval_loss(model, tok, examples), "em": em}


def completion_budget(tok, examples: list[Example]) -> int:
    """Enough new tokens for the longest completion, its EOS and one more (a generation budget)."""
    return max((len(_encode(tok, ex.completion)) for ex in examples if ex.completion), default=0) + 2


def run_eval(args) -> int:
    try:
        try:
            examples = load_examples(args.data, seed=args.seed)
        except DataError as e:
            raise EvalError(str(e)) from None
        if args.limit:
            examples = examples[: args.limit]
        model, tok = load_for_eval(args.model, args.device, args.seed)
        res = evaluate(model, tok, examples, args.max_new_tokens)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    em = "n/a (no prompt/completion examples)" if res["em"] is None else f"{res['em']:.3f}"
    print(f"{args.model}: {res['n']} examples  loss {res['loss']:.4f}  exact match {em}")
    return 0


def run_generate(args) -> int:
    try:
        model, tok = load_for_eval(args.model, args.device, args.seed)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = greedy(model, _encode(tok, args.prompt), args.max_new_tokens, tok.eos_token_id)
    print(decode(tok, ids))
    return 0


# ---------------------------------------------------------------------- held-out split (swarm --eval)


def split_heldout(examples: list[Example], n: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(n held-out examples with distinct prompts, every example whose prompt is not among them).

    Disjoint by prompt, not by position: the built-in task repeats problems, so dropping only
    the chosen rows would leave copies of the held-out problems in the training data.
    """
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    if len(prompts) < 2 * n:
        raise EvalError(
            f"--eval {n}: the data has only {len(prompts)} distinct prompts; "
            f"hold out at most {len(prompts) // 2}"
        )
    chosen = set(random.Random(seed ^ 0x5EED).sample(prompts, n))
    first = {}
    for ex in examples:
        if ex.prompt in chosen:
            first.setdefault(ex.prompt, ex)
    held = [first[p] for p in prompts if p in chosen]
    return held, [ex for ex in examples if ex.prompt not in chosen]


def write_jsonl(examples: list[Example], path: Path) -> None:
    """Examples as the JSONL ``node.model.data.load_examples`` reads back into the same examples."""
    with open(path, "w") as f:
        for ex in examples:
            rec = {"prompt": ex.prompt, "completion": ex.completion} if ex.completion else {"text": ex.prompt}
            f.write(json.dumps(rec) + "\n")
