"""The data-parallel outer round of a stage (DESIGN.md 4.3): DiLoCo / GASLoC over gossip groups.

A node that serves a stage creates one ``OuterSync`` ON THE MAIN THREAD, before its event loop
starts (hivemind's averager forks a helper process and touches signal handlers). Every H inner
steps, with no microbatch in flight, the node's compute thread calls ``round(k)``:

1. host: Delta = theta_global - theta_local (fp32, CPU) is written into shared memory;
2. helper process (a ``DecentralizedAverager``): hivemind matchmaking under the key prefix
   ``vnode_{run_id}_outer_{stage}`` forms a group of up to ``group_size`` live replicas of the
   stage (drawn afresh every round among the peers that are looking for a group);
3. in that group, two butterfly all-reduces with the same group id plus a phase suffix:
   phase P averages P_i = (Delta_i + e_i) Q for every compressed matrix; every member
   orthonormalises the same P_avg by QR (``compression.powersgd``); phase Q averages
   Q_i = M_i^T P_hat together with the tensors that go uncompressed (vectors, small
   matrices, everything at rank 0) and, when the members' outer states differ, the states
   themselves (see "re-anchoring");
4. every member rebuilds the same d_hat = P_hat Q_avg^T (error feedback e_i <- M_i - d_hat);
5. host: the outer optimizer (Nesterov SGD, or GASLoC's mix-then-momentum) steps theta_global
   with d_hat, and the new theta is written into the live parameters in place.

Q warm start and group changes. Every group member must hold the same Q when phase P starts.
Each member sends a *lineage* id with its matchmaking request: a hash of its initial outer
state, replaced after every committed round by a hash of that round's group id (all members
of a committed round hold bit-identical outer state and Q: the all-reduce hands every member
the reducer's average itself, see ``_ExactRunner``). If every member of a new group
has the same lineage, their Q's (and theta_global, momentum) are identical and the warm
start is kept; otherwise every member calls ``PowerSGD.reset_q(salt)`` with a salt derived
from the group id, which all members know, so the group agrees on Q without shipping it.

Re-anchoring (pulling replicas back). When lineages differ inside a group, theta_global and
the outer momentum state are averaged densely in phase Q (their group mean replaces each
member's own) before the outer step; afterwards the group is one model again. With one group
holding every replica, lineages never differ after the first round and nothing extra is sent.
Such a round costs about two dense fp32 copies of the stage on top of the compressed round.

Skips and failures. A round with no partner (fewer than ``min_group_size`` peers found) within
``timeout`` seconds, or whose all-reduce failed (a peer died, a part was lost, a sender was
banned), or that the host gave up on at the deadline, is *skipped*: the live parameters,
theta_global, the momentum state, the error feedback and Q are all left as they were (the
helper's compressor is aborted and nothing is committed), so the next committed round's
Delta covers every inner step since the last committed one. The host's deadline is
authoritative: a result that arrives after it is refused by a token check in shared memory.
A failed all-reduce is retried within the deadline with whoever is still looking (so the
survivors of a dead peer may still finish as a smaller group).

Bytes. ``RoundStats.bytes_sent`` is counted from the serialized protobuf messages this peer
writes into all-reduce streams (its tensor parts to other reducers, and the averaged parts it
returns as a reducer), for every attempt of the round; libp2p framing and matchmaking are not
included. ``dense_bytes`` is the per-peer traffic of a dense fp32 all-reduce of Delta in a
group of the same size, 2(k-1)/k * 4 * numel. Over a whole group the sums compare exactly:
sum(bytes_sent) = 2(k-1) * bytes_for(...) + message overhead, sum(dense_bytes) = 8(k-1) numel;
a single peer's share depends on how hivemind assigns whole 512 KiB parts to reducers.

Bits and overlap. With ``bits`` 8 or 4 every number a round averages (dense Deltas with their own
error feedback, P and Q under PowerSGD's) travels as blockwise codes (``compression.outer_quant``,
``node.dp.quant_wire``); the re-anchoring state stays fp32. ``begin``/``poll`` run a round while
the inner steps go on (``--outer-overlap``); ``round`` is both, waited on. Replicas that reach
each other only through a relay average through it (``node.dp.relayed_averaging``).

(Over 400 lines on purpose: the host side and the helper process's side of one round share one
shared-memory layout and one commit protocol; split, neither half reads on its own.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import hashlib
import logging
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import asdict, dataclass, field

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionInfo, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip

from compression import outer_quant
from compression.outer import GaslocOuter, OuterNesterov
from compression.powersgd import DEFAULT_MIN_COMPRESS_NUMEL, PowerSGD, PowerSGDState, initial_q
from node.dp import quant_wire
from node.dp.relayed_averaging import RelayedDialing, forwarder, handler_names
from node.net.pipes import tolerate_dead_senders
from node.stop_signal import default_signals_in_child
from node.swarm.membership import leave_process_group, parent_death_signal

log = logging.getLogger("node")


class _StateDownloadOneLine(logging.Filter):
    """A joiner asks the stage's replicas for the outer state in turn; under churn the first one
    named may be a replica whose record outlived it ("routing: not found"), and hivemind logs that
    with a whole traceback, then asks the next. The line already names the peer and the error: the
    traceback told a volunteer nothing, so it is dropped (the record stays, at warning level)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Failed to download state from"):
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("hivemind.averaging.averager").addFilter(_StateDownloadOneLine())

MODES = ("diloco", "gasloc")
STATE_VERSION = 1
LEAVE_GRACE_S = 5.0  # a node told to stop finishes an all-reduce under way for at most this long
AVERAGER_START_ATTEMPTS = 2  # hivemind's forked averager can deadlock at start-up; fork once more
REPLIES_SENT_S = 5.0  # the longest a member, its averages done, waits to return its last averaged parts

