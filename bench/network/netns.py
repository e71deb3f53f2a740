"""Network namespaces joined by a bridge, every node's link shaped with tc tbf (both veth ends).

Layout (all of it private to one harness process, named with its pid):

    ns <prefix>-br:  bridge br0, and for each node i the port v<tag>b<i>  (tbf: node i's download)
    ns <prefix>-n<i>: eth0 = 10.<net>.0.<10+i>/24                        (tbf: node i's upload)

Nothing is created in the root namespace and the host's loopback is never touched; each
node namespace brings up its *own* loopback (p2pd's control sockets are unix sockets).
``teardown`` ends every process still inside the namespaces (they can only be ours), then
deletes the namespaces, which destroys the veths and the bridge with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

NET_PREFIX = "vnh"  # every namespace this module creates starts with it


class NetnsUnavailable(RuntimeError):
    """No root, no `ip`/`tc`, or the kernel refuses namespaces/veth/tbf: one line says which."""


def _run(cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip()[:300]}")
    return p


def parse_rate(rate: str) -> float:
    """'80mbit' / '400Mbit' / '10000kbit' / '1gbit' / plain bits per second -> bits per second."""
    s = rate.strip().lower()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * mult
    return float(s)


def tc_rate(bits_per_s: float) -> str:
    return f"{int(round(bits_per_s / 1000))}kbit"


def tbf_burst_bytes(bits_per_s: float) -> int:
    """64 KiB at 80 Mbit/s (ENVIRONMENT.md: 76-77 Mbit/s of raw TCP); ~6.5 ms of traffic above."""
    return max(64 * 1024, int(bits_per_s / 8 * 0.0065))


def check_support() -> None:
    """Raise NetnsUnavailable with a one-line reason unless namespaces and tbf can be used here."""
    if sys.platform != "linux":
        raise NetnsUnavailable(f"network namespaces need Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces and tc need root (run as root, e.g. with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` (iproute2) is not installed")
    name = f"{NET_PREFIX}{os.getpid()}-probe"
    try:
        p = _run(["ip", "netns", "add", name], check=False)
        if p.returncode != 0:
            raise NetnsUnavailable(f"cannot create a network namespace: {p.stderr.strip()[:200]}")
        p = _run(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], check=False)
        if p.returncode != 0:
            raise NetnsUnavailable(f"cannot create a veth pair: {p.stderr.strip()[:200]}")
        p = _run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "add",
                "dev",
                "p0",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32kb",
                "latency",
                "50ms",
            ],
            check=False,
        )
        if p.returncode != 0:
            raise NetnsUnavailable(f"the tbf qdisc is unavailable: {p.stderr.strip()[:200]}")
    finally:
        _run(["ip", "netns", "del", name], check=False)


@dataclass
class Topology:
    n: int
    rate_bps: float
    latency_ms: int = 50
    # net.ipv4.tcp_notsent_lowat in every node namespace (0: the kernel's, unlimited): how many
    # bytes a socket may hold not yet sent, in front of everything written after them
    notsent_lowat: int = 0
    # net.ipv4.tcp_congestion_control in every node namespace ("": the kernel's default, cubic)
    congestion: str = ""
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    net: int = field(default_factory=lambda: 100 + os.getpid() % 100)
    created: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{NET_PREFIX}{self.tag}-br"

    def ns(self, i: int) -> str:
        return f"{NET_PREFIX}{self.tag}-n{i}"

    def addr(self, i: int) -> str:
        return f"10.{self.net}.0.{10 + i}"

    def port_dev(self, i: int) -> str:
        return f"v{self.tag}b{i}"  # bridge-side end, <= 15 chars

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    # ------------------------------------------------------------------ build / shape / remove
    def build(self) -> None:
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        self.created.append(br)
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for i in range(self.n):
            ns = self.ns(i)
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # the namespace's own loopback
            if self.notsent_lowat:
                _run(
                    self.exec_prefix(i)
                    + ["sysctl", "-qw", f"net.ipv4.tcp_notsent_lowat={self.notsent_lowat}"]
                )
            if self.congestion:
                _run(
                    self.exec_prefix(i)
                    + ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.congestion}"]
                )
            # both ends are born inside our namespaces: nothing appears in the root namespace
            _run(
                [
                    "ip",
                    "-n",
                    br,
                    "link",
                    "add",
                    self.port_dev(i),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                ]
            )
            _run(["ip", "-n", br, "link", "set", self.port_dev(i), "master", "br0"])
            _run(["ip", "-n", br, "link", "set", self.port_dev(i), "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        self.shape(self.rate_bps, replace=False)

    def shape(self, rate_bps: float, replace: bool = True) -> None:
        """tbf at ``rate_bps`` on both ends of every node's veth (upload and download)."""
        self.rate_bps = rate_bps
        verb = "replace" if replace else "add"
        tbf = [
            "tbf",
            "rate",
            tc_rate(rate_bps),
            "burst",
            str(tbf_burst_bytes(rate_bps)),
            "latency",
            f"{self.latency_ms}ms",
        ]
        for i in range(self.n):
            _run(["ip", "netns", "exec", self.ns(i), "tc", "qdisc", verb, "dev", "eth0", "root", *tbf])
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.bridge_ns,
                    "tc",
                    "qdisc",
                    verb,
                    "dev",
                    self.port_dev(i),
                    "root",
                    *tbf,
                ]
            )

    def set_link(self, i: int, up: bool) -> None:
        """Cut (or restore) node i's link: its bridge port goes down, so nothing reaches it or leaves it."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port_dev(i), "up" if up else "down"])

    def kill_all_processes(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL, every process inside our node namespaces (all started by us)."""

        def pids() -> set[int]:
            return self.pids() - {os.getpid()}

        found = pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in found:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while found and time.monotonic() < deadline:
                time.sleep(0.2)
                found = pids()
            if not found:
                break
        return len(found)

    def pids(self) -> set[int]:
        return namespace_pids(self.created)

    def cpu_seconds(self, roots: dict[int, list[int]]) -> dict[str, float]:
        """User + system CPU seconds of every node's process tree (``cpu_by_node``), by command name."""
        out: dict[str, float] = {}
        for per_pid in self.cpu_by_node(roots, by_comm=True).values():
            for comm, sec in per_pid.items():
                out[comm] = out.get(comm, 0.0) + sec
        return out

    def cpu_by_node(self, roots: dict[int, list[int]], by_comm: bool = False) -> dict[int, dict]:
        """{node index: {pid: user + system CPU seconds}} of each node's process trees.

        ``roots``: the pids the harness started for node i (the node, its delay proxy); their
        descendants (the DHT process, p2pd) count too. One pass over /proc, no subprocess: under a
        load average of 40, `ip netns pids` took over 30 s. ``by_comm``: keyed by command name."""
        tick = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        cpu: dict[int, float] = {}
        comm: dict[int, str] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                fields = rest.split()
            except (OSError, ValueError):
                continue
            pid = int(name)
            parent[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            comm[pid] = head.split("(", 1)[1]
        children: dict[int, list[int]] = {}
        for pid, pp in parent.items():
            children.setdefault(pp, []).append(pid)
        out: dict[int, dict] = {}
        for i, pids in roots.items():
            todo, got = list(pids), {}
            while todo:
                pid = todo.pop()
                if pid in cpu and pid not in got:
                    got[pid] = cpu[pid]
                    todo += children.get(pid, [])
            if by_comm:
                named: dict[str, float] = {}
                for pid, sec in got.items():
                    named[comm[pid]] = named.get(comm[pid], 0.0) + sec
                got = named
            out[i] = got
        return out

    def teardown(self) -> None:
        self.kill_all_processes()
        for ns in reversed(self.created):
            _run(["ip", "netns", "del", ns], check=False)
        self.created.clear()

    # ------------------------------------------------------------------ measure
    def counters(self) -> dict[int, dict[str, int]]:
        """Bytes each node sent (``up``) and received (``down``), from its bridge port's counters."""
        out: dict[int, dict[str, int]] = {}
        try:
            p = _run(["ip", "-n", self.bridge_ns, "-s", "-j", "link", "show"], check=False)
        except subprocess.TimeoutExpired:  # a loaded host: this snapshot has no counters
            return out
        try:
            links = json.loads(p.stdout or "[]")
        except json.JSONDecodeError:
            return out
        names = {self.port_dev(i): i for i in range(self.n)}
        for lk in links:
            i = names.get(lk.get("ifname"))
            if i is None:
                continue
            st = lk.get("stats64", {})
            # the bridge port receives what the node uploads and transmits what it downloads
            out[i] = {
                "up": int(st.get("rx", {}).get("bytes", 0)),
                "down": int(st.get("tx", {}).get("bytes", 0)),
            }
        return out

    def tcp_rate_check(self, a: int = 0, b: int = 1, seconds: float = 3.0, port: int = 5299) -> float:
        """Raw TCP goodput (bits/s) from node b's namespace to node a's, through both tbf's."""
        recv = (
            "import socket,time\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.addr(a)}',{port}))\n"
            "s.listen(1);c,_=s.accept();n=0;t0=None\n"
            "while True:\n"
            "  d=c.recv(1<<20)\n"
            "  if not d: break\n"
            "  if t0 is None: t0=time.perf_counter()\n"
            "  else: n+=len(d)\n"
            "print(n*8/max(time.perf_counter()-t0,1e-9))\n"
        )
        send = (
            "import socket,time\n"
            f"s=socket.create_connection(('{self.addr(a)}',{port}));b=b'x'*(1<<16);end=time.perf_counter()+{seconds}\n"
            "while time.perf_counter()<end: s.sendall(b)\n"
            "s.close()\n"
        )
        rp = subprocess.Popen(
            self.exec_prefix(a) + [sys.executable, "-c", recv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(0.5)
            _run(self.exec_prefix(b) + [sys.executable, "-c", send], timeout=seconds + 30)
            out, err = rp.communicate(timeout=seconds + 30)
        finally:
            if rp.poll() is None:
                rp.kill()
                rp.wait()
        if rp.returncode != 0:
            raise RuntimeError(f"tcp rate check failed: {err.strip()[:200]}")
        return float(out.strip().splitlines()[-1])


def leftover_namespaces() -> list[str]:
    """Namespaces named like ours (for the tests: the harness must leave none behind)."""
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.startswith(NET_PREFIX)]


# ---------------------------------------------------------------------------------------------- NAT
NAT_PREFIX = "vnat"  # every namespace NatTopology creates starts with it


def check_nat_support() -> None:
    """``check_support``, and nftables able to masquerade inside a namespace: NetnsUnavailable says
    which part is missing."""
    check_support()
    if shutil.which("nft") is None:
        raise NetnsUnavailable("`nft` (nftables) is not installed: apt-get install nftables")
    name = f"{NAT_PREFIX}{os.getpid()}-probe"
    try:
        p = _run(["ip", "netns", "add", name], check=False)
        if p.returncode != 0:
            raise NetnsUnavailable(f"cannot create a network namespace: {p.stderr.strip()[:200]}")
        p = subprocess.run(
            ["ip", "netns", "exec", name, "nft", "-f", "-"], input=NAT_RULES, capture_output=True, text=True
        )
        if p.returncode != 0:
            raise NetnsUnavailable(f"nftables cannot masquerade here: {p.stderr.strip()[:200]}")
    finally:
        _run(["ip", "netns", "del", name], check=False)


# The gateway of a home network: masquerade out of the uplink, and a forward chain that lets in
# only what belongs to a connection the home side opened (a home router with no forwarded port).
# A mid-stream packet of a connection the gateway no longer tracks is invalid, not new, and is
# dropped (nf_conntrack_tcp_loose=0, set below), as a router that lost its mappings does.
# The router drops what nobody inside asked for, without an answer (a consumer router's default
# "stealth" WAN side: no reset for a connection to a port it does not forward).
NAT_RULES = """
table ip vnat {
  chain postrouting { type nat hook postrouting priority 100; oifname "up0" masquerade; }
  chain forward {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "home0" oifname "up0" ct state new accept
  }
  chain input { type filter hook input priority 0; policy accept; iifname "up0" ct state new drop; }
}
"""
# A symmetric NAT: each new connection out gets a random source port, so the address one peer
# sees is not the one another would reach (hole punching cannot work through it).
RANDOM_PORTS = "masquerade random,fully-random"


def nat_rules(random_ports: bool = False) -> str:
    return NAT_RULES.replace("masquerade;", RANDOM_PORTS + ";") if random_ports else NAT_RULES


@dataclass
class NatTopology:
    """Public peers on a bridge, and home networks each behind a NAT gateway of its own:

        ns <p>-pub:   bridge br0 (the public segment 10.<net>.0.0/24)
        ns <p>-a<i>:  eth0 = 10.<net>.0.<10+i>            public peer i (a route to each home net via its gw)
        ns <p>-gw:    up0 = 10.<net>.0.1, home0 = 10.<net>.1.1   nftables NAT_RULES
        ns <p>-home:  eth0 = 10.<net>.1.10, default route via the gw
        ns <p>-gw<j>, <p>-home<j> (j >= 1, ``n_homes``): the same on 10.<net>.0.<1+j>, 10.<net>.<1+j>.0/24

    The public peers get a route to the home networks on purpose: what stops them is the gateway's
    forward chain, not a missing route. Two homes reach each other only through both gateways, as
    two volunteers behind two routers do. ``rate_bps``: tbf on each home link (both ends) and on each
    public peer's link, as ``Topology`` shapes its veths; 0 leaves them unshaped.
    """

    n_public: int
    rate_bps: float = 0.0
    latency_ms: int = 50
    n_homes: int = 1
    random_ports: tuple[int, ...] = ()  # homes whose gateway is a symmetric NAT (RANDOM_PORTS)
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    net: int = field(default_factory=lambda: 100 + os.getpid() % 100)
    created: list[str] = field(default_factory=list)

    def ns(self, name: str) -> str:
        return f"{NAT_PREFIX}{self.tag}-{name}"

    def public_ns(self, i: int) -> str:
        return self.ns(f"a{i}")

    def home_ns_of(self, j: int) -> str:
        return self.ns("home" if j == 0 else f"home{j}")

    def gw_ns_of(self, j: int) -> str:
        return self.ns("gw" if j == 0 else f"gw{j}")

    def home_addr_of(self, j: int) -> str:
        return f"10.{self.net}.{1 + j}.10"

    def gw_public_addr_of(self, j: int) -> str:
        return f"10.{self.net}.0.{1 + j}"

    @property
    def home_ns(self) -> str:
        return self.home_ns_of(0)

    @property
    def gw_ns(self) -> str:
        return self.gw_ns_of(0)

    def public_addr(self, i: int) -> str:
        return f"10.{self.net}.0.{10 + i}"

    @property
    def home_addr(self) -> str:
        return self.home_addr_of(0)

    @property
    def gw_public_addr(self) -> str:
        return self.gw_public_addr_of(0)

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def _add(self, name: str) -> str:
        return add_namespace(self.ns(name), self.created)

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        add_veth(ns_a, dev_a, ns_b, dev_b)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_bps:
            rate, burst = tc_rate(self.rate_bps), str(tbf_burst_bytes(self.rate_bps))
            tbf = ["tbf", "rate", rate, "burst", burst, "latency", f"{self.latency_ms}ms"]
            _run(self.exec_prefix(ns) + ["tc", "qdisc", "add", "dev", dev, "root", *tbf])

    def build(self) -> None:
        if not 1 <= self.n_homes <= 8 or self.n_public > 200:
            raise ValueError(
                f"NatTopology: 1-8 homes, at most 200 public peers: {self.n_homes}, {self.n_public}"
            )
        pub = self._add("pub")
        _run(["ip", "-n", pub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", pub, "link", "set", "br0", "up"])
        homes = range(self.n_homes)
        short = lambda full: full[len(self.ns("")) :]  # noqa: E731  (_add takes the name's tail)
        nodes = [
            (short(self.public_ns(i)), "eth0", self.public_addr(i), f"p{self.tag}a{i}")
            for i in range(self.n_public)
        ]
        gws = [
            (short(self.gw_ns_of(j)), "up0", self.gw_public_addr_of(j), f"p{self.tag}gw{j}") for j in homes
        ]
        for name, dev, addr, port in [*nodes, *gws]:
            ns = self._add(name)
            self._veth(pub, port, ns, dev)
            _run(["ip", "-n", pub, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", pub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            if dev == "eth0":  # a public peer: a route to every home network, through its gateway
                for j in homes:
                    home_net = f"10.{self.net}.{1 + j}.0/24"
                    _run(["ip", "-n", ns, "route", "add", home_net, "via", self.gw_public_addr_of(j)])
                self._shape(ns, dev)
                self._shape(pub, port)
        for j in homes:
            gw, lan_gw = self.gw_ns_of(j), f"10.{self.net}.{1 + j}.1"
            home = self._add(short(self.home_ns_of(j)))
            self._veth(gw, "home0", home, "eth0")
            _run(["ip", "-n", gw, "addr", "add", f"{lan_gw}/24", "dev", "home0"])
            _run(["ip", "-n", gw, "link", "set", "home0", "up"])
            _run(["ip", "-n", home, "addr", "add", f"{self.home_addr_of(j)}/24", "dev", "eth0"])
            _run(["ip", "-n", home, "link", "set", "eth0", "up"])
            _run(["ip", "-n", home, "route", "add", "default", "via", lan_gw])
            self._shape(home, "eth0")
            self._shape(gw, "home0")
            _run(self.exec_prefix(gw) + ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
            _run(
                self.exec_prefix(gw) + ["sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"],
                check=False,
            )
            rules = nat_rules(j in self.random_ports)
            p = subprocess.run(
                self.exec_prefix(gw) + ["nft", "-f", "-"], input=rules, capture_output=True, text=True
            )
            if p.returncode != 0:
                raise RuntimeError(f"nft: {p.stderr.strip()[:300]}")

    def bounce_uplink(self, down_s: float = 0.5) -> float:
        """The gateway's uplink goes down and up: masquerade forgets every mapping through it (the
        kernel drops the conntrack entries NAT'd to a device that goes down), as a router reboot
        or a DSL resync does; the home side's connections are then dead, not merely paused.
        Returns the wall-clock time the uplink was up again."""
        _run(["ip", "-n", self.gw_ns, "link", "set", "up0", "down"])
        time.sleep(down_s)
        _run(["ip", "-n", self.gw_ns, "link", "set", "up0", "up"])
        return time.time()

    def tcp_connects(self, from_ns: str, host: str, port: int, timeout_s: float = 3.0) -> bool:
        """Whether a plain TCP connect from namespace ``from_ns`` to host:port completes."""
        code = (
            "import socket,sys\n"
            f"s=socket.socket();s.settimeout({timeout_s})\n"
            f"sys.exit(0 if s.connect_ex(('{host}',{port}))==0 else 1)\n"
        )
        p = subprocess.run(self.exec_prefix(from_ns) + [sys.executable, "-c", code], timeout=timeout_s + 30)
        return p.returncode == 0

    def conntrack_flows(self, j: int = 0) -> list[dict[str, str]] | None:
        """Home ``j``'s gateway's tracked TCP flows (original direction: src, dst, sport, dport; the
        reply direction's as rsrc, rdst, rsport, rdport); None without the `conntrack` tool."""
        if shutil.which("conntrack") is None:
            return None
        p = _run(self.exec_prefix(self.gw_ns_of(j)) + ["conntrack", "-L", "-p", "tcp"], check=False)
        flows = []
        for line in p.stdout.splitlines():
            kv: dict[str, str] = {}
            for tok in line.split():
                k, eq, v = tok.partition("=")
                if eq and k not in kv:  # the first src/dst/sport/dport are the original direction's
                    kv[k] = v
                elif eq and "r" + k not in kv:
                    kv["r" + k] = v
            if "src" in kv:
                flows.append(kv)
        return flows

    def pids(self) -> set[int]:
        return namespace_pids(self.created)

    def teardown(self) -> None:
        """End every process inside our namespaces (all started by us), then delete them."""
        end_namespaces(self.created)


def add_namespace(ns: str, created: list[str]) -> str:
    """Make namespace ``ns`` with its loopback up, and note it in ``created`` (for teardown)."""
    _run(["ip", "netns", "add", ns])
    created.append(ns)
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    return ns


def add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """A veth pair between two namespaces (``dev_a`` in ``ns_a``, ``dev_b`` in ``ns_b``), down."""
    _run(["ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b])


def namespace_pids(namespaces: list[str]) -> set[int]:
    """The processes inside ``namespaces``."""
    out: set[int] = set()
    for ns in namespaces:
        p = _run(["ip", "netns", "pids", ns], check=False, timeout=180.0)  # slow under heavy load
        out |= {int(x) for x in p.stdout.split() if x.strip().isdigit()}
    return out


def end_namespaces(namespaces: list[str]) -> None:
    """End every process inside ``namespaces`` (SIGTERM, then SIGKILL), delete them, and empty the
    list. Only for namespaces this process made: everything in them is ours."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = namespace_pids(namespaces) - {os.getpid()}
        for pid in found:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while found and time.monotonic() < deadline:
            time.sleep(0.2)
            found = namespace_pids(namespaces) - {os.getpid()}
        if not found:
            break
    for ns in reversed(namespaces):
        _run(["ip", "netns", "del", ns], check=False)
    namespaces.clear()


def leftover_nat_namespaces() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.startswith(NAT_PREFIX)]
