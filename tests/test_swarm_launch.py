"""The swarm launcher's process handling: a node that never claims a stage is not left running."""

import signal

import pytest

from node.cli import build_parser
from node.local import launcher as swarm


def test_node_that_misses_the_ready_deadline_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(swarm, "READY_TIMEOUT_S", 0.5)  # a node needs seconds just to import torch
    spawned = []
    real_spawn = swarm.spawn_node

    def spawn(*a, **kw):
        spawned.append(real_spawn(*a, **kw))
        return spawned[-1]

    monkeypatch.setattr(swarm, "spawn_node", spawn)
    args = build_parser().parse_args(["swarm", "--model", "tiny:2", "--stages", "1"])
    with pytest.raises(swarm.SwarmError, match="did not claim a stage"):
        swarm.start_node(
            args, 0, tmp_path, "launch-test", [], extra=["--checkpoint-every", "3"], env={"VNODE_X": "1"}
        )
    (proc,) = spawned
    # before, the process was neither returned nor stopped: it trained on, unowned
    assert proc.poll() == -signal.SIGKILL
    assert proc.args[-2:] == ["--checkpoint-every", "3"]
