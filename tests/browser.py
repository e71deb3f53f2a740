"""Headless Chromium driven over the DevTools protocol, with the stdlib only (tests' helper).

One page stays open while the test changes the swarm, so what is checked is the page's own live
update, not a fresh load. The protocol runs over a WebSocket; the few lines of RFC 6455 a
client needs (the handshake, masked text frames out, unmasked frames in) are written here
rather than adding a WebSocket library for one test.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, url: str, width: int = 1200, height: int = 1100) -> None:
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        port = self._devtools_port()
        deadline = time.monotonic() + 30
        while True:
            targets = json.loads(
                urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read()
            )
            pages = [t for t in targets if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        ws = pages[0]["webSocketDebuggerUrl"]
        self.sock = _connect(ws)
        self._id = 0

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                return int(m.group(1))
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError("chromium did not open its DevTools port")

    def call(self, method: str, **params) -> dict:
        self._id += 1
        _send(self.sock, json.dumps({"id": self._id, "method": method, "params": params}).encode())
        while True:
            msg = json.loads(_recv(self.sock))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg["result"]

    def js(self, expression: str):
        """The value of ``expression`` in the page (JSON-serialisable)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return out["result"].get("value")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
            self.proc.stderr.close()
            shutil.rmtree(self.profile, ignore_errors=True)


def _connect(url: str) -> socket.socket:
    m = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
    host, port, path = m.group(1), int(m.group(2)), m.group(3)
    sock = socket.create_connection((host, port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("DevTools closed the WebSocket handshake")
        head += chunk
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise ConnectionError(head.decode(errors="replace"))
    return sock


def _send(sock: socket.socket, data: bytes) -> None:
    """One masked text frame (a client must mask)."""
    n = len(data)
    header = bytes([0x81]) + (
        bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
        if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n)
    )  # fmt: skip
    mask = os.urandom(4)
    sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("DevTools closed the WebSocket")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> bytes:
    """One whole message (fragments joined); the server's frames are not masked."""
    out = b""
    while True:
        b0, b1 = _exactly(sock, 2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", _exactly(sock, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", _exactly(sock, 8))[0]
        out += _exactly(sock, n)
        if b0 & 0x80:
            return out
