import os
import time

import pytest
import torch

# Two cores, several processes: one thread each keeps the suite predictable.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tiny_model():
    from node.model.loading import load_model

    return load_model("tiny:4", seed=0)[0]


def run_swarm(report_dir, *args: str, timeout: float = 420, codec: str | None = "dense") -> dict:
    """`python -m node swarm ... --report DIR` as a user runs it; returns the parsed report.json.

    ``codec`` goes first, so a ``--codec`` in ``args`` overrides it; dense unless a test is about
    codecs (the default codec, lowrank, adds an eigendecomposition per frame and direction);
    None runs the default codec as a user gets it.
    """
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "node",
        "swarm",
        *(["--codec", codec] if codec else []),
        # no dashboard process beside the nodes on two shared cores (tests/test_dashboard.py has its own)
        *([] if "--dashboard" in args else ["--dashboard", "-1"]),
        *args,
        "--report",
        str(report_dir),
        "--timeout",
        str(timeout - 60),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    (report_dir / "swarm.out").write_text(p.stdout)  # what the user sees, for tests of the final lines
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads((report_dir / "report.json").read_text())


def wait_for(cond, timeout: float, what: str):
    """Poll ``cond`` every 0.5 s; its first truthy value, or an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def replicas_agree(rep: dict) -> dict[int, int]:
    """Assert a swarm report's replicated stages ended with equal outer models; return, per stage,
    the rounds its replicas committed together.

    Replicas can be a round apart (one's round 4 met the other's round 5), so rounds are counted,
    never matched by index. With two replicas a stage, every round committed in a group of two is
    on both sides' records, except a round that failed on one side only (seen in CI: a tail's last
    round committed on one replica while the other gave up on it). So equal counts mean the last
    round was taken together and the outer models are equal (exact averages: ~1e-7). Counts one
    apart mean such a split: the replicas stay apart until a later round re-anchors them
    (tests/test_diloco_sync.py), which a run that stops first never takes; at most one stage.
    """
    by_stage: dict[int, list[list[dict]]] = {}
    for m in rep["nodes"]:
        by_stage.setdefault(m["stage"], []).append(m.get("outer_rounds", []))
    exact, apart, together = [], [], {}
    for stage, replicas in by_stage.items():
        assert len(replicas) == 2, (stage, rounds_of(rep))
        counts = [len([r for r in rs if not r["skipped"] and r["group_size"] == 2]) for rs in replicas]
        assert abs(counts[0] - counts[1]) <= 1, (stage, rounds_of(rep))
        together[stage] = min(counts)
        (apart if counts[0] != counts[1] else exact).append(stage)
    assert len(apart) <= 1 and exact, (apart, rounds_of(rep))
    dist = rep["outer"]["replica_distance"]
    for stage in exact:
        if together[stage] == 0 and str(stage) not in dist:
            continue  # never averaged: no outer model was left to compare
        assert dist[str(stage)] <= 1e-6, (stage, rep["outer"], rounds_of(rep))
    for stage in apart:
        # apart, unless a round after the split re-anchored them (both sides record it)
        healed = any(r.get("reanchored") for rs in by_stage[stage] for r in rs)
        assert healed or dist[str(stage)] > 1e-6, (stage, rep["outer"], rounds_of(rep))
    return together


def rounds_of(rep: dict) -> list:
    """Each node's rounds, for a failure message: (stage, steps, [(round, at step, group, why)])."""
    out = []
    for m in rep["nodes"]:
        rounds = [
            (r["round"], r["step"], r["group_size"], r["reason"][:30]) for r in m.get("outer_rounds", [])
        ]
        out.append((m["stage"], m.get("inner_step"), rounds))
    return out


# The files that take longest under `make test` (seconds summed over their tests, measured with
# --durations=0 on two loaded cores), run first: two workers then end within a short file of each
# other, where pytest-xdist's own order (files with the most tests first) left the one-test
# volunteer-internet file running alone at the end. A file not listed keeps its place after these.
HEAVY_FIRST = (
    "test_nat_pair.py",  # 230
    "test_volunteer_net.py",  # 165
    "test_bad_input.py",  # 98
    "test_nat_replicas.py",  # 89
    "test_nat.py",  # 84
    "test_links_swarm.py",  # 69
    "test_lifecycle.py",  # 64
    "test_churn.py",  # 62
    "test_lora_swarm.py",  # 57
    "test_harness.py",  # 51
    "test_dashboard.py",  # 46
    "test_swarm.py",  # 45
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
