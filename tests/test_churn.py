"""Churn: a node killed with SIGKILL mid-training; the swarm keeps training; the node rejoins."""

import json
import os
import signal
import time

from node.cli import build_parser
from node.local.launcher import read_metrics, start_node, stop_nodes, tail_steps
from node.local.report import build_report
from tests.conftest import wait_for

NODES = 4  # stages [0, 1, 0, 1]: the tail replicated


def test_kill_a_replica_swarm_continues_and_node_rejoins(tmp_path):
    args = build_parser().parse_args(
        [
            "swarm",
            "--nodes",
            str(NODES),
            "--stages",
            "2",
            "--model",
            "tiny:4",
            "--codec",
            "dense",
            "--lr",
            "1e-3",
            "--hop-timeout",
            "10",
            "--outer-every",
            "0",  # about churn, not DP: no outer rounds (on by default for replicated stages)
        ]
    )
    run_id = f"churn-{os.getpid()}"
    procs, stages = [], []
    try:
        proc, ready = start_node(args, 0, tmp_path, run_id, [])
        procs.append(proc)
        stages.append(ready["stage"])
        peers = [f"{ready['maddrs'][0]}/p2p/{ready['peer_id']}"]
        for i in range(1, NODES):
            proc, ready = start_node(args, i, tmp_path, run_id, peers)
            procs.append(proc)
            stages.append(ready["stage"])
        assert sorted(stages).count(1) >= 2, stages  # the tail stage is replicated
        victim = max(i for i, s in enumerate(stages) if s == 1)
        wait_for(lambda: tail_steps(read_metrics(tmp_path, NODES), 2) >= 10, 120, "10 steps before the kill")
        victim_id = json.loads((tmp_path / "nodes" / str(victim) / "ready.json").read_text())["peer_id"]

        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait(timeout=10)
        killed_at = time.monotonic()
        steps_at_kill = tail_steps(read_metrics(tmp_path, NODES), 2)
        # training goes on through the surviving tail replica within a bounded time
        wait_for(
            lambda: tail_steps(read_metrics(tmp_path, NODES), 2) >= steps_at_kill + 10,
            60,
            "10 steps after the kill",
        )
        recovered_s = time.monotonic() - killed_at
        assert recovered_s < 60

        # the killed node restarts with the same identity and rejoins, pulling current weights
        proc, ready = start_node(args, victim, tmp_path, run_id, peers)
        procs[victim] = proc
        assert ready["peer_id"] == victim_id

        def rejoined():
            m = next((m for m in read_metrics(tmp_path, NODES) if m["peer_id"] == victim_id), None)
            return m if m and m["microbatches"] > 0 else None

        m = wait_for(rejoined, 90, "the restarted node to serve microbatches")
        assert m["state_pull_bytes"] > 0
    finally:
        stop_nodes(procs, stages)
    rep = build_report(read_metrics(tmp_path, NODES), 2)
    loss = rep["loss"]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5
    served = sum(rep["microbatches_per_peer"].values())
    print(f"\ndropped {rep['dropped_microbatches']} of {served} microbatch-hops")
    # Only what was in flight at the dead tail, or routed to it before routing forgot it, is lost:
    # a few against thousands served (3 of 3,795 here). A head that kept drawing and dropping
    # while a stage was unreachable lost hundreds a minute before DROP_BACKOFF_S.
    assert rep["dropped_microbatches"] <= 0.02 * served, (rep["dropped_microbatches"], served)
