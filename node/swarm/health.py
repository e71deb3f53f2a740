"""`python -m node health`: is the node of this state dir alive and serving? (container healthcheck)"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from node.config import default_state_dir

HEALTH_FILE = "health.json"
STALE_AFTER_S = 30.0  # several missed heartbeats


def write_health(state_dir: str, record: dict) -> None:
    path = Path(state_dir) / HEALTH_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**record, "time": time.time()}))
    tmp.replace(path)


def check_health(state_dir: str | None, now: float | None = None) -> tuple[bool, str]:
    path = Path(state_dir or default_state_dir()) / HEALTH_FILE
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no node is running with state dir {path.parent} ({HEALTH_FILE} missing)"
    except (OSError, json.JSONDecodeError) as e:
        return False, f"{path} is unreadable: {e}"
    age = (now or time.time()) - float(rec.get("time", 0))
    if age > STALE_AFTER_S:
        return False, f"the node's last heartbeat was {age:.0f}s ago (stuck or stopped)"
    if not rec.get("serving"):
        return False, f"the node is up but not serving yet ({rec.get('state', 'starting')})"
    return (
        True,
        f"serving stage {rec.get('stage')} as {rec.get('peer_id', '?')}, inner step {rec.get('inner_step')}",
    )


def run_health(state_dir: str | None) -> int:
    ok, msg = check_health(state_dir)
    print(("ok: " if ok else "unhealthy: ") + msg, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
