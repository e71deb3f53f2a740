"""Training data for the head stage: examples -> right-padded microbatches with labels.

Sources: the built-in ``arithmetic`` task (2-digit addition, generated offline), ``ordering``
(chained comparisons, generated offline), ``stdlib``
(docstrings of standard-library modules, read from this Python), a JSONL
file of ``{"text": ...}`` or ``{"prompt": ..., "completion": ...}`` records, or plain text.
Prompt/completion examples carry loss on the completion only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from node.model.stages import IGNORE_INDEX

BUILTIN = "arithmetic"
ORDERING = "ordering"  # chained comparisons answered with a name (``ordering_example``)
STDLIB = "stdlib"  # docstrings of standard-library modules: English prose that ships with Python
STDLIB_MODULES = (
    "argparse collections dataclasses functools json logging os pathlib re shutil string subprocess "
    "textwrap threading typing unittest.case urllib.parse email.message http.client inspect pickle random "
    "statistics tarfile zipfile csv datetime decimal fractions heapq socket ssl asyncio.tasks "
    "asyncio.events contextlib enum abc copy difflib pprint calendar configparser optparse gettext "
    "locale tempfile glob fnmatch codecs base64 hashlib hmac secrets sched queue shlex traceback "
    "warnings weakref xml.dom.minidom html.parser mailbox smtplib ftplib imaplib uuid ipaddress "
    "operator bisect numbers cmd pdb bdb doctest trace timeit tokenize ast dis zoneinfo sqlite3 wave"
).split()


class DataError(ValueError):
    pass


@dataclass
class Example:
    prompt: str
    completion: str  # empty for plain-text examples: loss on every token


def arithmetic_example(rng: random.Random) -> Example:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return Example(prompt=f"Q: {a}+{b}=\nA:", completion=f" {a + b}")


_ORDER_NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Nora", "Max", "Ella")
_ORDER_RELATIONS = (
    ("older", "youngest", "oldest"),
    ("taller", "shortest", "tallest"),
    ("faster", "slowest", "fastest"),
)


def ordering_example(rng: random.Random) -> Example:
    """Multi-step comparison, answered with a name: three chained facts in a shuffled order,
    e.g. ``Q: Ben is taller than Mia. Anna is taller than Ben. Mia is taller than Leo. Who is
    the shortest?\nA:`` -> `` Leo``. The answer needs the whole chain (chance 1/4), unlike the
    one-step sums of ``arithmetic``; nothing is downloaded."""
    people = rng.sample(_ORDER_NAMES, 4)  # people[0] ranks highest
    rel, low, high = rng.choice(_ORDER_RELATIONS)
    facts = [f"{people[i]} is {rel} than {people[i + 1]}." for i in range(3)]
    rng.shuffle(facts)
    ask_high = rng.random() < 0.5
    return Example(
        prompt=f"Q: {' '.join(facts)} Who is the {high if ask_high else low}?\nA:",
        completion=f" {people[0] if ask_high else people[-1]}",
    )


TASKS = {BUILTIN: arithmetic_example, ORDERING: ordering_example}  # generated offline, per seed


def as_plain_text(examples: list[Example]) -> list[Example]:
    """Pretraining: next-token loss on every position, prompts included."""
    return [Example(ex.prompt + ex.completion, "") for ex in examples]


def load_examples(source: str, seed: int = 0, n_builtin: int = 20000) -> list[Example]:
    if source == STDLIB:
        text = stdlib_docstrings().decode("utf-8")
        return [Example(p.strip(), "") for p in text.split("\n\n") if p.strip()]
    if source in TASKS:
        rng = random.Random(seed)
        return [TASKS[source](rng) for _ in range(n_builtin)]
    path = Path(source)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise DataError(f"--data {source}: {what}; pass arithmetic, ordering, stdlib or a .jsonl/.txt file")
    text = read_text(path, source)
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"--data {source}:{i} is not JSON; one record per line") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                out.append(Example(rec["text"], ""))
            elif (
                isinstance(rec, dict)
                and isinstance(rec.get("prompt"), str)
                and isinstance(rec.get("completion"), str)
            ):
                out.append(Example(rec["prompt"], rec["completion"]))
            else:
                raise DataError(f"--data {source}:{i} needs a 'text' or 'prompt'+'completion' string field")
    else:
        out = [Example(p.strip(), "") for p in text.split("\n\n") if p.strip()]
    if not out:
        raise DataError(f"--data {source} holds no examples")
    return out


def read_text(path: Path, source: str) -> str:
    """A data file's text; ``DataError`` naming the file, and the first bad byte, if not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"--data {source}: cannot read it ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {source} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None


