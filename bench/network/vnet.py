"""A volunteer internet in network namespaces: public nodes, and homes behind three kinds of NAT.

    core (bridge br0, 10.N.0.0/24: the internet)
     |- pub<i>       10.N.0.<10+i>      a public node (the organiser, relays)
     |- gw<j>        10.N.0.<100+j>     a home router: masquerade (kind "eim": keeps ports, as
     |    `- home<j> 10.N.<1+j>.10      most do) or masquerade random,fully-random ("sym": a
     |                                  symmetric NAT); the home node behind it
     `- carrier      10.N.0.250         a carrier-grade NAT (masquerade) over 100.64.N.0/24
          `- gw<j>   100.64.N.<10+j>    a home router behind it ("cgnat": two layers of NAT)
               `- home<j> 10.N.<1+j>.10

Every router drops what nobody inside asked for, without an answer (``netns.NAT_RULES``). Each home
line is shaped as a home line is: tbf at its upload rate on the home node's egress, at its download
rate on the router's egress into the home, and a random loss on the router (nftables ``numgen
random``); public nodes get a faster symmetric line. This kernel has no netem, so there is no
added delay or jitter: the round trips are the namespaces' own (well under a millisecond).

``VolunteerNet(kinds=[])`` builds the same lines with every node public, for the comparison run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field

from bench.network.netns import (
    NAT_RULES,
    _run,
    add_namespace,
    add_veth,
    end_namespaces,
    namespace_pids,
    nat_rules,
    tbf_burst_bytes,
    tc_rate,
)

PREFIX = "vvn"  # every namespace this module creates starts with it
KINDS = ("eim", "sym", "cgnat")


def loss_rule(permille: int, hooks: tuple[str, ...] = ("forward",)) -> str:
    """An nftables table that drops ``permille``/1000 of the packets through each of ``hooks`` (a
    router: forward; a host with no router in front: input and output)."""
    chains = "".join(
        f" chain {h} {{\n  type filter hook {h} priority -10; policy accept;\n"
        f"  numgen random mod 1000 < {int(permille)} drop\n }}\n"
        for h in hooks
    )
    return "table ip vloss {\n" + chains + "}\n"


@dataclass
class Line:
    down_bps: float
    up_bps: float
    loss_permille: int = 0


def home_lines(n: int, seed: int = 0) -> list[Line]:
    """Residential lines: download 20-100 Mbit/s, upload a fifth to a half of it (5-40), loss
    0.1-1%; drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        down = rng.uniform(20e6, 100e6)
        out.append(Line(down, max(5e6, min(40e6, down * rng.uniform(0.2, 0.5))), rng.randint(1, 10)))
    return out