# Slots of the shared record between the host and the helper process (doubles; tokens < 2**53).
_ACTIVE, _BYTES, _COMMITTED, _GROUP, _REANCHOR, _PAYLOAD, _ATTEMPTS = range(7)
_LINEAGE_LEN = 32


def matchmaking_prefix(run_id: str, stage: int) -> str:
    """``vnode_{run_id}_outer_{stage}``: hivemind forbids '.' in a prefix, so dots become '_'."""
    return f"vnode_{re.sub(r'[^A-Za-z0-9_-]', '_', run_id)}_outer_{int(stage)}"


@dataclass
class RoundStats:
    """What one call of ``OuterSync.round`` did (see the module docstring for the byte counts)."""

    round: int
    group_size: int  # peers in the committed group; 1 if skipped
    skipped: bool
    bytes_sent: int  # serialized all-reduce messages this peer wrote, all attempts of the round
    dense_bytes: int  # per-peer bytes of a dense fp32 all-reduce of Delta in the same group; 0 if skipped
    seconds: float
    payload_bytes: int = 0  # bytes of the numbers this peer contributed (P + Q + dense [+ re-anchor])
    reanchored: bool = False  # theta_global and momentum were averaged because the lineages differed
    attempts: int = 0  # all-reduce attempts (matchmaking retries after a failed all-reduce)
    reason: str = ""  # why a round was skipped
    group: str = ""  # the committed group's id, hashed: equal on every member of that round's group

    def as_dict(self) -> dict:
        return asdict(self)


def _lineage_of(tensors: list[torch.Tensor], extra: str) -> str:
    h = hashlib.blake2b(extra.encode(), digest_size=_LINEAGE_LEN // 2)
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).numpy().view("uint8").data)
    return h.hexdigest()


def _salt_of(group_id: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"q-salt" + group_id, digest_size=8).digest(), "little")


