"""A userspace one-way delay for the harness's links (netem is missing from this kernel).

    python -m bench.network.delayproxy --listen 10.101.0.10:31337 --to 127.0.0.1:31337 --delay-ms 20

Runs inside a node's namespace in front of the node: every TCP connection peers open to the
node passes it, and each chunk read in either direction is written on ``delay`` seconds after
it arrived. The reader never waits for the writer (a timestamped queue, not a sleep per read),
so a link keeps its throughput and only gains latency: each connection crosses exactly one
proxy (the accepting node's), so its round trip grows by twice the delay.

``--max-queue BYTES`` bounds what one direction holds (read, not yet written). Unbounded, the
node's replies leave it at loopback speed into the proxy, which then holds megabytes in front
of the capped link: every small message behind them (a yamux window update, a heartbeat)
waits seconds, where a real link's TCP would have pushed back on the sender. Bounded, the
proxy stops reading once it holds that much, and the back-pressure reaches the node again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys

CHUNK = 1 << 16
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's value; Python 3.11 lacks the name


async def pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, max_queue: int = 0
) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read; EOF passes too.
    With ``max_queue`` > 0, reading pauses while that many bytes wait to be written."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    held = 0
    room = asyncio.Event()
    room.set()

    async def read() -> None:
        nonlocal held
        while True:
            await room.wait()
            try:
                data = await reader.read(CHUNK)
            except (ConnectionError, OSError):
                data = b""
            held += len(data)
            if max_queue and held >= max_queue:
                room.clear()
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                return

    reading = asyncio.create_task(read())
    try:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            held -= len(data)
            if held < max_queue:
                room.set()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()


def _node_socket(host: str, lean: int) -> socket.socket:
    """The proxy's socket to its node. With ``lean``, a small receive buffer: what the node sends
    waits in the node's own socket, which then pushes back on it, instead of in megabytes of the
    proxy's autotuned buffer that no TCP on the capped path sees."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if lean:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, lean)  # before connect: sets the window
    sock.setblocking(False)
    return sock


async def _serve_one(
    r_in: asyncio.StreamReader,
    w_in: asyncio.StreamWriter,
    host: str,
    port: int,
    delay: float,
    max_queue: int,
    lean: int = 0,
) -> None:
    try:
        sock = _node_socket(host, lean)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        r_out, w_out = await asyncio.open_connection(sock=sock)
    except OSError:
        w_in.close()
        return
    if lean:  # unsent bytes stay in the bounded queue above, not in the kernel's send buffers
        for w in (w_in, w_out):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, lean)
    try:
        await asyncio.gather(pump(r_in, w_out, delay, max_queue), pump(r_out, w_in, delay, max_queue))
    finally:
        for w in (w_in, w_out):
            w.close()


async def serve(
    listen: tuple[str, int], to: tuple[str, int], delay: float, ready=None, max_queue: int = 0, lean: int = 0
) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve_one(r, w, to[0], to[1], delay, max_queue, lean),
        listen[0],
        listen[1],
        reuse_address=True,
    )
    if ready is not None:
        ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{s!r} is not HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.network.delayproxy", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--listen", type=_addr, required=True, help="HOST:PORT peers connect to")
    p.add_argument("--to", type=_addr, required=True, help="HOST:PORT of the node behind the proxy")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to each direction")
    p.add_argument(
        "--max-queue", type=int, default=0, help="bytes one direction may hold unwritten (0: unbounded)"
    )
    p.add_argument(
        "--lean",
        type=int,
        default=0,
        help="bytes: the receive buffer of the socket to the node and the unsent bytes any socket "
        "may hold (0: the kernel's autotuned buffers)",
    )
    a = p.parse_args(argv)
    if a.delay_ms < 0 or a.max_queue < 0 or a.lean < 0:
        print("error: --delay-ms, --max-queue and --lean must be >= 0", file=sys.stderr)
        return 2

    def ready() -> None:
        print("ready", flush=True)

    try:
        asyncio.run(
            serve(a.listen, a.to, a.delay_ms / 1000.0, ready=ready, max_queue=a.max_queue, lean=a.lean)
        )
    except OSError as e:
        print(f"bench.network.delayproxy: cannot listen on {a.listen[0]}:{a.listen[1]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
