"""DiLoCo outer rounds inside a real swarm: replicated stages average through hivemind."""

from tests.conftest import run_swarm


def test_replicas_average_with_compressed_rounds(tmp_path):
    rep = run_swarm(
        tmp_path,
        "--nodes",
        "4",
        "--stages",
        "2",
        "--steps",
        "20",
        "--model",
        "tiny:2:256",
        "--lr",
        "1e-3",
        "--outer-every",
        "5",
        "--powersgd-rank",
        "8",
        # two replicas per stage are what this test averages: a move (a stage whose records expired
        # on a loaded machine looks empty) is tested in tests/test_rebalance.py, not here
        "--no-rebalance",
        # a round waits up to this long for its partner: on a loaded 2-core CI machine a replica can
        # take 20 s (the default) to finish the step that brings it to the round (seen: heads 0 and 0)
        "--outer-timeout",
        "45",
    )
    outer = rep["outer"]
    assert sorted(len(v) for v in rep["stages"].values()) == [2, 2]
    assert outer["rounds"] >= 2, outer
    # 256x512 and 512x256 matrices at rank 8: r(m+n) = 6144 numbers instead of 131072 (rounds that had
    # to re-anchor replicas after a skipped round also send theta densely, so they are counted apart)
    assert outer["steady_bytes"] > 0, outer
    assert outer["steady_bytes"] * 5 < outer["steady_dense_bytes"], outer
    # rounds counted per group, not summed over peers (one group's single round would pass that):
    # each stage's two replicas committed >= 1 round together, >= 3 group rounds in all (heads step
    # on their own microbatches only, so under load one head can reach a round too late to meet its
    # partner: seen 1 + 2). A replica's round index is its own step // H, and replicas can be a
    # round apart (one's round 4 met the other's round 5), so the groups are counted, not matched
    # by index: both replicas committed the same number, and after the last their outer models
    # must be equal (exact averages: distance ~1e-7)
    by_stage: dict[int, list[int]] = {}
    for m in rep["nodes"]:
        done = [r for r in m.get("outer_rounds", []) if not r["skipped"] and r["group_size"] == 2]
        by_stage.setdefault(m["stage"], []).append(len(done))
    assert sorted(by_stage) == [0, 1], by_stage
    for stage, counts in by_stage.items():
        assert len(counts) == 2 and counts[0] == counts[1] >= 1, (stage, counts, _rounds(rep))
    assert sum(c[0] for c in by_stage.values()) >= 3, (by_stage, _rounds(rep))
    assert outer["max_replica_distance"] is not None and outer["max_replica_distance"] <= 1e-6, outer
    loss = rep["loss"]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3


def _rounds(rep: dict) -> list:
    """Each node's rounds, for a failure message: (stage, steps, [(round, at step, group, why)])."""
    out = []
    for m in rep["nodes"]:
        rounds = [
            (r["round"], r["step"], r["group_size"], r["reason"][:30]) for r in m.get("outer_rounds", [])
        ]
        out.append((m["stage"], m.get("inner_step"), rounds))
    return out
