"""Where does a dense frame lose the 80 Mbit/s link? Goodput of A -> B transfers (issue 16).

    python -m bench.network.linkprobe                       # the default grid, ~10 min, root needed
    python -m bench.network.linkprobe --rtts 40 --sizes 16777216 --streams 4 --kinds p2p \
        --replies echo --writes concurrent,serial2
    python -m bench.network.linkprobe --table               # bench/results/linkprobe.json as markdown + .png

Two namespaces on the harness's bridge (bench/network/netns.py: tbf at --rate on both veth ends) and,
at RTT > 0, the harness's delay proxy in front of B. A sends N frames of S bytes to B:

* ``tcp``: one raw TCP connection, frames back to back (B acks each): the link's ceiling.
* ``p2p``: hivemind P2P (its own p2pd) in each namespace, set up as the node's DHT sets up its
  own; one libp2p stream per frame, as node/stage/hop.py sends a FORWARD frame (node.net.rpc.open_stream,
  node.net.wire); ``--streams`` frames in flight at a time, written at once or in turns (--writes).
* ``--replies echo``: B answers each frame with one of its size, as a BACKWARD frame answers a
  FORWARD one, so both directions are busy (a pipeline stage's link); ``ack``: 2 bytes.

While a case runs, a 1-byte request on its own stream every 0.25 s measures what small messages
(heartbeats, window updates) wait behind the bulk. The link knobs (--tbf-latency-ms,
--notsent-lowat, --proxy-queue) try the harness-side fixes. The receiver and sender stay up for
all cases of one (RTT, kind); between cases the probe reads each process's CPU seconds
(bench.network.netns.Topology.cpu_by_node), so CPU binding shows beside the goodput. Results: appended
to --out (.json), one line per case on stdout. Findings: bench/results/linkprobe.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.network.harness import (
    PORT,
    REPO,
    RESULTS,
    HarnessError,
    _cores_by_command,
    proxy_queue_bytes,
    start_proxy,
)
from bench.network.netns import NetnsUnavailable, Topology, check_support, parse_rate

EXIT_UNSUPPORTED = 3
DENSE_FRAME = 4096 * 2048 * 2  # one 4096-token microbatch at H = 2048 in bf16
HANDLER = "vnode.linkprobe"
ACK = b"ok"
# a frame's first byte: ECHO asks for a reply of its size (a BACKWARD reply); its second byte,
# when not 0, is how many replies B may write at once (serial writes, see --writes)
ECHO = 1
PING_EVERY_S = 0.25
CASE_TIMEOUT_S = 300.0
SEND, RECV, PROXY = 0, 1, 2  # process groups for the CPU accounting


# ---------------------------------------------------------------------------------------------- roles
# Each role runs inside a namespace (`python -m bench.network.linkprobe --role ...`), prints one JSON
# line when ready, then (the sender) reads one case per stdin line and answers one JSON line.


async def _tcp_recv(host: str, port: int) -> None:
    from node.net.transport import read_message, write_message

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                msg = await read_message(reader, 1 << 31, CASE_TIMEOUT_S)
                await write_message(writer, _reply(msg), CASE_TIMEOUT_S)
        except Exception:  # EOF between frames ends the case
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, host, port, reuse_address=True)
    _say({"ready": True})
    async with server:
        await _until_stdin_closes()


async def _tcp_send(host: str, port: int) -> None:
    from node.net.transport import read_message, write_message

    async def ping() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await write_message(writer, b"\0", CASE_TIMEOUT_S)
            await read_message(reader, 64, CASE_TIMEOUT_S)
        finally:
            writer.close()

    async def one_case(size: int, frames: int, echo: bool) -> dict:
        data = _frame(size, echo)
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port)

        async def acks() -> None:
            for _ in range(frames):
                await read_message(reader, 1 << 31, CASE_TIMEOUT_S)

        got = asyncio.ensure_future(acks())
        for _ in range(frames):  # back to back: the ack of one frame is never waited for
            await write_message(writer, data, CASE_TIMEOUT_S)
        await got
        seconds = time.perf_counter() - t0
        writer.close()
        return {"seconds": seconds}

    await _serve_cases(one_case, ping)


async def _serve_cases(one_case, ping) -> None:
    """Announce readiness, then run one case per stdin line and answer each with a JSON line.

    While a case runs, a tiny request on a connection (tcp) or stream (p2p) of its own goes out
    every PING_EVERY_S: its round trip is what a heartbeat or DHT reply waits behind the bulk."""
    _say({"ready": True})
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        pings: list[float] = []
        failed: list[str] = []

        async def pinger(pings: list[float], failed: list[str]) -> None:
            while True:
                await asyncio.sleep(PING_EVERY_S)
                t = time.perf_counter()
                try:
                    await ping()
                except Exception as e:  # counted, not fatal: the bulk case goes on
                    failed.append(f"{type(e).__name__}: {e}")
                    continue
                pings.append(time.perf_counter() - t)

        task = asyncio.ensure_future(pinger(pings, failed))
        try:
            out = await one_case(**json.loads(line))
        finally:
            task.cancel()
        pings.sort()
        out["ping_ms"] = {
            "n": len(pings),
            "median": round(1000 * pings[len(pings) // 2], 1) if pings else None,
            "max": round(1000 * pings[-1], 1) if pings else None,
            "failed": failed[:3],
        }
        _say(out)


def _frame(size: int, echo: bool, serial: int = 0, persist: bool = False) -> bytes:
    data = bytearray(max(size, 3))
    data[0] = ECHO if echo else 0
    data[1] = serial
    data[2] = 1 if persist else 0  # another frame follows on this stream
    return bytes(data)


def _reply(msg: bytes) -> bytes:
    return bytes(len(msg)) if msg and msg[0] & ECHO else ACK


def _p2p_kwargs() -> dict:
    """P2P.create settings of the node's DHT (node/swarm/membership.py start_dht, NodeConfig defaults)."""
    from node.config import NodeConfig

    cfg = NodeConfig()
    return dict(startup_timeout=60, use_relay=cfg.use_relay, use_auto_relay=cfg.use_auto_relay)