def check_data(source: str) -> None:
    """Refuse a bad ``--data`` before anything starts (node.join, node.local.launcher): a file is
    read and parsed whole (a node reads it again when it serves the head); built-ins are fine."""
    if source not in TASKS and source != STDLIB:
        load_examples(source)


def stdlib_docstrings() -> bytes:
    """Docstrings (over 40 characters) of ``STDLIB_MODULES``, read from this Python's own sources.

    Offline pretraining text (also the corpus of ``bench/dp/subspace_scape.py``); it differs slightly
    between Python versions.
    """
    parts = []
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc)
    return "\n\n".join(parts).encode("utf-8")


class ByteTokenizer:
    """Fallback for models without a tokenizer (the tiny test model): bytes modulo vocab."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.eos_token_id = vocab - 1

    def encode(self, text: str) -> list[int]:
        return [b % (self.vocab - 1) for b in text.encode()]


def _encode(tok, text: str) -> list[int]:
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)
    return tok(text, add_special_tokens=False)["input_ids"]


def tokenize(tok, ex: Example, seq_len: int) -> tuple[list[int], list[int]]:
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    p = _encode(tok, ex.prompt)
    if ex.completion:
        c = _encode(tok, ex.completion) + [eos]
        ids, labels = p + c, [IGNORE_INDEX] * len(p) + c
    else:
        ids = p + [eos]
        labels = list(ids)
    return ids[:seq_len], labels[:seq_len]


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), t), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), t), IGNORE_INDEX, dtype=torch.long)
    for i, (a, b) in enumerate(pairs):
        ids[i, : len(a)] = torch.tensor(a)
        labels[i, : len(b)] = torch.tensor(b)
    return ids, labels


def frame_full(rows: int, longest: int, next_len: int, max_tokens: int) -> bool:
    """Whether a microbatch of ``rows`` examples (the longest ``longest`` tokens) is full: the next
    example (``next_len`` tokens) would take it past ``max_tokens`` padded tokens. A microbatch
    always takes its first example, so an empty one is never full."""
    return rows > 0 and (rows + 1) * max(longest, next_len) > max_tokens


def microbatches(
    examples: list[Example], tok, batch: int, seq_len: int, seed: int, max_tokens: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled stream of (input_ids, labels) microbatches: ``batch`` examples each, or with
    ``max_tokens`` as many as fit in that many padded tokens (rows x the longest row; at least one)."""
    rng = random.Random(seed)
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    order: list[int] = []
    pending: tuple[list[int], list[int]] | None = None
    while True:
        if not max_tokens:
            if len(order) < batch:
                order += rng.sample(range(len(examples)), len(examples))
            take, order = order[:batch], order[batch:]
            yield collate([tokenize(tok, examples[i], seq_len) for i in take], pad)
            continue
        rows: list[tuple[list[int], list[int]]] = []
        longest = 0
        while True:
            if pending is None:
                if not order:
                    order = rng.sample(range(len(examples)), len(examples))
                pending = tokenize(tok, examples[order.pop(0)], seq_len)
            if frame_full(len(rows), longest, len(pending[0]), max_tokens):
                break  # the next example waits for the next microbatch: none is dropped
            rows.append(pending)
            longest, pending = max(longest, len(pending[0])), None
        yield collate(rows, pad)
