"""A real multi-process swarm on loopback: separate processes, real p2pd, real hivemind DHT."""

import glob
import os
import time
from pathlib import Path

import pytest

from tests.conftest import run_swarm


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            raw = Path(cmdline).read_bytes()
        except OSError:
            continue
        if text.encode() in raw:
            found.append(raw.replace(b"\0", b" ").decode(errors="replace")[:200])
    return found


@pytest.fixture(scope="module")
def swarm_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("swarm")
    rep = run_swarm(
        out,
        "--nodes",
        "3",
        "--stages",
        "2",
        "--steps",
        "40",
        "--model",
        "tiny:4",
        "--lr",
        "3e-3",
        timeout=400,
    )
    return rep, out


def test_loss_falls(swarm_report):
    rep, _ = swarm_report
    loss = rep["loss"]
    assert len(loss) >= 40
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_replicated_stage_all_replicas_served(swarm_report):
    rep, _ = swarm_report
    replicated = [peers for peers in rep["stages"].values() if len(peers) > 1]
    assert replicated, rep["stages"]
    assert sorted(len(p) for p in rep["stages"].values()) == [1, 2]
    for peer in replicated[0]:
        assert rep["microbatches_per_peer"][peer] > 0, rep["microbatches_per_peer"]


def test_replicas_average_by_default(swarm_report):
    """No --outer-every: the replicated stage runs DiLoCo rounds, and the last lines show them."""
    rep, out = swarm_report
    assert rep["outer"]["rounds"] >= 2, rep["outer"]
    assert rep["outer"]["max_replica_distance"] is not None, rep["outer"]
    last = (out / "swarm.out").read_text().strip().splitlines()[-1]
    assert "outer rounds" in last and "replica distance" in last and "replica distance -" not in last, last


def test_links_counted_where_frames_are_written(swarm_report):
    rep, _ = swarm_report
    by_dir = {(lk["boundary"], lk["direction"]): lk for lk in rep["links"]}
    assert set(by_dir) == {(0, "forward"), (0, "backward")}
    hidden = 64  # tiny:4
    for lk in by_dir.values():
        # dense bf16: 2 bytes per channel per token, plus header (and int32 labels forward)
        assert 2 * hidden <= lk["bytes_per_token"] < 2 * hidden + 40, lk
    assert rep["tokens"] > 0
    # no faults: nothing should drop; a rare hop timeout on a loaded host may, never many
    assert rep["dropped_microbatches"] <= 0.05 * sum(rep["microbatches_per_peer"].values()), rep


def test_report_has_plot_and_nothing_left_behind(swarm_report):
    rep, out = swarm_report
    assert (out / "loss.png").stat().st_size > 1000
    run_id = rep["run_id"]
    time.sleep(0.5)
    assert glob.glob(f"/tmp/vnode-{run_id}-*") == []
    assert _processes_mentioning(f"vnode-{run_id}-") == []
    assert all(not p.endswith(".sock") for p in os.listdir("/tmp") if f"vnode-{run_id}" in p)
