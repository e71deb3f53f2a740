"""What importing the node's libraries prints: nothing a user cannot act on (issue 51).

bitsandbytes (imported by peft) logs, on a CPU with AVX512-BF16, that the optional ``kernels``
package is missing; ``make demo`` ended with that line. node.model.adapters drops that one record.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HINT = (
    "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
    "`pip install kernels` and the kernels >= 0.11.1"
)


def test_the_kernels_hint_alone_is_dropped():
    import node.model.adapters  # noqa: F401  (installs the filter)

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def record(msg, *args):
        return log.makeRecord(log.name, logging.WARNING, __file__, 1, msg, args, None)

    assert not log.filter(record(HINT, "No module named 'kernels'"))
    assert log.filter(record("any other warning of %s", "bitsandbytes"))
    assert logging.getLogger("bitsandbytes").filter(record(HINT, "x"))  # other loggers: untouched


def test_importing_peft_after_the_node_logs_no_kernels_hint():
    code = "import logging; logging.basicConfig(); import node.model.adapters; import peft"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "kernels" not in p.stderr, p.stderr


def test_a_failed_state_download_is_one_line_not_a_traceback():
    """hivemind logs a joiner's failed state download from a replica gone under churn with its whole
    traceback (node.dp.diloco drops the traceback: the line names the peer and the error)."""
    import io

    import node.dp.diloco  # noqa: F401  (installs the filter)

    log = logging.getLogger("hivemind.averaging.averager")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log.addHandler(handler)
    try:
        try:
            raise ConnectionError("Connect failed. msg=routing: not found")
        except ConnectionError as e:
            log.exception(f"Failed to download state from QmPeer - {e!r}")
            log.exception("any other failure")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert (
        lines[0]
        == "Failed to download state from QmPeer - ConnectionError('Connect failed. msg=routing: not found')"
    )
    assert (
        lines[1] == "any other failure" and "Traceback (most recent call last):" in lines[2:]
    )  # others keep theirs
