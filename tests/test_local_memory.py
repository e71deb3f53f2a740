"""node.local.memory: a node's process tree measured as PSS, whole and by process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from node.local.memory import PeakMemory

CHILD = "import time; b = bytearray(200 * 2**20); print('ready', flush=True); time.sleep(60)"
PARENT = (
    "import subprocess, sys, time; "
    f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE, text=True); "
    "c.stdout.readline(); print('ready', flush=True); time.sleep(60)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from /proc")
def test_a_tree_is_measured_whole_and_each_process_apart():
    p = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        split = PeakMemory()
        split.sample([p.pid, None])
        at = split.at_peak[0]
        assert len(at) == 2 and "node" in at, at  # the root, and its child by command name
        child = next(k for k in at if k != "node")
        assert at[child] > 200 * 2**20 > at["node"]  # the 200 MiB are the child's, not the root's
        assert split.as_dict()["peak_pss_per_node"] == [sum(at.values())]  # the None node is skipped
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the child too
        p.wait()
