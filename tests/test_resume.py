"""Checkpoints through the CLI: a kill in the middle of a checkpoint write loses nothing."""

import json
import os
import subprocess
import sys

from node.checkpoint import list_checkpoints, load_latest


def _join(tmp, *extra, env=None, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "node",
        "join",
        "--model",
        "tiny",
        "--stages",
        "1",
        "--run-id",
        "resume-test",
        "--state-dir",
        str(tmp / "state"),
        "--metrics-file",
        str(tmp / "metrics.json"),
        "--checkpoint-every",
        "2",
        "--lr",
        "1e-3",
        "--threads",
        "1",
        *extra,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def _metrics(tmp):
    return json.loads((tmp / "metrics.json").read_text())


def test_kill_during_checkpoint_write_then_resume(tmp_path):
    first = _join(tmp_path, "--max-steps", "6")
    assert first.returncode == 0, first.stderr[-2000:]
    ckdir = tmp_path / "state" / "checkpoints" / "resume-test" / "stage-0"
    assert load_latest(ckdir).counters["inner_step"] == 6

    # resume, and die by SIGKILL between writing the step-8 checkpoint and renaming it into place
    killed = _join(tmp_path, "--resume", "--max-steps", "10", env={"VNODE_CKPT_FAULT": "written:kill"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert _metrics(tmp_path)["resumed_from"] == 6
    ck = load_latest(ckdir)  # the torn write is invisible: the step-6 checkpoint still loads
    assert ck is not None and ck.counters["inner_step"] == 6
    assert all(p.name.startswith("ckpt-") for p in list_checkpoints(ckdir))

    resumed = _join(tmp_path, "--resume", "--max-steps", "10")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    m = _metrics(tmp_path)
    assert m["resumed_from"] == 6 and m["inner_step"] == 10  # the step count continues
    assert load_latest(ckdir).counters["inner_step"] == 10
