"""`swarm` outlives a dead node (and restarts it with --restart-dead); its nodes do not outlive it."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.local.launcher import read_metrics, tail_steps
from tests.conftest import wait_for

SWARM = [sys.executable, "-m", "node", "swarm", "--model", "tiny:4", "--codec", "dense", "--outer-every", "0"]


def _descendants(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _node_pid(launcher: int, i: int) -> int:
    """The `join` process of node ``i`` (its cmdline names its state dir nodes/i)."""
    for pid in _descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"join" in cmd and any(a.endswith(f"/nodes/{i}".encode()) for a in cmd):
            return pid
    raise AssertionError(f"no process of node {i}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_all(pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# slow (~105 s); the launcher's teardown on death stays in the default suite below
@pytest.mark.slow
def test_dead_node_is_reported_and_restarted_and_the_run_goes_on(tmp_path):
    out = open(tmp_path / "swarm.log", "w")
    launcher = subprocess.Popen(
        # no step target to race: the run goes on until this test has seen the restarted node serve
        # (a fixed --steps ended first whenever training outran the restart's start-up under load),
        # then it stops the launcher as a user's Ctrl-C does
        [*SWARM, "--nodes", "3", "--stages", "2", "--steps", "1000000", "--lr", "1e-3", "--restart-dead",
         "--report", str(tmp_path), "--timeout", "400"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    pids: list[int] = []
    try:
        wait_for(lambda: tail_steps(read_metrics(tmp_path, 3), 2) >= 8, 240, "8 steps before the kill")
        stages = [_ready(tmp_path, i)["stage"] for i in range(3)]
        victim = max(i for i in range(3) if stages.count(stages[i]) > 1)
        pids = _descendants(launcher.pid)
        os.kill(_node_pid(launcher.pid, victim), signal.SIGKILL)

        def served_again():  # the restarted life's metrics: the launcher kept the dead life's aside first
            d = tmp_path / "nodes" / str(victim)
            if not (d / "metrics.0.json").exists() or not (d / "metrics.json").exists():
                return False
            return json.loads((d / "metrics.json").read_text())["microbatches"] > 0

        wait_for(lambda: served_again() or launcher.poll() is not None, 240, "the restarted node to serve")
        assert launcher.poll() is None, "the launcher stopped before the restarted node served"
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(pids + _descendants(launcher.pid))
    log = (tmp_path / "swarm.log").read_text()
    assert launcher.returncode == 130 and "interrupted; stopping the swarm" in log, log[-3000:]
    assert f"node {victim} (stage {stages[victim]}) died (code -9)" in log, log[-3000:]
    assert f"restarting node {victim} with --resume" in log, log[-3000:]
    assert (tmp_path / "nodes" / str(victim) / "node.0.log").exists()  # the dead life's log is kept
    # the report still comes out, and counts the restarted life's work
    rep = json.loads((tmp_path / "report.json").read_text())
    assert sum(m["microbatches"] for m in rep["nodes"] if m["stage"] == stages[victim]) > 0


def _ready(report: Path, i: int) -> dict:
    return json.loads((report / "nodes" / str(i) / "ready.json").read_text())


def test_killed_launcher_takes_its_nodes_down(tmp_path):
    out = open(tmp_path / "swarm.log", "w")
    launcher = subprocess.Popen(
        [*SWARM, "--nodes", "2", "--stages", "2", "--steps", "100000", "--report", str(tmp_path)],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    pids: list[int] = []
    try:
        wait_for(lambda: len(read_metrics(tmp_path, 2)) == 2, 240, "both nodes serving")
        pids = _descendants(launcher.pid)  # nodes, their DHT processes, p2pd
        assert len(pids) >= 4, pids
        launcher.kill()
        launcher.wait(timeout=10)
        wait_for(lambda: not any(_alive(p) for p in pids), 90, "the nodes to die with their launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill_all(pids)
