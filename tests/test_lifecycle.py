"""A swarm that stays joinable: DHT lifetimes from --heartbeat, the run record kept alive by every
node, one identity per state dir, a node that is PID 1, --new-run on a foreign DHT, and the printed
join command. Real p2pd and hivemind DHTs on loopback, real `python -m node join` processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from node.config import NodeConfig
from node.swarm.membership import lock_identity, publish_run_record, start_dht, store_stage_record_sync
from protocol.records import RunRecord, StageRecord, run_key, stage_key
from tests.conftest import wait_for

TINY = ["--model", "tiny:2", "--codec", "dense", "--p2pd-timeout", "60"]


def _join(*args: str, state_dir, to_files: bool = False) -> subprocess.Popen:
    """A join process; a long-lived one logs to files in its state dir (a full pipe would block it)."""
    out = err = subprocess.PIPE
    if to_files:
        state_dir.mkdir(parents=True, exist_ok=True)
        out, err = open(state_dir / "out.log", "w"), open(state_dir / "err.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "node", "join", *args, "--state-dir", str(state_dir)],
        stdout=out,
        stderr=err,
        text=True,
        start_new_session=True,
    )


def _log(state_dir, name: str = "err.log") -> str:
    return (state_dir / name).read_text()[-2000:]


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _ready(state_dir) -> dict | None:
    path = state_dir / "ready.json"
    return json.loads(path.read_text()) if path.exists() else None


def _addr(ready: dict) -> str:
    a = next(m for m in ready["maddrs"] if "127.0.0.1" in m)
    return a if "/p2p/" in a else f"{a}/p2p/{ready['peer_id']}"


def _one_error_line(p: subprocess.Popen, timeout: float = 180) -> str:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        raise AssertionError("the node kept running instead of refusing") from None
    assert p.returncode != 0, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def _record(run_id: str) -> RunRecord:
    return RunRecord(run_id=run_id, model_name="m", model_hash="h", num_layers=2, hidden=8, stages=[[0, 2]])


def test_dht_lifetimes_follow_the_heartbeat(tmp_path):
    """--heartbeat 10: stage records live 5 beats (not 10 s), the run record 30 beats (not 1 h)."""
    dht = start_dht(NodeConfig(state_dir=str(tmp_path), heartbeat_s=10.0, p2pd_timeout=60))
    try:
        now = get_dht_time()
        assert store_stage_record_sync(dht, "ttl", 0, "QmPeer", StageRecord())
        assert publish_run_record(dht, _record("ttl"))
        stage_exp = dht.get(stage_key("ttl", 0), latest=True).value["QmPeer"].expiration_time - now
        run_exp = dht.get(run_key("ttl"), latest=True).expiration_time - now
    finally:
        dht.shutdown()
    assert 45 < stage_exp < 55, stage_exp
    assert 295 < run_exp < 305, run_exp


def test_second_process_on_an_identity_in_use_is_refused_in_one_line(tmp_path):
    fd = lock_identity(str(tmp_path / "identity.key"))  # as a running node holds it
    try:
        p = _join(*TINY, "--stages", "1", "--max-steps", "1", state_dir=tmp_path)
        line = _one_error_line(p)
    finally:
        os.close(fd)
    assert "in use" in line and "--state-dir" in line, line


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (PID namespaces)"
)
def test_node_that_is_pid_1_starts_and_stops(tmp_path):
    """In a container without --init the node is PID 1; its DHT child must not take that for orphaned.

    It is stopped as docker stop does, the moment its ready file appears: while it still loads its
    stage and forks the outer averager. SIGTERM raised where it landed once hung a PID-1 node for
    good (inside logging's after-fork hook); now the stop waits for the next safe point.
    """
    log = open(tmp_path / "out.log", "w")
    p = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "node",
         "join", *TINY, "--stages", "1", "--state-dir", str(tmp_path), "--join-timeout", "20",
         "--ready-file", str(tmp_path / "ready.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    children: list[int] = []
    try:
        wait_for(lambda: _ready(tmp_path) or p.poll() is not None, 150, "the node to claim a stage")
        assert p.poll() is None, _log(tmp_path, "out.log")
        # unshare ignores SIGTERM while it waits: signal the node, its child
        children = [int(c) for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
        for child in children:
            os.kill(child, signal.SIGTERM)
        try:
            p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the PID-1 node did not stop within 90 s of SIGTERM:\n" + _log(tmp_path, "out.log"))
    finally:
        if p.poll() is None:
            for child in children:
                os.kill(child, signal.SIGKILL)
            p.kill()
            p.wait(timeout=30)
    out = _log(tmp_path, "out.log")
    assert p.returncode in (0, 130), out
    assert "serves stage 0" in out and "Traceback" not in out, out


def test_sigterm_while_the_node_starts_is_acted_on_after_the_phase(tmp_path):
    """SIGTERM while the node waits for the run record (p2pd already up): the node must neither
    lose it (it would then fail with "no run found") nor die where it stands; it unwinds through
    its cleanup and says so in one line."""
    boot = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addr = str(next(a for a in boot.get_visible_maddrs() if "127.0.0.1" in str(a)))
    p = _join(*TINY, "--peers", addr, "--join-timeout", "15", state_dir=tmp_path, to_files=True)
    try:
        wait_for(lambda: "starting p2pd" in _log(tmp_path) or p.poll() is not None, 60, "the node to start")
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGTERM)  # the node only, not its group: its helpers must follow by themselves
        p.wait(timeout=60)
    finally:
        _stop(p)
        boot.shutdown()
    err = _log(tmp_path)
    assert p.returncode == 130, err
    assert "interrupted before the node started serving" in err and "Traceback" not in err, err


def test_new_run_on_a_plain_hivemind_dht(tmp_path):
    boot = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addr = str(next(a for a in boot.get_visible_maddrs() if "127.0.0.1" in str(a)))
    starter = None
    try:
        # without --new-run, today's refusal stays: there is no run on that DHT
        p = _join(*TINY, "--peers", addr, "--join-timeout", "3", state_dir=tmp_path / "a")
        assert "--new-run" in _one_error_line(p)

        starter = _join(
            *TINY, "--peers", addr, "--new-run", "--run-id", "shared", "--ready-file",
            str(tmp_path / "b" / "ready.json"), state_dir=tmp_path / "b", to_files=True,
        )  # fmt: skip
        wait_for(lambda: _ready(tmp_path / "b") or starter.poll() is not None, 150, "the new run's node")
        assert starter.poll() is None, _log(tmp_path / "b")
        assert boot.get(run_key("shared"), latest=True) is not None  # the run lives on the foreign DHT

        p = _join(*TINY, "--peers", addr, "--new-run", "--run-id", "shared", state_dir=tmp_path / "c")
        assert "already exists" in _one_error_line(p)
    finally:
        if starter is not None:
            _stop(starter)
        boot.shutdown()


def test_printed_join_command_carries_a_non_default_model(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    starter = _join(*TINY, "--ready-file", str(a / "ready.json"), state_dir=a, to_files=True)
    joiner = None
    try:
        wait_for(lambda: _ready(a) or starter.poll() is not None, 150, "the starter")
        assert starter.poll() is None, _log(a)
        printed = next(line for line in _log(a, "out.log").splitlines() if "python -m node join" in line)
        cmd = printed.split()[4:]  # after "python -m node join"
        assert "--model" in cmd, printed
        joiner = _join(
            *cmd, "--p2pd-timeout", "60", "--ready-file", str(b / "ready.json"), state_dir=b, to_files=True
        )
        wait_for(lambda: _ready(b) or joiner.poll() is not None, 150, "the joiner")
        assert joiner.poll() is None, _log(b)
    finally:
        for p in (joiner, starter):
            if p is not None:
                _stop(p)


@pytest.mark.slow
def test_node_joins_after_three_run_record_lifetimes(tmp_path):
    """With --heartbeat 1 the run record lives 30 s; the live node keeps re-publishing it."""
    beat = ["--heartbeat", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    starter = _join(*TINY, *beat, "--ready-file", str(a / "ready.json"), state_dir=a, to_files=True)
    joiner = None
    try:
        ready = wait_for(lambda: _ready(a) or starter.poll() is not None, 150, "the starter")
        assert starter.poll() is None, _log(a)
        addr = _addr(ready)
        client = DHT(start=True, initial_peers=[addr], client_mode=True)
        try:
            found = wait_for(lambda: client.get(run_key("default"), latest=True), 30, "the run record")
            lifetime = found.expiration_time - get_dht_time()
        finally:
            client.shutdown()
        assert lifetime <= 31, lifetime  # derived from --heartbeat, not a fixed hour
        time.sleep(3 * 30 + 2)
        joiner = _join(
            *TINY, *beat, "--peers", addr, "--join-timeout", "10", "--ready-file",
            str(b / "ready.json"), state_dir=b, to_files=True,
        )  # fmt: skip
        wait_for(lambda: _ready(b) or joiner.poll() is not None, 150, "the late joiner")
        assert joiner.poll() is None, _log(b)
    finally:
        for p in (joiner, starter):
            if p is not None:
                _stop(p)


def test_a_restarted_node_does_not_count_its_last_lifes_record_as_a_replica():
    """Killed, a node's stage record outlives it (until it expires); restarted with the same identity,
    it must not count that record as a live replica when it chooses a stage: it would avoid the
    stage it left, which has lost a replica, for a well-served one."""
    from node.join import claim_stage

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        run = RunRecord(run_id="restart", model_name="tiny", model_hash="x", num_layers=2, hidden=64,
                        stages=[[0, 1], [1, 2]])  # fmt: skip
        # stage 0: two heads; stage 1: one tail and the dead life of "QmMe" (which alone is 100 tokens/s)
        for peer, stage, rate in (("QmHeadA", 0, 60.0), ("QmHeadB", 0, 60.0), ("QmTail", 1, 100.0),
                                  ("QmMe", 1, 100.0)):  # fmt: skip
            store_stage_record_sync(dht, "restart", stage, peer, StageRecord(ready=True, throughput=rate))
        cfg = NodeConfig(run_id="restart")
        # another node, for which QmMe's record is a live replica: stage 0 (120 tokens/s) is least served
        assert claim_stage(cfg, dht, run, "QmOther") == 0
        assert claim_stage(cfg, dht, run, "QmMe") == 1
    finally:
        dht.shutdown()
