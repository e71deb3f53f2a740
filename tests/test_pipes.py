"""A request whose sender died must not end hivemind's DHT loop (node/net/pipes.py, issue 18).

The request is built the way a real one fails: its pickle asks the receiving process to fetch a
file descriptor from the sender's ``multiprocessing.resource_sharer`` listener, and the "sender"
here is a socket that accepts and closes, as a process dying mid-handshake does. Unpickling then
raises EOFError inside ``answer_challenge``, the traceback seen in the failed fresh-clone runs.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from multiprocessing.resource_sharer import _ResourceSharer

import pytest

from node.swarm.membership import NodeDHT


class _DeadSenderHandle:
    """Unpickles into a resource_sharer fetch from ``address``."""

    def __init__(self, address: str):
        self.address = address

    def __reduce__(self):
        return _ResourceSharer.get_connection, ((self.address, 1),)


def _accept_and_close(path: str, stop: threading.Event) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    srv.settimeout(0.2)

    def loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.close()  # before the auth challenge: the client reads EOF

    threading.Thread(target=loop, daemon=True).start()
    return srv


@pytest.fixture
def dead_sender():
    d = tempfile.mkdtemp(prefix="vnode-pipes-")
    path = os.path.join(d, "listener")
    stop = threading.Event()
    srv = _accept_and_close(path, stop)
    yield path
    stop.set()
    srv.close()
    os.unlink(path)
    os.rmdir(d)


def test_dht_survives_a_request_whose_sender_died(dead_sender):
    dht = NodeDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, wait_timeout=1.0)
    try:
        assert dht.store("k", b"v", expiration_time=2e9)
        dht._outer_pipe.send(("_get", [], dict(key="k", latest=True, future=_DeadSenderHandle(dead_sender))))
        # the DHT must still answer: a dead loop leaves this future pending forever
        found = dht.get("k", latest=True, return_future=True).result(timeout=20)
        assert found is not None and found.value == b"v"
    finally:
        dht.shutdown()
