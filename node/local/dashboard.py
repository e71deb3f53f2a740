"""The dashboard of a local swarm: ``node dashboard`` as a process of its own, for the run's life.

Started as a user would start it, on the first node's address. Its URL is printed once it serves,
checked from the launcher's live loop rather than waited for: its DHT and p2pd take seconds on
cores the nodes keep busy, and a launcher waiting on them would not see the tail reach
``--steps`` meanwhile. A dashboard that cannot start (its port taken) costs one line, not the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

URL_PREFIX = "dashboard: "  # the line `node dashboard` prints once it serves


class DashboardProcess:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        self.said = False  # its URL, or why there is none, was printed

    def check(self) -> None:
        """Print the URL once it is served, or once why the dashboard stopped."""
        if self.said:
            return
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        url = next((ln.split()[1] for ln in lines if ln.startswith(URL_PREFIX)), None)
        if url is not None:
            print(f"dashboard: {url}", flush=True)
        elif self.proc.poll() is not None:
            print(f"dashboard not started: {lines[-1] if lines else 'it exited'}", flush=True)
        else:
            return
        self.said = True


def start_dashboard(
    args, report: Path, run_id: str, peers: list[str], preexec: Callable[[], None]
) -> DashboardProcess | None:
    """``--dashboard PORT`` (0: a free port; -1: none) on the swarm of ``peers``."""
    if args.dashboard_port < 0:
        return None
    log = report / "dashboard.log"
    cmd = [sys.executable, "-m", "node", "dashboard", "--peers", *peers, "--run-id", run_id]
    cmd += ["--port", str(args.dashboard_port)] + (["--swarm-key", args.swarm_key] if args.swarm_key else [])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
            preexec_fn=preexec,
        )
    return DashboardProcess(proc, log)
