"""Joining the DHT, the run record, stage records and claiming a stage.

Everything read from the DHT goes through the record schemas in ``protocol.records``; a
record that fails validation is skipped (and logged once), never trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from node.config import NodeConfig
from node.net.pipes import tolerate_dead_senders
from protocol.records import (
    HEARTBEAT_S,
    RUN_RECORD_BEATS,
    RecordError,
    RunRecord,
    StageRecord,
    run_key,
    run_record_ttl,
    stage_key,
    stage_record_ttl,
)

log = logging.getLogger("node")


class JoinError(RuntimeError):
    """A one-line reason the node could not join, with the fix."""


def socket_dir(run_id: str) -> str:
    """A private directory for p2pd's unix sockets, removed when the node stops."""
    d = tempfile.mkdtemp(prefix=f"vnode-{run_id}-")
    # hivemind builds socket paths from this class attribute; the DHT child process inherits it.
    P2P._UNIX_SOCKET_PREFIX = f"/unix{d}/hm-"
    return d


def remove_socket_dir(d: str) -> None:
    shutil.rmtree(d, ignore_errors=True)


def _children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields_ = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields_[1]) == pid:
            out.append(int(stat.split("/")[2]))
    return out


def parent_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)


def leave_process_group() -> None:
    """In a forked helper that dies with its node: out of the node's process group.

    Ctrl-C in a terminal, ``kill -TERM -PGID`` and systemd's control-group stop signal the whole
    group at once. The node only notes the first signal and stops at a safe point; a helper that
    died of the same signal would leave the node waiting on it for ever (hivemind's DHT calls
    have no liveness check). The node shuts its helpers down itself, and PR_SET_PDEATHSIG takes
    them down if it dies; p2pd, started after this call, joins the helper's group.
    """
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def _die_with_parent(parent_pid: int) -> None:
    """In the DHT process: when the node process dies (even by SIGKILL), take p2pd down too.

    hivemind's DHT process would otherwise outlive a killed node, keeping its p2pd and its
    DHT entries alive. Linux only (prctl); elsewhere a killed node may leave them behind.
    ``parent_pid`` is the node's PID, read before the fork.
    """
    if not sys.platform.startswith("linux"):
        return

    def on_term(signum, frame):
        for child in _children(os.getpid()):  # p2pd
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    parent_death_signal(signal.SIGTERM)
    leave_process_group()
    # The parent died before prctl took effect (we were re-parented). Compare with the node's
    # real PID, not 1: in a container the node itself is PID 1.
    if os.getppid() != parent_pid:
        os._exit(0)


class NodeDHT(DHT):
    """hivemind's DHT process, tied to the lifetime of the node process that started it.

    ``heartbeat_s`` (the node's ``--heartbeat``) sets the lifetime of the records stored through it.
    """

    def __init__(self, *args, heartbeat_s: float = HEARTBEAT_S, **kwargs):
        self.node_pid = os.getpid()
        self.heartbeat_s = heartbeat_s
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        _die_with_parent(self.node_pid)
        tolerate_dead_senders(self, "DHT")  # one request from a dead sender must not end the DHT
        super().run()


def _heartbeat_of(dht: DHT) -> float:
    return getattr(dht, "heartbeat_s", HEARTBEAT_S)  # a plain hivemind DHT: the default beat


