"""The dashboard against a real local swarm, and in a real browser (headless Chromium).

One ``python -m node swarm`` of three nodes of a tiny model on two stages (stage 0 replicated,
so a node can be killed and the run goes on) serves its dashboard (``--dashboard 0``: a free
port, its URL printed). ``/api/state`` lists every node on its stage with its step and
throughput and the loss history grows; ``/metrics`` parses as Prometheus text and its counters
rise; unknown paths 404; Chromium shows the stage map with each node and a loss chart with
points, and after a node is killed the same open page (driven over the DevTools protocol,
tests/browser.py) drops it from the map within its record's lifetime and lists the leave.

``SAVE_DASHBOARD_PNG=PATH`` keeps the browser's last screenshot there (bench/results/dashboard.png
was made so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser import CHROMIUM, Browser
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    out = tmp_path_factory.mktemp("dash")
    cmd = [sys.executable, "-m", "node", "swarm", "--codec", "dense", "--nodes", "3", "--stages", "2"]
    cmd += ["--steps", "1000000", "--model", "tiny:2:64", "--no-rebalance", "--dashboard", "0"]
    cmd += ["--report", str(out / "r"), "--timeout", "900"]
    log = open(out / "swarm.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for(lambda: _url(out / "swarm.out", proc), 240, "the dashboard's URL")
        yield url, out / "r", proc
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its nodes and the dashboard
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _url(path: Path, proc: subprocess.Popen) -> str | None:
    text = path.read_text()
    assert proc.poll() is None, text[-2000:]
    m = re.search(r"^dashboard: (http://\S+)", text, re.M)
    return m.group(1) if m else None


def _get(url: str) -> bytes:
    return urllib.request.urlopen(url, timeout=10).read()


def _state(url: str) -> dict:
    return json.loads(_get(url + "api/state"))


def _peers(s: dict) -> dict[str, dict]:
    return {p["peer"]: {**p, "stage": st["index"]} for st in s["stages"] for p in st["peers"]}


def _node_ids(report: Path) -> dict[int, str]:
    return {
        i: json.loads((report / "nodes" / str(i) / "ready.json").read_text())["peer_id"] for i in range(3)
    }


def test_state_lists_every_node_on_its_stage_and_the_loss_grows(swarm):
    url, report, _ = swarm

    def trained() -> dict | None:
        s = _state(url)
        peers = _peers(s)
        ok = len(peers) == 3 and all(
            p["reachable"] and p["inner_step"] > 0 and p["throughput"] > 0 for p in peers.values()
        )
        return s if ok and s["loss"] else None

    s = wait_for(trained, 120, "three reachable nodes that have stepped")
    ids = _node_ids(report)
    peers = _peers(s)
    assert set(peers) == set(ids.values())
    for i, pid in ids.items():
        ready = json.loads((report / "nodes" / str(i) / "ready.json").read_text())
        assert peers[pid]["stage"] == ready["stage"]
    assert s["nodes"][ids[0]]["device"] == "cpu" and s["stages"][0]["layers"] == [0, 1]
    assert s["run"]["hidden"] == 64 and s["links"] and s["links"][0]["dense_bytes_per_token"] == 128
    # stage 0 has two replicas: their drift is estimated from each one's sample of its weights
    assert list(s["dp"]["replica_distance_by_stage"]) == ["0"] and s["dp"]["replica_distance"] >= 0
    (tail,) = s["loss"]
    first = len(s["loss"][tail]["values"]) + s["loss"][tail]["first_step"]
    later = wait_for(
        lambda: (x := _state(url)["loss"].get(tail)) and x["first_step"] + len(x["values"]) > first and x,
        60,
        "the loss history to grow",
    )
    assert later["first_step"] + len(later["values"]) > first


def test_metrics_parse_as_prometheus_text_and_counters_rise(swarm):
    url, _, _ = swarm

    def scrape() -> dict:
        fams = text_string_to_metric_families(_get(url + "metrics").decode())
        return {(s.name, s.labels.get("peer")): s.value for f in fams for s in f.samples}

    a = scrape()
    tokens = {k: v for k, v in a.items() if k[0] == "vnode_trained_tokens_total"}
    assert len(tokens) == 3, a.keys()
    b = wait_for(
        lambda: (x := scrape()) and all(x.get(k, 0) > v for k, v in tokens.items()) and x,
        60,
        "every node's trained tokens to rise between two scrapes",
    )
    assert sum(v for k, v in b.items() if k[0] == "vnode_link_bytes_total") > 0


def test_unknown_paths_are_404(swarm):
    url, _, _ = swarm
    for path in ("nope", "api", "api/state.json"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url + path)
        assert e.value.code == 404


SHOWN = """JSON.stringify({
  peers: [...document.querySelectorAll('#stages [data-peer]')].map(e => e.dataset.peer),
  points: Number(document.getElementById('loss').dataset.points),
  lines: document.querySelectorAll('#loss .loss-line').length,
  stages: document.querySelectorAll('#stages .stage').length,
  bottleneck: document.querySelectorAll('#stages .stage.bottleneck').length,
  leaves: document.querySelectorAll('#events [data-kind="leave"]').length,
  polls: Number(document.body.dataset.polls || 0),
})"""


def test_a_browser_shows_the_stage_map_and_the_loss_and_follows_a_node_that_is_killed(swarm, tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    url, report, _ = swarm
    ids = _node_ids(report)
    wait_for(lambda: len(_peers(_state(url))) == 3 and _state(url)["loss"], 120, "three nodes and a loss")
    browser = Browser(url)
    try:

        def shown() -> dict:
            return json.loads(browser.js(SHOWN) or "{}")

        page = wait_for(lambda: (x := shown()) and x.get("polls", 0) > 0 and x, 60, "the page's first draw")
        assert sorted(page["peers"]) == sorted(ids.values()), "the stage map does not show every node"
        assert page["points"] > 0 and page["lines"] == 1, page
        assert page["stages"] == 2 and page["bottleneck"] == 1, page
        browser.screenshot(tmp_path / "before.png")

        stage0 = [
            i
            for i in (2, 0)
            if json.loads((report / "nodes" / str(i) / "ready.json").read_text())["stage"] == 0
        ]
        victim = stage0[0]  # a replica of stage 0: the run goes on without it
        pid = int(
            (report / "nodes" / str(victim) / "identity.key.lock").read_text()
        )  # the node holds its identity
        os.kill(pid, signal.SIGKILL)  # its DHT process and p2pd die with it
        gone = ids[victim]
        # the same page, not reloaded: its own polls take the node off the map once its record expires
        after = wait_for(
            lambda: (x := shown()) and gone not in x["peers"] and x, 90, "the page to drop the killed node"
        )
        assert sorted(after["peers"]) == sorted(set(ids.values()) - {gone})
        assert after["polls"] > page["polls"] and after["leaves"] >= 1 and after["points"] > 0, after
        browser.screenshot(tmp_path / "after.png")
    finally:
        browser.close()
    if os.environ.get("SAVE_DASHBOARD_PNG"):
        shutil.copy(tmp_path / "after.png", os.environ["SAVE_DASHBOARD_PNG"])


@pytest.mark.slow
def test_a_joining_node_serves_the_dashboard_with_its_own_metrics(swarm, tmp_path):
    """``join --dashboard PORT``: the node reads its own metrics directly (p2pd opens no stream to
    itself) and the others' over the swarm."""
    import socket

    url, report, _ = swarm
    ready0 = json.loads((report / "nodes" / "0" / "ready.json").read_text())
    peer = next(a for a in ready0["maddrs"] if "127.0.0.1" in a)
    peer = peer if "/p2p/" in peer else f"{peer}/p2p/{ready0['peer_id']}"
    with socket.socket() as s:  # a free port (join's --dashboard 0 means off)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_id = _state(url)["run"]["run_id"]
    cmd = [sys.executable, "-m", "node", "join", "--peers", peer, "--run-id", run_id, "--model", "tiny:2:64"]
    cmd += ["--codec", "dense", "--stage", "0", "--state-dir", str(tmp_path / "n"), "--heartbeat", "1"]
    cmd += [
        "--no-rebalance",
        "--threads",
        "1",
        "--dashboard",
        str(port),
        "--ready-file",
        str(tmp_path / "ready"),
    ]
    log = open(tmp_path / "node.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        own = wait_for(
            lambda: (tmp_path / "ready").exists() and json.loads((tmp_path / "ready").read_text()),
            180,
            "the joiner",
        )
        mine = f"http://127.0.0.1:{port}/"

        def seen() -> dict | None:
            try:
                s = _state(mine)
            except OSError:
                return None
            peers = _peers(s)
            return s if own["peer_id"] in peers and all(p["reachable"] for p in peers.values()) else None

        s = wait_for(seen, 90, "the joiner's dashboard to show itself and its peers, all reachable")
        assert s["nodes"][own["peer_id"]]["stage"] == 0 and len(_peers(s)) >= 2
        assert "vnode_inner_step" in _get(mine + "metrics").decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
