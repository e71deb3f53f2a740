"""How much memory a local swarm holds: the proportional set size of every node's process tree.

A node is a process tree (the node, its DHT process, DiLoCo's averager helper, p2pd), and its
DiLoCo buffers live in shared memory that several of them map. Summing each process's resident
size would count shared pages once per process; PSS (``/proc/PID/smaps_rollup``) splits each page
among the processes that map it, so the sum over the swarm is what the machine holds.
"""

from __future__ import annotations

import os
from collections import defaultdict


def _ppids() -> dict[int, list[int]]:
    children: dict[int, list[int]] = defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                # the command may hold spaces and parentheses: the fields after the last ')' are plain
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(name))
    return children


def tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def pss(pid: int) -> int:
    """The process's proportional set size in bytes (0 when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def parts(pids: list[int]) -> dict[str, int]:
    """A tree's PSS by process: the root as ``node``, the rest by command name and, where several
    share one (the DHT process and the averager helper are both forks of the node), by start order."""
    out: dict[str, int] = {}
    root, *rest = pids
    out["node"] = pss(root)
    for p in sorted(rest):
        name = comm(p)
        key, k = name, 1
        while key in out:
            k += 1
            key = f"{name}#{k}"
        out[key] = pss(p)
    return out


class PeakMemory:
    """The largest PSS each node's tree reached (and, in ``at_peak``, its processes at that sample),
    and the largest the swarm's reached together."""

    def __init__(self) -> None:
        self.per_node: dict[int, int] = {}
        self.at_peak: dict[int, dict[str, int]] = {}
        self.total = 0

    def sample(self, pids: list[int | None]) -> None:
        if not os.path.exists("/proc/self/smaps_rollup"):
            return  # not Linux: nothing to report
        children = _ppids()
        now = 0
        for i, pid in enumerate(pids):
            if pid is None:
                continue
            split = parts(tree(pid, children))
            n = sum(split.values())
            if n > self.per_node.get(i, 0):
                self.per_node[i], self.at_peak[i] = n, split
            now += n
        self.total = max(self.total, now)

    def as_dict(self) -> dict:
        per_node = [self.per_node[i] for i in sorted(self.per_node)]
        return {"peak_pss_total": self.total, "peak_pss_per_node": per_node}
