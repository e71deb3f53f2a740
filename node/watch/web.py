"""The dashboard's HTTP server: the stdlib's, in a thread, read-only.

``GET /`` the page (``page.html``: its script and style are inline, so it works with no
internet), ``GET /api/state`` the collector's state as JSON, ``GET /metrics`` Prometheus text;
any other path 404, any other method 501 (the stdlib's answer). Nothing a request sends
changes the swarm: there are no control actions. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from node.watch.prom import CONTENT_TYPE, render

log = logging.getLogger("node")

PAGE = Path(__file__).with_name("page.html")


class DashboardServer:
    """Serves ``state()`` (the collector's latest, replaced whole after each poll) on host:port
    (port 0: one the system picks; ``url`` says which)."""

    def __init__(self, host: str, port: int, state: Callable[[], dict]) -> None:
        page = PAGE.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", page)
                elif path == "/api/state":
                    self._send(200, "application/json", json.dumps(state()).encode())
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE, render(state()))
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # a poll every 2 s: not for the log
                log.debug("dashboard %s", format % args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True  # a browser holding a connection must not hold the exit
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
