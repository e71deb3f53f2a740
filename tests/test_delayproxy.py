"""The harness's delay proxy (bench/network/delayproxy.py): it adds latency and keeps throughput.

On loopback, with no namespaces: an echo server behind a proxy of one-way delay D. A small
message's round trip must take about 2 D (each direction delayed once), and a long transfer
must take about its size over loopback speed plus D, not D per chunk (a proxy that slept on
each read would need chunks x D).
"""

from __future__ import annotations

import asyncio
import socket
import time

from bench.network.delayproxy import CHUNK, serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _measure(delay_s: float, nbytes: int) -> tuple[float, float]:
    backend = await asyncio.start_server(_echo, "127.0.0.1", 0)
    back_port = backend.sockets[0].getsockname()[1]
    port = _free_port()
    ready = asyncio.Event()
    proxy = asyncio.create_task(serve(("127.0.0.1", port), ("127.0.0.1", back_port), delay_s, ready.set))
    await ready.wait()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.perf_counter()
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        rtt = time.perf_counter() - t0

        async def send() -> None:
            block = b"x" * CHUNK
            for _ in range(nbytes // CHUNK):
                writer.write(block)
                await writer.drain()

        t0 = time.perf_counter()
        sender = asyncio.create_task(send())
        got = 0
        while got < nbytes:
            got += len(await reader.read(1 << 20))
        await sender
        bulk = time.perf_counter() - t0
    finally:
        writer.close()
        proxy.cancel()
        backend.close()
    return rtt, bulk


def test_delay_adds_latency_not_per_chunk_cost():
    delay = 0.05
    nbytes = 400 * CHUNK  # 26 MB: 800 chunk crossings of the proxy, each way
    rtt, bulk = asyncio.run(_measure(delay, nbytes))
    print(f"round trip {rtt * 1e3:.0f} ms, {nbytes / 1e6:.0f} MB echoed in {bulk:.2f} s")
    assert 2 * delay <= rtt < 2 * delay + 0.08, rtt
    # a sleep per read would cost >= 800 x 50 ms = 40 s; the queue costs one delay each way
    assert bulk < 2 * delay + 8.0, bulk