def lock_identity(identity: str) -> int:
    """Hold an exclusive lock beside ``identity`` for this process's lifetime; returns its fd.

    Two processes with one identity would be one peer id with two addresses: the DHT routes to
    either and both claim stages. The lock dies with the process (even by SIGKILL).
    """
    path = identity + ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise JoinError(
            f"identity {identity} is in use by another running node (pid {holder}); give each node "
            "its own --state-dir (or --identity)"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def start_dht(cfg: NodeConfig) -> DHT:
    """Start the DHT process (and its p2pd). Fails with a JoinError naming the cause.

    The identity is locked for the life of this process (``lock_identity``); the lock's fd is
    ``dht.identity_lock``.
    """
    check_peer_addresses(cfg.peers)
    identity = cfg.identity or os.path.join(cfg.state_dir, "identity.key")
    os.makedirs(os.path.dirname(os.path.abspath(identity)), exist_ok=True)
    lock = lock_identity(identity)
    kwargs = dict(
        host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
        identity_path=identity,
        startup_timeout=cfg.p2pd_timeout,
        client_mode=cfg.client_mode,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
    )
    if cfg.announce_maddrs:
        kwargs["announce_maddrs"] = cfg.announce_maddrs
    dht = NodeDHT(initial_peers=cfg.peers or None, start=False, heartbeat_s=cfg.heartbeat_s, **kwargs)
    dht.identity_lock = lock
    try:
        dht.run_in_background(await_ready=True, timeout=cfg.p2pd_timeout + cfg.join_timeout)
    except Exception as e:
        if dht.is_alive():
            dht.terminate()
        os.close(lock)
        raise JoinError(_explain_start_failure(e, cfg)) from None
    if identity and os.path.exists(identity):
        os.chmod(identity, 0o600)  # a private key
    return dht


def _explain_start_failure(e: Exception, cfg: NodeConfig) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    low = text.lower()
    if "failed to connect to bootstrap" in low or (cfg.peers and isinstance(e, TimeoutError)):
        return (
            f"could not reach any bootstrap peer of {' '.join(cfg.peers)}; check the address and that the "
            f"peer is running (raise --join-timeout on slow links)"
        )
    if "address already in use" in low:
        return f"port {cfg.port} is taken; pick another --port or stop the process using it"
    if "identity" in low:
        return f"{text}; another node already runs with this identity: pass a different --identity"
    if "failed to start in" in low:
        return f"p2pd did not start within {cfg.p2pd_timeout:.0f}s; raise --p2pd-timeout on a slow machine"
    return f"could not start p2pd and the DHT: {type(e).__name__}: {text}"


def check_peer_addresses(peers: list[str]) -> None:
    """Reject a malformed --peers entry before anything starts."""
    from hivemind.utils.multiaddr import Multiaddr

    for p in peers:
        try:
            addr = Multiaddr(p)
        except Exception as e:
            raise JoinError(
                f"--peers {p!r} is not a multiaddr ({e}); expected /ip4/HOST/tcp/PORT/p2p/PEER_ID"
            ) from None
        if "/p2p/" not in str(addr):
            raise JoinError(
                f"--peers {p!r} lacks the peer id; expected /ip4/HOST/tcp/PORT/p2p/PEER_ID "
                "(the joining command printed by the first node has it)"
            )


async def dht_call(dht: DHT, method: str, *args, timeout: float, **kwargs):
    fut = getattr(dht, method)(*args, return_future=True, **kwargs)
    return await asyncio.wait_for(fut, timeout)


def read_run_record(
    dht: DHT, run_id: str, timeout: float, between_tries: Callable[[], None] = lambda: None
) -> RunRecord | None:
    """The run's record, polled for up to ``timeout`` s; ``between_tries`` may raise to give up early
    (a stop request while the node starts)."""
    deadline = time.monotonic() + timeout
    while True:
        between_tries()
        found = dht.get(run_key(run_id), latest=True)
        if found is not None:
            try:
                return RunRecord.from_dict(found.value)
            except RecordError as e:
                raise JoinError(f"the swarm's run record is invalid ({e})") from None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def publish_run_record(dht: DHT, rec: RunRecord) -> bool:
    """Store the run record for ``run_record_ttl`` of the DHT's heartbeat."""
    ttl = run_record_ttl(_heartbeat_of(dht))
    return bool(dht.store(run_key(rec.run_id), rec.to_dict(), expiration_time=get_dht_time() + ttl))


async def keep_run_record(dht: DHT, rec: RunRecord, stop: asyncio.Event) -> None:
    """Re-publish the run record every third of its lifetime until ``stop``: every live node runs
    this, so the run stays joinable while any node serves it, and expires once none does."""
    beat = _heartbeat_of(dht)
    ttl = run_record_ttl(beat)
    while not stop.is_set():
        try:
            await dht_call(
                dht,
                "store",
                run_key(rec.run_id),
                rec.to_dict(),
                expiration_time=get_dht_time() + ttl,
                timeout=ttl / 3,
            )
        except Exception as e:  # a missed re-publish is survived: the record lives 3 periods
            log.info("could not re-publish the run record: %s", e)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), beat * (RUN_RECORD_BEATS // 3))


def parse_stage_records(found) -> dict[str, StageRecord]:
    """DHT subkey map -> validated records; invalid or expired entries are dropped."""
    out: dict[str, StageRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for peer, item in found.value.items():
        try:
            if not isinstance(peer, str):
                raise RecordError("subkey is not a peer id")
            out[peer] = StageRecord.from_dict(item.value)
        except (RecordError, AttributeError) as e:
            log.debug("ignoring stage record of %s: %s", peer, e)
    return out


def read_stage_records_sync(dht: DHT, run_id: str, n_stages: int) -> list[dict[str, StageRecord]]:
    return [parse_stage_records(dht.get(stage_key(run_id, s), latest=True)) for s in range(n_stages)]


async def read_stage_records(
    dht: DHT, run_id: str, n_stages: int, timeout: float
) -> list[dict[str, StageRecord]]:
    found = await asyncio.gather(
        *[dht_call(dht, "get", stage_key(run_id, s), latest=True, timeout=timeout) for s in range(n_stages)]
    )
    return [parse_stage_records(f) for f in found]


def store_stage_record_sync(dht: DHT, run_id: str, stage: int, peer_id: str, rec: StageRecord) -> bool:
    return bool(
        dht.store(
            stage_key(run_id, stage),
            rec.to_dict(),
            subkey=peer_id,
            expiration_time=get_dht_time() + stage_record_ttl(_heartbeat_of(dht)),
        )
    )


async def store_stage_record(
    dht: DHT,
    run_id: str,
    stage: int,
    peer_id: str,
    rec: StageRecord,
    timeout: float,
    ttl: float | None = None,
) -> bool:
    """Our stage record, living ``ttl`` seconds (default: ``stage_record_ttl`` of the DHT's beat)."""
    ttl = stage_record_ttl(_heartbeat_of(dht)) if ttl is None else ttl
    return bool(
        await dht_call(
            dht,
            "store",
            stage_key(run_id, stage),
            rec.to_dict(),
            subkey=peer_id,
            expiration_time=get_dht_time() + ttl,
            timeout=timeout,
        )
    )


EMPTY_STAGE_NOTICE_S = 30.0  # a next stage empty this long gets one clear line, then back-off
EMPTY_STAGE_MAX_BACKOFF_S = 30.0


class EmptyStageBackoff:
    """Head: what a microbatch that found no live peer downstream does, and how long its slot waits.

    For the first ``EMPTY_STAGE_NOTICE_S`` (a node restarting, a record expiring) it is kept and
    tried again (``keep``); past that the stage is taken as empty: one line says so, microbatches
    are dropped silently and the wait doubles up to ``EMPTY_STAGE_MAX_BACKOFF_S``, until a
    microbatch is served.
    """

    def __init__(self) -> None:
        self.since: float | None = None  # first drop (or hold) of the current empty spell
        self.delay = 0.0
        self.noticed = False
        self.said_hold = False

    def keep(self, reason: str) -> bool:
        """Whether a microbatch that found no live peer downstream waits for one instead of being
        dropped: while the empty spell is younger than ``EMPTY_STAGE_NOTICE_S``. A stage is empty
        for a moment far more often than for good (a node restarting, its record expiring on a slow
        line, a rebalance moving its last replica): the microbatch, computed already, is kept and
        its tokens trained; a stage empty past that is taken as empty, and drops resume."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= EMPTY_STAGE_NOTICE_S:
            return False
        if not self.said_hold:  # once per empty spell
            self.said_hold = True
            log.info("%s: holding microbatches back until one joins", reason)
        return True

    def dropped(self, reason: str, base_s: float) -> float:
        """Seconds to hold the slot after a microbatch dropped because ``reason``."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if not self.delay:
            self.delay = base_s
        if now - self.since < EMPTY_STAGE_NOTICE_S:
            log.warning("dropped a microbatch: %s", reason)
            return base_s
        if not self.noticed:
            self.noticed = True
            log.warning(
                "%s for %.0fs: taken as empty, its microbatches dropped, retrying with back-off up to "
                "%.0fs, until a node serves it",
                reason,
                now - self.since,
                EMPTY_STAGE_MAX_BACKOFF_S,
            )
        self.delay = min(2 * self.delay, EMPTY_STAGE_MAX_BACKOFF_S)
        return self.delay

    def served(self) -> None:
        if self.noticed:
            log.warning("the pipeline is whole again: training resumes")
        self.since, self.delay, self.noticed, self.said_hold = None, 0.0, False, False