async def _p2p_recv(host: str, port: int, announce: str) -> None:
    from hivemind.p2p import P2P

    from node.net.transport import close_quietly
    from node.net.wire import IDLE_S, Wire
    from protocol.frames import MalformedFrame

    wire = Wire()
    p2p = await P2P.create(
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        announce_maddrs=[announce] if announce else None,
        **_p2p_kwargs(),
    )

    replying: dict[int, asyncio.Semaphore] = {}

    async def handle(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:  # as node/stage/server.py reads a FORWARD frame: an inactivity deadline, not a total one
            while True:  # a persistent stream (--writes persist) carries frame after frame
                try:
                    msg = await wire.recv(reader, 1 << 31, CASE_TIMEOUT_S, idle=IDLE_S if first else 3600)
                except MalformedFrame:
                    if first:
                        raise
                    return  # the sender closed its persistent stream
                first = False
                if len(msg) > 1 and msg[1]:
                    async with replying.setdefault(msg[1], asyncio.Semaphore(msg[1])):
                        await wire.send(writer, _reply(msg), CASE_TIMEOUT_S)
                else:
                    await wire.send(writer, _reply(msg), CASE_TIMEOUT_S)
                if not (len(msg) > 2 and msg[2]):
                    return
        except Exception as e:  # the sender's traceback only says the stream closed: say why here
            print(f"linkprobe receiver: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            close_quietly(writer)

    await p2p.add_binary_stream_handler(HANDLER, handle)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    _say({"ready": True, "peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs})
    try:
        await _until_stdin_closes()
    finally:
        await p2p.shutdown()


async def _p2p_send(peer_maddr: str) -> None:
    from hivemind.p2p import P2P

    from node.net.rpc import open_stream
    from node.net.transport import close_quietly
    from node.net.wire import Wire

    wire = Wire()
    p2p = await P2P.create(initial_peers=[peer_maddr], **_p2p_kwargs())
    peer = peer_maddr.rsplit("/p2p/", 1)[1]

    async def call(data: bytes, sending: asyncio.Semaphore | None = None) -> None:
        # serial: the stream opens once it is this frame's turn, since a receiver closes a
        # stream that sent nothing for IDLE_S (node/net/wire.py), and the turn may take longer
        async with sending or contextlib.nullcontext():
            reader, writer = await open_stream(p2p, peer, HANDLER, CASE_TIMEOUT_S)
            try:
                await wire.send(writer, data, CASE_TIMEOUT_S)
            except BaseException:
                close_quietly(writer)
                raise
        try:
            await wire.recv(reader, len(data) + 64, CASE_TIMEOUT_S)
        finally:
            close_quietly(writer)

    async def call_split(chunk: bytes, split: int, sending: asyncio.Semaphore | None) -> None:
        # one frame as `split` parts, each on its own stream at once: each stream's yamux window
        # starts small and grows per round trip, so parts multiply the window a frame starts with
        async with sending or contextlib.nullcontext():
            streams = [await open_stream(p2p, peer, HANDLER, CASE_TIMEOUT_S) for _ in range(split)]
            try:
                await asyncio.gather(*(wire.send(w, chunk, CASE_TIMEOUT_S) for _, w in streams))
            except BaseException:
                for _, w in streams:
                    close_quietly(w)
                raise
        try:
            await asyncio.gather(*(wire.recv(r, len(chunk) + 64, CASE_TIMEOUT_S) for r, _ in streams))
        finally:
            for _, w in streams:
                close_quietly(w)

    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def persist_worker(i: int, data: bytes, n: int, per_frame: list[float]) -> None:
        # one long-lived stream, frames back to back, the replies read as they come: its yamux
        # window, once grown, is not spent again per frame (the stream outlives the case too)
        while len(held) <= i:
            held.append(await open_stream(p2p, peer, HANDLER, CASE_TIMEOUT_S))
        reader, writer = held[i]
        sent: list[float] = []

        async def replies() -> None:
            for j in range(n):
                await wire.recv(reader, len(data) + 64, CASE_TIMEOUT_S)
                per_frame.append(round(time.perf_counter() - sent[j], 3))

        task = asyncio.ensure_future(replies())
        for _ in range(n):
            sent.append(time.perf_counter())
            await wire.send(writer, data, CASE_TIMEOUT_S)
        await task

    async def one_case(
        size: int,
        frames: int,
        streams: int,
        echo: bool,
        serial: int = 0,
        split: int = 1,
        persist: bool = False,
    ) -> dict:
        if persist:
            data, per_frame = _frame(size, echo, persist=True), []
            shares = [frames // streams + (i < frames % streams) for i in range(streams)]
            t0 = time.perf_counter()
            await asyncio.gather(*(persist_worker(i, data, n, per_frame) for i, n in enumerate(shares)))
            return {"seconds": time.perf_counter() - t0, "frame_s": sorted(per_frame)}
        # the receiver writes as many replies at once as this side writes parts
        data = _frame(size // split, echo, min(255, serial * split))
        sending = asyncio.Semaphore(serial) if serial else None
        todo = list(range(frames))
        per_frame: list[float] = []

        async def worker() -> None:
            while todo:
                todo.pop()
                t = time.perf_counter()
                await (call(data, sending) if split == 1 else call_split(data, split, sending))
                per_frame.append(round(time.perf_counter() - t, 3))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return {"seconds": time.perf_counter() - t0, "frame_s": sorted(per_frame)}

    try:
        await _serve_cases(one_case, lambda: call(b"\0"))
    finally:
        await p2p.shutdown()


async def _until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def _say(obj: dict) -> None:
    obj["cpu_s"] = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------------- driver
class Pair:
    """Receiver in namespace 1 (behind the proxy at RTT > 0), sender in namespace 0."""

    def __init__(self, topo: Topology, kind: str, delay_ms: float, proxy_queue: int = 0, proxy_lean: int = 0):
        self.topo, self.kind, self.delay_ms, self.proxy_queue = topo, kind, delay_ms, proxy_queue
        self.proxy_lean = proxy_lean
        self.procs: dict[int, subprocess.Popen] = {}

    def _role(self, ns: int, group: int, *args: str) -> dict:
        cmd = self.topo.exec_prefix(ns) + [sys.executable, "-m", "bench.network.linkprobe", "--role", *args]
        p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
        )
        self.procs[group] = p
        line = p.stdout.readline()
        if not line:
            raise HarnessError(f"{' '.join(args[:1])} in {self.topo.ns(ns)} exited with code {p.wait()}")
        return json.loads(line)

    def start(self) -> None:
        behind = self.delay_ms > 0  # the receiver listens on its loopback, the proxy on its address
        host = "127.0.0.1" if behind else self.topo.addr(1)
        if behind:
            self.procs[PROXY] = start_proxy(
                self.topo, 1, self.delay_ms, max_queue=self.proxy_queue, lean=self.proxy_lean
            )
        dial = f"/ip4/{self.topo.addr(1)}/tcp/{PORT}"
        if self.kind == "tcp":
            self._role(1, RECV, "tcp-recv", host, str(PORT))
            self._role(0, SEND, "tcp-send", self.topo.addr(1), str(PORT))
        else:
            ready = self._role(1, RECV, "p2p-recv", host, str(PORT), dial if behind else "")
            self._role(0, SEND, "p2p-send", f"{dial}/p2p/{ready['peer_id']}")

    def run_case(
        self,
        size: int,
        frames: int,
        streams: int,
        echo: bool,
        serial: int,
        split: int = 1,
        persist: bool = False,
    ) -> dict:
        roots = {g: [p.pid] for g, p in self.procs.items()}
        c0, w0, t0 = self.topo.cpu_by_node(roots, by_comm=True), self.topo.counters(), time.monotonic()
        send = self.procs[SEND]
        case = {"size": size, "frames": frames, "echo": echo}
        case |= {"streams": streams, "serial": serial, "split": split} if self.kind == "p2p" else {}
        case |= {"persist": True} if persist else {}
        send.stdin.write(json.dumps(case) + "\n")
        send.stdin.flush()
        line = send.stdout.readline()
        t1 = time.monotonic()
        c1, w1 = self.topo.cpu_by_node(roots, by_comm=True), self.topo.counters()
        if not line:
            raise HarnessError(f"the {self.kind} sender exited with code {send.wait()} mid-case")
        out = json.loads(line)
        out.pop("cpu_s")
        names = {SEND: "A", RECV: "B", PROXY: "proxy"}
        cpu = {}
        for g, name in names.items():
            if g in c1:
                for comm, cores in _cores_by_command({"s0": c0[g], "s1": c1[g], "t0": t0, "t1": t1}).items():
                    cpu[f"{name}:{comm}"] = cores
        wire_up = (w1.get(0, {}).get("up", 0) - w0.get(0, {}).get("up", 0)) if w0 and w1 else None
        out["cpu_cores"] = cpu
        out["wire_bytes"] = wire_up
        return out

    def stop(self) -> None:
        for g in (SEND, RECV, PROXY):
            p = self.procs.get(g)
            if p is None or p.poll() is not None:
                continue
            if p.stdin:
                p.stdin.close()  # the roles end when their stdin closes
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.procs.clear()


def _cases(a, kind: str) -> list[tuple[int, str, int, str, int]]:
    """(frame size, reply, streams, writes, split) of one (RTT, kind); tcp runs one connection,
    whose frames are serial and whole already."""
    replies = [r.strip() for r in a.replies.split(",") if r.strip()]
    streams = _ints(a.streams) if kind == "p2p" else [1]
    writes = [w.strip() for w in a.writes.split(",") if w.strip()] if kind == "p2p" else ["serial"]
    splits = _ints(a.splits) if kind == "p2p" else [1]
    return [
        (size, r, n, w, k)
        for size in _ints(a.sizes) for r in replies for n in streams for w in writes for k in splits
    ]  # fmt: skip


def _proxy_queue(spec: str, rate_bps: float, delay_ms: float) -> int:
    return proxy_queue_bytes(rate_bps, delay_ms) if spec == "bdp" else int(spec)


def _serial(writes: str) -> int | None:
    """'concurrent' -> 0, 'serial' -> 1, 'serialN' -> N (frames written at once), else None.
    'persist' (a long-lived stream per frame in flight, frames back to back on it) -> 0."""
    if writes in ("concurrent", "persist"):
        return 0
    n = writes.removeprefix("serial")
    if writes.startswith("serial") and (n == "" or (n.isdigit() and 0 < int(n) < 256)):
        return int(n or 1)
    return None


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.network.linkprobe", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rate", default="80mbit", help="tbf rate of both links, both directions")
    p.add_argument("--rtts", default="0,40,100", help="round-trip times in ms (proxy delay = half)")
    p.add_argument("--kinds", default="tcp,p2p", help="tcp (one raw connection), p2p (a stream per frame)")
    p.add_argument("--sizes", default=f"{DENSE_FRAME},1048576", help="frame sizes in bytes")
    p.add_argument("--streams", default="1,2,4", help="p2p: frames in flight (concurrent streams)")
    p.add_argument(
        "--splits",
        default="1",
        help="p2p: parts per frame, each written on its own stream at once (1: one stream per frame)",
    )
    p.add_argument("--bytes", type=float, default=128e6, help="bytes per case; frames = max(4, bytes / size)")
    p.add_argument("--tcp-rtts", default="0,40", help="RTTs of the tcp kind (its ceiling)")
    p.add_argument(
        "--replies",
        default="ack",
        help="ack: B answers a frame with 2 bytes; echo: with a frame of its size, as a BACKWARD "
        "frame answers a FORWARD one, so both directions are busy at once (as in the harness)",
    )
    p.add_argument("--label", default="baseline", help="name of this configuration in the results")
    p.add_argument(
        "--writes",
        default="concurrent",
        help="p2p: concurrent (the in-flight frames share the link, as the node sends them) and/or "
        "serial (one frame written at a time, each side; the rest wait their turn), serialN (N at a time), "
        "persist (one long-lived stream per frame in flight, frames back to back on it)",
    )
    p.add_argument(
        "--tbf-latency-ms",
        type=int,
        default=Topology.latency_ms,
        help="tbf latency (its queue: rate x this + burst; default: the harness's %(default)s ms)",
    )
    p.add_argument(
        "--notsent-lowat",
        type=int,
        default=0,
        help="net.ipv4.tcp_notsent_lowat in both namespaces (unsent bytes a socket may hold; "
        "0: the kernel's)",
    )
    p.add_argument(
        "--congestion",
        default="",
        help="net.ipv4.tcp_congestion_control in both namespaces, e.g. bbr (default: the kernel's)",
    )
    p.add_argument(
        "--proxy-lean",
        type=int,
        default=0,
        help="the proxy's --lean: bytes of its receive buffer from the node and of unsent bytes per socket",
    )
    p.add_argument(
        "--proxy-queue",
        default="0",
        help="the proxy's --max-queue: bytes, or 'bdp' for twice rate x one-way delay (0: unbounded)",
    )
    p.add_argument("--out", default=str(RESULTS / "linkprobe.json"), help="append the results here")
    p.add_argument(
        "--table",
        action="store_true",
        help="print --out's results as a markdown table and draw them beside it (.png), run nothing",
    )
    p.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    return p


def _run_role(args: list[str]) -> int:
    role, rest = args[0], args[1:]
    coro = {
        "tcp-recv": lambda: _tcp_recv(rest[0], int(rest[1])),
        "tcp-send": lambda: _tcp_send(rest[0], int(rest[1])),
        "p2p-recv": lambda: _p2p_recv(rest[0], int(rest[1]), rest[2]),
        "p2p-send": lambda: _p2p_send(rest[0]),
    }[role]
    asyncio.run(coro())
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.role:
        return _run_role(a.role)
    if a.table:
        rows = json.loads(Path(a.out).read_text())
        print(markdown_table(rows))
        print(f"plot: {plot(rows, Path(a.out).with_suffix('.png'))}")
        return 0
    try:
        check_support()
    except NetnsUnavailable as e:
        print(f"bench.network.linkprobe: cannot build the capped network here: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    rate = parse_rate(a.rate)
    cap = rate / 8
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("tcp", "p2p")]
    if bad:
        print(f"error: unknown --kinds {bad}; choose tcp and/or p2p", file=sys.stderr)
        return 2
    bad = [r for r in a.replies.split(",") if r.strip() not in ("ack", "echo")]
    bad += [w for w in a.writes.split(",") if _serial(w.strip()) is None]
    if bad:
        print(f"error: unknown --replies/--writes {bad}; see --help", file=sys.stderr)
        return 2
    if a.proxy_queue != "bdp" and not a.proxy_queue.isdigit():
        print(f"error: --proxy-queue {a.proxy_queue!r}: give bytes (0: unbounded) or 'bdp'", file=sys.stderr)
        return 2
    command = "python -m bench.network.linkprobe " + " ".join(sys.argv[1:] if argv is None else argv)
    topo = Topology(
        2, rate, latency_ms=a.tbf_latency_ms, notsent_lowat=a.notsent_lowat, congestion=a.congestion
    )
    signal.signal(signal.SIGTERM, _interrupt)
    rows: list[dict] = []
    status = 0
    try:
        topo.build()
        for rtt in _ints(a.rtts):
            for kind in kinds:
                if kind == "tcp" and rtt not in _ints(a.tcp_rtts):
                    continue
                pair = Pair(topo, kind, rtt / 2, _proxy_queue(a.proxy_queue, rate, rtt / 2), a.proxy_lean)
                try:
                    pair.start()
                    for size, reply, streams, writes, split in _cases(a, kind):
                        frames = max(4, round(a.bytes / size))
                        r = pair.run_case(
                            size,
                            frames,
                            streams,
                            reply == "echo",
                            _serial(writes),
                            split,
                            writes == "persist",
                        )
                        row = {
                            "label": a.label, "kind": kind, "rtt_ms": rtt, "size": size,
                            "frames": frames, "streams": streams, "reply": reply, "writes": writes,
                            "split": split,
                            # each direction moves size x frames with echo replies
                            "mb_per_s": size * frames / r["seconds"] / 1e6,
                            "fill": size * frames / r["seconds"] / cap,
                            "wire_fill": (r["wire_bytes"] or 0) / r["seconds"] / cap,
                            "loadavg_1m": round(os.getloadavg()[0], 1),
                            **r,
                        }  # fmt: skip
                        rows.append(row)
                        print(_line(row), flush=True)
                except HarnessError as e:
                    print(f"{kind} at RTT {rtt} failed: {e}", file=sys.stderr, flush=True)
                    status = 1
                finally:
                    pair.stop()
    except KeyboardInterrupt:
        print("interrupted; tearing down", file=sys.stderr, flush=True)
        status = 130
    finally:
        topo.teardown()
    if rows:
        out = Path(a.out)
        try:
            old = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            old = []
        meta = {
            "command": command,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "rate_mbit": rate / 1e6,
            "tbf_latency_ms": a.tbf_latency_ms,
            "notsent_lowat": a.notsent_lowat,
            "congestion": a.congestion or "default",
            "proxy_queue": a.proxy_queue,
            "proxy_lean": a.proxy_lean,
        }
        out.write_text(json.dumps(old + [{**meta, **r} for r in rows], indent=1) + "\n")
        print(f"results appended to {out}")
    return status


def markdown_table(rows: list[dict]) -> str:
    """One line per case: goodput, fill of the cap, the small-message round trip, CPU by process."""
    out = [
        "| config | kind | reply | writes | RTT ms | frame MB | in flight | MB/s | % of cap | wire % "
        "| ping median / max ms | CPU cores by process (>= 0.01) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items() if v >= 0.01)
        ping = r.get("ping_ms") or {}
        out.append(
            f"| {r['label']} | {r['kind']} | {r.get('reply', 'ack')} | {r.get('writes', 'concurrent')} "
            f"| {r['rtt_ms']} | {r['size'] / 1e6:.1f} | {r['streams']}{_parts(r)} | {r['mb_per_s']:.2f} "
            f"| {r['fill']:.0%} | {r['wire_fill']:.0%} | {ping.get('median', '-')} / {ping.get('max', '-')} "
            f"| {cpu} | {r.get('loadavg_1m', '-')} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> Path:
    """Bars: % of the cap per case with 16.8 MB frames, one group per (reply, RTT)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in rows if r["size"] == DENSE_FRAME]
    names = [
        f"{r['kind']} {r.get('reply', 'ack')} RTT {r['rtt_ms']}\n{r['label']}, "
        + ("1 conn" if r["kind"] == "tcp" else _flight(r))
        for r in dense
    ]
    colour = {"tcp": "grey", "concurrent": "tab:red", "serial": "tab:blue", "serial2": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(dense) + 1.5))
    ax.barh(
        range(len(dense)),
        [100 * r["fill"] for r in dense],
        color=[
            colour.get("tcp" if r["kind"] == "tcp" else r.get("writes", "concurrent"), "tab:purple")
            for r in dense
        ],
    )
    ax.set_yticks(range(len(dense)), names, fontsize=6)
    ax.invert_yaxis()
    ax.axvline(80, color="black", lw=0.8, ls="--")
    ax.set_xlabel("goodput, % of the 80 Mbit/s cap (16.8 MB frames; echo: each direction)")
    ax.set_title("bench/network/linkprobe.py: where a dense frame loses the link", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _flight(r: dict) -> str:
    return f"{r['streams']} in flight{_parts(r)}, {r.get('writes', 'concurrent')}"


def _parts(r: dict) -> str:
    return "" if r.get("split", 1) == 1 else f" x{r['split']} parts"


def _line(r: dict) -> str:
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items() if v >= 0.01)
    return (
        f"{r['label']:<10} {r['kind']:<4} {r['reply']:<4} {r['writes'][:3]} RTT {r['rtt_ms']:>3} ms  "
        f"{r['size'] / 1e6:>5.1f} MB x {r['frames']:<3} "
        f"{r['streams']} in flight{_parts(r)}: {r['mb_per_s']:5.2f} MB/s = {r['fill']:4.0%} of the cap "
        f"({r['seconds']:.1f} s; ping {r['ping_ms']['median']}/{r['ping_ms']['max']} ms; "
        f"cores: {cpu}; load {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    sys.exit(main())