class _ExactRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, changed in two ways.

    1. Every member ends with the reducer's average itself. Stock hivemind returns
       average - local and adds it back, which leaves each member a different rounding of the
       average; PowerSGD cannot live with that: where P_avg is rank-deficient, QR turns those
       last-bit differences into different noise columns of P_hat on each member, and their
       d_hat's then differ by far more than rounding. With exact averages all members compute
       bit-identical P_hat, Q_avg, d_hat and theta (same CPU math library).
    2. The serialized size of every message this peer sends is added to ``counter[0]``. A member's
       own averages can be complete while, as a reducer, it is still returning the last averaged
       part to a partner; ``replies_sent`` waits for that, so the count is the round's whole.

    3. With ``--outer-bits`` 8 or 4 (``node.dp.quant_wire``), parts travel quantised: a reducer
       quantises each average afresh and keeps, for its own parts, exactly what it sends.
    """

    def __init__(self, *args, counter: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self._counter = counter
        own = self.ordered_peer_ids.index(self.peer_id)
        self._own_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[own]]
        self._serving = 0  # reducer streams still returning averaged parts
        self._served = asyncio.Event()
        self._served.set()

    async def replies_sent(self, timeout: float) -> None:
        """Until every averaged part this peer returns as a reducer is written (or ``timeout``)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._served.wait(), timeout)

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self._counter[0] += msg.ByteSize()
            yield msg

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            comp = self.tensor_part_container.compression
            if isinstance(comp, quant_wire.QuantParts) and comp.quantised(self._own_infos[part_index]):
                averaged = quant_wire.average_as_received(averaged, comp.bits)
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged.clone())

    def _get_peer_stub(self, peer):
        return quant_wire.decoded_stub(super()._get_peer_stub(peer))

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        self._serving += 1
        self._served.clear()
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression, bits in amap_in_executor(
                _unpack_part,
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was dropped; nothing more to aggregate from it
                if bits:
                    serialized = await loop.run_in_executor(None, quant_wire.encode_average, averaged, bits)
                else:
                    serialized = await loop.run_in_executor(
                        None, serialize_torch_tensor, averaged, part_compression
                    )
                msg = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self._counter[0] += msg.ByteSize()
                yield msg
        finally:
            self._serving -= 1
            if not self._serving:
                self._served.set()
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class _OuterAverager(DecentralizedAverager):
    """hivemind averager whose group step is a two-phase PowerSGD round (runs in the helper process).

    Shared memory (allocated by the host before the fork): ``delta`` (Delta in, d_hat out),
    ``err``/``q`` (PowerSGD state of the compressed matrices), ``theta``/``mom`` (the outer
    state, read and written here only when re-anchoring), and a small record guarded by
    ``lock_averaged_tensors`` through which the host hands over a round (token) and the helper
    commits it.
    """

    def __init__(
        self,
        *,
        names: list[str],
        delta: dict[str, torch.Tensor],
        err: dict[str, torch.Tensor],
        q: dict[str, torch.Tensor],
        theta: dict[str, torch.Tensor],
        mom: dict[str, torch.Tensor],
        qerr: dict[str, torch.Tensor],
        rank: int,
        bits: int,
        seed: int,
        min_compress_numel: int,
        config_tag: str,
        state_fn,
        run_id: str = "",
        stage: int = 0,
        wire_key: bytes | None = None,
        **kwargs,
    ):
        self.names = list(names)
        # streams to replicas reachable only through a relay (node/dp/relayed_averaging.py)
        self.run_id, self.stage, self.wire_key = run_id, int(stage), wire_key
        self._dialing: RelayedDialing | None = None
        self.listen_out = mp.RawArray(ctypes.c_char, 512)  # the helper's daemon-client socket
        self.delta, self.err, self.q, self.theta, self.mom = delta, err, q, theta, mom
        self.qerr = qerr  # error feedback of the quantised dense tensors (--outer-bits 8/4)
        self.comp_names = [n for n in self.names if n in err]
        self.dense_names = [n for n in self.names if n not in err]
        self.rank, self.seed, self.min_compress_numel = int(rank), int(seed), int(min_compress_numel)
        self.bits = outer_quant.check_bits(bits)
        for t in [*err.values(), *q.values(), *theta.values(), *mom.values(), *qerr.values()]:
            t.share_memory_()
        self.record = mp.RawArray(ctypes.c_double, 8)
        self.record[_ACTIVE] = self.record[_COMMITTED] = -1
        self.lineage_out = mp.RawArray(ctypes.c_char, _LINEAGE_LEN)
        self._state_fn = state_fn
        self._node_pid = os.getpid()
        super().__init__([delta[n] for n in self.names], start=False, **kwargs)
        # Peers with another rank / mode / seed / threshold must never share a group: fold the
        # configuration into the schema hash that matchmaking compares.
        self.schema_hash = hashlib.blake2b(self.schema_hash + config_tag.encode(), digest_size=20).digest()

    def run(self):
        # The helper dies with its node, even a SIGKILLed one: left behind it would hold the node's
        # stdout (a caller waiting for EOF hangs) and its identity lock (a restart is refused).
        parent_death_signal(signal.SIGKILL)
        if os.getppid() != self._node_pid:  # the node died before prctl took effect
            os._exit(0)
        default_signals_in_child()  # not the node's start-up handler, which only sets a flag
        leave_process_group()  # a signal to the node's group is the node's to act on
        tolerate_dead_senders(self, "outer averager")  # see node/net/pipes.py
        super().run()

    @staticmethod
    def _Popen(process_obj):
        # The helper shares tensors, locks and pipes with the host by inheritance: always fork, also
        # in a process whose default start method is "spawn" (e.g. one started by multiprocessing).
        return mp.get_context("fork").Process._Popen(process_obj)

    # ------------------------------------------------------------------ host side
    def get_current_state(self):
        """Called in the host process (hivemind's background thread) when a peer downloads our state."""
        return self._state_fn()

    # ------------------------------------------------------------------ helper side
    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False) -> None:
        """hivemind's, on the helper's daemon client; first, its streams learn the replicas' relays,
        and after, the node learns where to hand the relayed streams for these handlers."""
        if self._dialing is None and self.run_id:
            timeout = max(1.0, min(10.0, float(self._allreduce_timeout or 10.0) / 2))
            self._dialing = RelayedDialing(p2p, self.dht, self.run_id, self.stage, self.wire_key, timeout)
            self._refresher = asyncio.create_task(self._dialing.refresh_forever())
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        self.listen_out.value = str(p2p._client_listen_maddr["unix"]).encode()

    def _phase_ids(self, group_id: bytes) -> list[bytes]:
        return ([group_id + b".P"] if self.comp_names else []) + [group_id + b".Q"]

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """One pending runner per phase, registered before either phase starts (as hivemind's PowerSGD)."""
        ids = self._phase_ids(group_info.group_id)
        try:
            for gid in ids:
                self._running_groups[gid] = asyncio.Future()
            self._pending_groups_registered.set()
            yield
        finally:
            for gid in ids:
                fut = self._running_groups.pop(gid, None)
                if fut is not None and not fut.done():
                    fut.cancel()
            self._pending_groups_registered.set()

    async def _run_allreduce_inplace_(
        self,
        tensors,
        group_info: GroupInfo,
        group_id: bytes | None = None,
        *,
        counter=None,
        scales: dict[int, torch.Tensor] | None = None,
        **kwargs,
    ):
        """``scales``: tensor index -> block scales of the tensors that travel quantised (--outer-bits)."""
        group_id = group_info.group_id if group_id is None else group_id
        if scales:
            kwargs["compression"] = quant_wire.QuantParts(self.bits, scales)
            kwargs["tensor_infos"] = tuple(
                CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)
            )
        runner = _ExactRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            counter=counter if counter is not None else [0],
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id!r} was not registered"
        self._running_groups[group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        # (a CI run read 127,323 of a LoRA stage's 131,072 bytes: the last averaged part uncounted)
        await runner.replies_sent(REPLIES_SENT_S)
        # hivemind finishes an all-reduce even when a reducer failed (its parts keep our local
        # values) or a sender was dropped (its parts are averaged without it). Members would then
        # hold different "averages", so such an attempt fails as a whole instead.
        lost = runner.tensor_part_container.failed_size
        if lost or runner.banned_senders:
            raise AllreduceException(f"{lost} values lost, {len(runner.banned_senders)} senders dropped")

    def _snapshot(self, reanchor: bool):
        with self.lock_averaged_tensors:
            token = int(self.record[_ACTIVE])
            if token < 0:
                raise AllreduceException("the host is not running a round")
            self.record[_ATTEMPTS] += 1
            deltas = {n: self.delta[n].clone() for n in self.names}
            anchor = None
            if reanchor:
                anchor = [self.theta[n].clone() for n in self.names]
                anchor += [self.mom[n].clone() for n in self.names]
        comp = PowerSGD(self.rank, self.seed, self.min_compress_numel)
        # e and Q are read in phase 1 and replaced (never modified) by finish(): no copy needed.
        comp.states = {n: PowerSGDState(error=self.err[n], q=self.q[n]) for n in self.comp_names}
        return token, deltas, anchor, comp

    def _commit(self, token, out, anchor, comp, group_size, reanchor, payload, lineage, qerr) -> None:
        with self.lock_averaged_tensors:
            if int(self.record[_ACTIVE]) != token:
                raise AllreduceException("the host gave up on this round before it finished")
            for n in self.names:
                self.delta[n].copy_(out[n])
            for n, e in qerr.items():
                self.qerr[n].copy_(e)
            for n in self.comp_names:
                st = comp.states[n]
                if st.error is not self.err[n]:
                    self.err[n].copy_(st.error)
                if st.q is not self.q[n]:
                    self.q[n].copy_(st.q)
            if anchor is not None:
                k = len(self.names)
                for i, n in enumerate(self.names):
                    self.theta[n].copy_(anchor[i])
                    self.mom[n].copy_(anchor[k + i])
            self.record[_COMMITTED] = token
            self.record[_GROUP] = group_size
            self.record[_REANCHOR] = float(reanchor)
            self.record[_PAYLOAD] = payload
            self.lineage_out.value = lineage.encode()

    def _add_bytes(self, token, nbytes: int) -> None:
        with self.lock_averaged_tensors:
            if token is not None and int(self.record[_ACTIVE]) == token:
                self.record[_BYTES] += nbytes

    def _quantise(
        self, tensors: list[torch.Tensor], feedback: list[str | None], new_err: dict, count: int | None = None
    ) -> dict:
        """Replace the first ``count`` (default all) ``tensors[i]`` by their quantised values
        (--outer-bits 8/4); return their block scales by index. A named tensor adds its error
        feedback and puts the new one in ``new_err`` (committed with the round); unnamed ones
        (P, Q) rely on PowerSGD's."""
        if self.bits == 32:
            return {}
        scales = {}
        n = len(tensors) if count is None else count
        for i, (t, name) in enumerate(zip(tensors[:n], feedback[:n])):
            if name is None:
                values, scales[i] = outer_quant.quantize(t, self.bits)
            else:
                values, scales[i], new_err[name] = outer_quant.with_feedback(t, self.qerr[name], self.bits)
            tensors[i] = values.contiguous()
        return scales

    def _payload_bytes(self, tensors: list[torch.Tensor], scales: dict) -> int:
        return sum(
            outer_quant.wire_nbytes(t.numel(), self.bits if i in scales else 32)
            for i, t in enumerate(tensors)
        )

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        loop = asyncio.get_event_loop()
        counter, token, comp = [0], None, None
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            members = [self.serializer.loads(b) or {} for b in user_bytes]
            modes = tuple(map(AveragingMode, mode_ids))
            download_bandwidths = [b if m != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, modes)]
            fractions = await loop.run_in_executor(
                None, load_balance_peers, self.total_size, download_bandwidths, min_vector_size
            )
            reanchor = len({str(m.get("lineage")) for m in members}) != 1
            token, deltas, anchor, comp = await loop.run_in_executor(None, self._snapshot, reanchor)
            if reanchor:
                comp.reset_q(_salt_of(group_info.group_id))  # same salt on every member
            gid = group_info.group_id
            ps, dense = await loop.run_in_executor(None, comp.phase1_all, deltas)
            qs: dict[str, torch.Tensor] = {}
            payload = 0
            if self.comp_names:
                p_list = [ps[n].contiguous() for n in self.comp_names]
                p_scales = await loop.run_in_executor(None, self._quantise, p_list, [None] * len(p_list), {})
                payload += self._payload_bytes(p_list, p_scales)
                await self._run_allreduce_inplace_(
                    p_list,
                    group_info,
                    gid + b".P",
                    peer_fractions=fractions,
                    counter=counter,
                    scales=p_scales,
                    **kwargs,
                )
                qs = await loop.run_in_executor(None, comp.phase2_all, dict(zip(self.comp_names, p_list)))
            q_list = [qs[n].contiguous() for n in self.comp_names]
            dense_list = [dense[n].to(torch.float32).contiguous() for n in self.dense_names]
            # PowerSGD's own error feedback (e <- M - d_hat) covers what quantising P and Q loses;
            # the dense tensors carry their own (qerr)
            new_qerr: dict[str, torch.Tensor] = {}
            phase_q = q_list + dense_list + (anchor or [])  # the re-anchoring state goes as it is
            feedback = [None] * len(q_list) + self.dense_names + [None] * len(anchor or [])
            q_scales = await loop.run_in_executor(
                None, self._quantise, phase_q, feedback, new_qerr, len(q_list) + len(dense_list)
            )
            payload += self._payload_bytes(phase_q, q_scales)
            await self._run_allreduce_inplace_(
                phase_q,
                group_info,
                gid + b".Q",
                peer_fractions=fractions,
                counter=counter,
                scales=q_scales,
                **kwargs,
            )
            nq, nd = len(q_list), len(dense_list)
            out = await loop.run_in_executor(
                None,
                comp.finish_all,
                dict(zip(self.comp_names, phase_q[:nq])),
                dict(zip(self.dense_names, phase_q[nq : nq + nd])),
            )
            lineage = hashlib.blake2b(b"lineage" + gid, digest_size=_LINEAGE_LEN // 2).hexdigest()
            await loop.run_in_executor(
                None,
                self._commit,
                token,
                out,
                phase_q[nq + nd :] if reanchor else None,
                comp,
                group_info.group_size,
                reanchor,
                payload,
                lineage,
                new_qerr,
            )
            return {"group_size": group_info.group_size, "reanchored": reanchor}
        except BaseException as e:
            if comp is not None:
                comp.abort()  # e and Q stay as they were before phase 1
            if isinstance(e, Exception):
                log.debug("outer all-reduce attempt failed: %r", e)
            raise MatchmakingException(f"outer all-reduce failed: {e!r}") from e
        finally:
            await loop.run_in_executor(None, self._add_bytes, token, counter[0])


def _await_helper(avg: DecentralizedAverager, timeout: float) -> None:
    """Wait for the averager's forked helper to be ready, watching that it is still alive.

    A Ctrl-C or ``kill -TERM -PGID`` reaches the whole process group: the helper dies of it while
    this process only notes the request (node.stop_signal), and a plain wait would then sit out
    its whole timeout. A helper killed by such a signal is the user's stop; any other death is an
    error; a live helper that is not ready by ``timeout`` raises TimeoutError (forked anew).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            avg.wait_until_ready(timeout=0.5)
            return
        except TimeoutError:
            code = avg.exitcode
            if code is not None:
                if -code in (signal.SIGINT, signal.SIGTERM):
                    raise KeyboardInterrupt from None
                raise RuntimeError(
                    f"the outer averager's helper process died at start (exit code {code})"
                ) from None
            if time.monotonic() >= deadline:
                raise


@dataclass
class _Round:
    """A round between ``begin`` and the ``poll`` that hands it back."""

    index: int
    token: int
    t0: float
    deadline: float
    local: dict[str, torch.Tensor] | None  # the params at begin, for an overlapped round
    control: object = None  # hivemind's StepControl
    reason: str = ""  # why it failed, once it has
    extended: bool = False  # the deadline was moved once for an all-reduce under way
    thread: int = field(default_factory=threading.get_ident)  # the one that began it (and polls)


class OuterSync:
    """DiLoCo / GASLoC outer rounds for one stage's parameters over hivemind gossip groups.

    Create on the main thread before the event loop starts; call ``round`` from the compute
    thread between inner steps (blocking, at most about ``timeout`` seconds); ``shutdown`` at exit.
    """

    def __init__(
        self,
        dht,
        run_id: str,
        stage: int,
        named_params: Mapping[str, torch.nn.Parameter],
        *,
        rank: int,
        group_size: int,
        bits: int = 32,
        outer_lr: float = 0.7,
        momentum: float = 0.9,
        seed: int,
        timeout: float,
        mode: str = "diloco",
        min_group_size: int = 2,
        matchmaking_time: float = 5.0,
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
        next_chunk_timeout: float | None = None,
        state_sharing: bool = True,
        theta0: Mapping[str, torch.Tensor] | None = None,
        wire_key: bytes | None = None,
    ):
        """``theta0``: the outer model to start from (default: the parameters as they are now). A
        replica that built its outer state only when a partner appeared (node.dp.deferred) passes
        the stage's starting weights: the state it would have held since the start."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("create OuterSync on the main thread (hivemind installs signal handlers)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.bits = outer_quant.check_bits(bits)
        if not 1 <= min_group_size <= group_size:
            raise ValueError(f"need 1 <= min_group_size <= group_size, got {min_group_size}, {group_size}")
        if timeout <= 0 or matchmaking_time <= 0:
            raise ValueError("timeout and matchmaking_time must be positive")
        if not named_params:
            raise ValueError("no parameters to synchronise")
        self.run_id, self.stage, self.mode = run_id, int(stage), mode
        self.rank, self.seed, self.timeout = int(rank), int(seed), float(timeout)
        self.group_size, self.min_group_size = int(group_size), int(min_group_size)
        self.min_compress_numel = int(min_compress_numel)
        # matchmaking must leave room for the all-reduce inside the round's deadline
        self.matchmaking_time = min(float(matchmaking_time), 0.5 * self.timeout)
        self.names = sorted(named_params)
        self._params = {n: named_params[n] for n in self.names}
        self.prefix = matchmaking_prefix(run_id, stage)

        comp = PowerSGD(self.rank, self.seed, self.min_compress_numel)
        self._theta: dict[str, torch.Tensor] = {}
        self._delta: dict[str, torch.Tensor] = {}
        err: dict[str, torch.Tensor] = {}
        q: dict[str, torch.Tensor] = {}
        for n in self.names:
            p = self._params[n].detach()
            start = p if theta0 is None else theta0[n]
            if tuple(start.shape) != tuple(p.shape):
                raise ValueError(f"theta0[{n!r}]: shape {list(start.shape)}, the parameter {list(p.shape)}")
            self._theta[n] = start.to("cpu", torch.float32).clone().share_memory_()
            self._delta[n] = torch.zeros(p.shape, dtype=torch.float32).share_memory_()
            if comp.is_compressed(n, p.shape):
                m = p.shape[0]
                cols = p.numel() // m
                err[n] = torch.zeros((m, cols), dtype=torch.float32)
                q[n] = initial_q(self.seed, n, cols, self.rank)  # the run's shared starting Q (salt 0)
        # Momentum state in shared memory (re-anchoring averages it). DiLoCo: Nesterov buffers,
        # zero-initialised (b = 0.9*0 + g on the first step is torch's clone(g)). GASLoC: z_{t-1},
        # initialised to theta_0 (GaslocOuter's convention for its first step).
        self._mom = {
            n: (torch.zeros_like(t) if mode == "diloco" else t.clone()).share_memory_()
            for n, t in self._theta.items()
        }
        if mode == "diloco":
            self.outer: OuterNesterov | GaslocOuter = OuterNesterov(outer_lr, momentum)
            self.outer.buffers = dict(self._mom)
        else:
            self.outer = GaslocOuter(outer_lr, momentum, mix_weight=1.0)
            self.outer.z_prev = dict(self._mom)
        self.compressed = [n for n in self.names if n in err]
        # error feedback of the tensors averaged densely when they travel at 8/4 bits
        self._qerr = {
            n: torch.zeros(self._theta[n].shape, dtype=torch.float32)
            for n in self.names
            if self.bits != 32 and n not in err
        }
        self.numel = sum(t.numel() for t in self._theta.values())
        self.config_tag = f"v{STATE_VERSION}/{mode}/r{self.rank}/s{self.seed}/c{self.min_compress_numel}"
        if self.bits != 32:  # (fp32 runs keep the tag, and so the checkpoints, they had)
            self.config_tag += f"/b{self.bits}"
        self.lineage = _lineage_of(
            [*self._theta.values(), *self._mom.values()], f"{self.config_tag}/{self.names}"
        )
        self.outer_steps = 0
        self.totals = {"rounds": 0, "committed": 0, "skipped": 0, "bytes_sent": 0, "dense_bytes": 0}
        self._cond = threading.Condition()
        self._token = 0
        self._inflight: int | None = None
        self._round: _Round | None = None  # begun, not yet handed back by poll()
        self._finished: RoundStats | None = None
        self._relayed: dict | None = None  # relayed_handlers(), built once
        self._closed = False
        self._leaving = threading.Event()  # see abort()

        chunk = min(10.0, max(1.0, self.timeout / 4)) if next_chunk_timeout is None else next_chunk_timeout
        make = functools.partial(
            _OuterAverager,
            names=self.names,
            delta=self._delta,
            err=err,
            q=q,
            theta=self._theta,
            mom=self._mom,
            qerr=self._qerr,
            rank=self.rank,
            bits=self.bits,
            seed=self.seed,
            min_compress_numel=self.min_compress_numel,
            config_tag=self.config_tag,
            state_fn=self._current_state,
            run_id=run_id,
            stage=self.stage,
            wire_key=wire_key,
            dht=dht,
            prefix=self.prefix,
            target_group_size=self.group_size,
            min_group_size=self.min_group_size,
            min_matchmaking_time=self.matchmaking_time,
            request_timeout=min(3.0, 0.5 * self.matchmaking_time),
            allreduce_timeout=self.timeout,
            next_chunk_timeout=chunk,
            allow_state_sharing=state_sharing and not dht.client_mode,
            declare_state_period=30.0,
            # hivemind terminates a helper that has not exited by then; one killed while holding
            # MPFuture's process-wide locks (inherited by the DHT process) would hang this node's
            # other hivemind calls, so give it time on a busy machine.
            shutdown_timeout=30.0,
        )
        previous = signal.getsignal(signal.SIGINT)
        try:
            for attempt in range(AVERAGER_START_ATTEMPTS):
                self._avg = make()
                try:
                    self._avg.run_in_background(await_ready=False)
                    _await_helper(self._avg, 60.0)
                    break
                except TimeoutError:
                    # A child forked while another thread held one of hivemind's process-wide
                    # locks never becomes ready (seen once in a fresh-clone test run, in a process with many
                    # earlier averagers); kill it and fork a fresh one rather than fail the node.
                    log.warning("outer averager not ready in 60 s (try %d); forking anew", attempt + 1)
                    self._avg.kill()
                    self._avg.join(5.0)
                    if attempt == AVERAGER_START_ATTEMPTS - 1:
                        raise
        finally:
            # run_in_background ignores SIGINT in this process too (it means the child); give it back
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    # ------------------------------------------------------------------ the round
    def round(self, round_index: int) -> RoundStats:
        """One outer round; blocks for at most about ``timeout`` s (compute thread, no microbatch in
        flight), or twice that when its all-reduce is under way at the deadline.

        Never raises for network trouble: a round without a group, or whose all-reduce failed,
        comes back with ``skipped=True`` and leaves every parameter and state as it was.
        ``round_index`` is only reported back (Q salts come from the group id, not from it).
        """
        self.begin(round_index)
        self.settle()
        stats = self.poll()
        assert stats is not None
        return stats

    # An overlapped round (--outer-overlap, as Streaming DiLoCo's): ``begin`` hands Delta to the
    # averager and returns; inner steps go on; ``poll`` between steps applies the round once it is
    # done. The replica keeps what it learned meanwhile: params <- theta_new + (params - local at
    # begin), so the next round's Delta holds those steps and nothing is counted twice.
    def begin(self, round_index: int, *, overlap: bool = False) -> None:
        """Start a round (compute thread, between inner steps); ``poll``/``settle`` finish it."""
        if self._closed:
            raise RuntimeError("OuterSync is shut down")
        if self._round is not None:
            raise RuntimeError("an outer round is already under way")
        t0 = time.monotonic()
        rec = self._avg.record
        with self._cond:
            self._token += 1
            token = self._token
            local = {n: self._params[n].detach().to("cpu", torch.float32) for n in self.names}
            with self._avg.lock_averaged_tensors:
                for n in self.names:
                    torch.sub(self._theta[n], local[n], out=self._delta[n])
                rec[_ACTIVE], rec[_BYTES], rec[_ATTEMPTS] = token, 0, 0
            self._inflight = token
        # (a CPU fp32 parameter's .to() is the parameter itself: an overlapped round keeps a copy)
        kept = {n: t.clone() for n, t in local.items()} if overlap else None
        r = _Round(round_index, token, t0, t0 + self.timeout, kept)
        del local
        try:
            if not self._avg.is_alive():
                raise RuntimeError("the averager process is not running")
            r.control = self._avg.step(
                gather={"lineage": self.lineage}, timeout=self.timeout, allow_retries=True, wait=False
            )
        except Exception as e:
            r.reason = _one_line(e) or type(e).__name__
        self._round = r

    def settle(self) -> None:
        """Wait until the round under way (if any) is done or given up; ``poll`` then returns it."""
        if self._round is not None and self._finished is None:
            self._finished = self._finish(self._round, block=True)

    def poll(self) -> RoundStats | None:
        """The round's stats once it is done and applied (once), else None without waiting."""
        if self._finished is None and self._round is not None:
            self._finished = self._finish(self._round, block=False)
        stats, self._finished = self._finished, None
        if stats is not None:
            self._round = None
        return stats

    @property
    def under_way(self) -> bool:
        return self._round is not None

    def _wait(self, r: _Round, block: bool) -> bool:
        """True once the averager's step ended (or raised: the round failed); False if not yet."""
        while True:  # in slices, so that a node told to stop leaves a lonely round at once
            if self._leaving.is_set():
                if not r.control.began_allreduce:
                    raise RuntimeError("the node is leaving the swarm")
                # the group formed and the all-reduce is under way: the partners will commit
                # it, so finish it (briefly) rather than keep an outer model they no longer hold
                r.deadline = min(r.deadline, time.monotonic() + LEAVE_GRACE_S)
            try:
                wait = min(0.25, max(0.0, r.deadline - time.monotonic())) if block else 0.0
                r.control.result(timeout=wait)
                return True
            except futures.TimeoutError:
                if time.monotonic() < r.deadline:
                    if not block:
                        return False
                    continue
                if r.control.began_allreduce and not r.extended and not self._leaving.is_set():
                    # Likewise at the deadline: a replica that gives up on an all-reduce under
                    # way keeps the old outer model while its partners commit the new one, and
                    # they stay apart until a later round re-anchors them (seen on a loaded
                    # 2-core host: one replica committed after 11 s, its partner gave up at 20).
                    # hivemind bounds the all-reduce itself by the same timeout from its start.
                    r.deadline = time.monotonic() + self.timeout
                    r.extended = True
                    log.info("outer round %d: all-reduce under way at the deadline; finishing it", r.index)
                    continue
                raise

    def _finish(self, r: _Round, block: bool) -> RoundStats | None:
        rec = self._avg.record
        if not r.reason:
            try:
                if not self._wait(r, block):
                    return None
            except Exception as e:  # no group, failed all-reduce, deadline: the round is skipped
                r.reason = _one_line(e) or type(e).__name__
        with self._cond:
            with self._avg.lock_averaged_tensors:
                committed = int(rec[_COMMITTED]) == r.token
                rec[_ACTIVE] = -1  # a late commit of this round is refused from now on
                sent, attempts = int(rec[_BYTES]), int(rec[_ATTEMPTS])
                group, reanchored, payload = int(rec[_GROUP]), bool(rec[_REANCHOR]), int(rec[_PAYLOAD])
                lineage = self._avg.lineage_out.value.decode()
                d_hat = {n: self._delta[n].clone() for n in self.names} if committed else None
            if r.control is not None and not r.control.done():
                r.control.cancel()
            try:
                if committed:
                    self._apply(d_hat, lineage, r.local)
            finally:
                self._inflight = None
                self._cond.notify_all()
        seconds = time.monotonic() - r.t0
        if committed:
            stats = RoundStats(
                round=r.index,
                group_size=group,
                skipped=False,
                bytes_sent=sent,
                dense_bytes=round(8 * (group - 1) * self.numel / group),
                seconds=seconds,
                payload_bytes=payload,
                reanchored=reanchored,
                attempts=attempts,
                group=lineage[:12],
            )
            try:  # donors with more outer steps are preferred by joining peers
                self._avg.state_sharing_priority = float(self.outer_steps)
            except Exception:
                pass
        else:
            stats = RoundStats(
                round=r.index,
                group_size=1,
                skipped=True,
                bytes_sent=sent,
                dense_bytes=0,
                seconds=seconds,
                attempts=attempts,
                reason=r.reason or "no group",
            )
        self.totals["rounds"] += 1
        self.totals["committed" if committed else "skipped"] += 1
        self.totals["bytes_sent"] += stats.bytes_sent
        self.totals["dense_bytes"] += stats.dense_bytes
        return stats

    @torch.no_grad()
    def _apply(
        self, d_hat: dict[str, torch.Tensor], lineage: str, local: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Outer step on theta_global (already re-anchored by the helper if needed); write the params
        (plus what they moved since ``local``, the params an overlapped round began from)."""
        theta = self._theta
        if isinstance(self.outer, OuterNesterov):
            self.outer.buffers = dict(self._mom)  # updated in place (shared memory)
            new = self.outer.step(theta, d_hat)
        else:
            # y_i = theta + eta * (theta_local - theta) = theta - eta * Delta_i; group mean of y with a
            # shared (or re-anchored) theta: theta - eta * mean(Delta) ~= theta - eta * d_hat.
            eta = self.outer.eta
            y_mean = {n: theta[n] - eta * d_hat[n] for n in self.names}
            self.outer.z_prev = dict(self._mom)
            new = self.outer.step(theta, y_mean, y_mean)  # mix_weight = 1: the peer's own y is unused
            for n in self.names:
                self._mom[n].copy_(self.outer.z_prev[n])
            self.outer.z_prev = dict(self._mom)
        with self._avg.lock_averaged_tensors:
            for n in self.names:
                theta[n].copy_(new[n])
        for n in self.names:
            p = self._params[n]
            if local is None:
                p.data.copy_(theta[n].to(device=p.device, dtype=p.dtype))
            else:
                moved = p.detach().to("cpu", torch.float32) - local[n]
                p.data.copy_((theta[n] + moved).to(device=p.device, dtype=p.dtype))
        self.lineage = lineage
        self.outer_steps += 1

    # ------------------------------------------------------------------ state
    def _wait_idle(self, timeout: float) -> bool:
        """Wait (holding self._cond on return) until no committed-but-unapplied round is pending."""

        def idle():
            return self._inflight is None or int(self._avg.record[_COMMITTED]) != self._inflight

        return self._cond.wait_for(idle, timeout=timeout)

    def _current_state(self):
        """(metadata, tensors, infos) for a peer that downloads this stage's outer state."""
        with self._cond:
            if not self._wait_idle(30.0):
                return None, [], None  # the downloader moves on to another donor
            with self._avg.lock_averaged_tensors:
                tensors = [self._theta[n].clone() for n in self.names]
                tensors += [self._mom[n].clone() for n in self.names]
                tensors += [self._avg.q[n].clone() for n in self.compressed]
            meta = {
                "version": STATE_VERSION,
                "config": self.config_tag,
                "names": self.names,
                "compressed": self.compressed,
                "lineage": self.lineage,
                "outer_steps": self.outer_steps,
            }
        return meta, tensors, None

    def load_state_from_peers(self, timeout: float = 60.0) -> bool:
        """Download theta_global, the outer state and Q from a live replica; write theta into the params.

        Returns False if no donor answered in time or its state does not fit this node's
        configuration. The local error feedback starts at zero (it is per peer).
        """
        try:
            got = self._avg.load_state_from_peers(wait=True, timeout=timeout)
        except Exception as e:
            log.warning("outer state download failed: %s", _one_line(e))
            return False
        if not got:
            return False
        meta, tensors = got
        k, c = len(self.names), len(self.compressed)
        if (
            not isinstance(meta, dict)
            or meta.get("version") != STATE_VERSION
            or meta.get("config") != self.config_tag
            or list(meta.get("names", [])) != self.names
            or list(meta.get("compressed", [])) != self.compressed
            or len(tensors) != 2 * k + c
        ):
            log.warning("outer state from peer does not match this node's configuration; ignored")
            return False
        shapes = [self._theta[n].shape for n in self.names] * 2
        shapes += [self._avg.q[n].shape for n in self.compressed]
        if any(t.shape != s for t, s in zip(tensors, shapes)):
            log.warning("outer state from peer has wrong shapes; ignored")
            return False
        self._load(
            theta=dict(zip(self.names, tensors[:k])),
            mom=dict(zip(self.names, tensors[k : 2 * k])),
            q=dict(zip(self.compressed, tensors[2 * k :])),
            error=None,
            qerr=None,
            lineage=str(meta["lineage"]),
            outer_steps=int(meta["outer_steps"]),
            set_params=True,
        )
        return True

    def state_dict(self) -> dict:
        """theta_global, outer optimizer state, compressor state (PowerSGD.state_dict format), lineage."""
        if self._round is not None and self._round.thread == threading.get_ident():
            self.settle()  # an overlapped round of this (compute) thread: applied first, not waited on
        with self._cond:
            self._wait_idle(30.0)
            with self._avg.lock_averaged_tensors:
                comp = PowerSGD(self.rank, self.seed, self.min_compress_numel)
                comp.states = {
                    n: PowerSGDState(error=self._avg.err[n], q=self._avg.q[n]) for n in self.compressed
                }
                return {
                    "version": STATE_VERSION,
                    "config": self.config_tag,
                    "names": list(self.names),
                    "theta": {n: self._theta[n].clone() for n in self.names},
                    "outer": {
                        "mode": self.mode,
                        "steps": self.outer_steps,
                        "state": {n: self._mom[n].clone() for n in self.names},
                    },
                    "compressor": comp.state_dict(),
                    "quant_error": {n: e.clone() for n, e in self._qerr.items()},
                    "lineage": self.lineage,
                    "totals": dict(self.totals),
                }

    def load_state_dict(self, sd: Mapping, *, set_params: bool = False) -> None:
        """Restore ``state_dict()`` output; ``set_params`` also writes theta_global into the live params."""
        if sd.get("version") != STATE_VERSION or sd.get("config") != self.config_tag:
            raise ValueError(f"state is for {sd.get('config')!r}, this OuterSync is {self.config_tag!r}")
        if list(sd["names"]) != self.names:
            raise ValueError("state has different parameter names")
        comp_sd = sd["compressor"]
        self._load(
            theta=sd["theta"],
            mom=sd["outer"]["state"],
            q={n: comp_sd["q"][n] for n in self.compressed},
            error={n: comp_sd["error"][n] for n in self.compressed},
            qerr=sd.get("quant_error"),
            lineage=str(sd["lineage"]),
            outer_steps=int(sd["outer"]["steps"]),
            set_params=set_params,
        )
        self.totals.update(sd.get("totals", {}))

    @torch.no_grad()
    def _load(self, *, theta, mom, q, error, qerr, lineage, outer_steps, set_params) -> None:
        with self._cond:
            if self._inflight is not None:
                raise RuntimeError("cannot load state while a round is in progress")
            with self._avg.lock_averaged_tensors:
                for n in self.names:
                    self._theta[n].copy_(theta[n])
                    self._mom[n].copy_(mom[n])
                for n in self.compressed:
                    self._avg.q[n].copy_(q[n])
                    if error is None:
                        self._avg.err[n].zero_()
                    else:
                        self._avg.err[n].copy_(error[n])
                for n, e in self._qerr.items():  # per peer: a downloaded state starts it at zero
                    e.copy_(qerr[n]) if qerr is not None else e.zero_()
            self.lineage = lineage
            self.outer_steps = outer_steps
            self.outer.steps = outer_steps
            if set_params:
                for n in self.names:
                    p = self._params[n]
                    p.data.copy_(self._theta[n].to(device=p.device, dtype=p.dtype))

    def relayed_handlers(self) -> dict:
        """The averager's stream handlers, for the node's ``RelayedIn``: a relayed stream for one of
        them goes on to the helper's daemon client (``node.dp.relayed_averaging.forwarder``)."""
        if self._relayed is None:
            forward = forwarder(lambda: self._avg.listen_out.value.decode())
            self._relayed = {name: forward for name in handler_names(_OuterAverager, self.prefix)}
        return self._relayed

    def theta_global(self) -> dict[str, torch.Tensor]:
        """A copy of theta_global (fp32, CPU)."""
        with self._cond:
            return {n: t.clone() for n, t in self._theta.items()}

    def abort(self) -> None:
        """The node is stopping: a round in progress is skipped now, and later ones too.

        A replica whose partner already left waits out --outer-timeout alone; a node stopped by
        docker stop (SIGKILL after 10 s) would die there before it writes its checkpoint.
        Thread-safe: called from the event loop while the compute thread is in ``round``.
        """
        self._leaving.set()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._avg.is_alive():
                self._avg.shutdown()
        except Exception as e:
            log.debug("averager shutdown: %r", e)
        if self._avg.is_alive():
            self._avg.terminate()
            self._avg.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False


def _unpack_part(msg):
    part = msg.tensor_part
    return quant_wire.unpack(part), msg.weight, part.compression, quant_wire.bits_of(part)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