@dataclass
class VolunteerNet:
    n_public: int
    kinds: list[str]  # one per home: eim | sym | cgnat
    lines: list[Line] | None = None  # one per home (default: home_lines)
    public_line: Line = field(default_factory=lambda: Line(200e6, 200e6, 0))
    public_lines: list[Line] | None = None  # one per public node, instead of public_line
    seed: int = 0
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    net: int = field(default_factory=lambda: 100 + os.getpid() % 100)
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if any(k not in KINDS for k in self.kinds):
            raise ValueError(f"home kinds are {KINDS}: {self.kinds}")
        if not 1 <= self.n_public <= 90 or len(self.kinds) > 90:
            raise ValueError("1-90 public nodes and at most 90 homes")
        self.lines = self.lines or home_lines(len(self.kinds), self.seed)

    # ------------------------------------------------------------------ names
    def ns(self, name: str) -> str:
        return f"{PREFIX}{self.tag}-{name}"

    def public_ns(self, i: int) -> str:
        return self.ns(f"p{i}")

    def public_addr(self, i: int) -> str:
        return f"10.{self.net}.0.{10 + i}"

    def home_ns(self, j: int) -> str:
        return self.ns(f"h{j}")

    def home_addr(self, j: int) -> str:
        return f"10.{self.net}.{1 + j}.10"

    def gw_ns(self, j: int) -> str:
        return self.ns(f"g{j}")

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    # ------------------------------------------------------------------ build
    def _add(self, name: str) -> str:
        return add_namespace(self.ns(name), self.created)

    def _link(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        add_veth(ns_a, dev_a, ns_b, dev_b)
        _run(["ip", "-n", ns_a, "link", "set", dev_a, "up"])
        _run(["ip", "-n", ns_b, "link", "set", dev_b, "up"])

    def _shape(self, ns: str, dev: str, bps: float) -> None:
        tbf = ["tbf", "rate", tc_rate(bps), "burst", str(tbf_burst_bytes(bps)), "latency", "50ms"]
        _run(self.exec_prefix(ns) + ["tc", "qdisc", "add", "dev", dev, "root", *tbf])

    def _nft(self, ns: str, rules: str) -> None:
        p = subprocess.run(
            self.exec_prefix(ns) + ["nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if p.returncode != 0:
            raise RuntimeError(f"nft in {ns}: {p.stderr.strip()[:300]}")

    def _bridge(self, name: str) -> str:
        ns = self._add(name)
        _run(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "set", "br0", "up"])
        return ns

    def _on_bridge(self, bridge: str, port: str, ns: str, dev: str, addr: str) -> None:
        self._link(bridge, port, ns, dev)
        _run(["ip", "-n", bridge, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])

    def _router(self, ns: str, rules: str) -> None:
        _run(self.exec_prefix(ns) + ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _run(self.exec_prefix(ns) + ["sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"], check=False)
        self._nft(ns, rules)

    def build(self) -> None:
        core = self._bridge("core")
        n = self.net
        for i in range(self.n_public):
            ns = self._add(f"p{i}")
            line = self.public_lines[i] if self.public_lines else self.public_line
            self._on_bridge(core, f"c{self.tag}p{i}", ns, "eth0", f"{self.public_addr(i)}/24")
            self._shape(ns, "eth0", line.up_bps)
            self._shape(core, f"c{self.tag}p{i}", line.down_bps)
            if line.loss_permille:  # no router in front of it: its own namespace drops the share
                self._nft(ns, loss_rule(line.loss_permille, hooks=("input", "output")))
        carrier = None
        if "cgnat" in self.kinds:  # one carrier NAT for every cgnat home, as an ISP's is
            carrier = self._add("carrier")
            self._on_bridge(core, f"c{self.tag}cr", carrier, "up0", f"10.{n}.0.250/24")
            cbr = self._bridge("cbr")
            self._on_bridge(cbr, f"k{self.tag}cr", carrier, "home0", f"100.64.{n}.1/24")
            self._router(carrier, NAT_RULES)
        for j, (kind, line) in enumerate(zip(self.kinds, self.lines)):
            gw = self._add(f"g{j}")
            if kind == "cgnat":
                self._on_bridge(self.ns("cbr"), f"k{self.tag}g{j}", gw, "up0", f"100.64.{n}.{10 + j}/24")
                _run(["ip", "-n", gw, "route", "add", "default", "via", f"100.64.{n}.1"])
            else:
                self._on_bridge(core, f"c{self.tag}g{j}", gw, "up0", f"10.{n}.0.{100 + j}/24")
            home = self._add(f"h{j}")
            self._link(gw, "home0", home, "eth0")
            _run(["ip", "-n", gw, "addr", "add", f"10.{n}.{1 + j}.1/24", "dev", "home0"])
            _run(["ip", "-n", home, "addr", "add", f"{self.home_addr(j)}/24", "dev", "eth0"])
            _run(["ip", "-n", home, "route", "add", "default", "via", f"10.{n}.{1 + j}.1"])
            self._router(gw, nat_rules(kind == "sym"))
            if line.loss_permille:
                self._nft(gw, loss_rule(line.loss_permille))
            self._shape(home, "eth0", line.up_bps)
            self._shape(gw, "home0", line.down_bps)

    def bounce_uplink(self, j: int, down_s: float = 0.5) -> float:
        """Home ``j``'s router's uplink down and up (every mapping through it lost); the wall time
        it was up again."""
        _run(["ip", "-n", self.gw_ns(j), "link", "set", "up0", "down"])
        time.sleep(down_s)
        _run(["ip", "-n", self.gw_ns(j), "link", "set", "up0", "up"])
        if self.kinds[j] == "cgnat":
            _run(["ip", "-n", self.gw_ns(j), "route", "replace", "default", "via", f"100.64.{self.net}.1"])
        return time.time()

    def bounce_public(self, i: int, down_s: float = 0.5) -> float:
        """Public node ``i``'s own line down and up (the comparison run's stand-in for a home
        router's uplink); the wall time it was up again."""
        _run(["ip", "-n", self.public_ns(i), "link", "set", "eth0", "down"])
        time.sleep(down_s)
        _run(["ip", "-n", self.public_ns(i), "link", "set", "eth0", "up"])
        return time.time()

    def node_namespaces(self) -> list[str]:
        """Every namespace a node runs in: one per public node, one per home (a home's successive
        volunteers share it); routers and bridges excluded."""
        return [self.public_ns(i) for i in range(self.n_public)] + [
            self.home_ns(j) for j in range(len(self.kinds))
        ]

    def tx_bytes(self, ns: str, dev: str = "eth0") -> int:
        """Bytes ``dev`` in namespace ``ns`` transmitted (its own counter, every header included);
        0 when it cannot be read."""
        return self.tx_counters(ns, dev)[0]

    def tx_counters(self, ns: str, dev: str = "eth0") -> tuple[int, int]:
        """(bytes, packets) ``dev`` in namespace ``ns`` transmitted; (0, 0) when they cannot be read."""
        p = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], check=False)
        try:
            tx = json.loads(p.stdout)[0]["stats64"]["tx"]
            return int(tx["bytes"]), int(tx["packets"])
        except (ValueError, LookupError, TypeError):
            return 0, 0

    def pids(self) -> set[int]:
        return namespace_pids(self.created)

    def teardown(self) -> None:
        """End every process inside our namespaces (all started by us), then delete them."""
        end_namespaces(self.created)


def leftover() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.startswith(PREFIX)]


__all__ = ["KINDS", "Line", "VolunteerNet", "home_lines", "leftover", "loss_rule"]
