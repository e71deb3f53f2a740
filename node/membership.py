"""Joining the DHT, the run record, stage records and claiming a stage.

Everything read from the DHT goes through the record schemas in ``protocol.records``; a
record that fails validation is skipped (and logged once), never trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from node.config import NodeConfig
from node.pipes import tolerate_dead_senders
from protocol.records import RECORD_TTL_S, RecordError, RunRecord, StageRecord, run_key, stage_key

log = logging.getLogger("node")

RUN_RECORD_TTL_S = 3600.0  # every live node re-publishes it, so it outlives any one node


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


def _die_with_parent() -> None:
    """In the DHT process: when the node process dies (even by SIGKILL), take p2pd down too.

    hivemind's DHT process would otherwise outlive a killed node, keeping its p2pd and its
    DHT entries alive. Linux only (prctl); elsewhere a killed node may leave them behind.
    """
    if not sys.platform.startswith("linux"):
        return

    def on_term(signum, frame):
        for child in _children(os.getpid()):  # p2pd
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)


class NodeDHT(DHT):
    """hivemind's DHT process, tied to the lifetime of the node process that started it."""

    def run(self) -> None:
        _die_with_parent()
        tolerate_dead_senders(self, "DHT")  # one request from a dead sender must not end the DHT
        super().run()


def start_dht(cfg: NodeConfig) -> DHT:
    """Start the DHT process (and its p2pd). Fails with a JoinError naming the cause."""
    check_peer_addresses(cfg.peers)
    identity = cfg.identity or os.path.join(cfg.state_dir, "identity.key")
    os.makedirs(os.path.dirname(os.path.abspath(identity)), exist_ok=True)
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
    dht = NodeDHT(initial_peers=cfg.peers or None, start=False, **kwargs)
    try:
        dht.run_in_background(await_ready=True, timeout=cfg.p2pd_timeout + cfg.join_timeout)
    except Exception as e:
        if dht.is_alive():
            dht.terminate()
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


def read_run_record(dht: DHT, run_id: str, timeout: float) -> RunRecord | None:
    deadline = time.monotonic() + timeout
    while True:
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
    return bool(
        dht.store(run_key(rec.run_id), rec.to_dict(), expiration_time=get_dht_time() + RUN_RECORD_TTL_S)
    )


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
            expiration_time=get_dht_time() + RECORD_TTL_S,
        )
    )


async def store_stage_record(
    dht: DHT,
    run_id: str,
    stage: int,
    peer_id: str,
    rec: StageRecord,
    timeout: float,
    ttl: float = RECORD_TTL_S,
) -> bool:
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
