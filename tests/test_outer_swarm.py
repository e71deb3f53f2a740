"""DiLoCo outer rounds inside a real swarm: replicated stages average through hivemind."""

import json
import subprocess
import sys


def test_replicas_average_with_compressed_rounds(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "node",
        "swarm",
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
        "--report",
        str(tmp_path),
        "--timeout",
        "300",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
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
