"""A lone replica holds no DiLoCo state (node.dp.deferred): its checkpoints carry none.

That the state it builds later is the one it would have held is checked against the DiLoCo
reference in tests/test_diloco_sync.py (test_outer_state_built_late_equals_diloco); an in-memory
model (``--model tiny``) builds it at once, and tests/test_resume.py checks that it is saved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from node.model.checkpoint import load_latest
from node.model.loading import load_model


def test_a_lone_replica_of_a_model_on_disk_keeps_no_outer_state(tmp_path):
    load_model("tiny")[0].save_pretrained(tmp_path / "model")  # read from files, as a real model is
    cmd = [
        sys.executable, "-m", "node", "join", "--model", str(tmp_path / "model"), "--stages", "1",
        "--run-id", "lone", "--state-dir", str(tmp_path / "state"),
        "--metrics-file", str(tmp_path / "metrics.json"), "--max-steps", "4", "--outer-every", "2",
        "--checkpoint-every", "2", "--lr", "1e-3", "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    ck = load_latest(tmp_path / "state" / "checkpoints" / "lone" / "stage-0")
    assert ck.counters["inner_step"] == 4
    assert "outer" not in ck.extra_states, sorted(ck.extra_states)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["outer_alone"] >= 1  # its rounds came due and were passed over: nobody to average with
