"""The quality bench's harder tasks (bench/quality/quality_tasks.py, issue 35): ``carry`` and ``multistep``.

Answers are checked by parsing each prompt back and solving it here, not by calling the generator's
own arithmetic; the difficulty each task claims is counted the same way."""

import random
import re
from functools import lru_cache

import pytest

from bench.quality.quality_tasks import SEQ_LEN, TASKS, held_out, task_stream
from node.model.data import tokenize

NEW = ("carry", "multistep")


def _sample(task: str, seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [TASKS[task](rng) for _ in range(n)]


def _digit_sum(n: int) -> int:
    return sum(map(int, str(n)))


def _carries(a: int, b: int) -> int:
    """Carries of the column addition a + b, by the digit-sum identity: each carry turns a 10 in
    one column into a 1 in the next, so it lowers the digit sum by 9."""
    return (_digit_sum(a) + _digit_sum(b) - _digit_sum(a + b)) // 9


def _parse_carry(prompt: str) -> tuple[int, str, int]:
    m = re.fullmatch(r"Q: (\d{3})([+-])(\d{3})=\nA:", prompt)
    assert m, prompt
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_carry_answers_are_the_sum_or_difference():
    for ex in _sample("carry", 3, 2000):
        a, op, b = _parse_carry(ex.prompt)
        assert ex.completion == f" {a + b if op == '+' else a - b}", ex
        assert int(ex.completion) >= 0  # a subtraction never goes below zero


def test_every_carry_problem_has_two_carries_or_borrows():
    exs = _sample("carry", 4, 2000)
    ops = {"+": 0, "-": 0}
    for ex in exs:
        a, op, b = _parse_carry(ex.prompt)
        ops[op] += 1
        # the borrows of a - b are the carries of b + (a - b) = a
        n = _carries(a, b) if op == "+" else _carries(b, a - b)
        assert n >= 2, ex
    assert min(ops.values()) > 0.4 * len(exs)  # both operations, about evenly
    assert any(len(ex.completion) == 5 for ex in exs)  # some sums carry into a fourth digit


_NUM = r"(\d+)"
_FACTS = [
    (re.compile(rf"(\w+) has {_NUM} (\w+)$"), "set"),
    (re.compile(rf"(\w+) has {_NUM} (more|fewer) \w+ than (\w+)$"), "rel"),
    (re.compile(rf"(\w+) gives (\w+) {_NUM} \w+$"), "gift"),
    (re.compile(rf"(\w+) (?:buys|finds|is given) {_NUM} more$"), "gain"),
    (re.compile(rf"(\w+) (?:loses|sells|uses) {_NUM}$"), "loss"),
]


def _solve_multistep(prompt: str) -> tuple[int, int, int, list[int]]:
    """Read the sentences in order and keep a ledger. Returns the answer, how many operations
    changed the asked person's count, how many operations the problem states, and every count
    the ledger held (to check they stay positive)."""
    body = re.fullmatch(r"Q: (.*) How many \w+ does (\w+) have now\?\nA:", prompt)
    assert body, prompt
    sentences, who = body.group(1).rstrip(".").split(". "), body.group(2)
    have: dict[str, int] = {}
    ops: dict[str, int] = {}
    seen, total = [], 0
    for s in sentences:
        kind, m = next((k, r.match(s)) for r, k in _FACTS if r.match(s))
        if kind == "set":
            assert not have, prompt  # only the first sentence states a count outright
            have[m.group(1)], ops[m.group(1)] = int(m.group(2)), 0
            continue
        total += 1
        if kind == "rel":
            x, d, base = m.group(1), int(m.group(2)), have[m.group(4)]
            have[x], ops[x] = base + d if m.group(3) == "more" else base - d, 1
        elif kind == "gift":
            x, y, k = m.group(1), m.group(2), int(m.group(3))
            have[x], have[y] = have[x] - k, have[y] + k
            ops[x], ops[y] = ops[x] + 1, ops[y] + 1
        else:
            x, k = m.group(1), int(m.group(2))
            have[x] += k if kind == "gain" else -k
            ops[x] += 1
        seen += have.values()
    return have[who], ops[who], total, seen


def test_multistep_answers_follow_from_the_ledger():
    for ex in _sample("multistep", 3, 2000):
        ans, _, _, counts = _solve_multistep(ex.prompt)
        assert ex.completion == f" {ans}", ex
        assert min(counts) >= 1, ex  # nobody gives, sells or loses more than they hold


def test_multistep_asks_a_count_of_two_operations():
    exs = _sample("multistep", 5, 2000)
    per_problem, on_asked, copied = [], [], 0
    for ex in exs:
        ans, n_asked, total, _ = _solve_multistep(ex.prompt)
        per_problem.append(total)
        on_asked.append(n_asked)
        copied += ex.completion.strip() in re.findall(r"\d+", ex.prompt)
    assert set(per_problem) == {2, 3}  # both lengths occur, nothing else
    assert set(on_asked) == {2}  # the asked count went through exactly two operations
    assert sum(t > a for t, a in zip(per_problem, on_asked)) > 0.1 * len(exs)  # distractors occur
    assert copied < 0.05 * len(exs)  # the answer is (almost) never a number in the prompt
    # both people are asked about, so the question has to be read
    asked_first = sum(re.search(r"does (\w+) have", e.prompt)[1] == e.prompt.split()[1] for e in exs)
    assert 0.05 * len(exs) < asked_first < 0.95 * len(exs)


@pytest.mark.parametrize("task", NEW)
def test_generators_are_deterministic_per_seed(task):
    assert _sample(task, 7, 300) == _sample(task, 7, 300)
    assert _sample(task, 7, 300) != _sample(task, 8, 300)
    assert task in TASKS


@pytest.mark.parametrize("task", NEW)
def test_held_out_problems_are_not_trained_on(task):
    stream = task_stream(task, 0)
    train = [next(stream) for _ in range(10_000)]  # about a 2048-token run's 100 steps of carry
    prompts = {e.prompt for e in train}
    assert len(prompts) > 0.95 * len(train)  # a large problem space: few repeats within a run
    evals = held_out(task, 200, prompts)
    assert len({e.prompt for e in evals}) == 200
    assert not prompts & {e.prompt for e in evals}


@lru_cache(maxsize=1)
def _bundled_tokenizer():
    from transformers import AutoTokenizer

    from node.model.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("bundled"))


@pytest.mark.parametrize("task", NEW)
def test_problems_fit_the_bench_sequence_with_the_bundled_tokenizer(task):
    tok = _bundled_tokenizer()
    for ex in _sample(task, 11, 1000):
        ids, labels = tokenize(tok, ex, 10 * SEQ_LEN)
        assert len(ids) <= SEQ_LEN, ex  # never cut: the whole answer and its EOS are trained
