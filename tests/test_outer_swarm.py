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
    )
    outer = rep["outer"]
    assert sorted(len(v) for v in rep["stages"].values()) == [2, 2]
    assert outer["rounds"] >= 2, outer
    # 256x512 and 512x256 matrices at rank 8: r(m+n) = 6144 numbers instead of 131072 (rounds that had
    # to re-anchor replicas after a skipped round also send theta densely, so they are counted apart)
    assert outer["steady_bytes"] > 0, outer
    assert outer["steady_bytes"] * 5 < outer["steady_dense_bytes"], outer
    assert outer["max_replica_distance"] is not None
    loss = rep["loss"]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3
