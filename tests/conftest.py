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
