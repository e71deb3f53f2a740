"""See the swarm: a live web dashboard and Prometheus metrics (read-only).

stream.py (``vnode.metrics``: each node's recent counters and loss history), state.py (pure: what
the page shows, the bottleneck, events from record changes), collect.py (one poll of the DHT and
every peer), prom.py (``/metrics``), web.py (the HTTP server), page.html (the page, self-contained),
dashboard.py (``python -m node dashboard``, and ``join --dashboard``'s server in a node).
"""
