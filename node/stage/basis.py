"""Fixed link bases (the PCA codec): calibrate once, publish through the swarm, fetch on demand.

The node that starts a run calibrates the basis of every boundary from the run's data (the
activations of the untouched pretrained weights, as in the reference measurement) and serves it.
It walks the model one stage at a time (``calibrate_stagewise``): a model larger than its RAM
calibrates with one stage's weights and the calibration activations in memory. Every node that
later holds a basis announces itself in the DHT (``vnode.<run>.basis.<boundary>``, subkey = peer
id) and serves it too, so no node is special once the swarm is up. A basis travels once per node
and boundary; its bytes are counted as a one-time cost. Frames name the basis version they were
encoded with, and a receiver that lacks that version fetches it before decoding: never decoding
with the wrong one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random

import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from compression.codec import Payload
from compression.pca import fit_basis
from compression.tiered import fit_rotation
from node.net.caps import Limits
from node.net.rpc import request
from node.net.serve import serve
from node.net.wire import Wire
from node.swarm.membership import dht_call
from protocol.frames import Frame, FrameError, decode_frame, encode_frame
from protocol.records import RecordError, basis_key

log = logging.getLogger("node")

HANDLER = "vnode.basis"
BASIS_TTL_S = 60.0
REQUEST_BYTES = 4096  # a basis request is a frame without tensors
# a node asks for each boundary's basis once per version, retrying a failed fetch: a peer asking
# more often than this is a flood, struck like one (each answer sends the whole basis)
LIMITS = Limits(per_peer=2, total=16, rate=1.0, burst=8)
BASIS_VERSION = 1  # refresh policy: never (measured in bench/results: the step-0 basis keeps learning)


class BasisUnavailable(RuntimeError):
    pass


def digest(payload: Payload) -> str:
    """Of every tensor, by name: a PCA basis (mean, V, version) or tiered rotations alike."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(payload):
        h.update(name.encode())
        h.update(payload[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def real_tokens(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Right-padded rows: positions up to the last non-pad token, plus the closing eos (= pad)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    last = torch.where(ids != pad_id, pos, torch.zeros_like(pos)).max(dim=1, keepdim=True).values
    return pos <= last + 1


def _calibration_batches(batches, pad_id: int, max_tokens: int) -> list[tuple]:
    """(ids, labels, real-token mask) of the first batches holding ``max_tokens`` real tokens."""
    out, seen = [], 0
    for ids, labels in batches:
        out.append((ids, labels, real_tokens(ids, pad_id)))
        seen += int(out[-1][2].sum())
        if seen >= max_tokens:
            break
    return out


@torch.no_grad()
def calibrate_stagewise(
    load_stage, ranges: list[list[int]], batches, k: int, pad_id: int, max_tokens: int = 8192
) -> list:
    """(mean, V) of every boundary's activations over the real tokens of ``batches``, one stage at a time.

    ``load_stage(i)`` returns stage ``i`` of ``ranges`` (``node.model.stages.Stage``); each is run on
    every calibration batch, its outputs kept as the next stage's inputs, and dropped before the
    next is loaded. The last stage is never loaded: no boundary follows it.
    """
    cal = _calibration_batches(batches, pad_id, max_tokens)
    inputs, masks = [ids for ids, _, _ in cal], [m for _, _, m in cal]
    fitted = []
    for b in range(len(ranges) - 1):
        stage = load_stage(b)
        inputs = [stage(x) for x in inputs]
        del stage
        fitted.append(fit_basis(_real_rows(inputs, masks), k))
    return fitted


def calibrate_rotations_stagewise(
    load_stage, ranges: list[list[int]], batches, pad_id: int, max_tokens: int = 8192
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(forward, backward) rotations of every boundary (``compression.tiered.fit_rotation``): of the
    activations, median-centred, and of the gradients of the causal LM loss, over the real tokens.

    One stage in memory at a time, as ``calibrate_stagewise``: stages 0..n-2 forward, keeping
    each boundary's activations; then n-1 down to 1 backward, each recomputing its forward from
    the kept input and passing the gradient of that input down. 2n-2 stage loads; the kept
    activations and gradients are (n-1) x max_tokens x H floats.
    """
    cal = _calibration_batches(batches, pad_id, max_tokens)
    acts: list[list[torch.Tensor]] = []
    with torch.no_grad():
        h = [ids for ids, _, _ in cal]
        for b in range(len(ranges) - 1):
            stage = load_stage(b)
            h = [stage(x) for x in h]
            del stage
            acts.append(h)
    grads: list[list[torch.Tensor]] = [[] for _ in acts]
    upstream: list[torch.Tensor] | None = None
    for b in range(len(ranges) - 1, 0, -1):
        stage = load_stage(b)
        stage.requires_grad_(False)  # only the input's gradient is wanted
        for i, (_, labels, _) in enumerate(cal):
            x = acts[b - 1][i].detach().requires_grad_(True)
            if upstream is None:  # the tail: the training loss itself
                stage.loss(x, labels)[0].backward()
            else:
                stage(x).backward(upstream[i])
            grads[b - 1].append(x.grad.detach())
        upstream = grads[b - 1]
        del stage
    masks = [m for _, _, m in cal]
    return [
        (fit_rotation(_real_rows(a, masks), centre=True), fit_rotation(_real_rows(g, masks), centre=False))
        for a, g in zip(acts, grads)
    ]


def _real_rows(tensors: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t[m].float() for t, m in zip(tensors, masks)])


class BasisStore:
    """The bases this node holds (boundary -> version -> payload), served to peers."""

    def __init__(self, run_id: str, dht, peer_id: str, timeout: float):
        self.run_id, self.dht, self.peer_id, self.timeout = run_id, dht, peer_id, timeout
        self.wire = Wire()  # the node's, with its swarm key, is set before serving
        self.held: dict[tuple[int, int], Payload] = {}
        self.p2p = None
        self.bytes_served = 0
        self.bytes_fetched = 0
        self._locks: dict[tuple[int, int], asyncio.Lock] = {}

    def add(self, boundary: int, payload: Payload) -> None:
        self.held[(boundary, int(payload["version"][0]))] = payload

    async def start(self, p2p) -> None:
        self.p2p = p2p
        await p2p.add_binary_stream_handler(HANDLER, self.handle)
        await self.announce()

    async def announce(self) -> None:
        from hivemind.utils import get_dht_time

        for (boundary, version), payload in self.held.items():
            await dht_call(
                self.dht,
                "store",
                basis_key(self.run_id, boundary),
                {"version": version, "digest": digest(payload)},
                subkey=self.peer_id,
                expiration_time=get_dht_time() + BASIS_TTL_S,
                timeout=self.timeout,
            )

    async def handle(self, stream_info, reader, writer) -> None:
        await serve(
            stream_info,
            reader,
            writer,
            self.wire,
            self._send_basis,
            run_id=self.run_id,
            timeout=self.timeout,
            what="basis request",
            strikes=False,
            caps=self.wire.caps(HANDLER, LIMITS),
        )

    async def _send_basis(self, s) -> None:
        req = decode_frame(await s.receive(REQUEST_BYTES, idle=None), run_id=self.run_id)
        payload = self.held.get((req.boundary, req.basis_version))
        if req.kind != "basis" or payload is None:
            raise FrameError(f"no basis {req.boundary}:{req.basis_version} here")
        reply = Frame(
            kind="basis",
            run_id=self.run_id,
            boundary=req.boundary,
            basis_version=req.basis_version,
            tensors=payload,
        )
        data = encode_frame(reply)
        self.bytes_served += len(data)
        await s.send(data)

    async def holders(self, boundary: int, version: int) -> list[tuple[str, str]]:
        found = await dht_call(
            self.dht, "get", basis_key(self.run_id, boundary), latest=True, timeout=self.timeout
        )
        out = []
        if found is not None and isinstance(found.value, dict):
            for peer, item in found.value.items():
                try:
                    v = item.value
                    if not (
                        isinstance(v, dict)
                        and isinstance(v.get("digest"), str)
                        and v.get("version") == version
                    ):
                        raise RecordError("malformed basis record")
                    out.append((peer, v["digest"]))
                except (RecordError, AttributeError):
                    continue
        return out

    async def latest_version(self, boundary: int) -> int | None:
        found = await dht_call(
            self.dht, "get", basis_key(self.run_id, boundary), latest=True, timeout=self.timeout
        )
        versions = [
            item.value.get("version")
            for item in (found.value.values() if found else [])
            if isinstance(getattr(item, "value", None), dict)
        ]
        versions = [v for v in versions if isinstance(v, int)]
        return max(versions) if versions else None

    async def fetch(self, boundary: int, version: int, codec) -> None:
        """Install basis ``version`` of ``boundary`` into ``codec``, fetching it if not held."""
        key = (boundary, version)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # many frames may ask at once; fetch once
            if key not in self.held:
                self.held[key] = await self._download(boundary, version)
                await self.announce()
            if version not in codec.versions:
                codec.basis_from_payload(self.held[key])

    async def _download(self, boundary: int, version: int) -> Payload:
        holders = [h for h in await self.holders(boundary, version) if h[0] != self.peer_id]
        random.shuffle(holders)
        for peer, want in holders:
            try:
                req = Frame(kind="basis", run_id=self.run_id, boundary=boundary, basis_version=version)
                (reply,), _, nbytes = await request(
                    self.p2p, self.wire, peer, HANDLER, req, self.timeout, self.run_id
                )
                if reply.kind != "basis" or digest(reply.tensors) != want:
                    raise FrameError("basis reply does not match its announced digest")
                self.bytes_fetched += nbytes
                log.info("fetched basis %d:%d from %s (%d bytes)", boundary, version, peer[:12], nbytes)
                return reply.tensors
            # P2PDaemonError: p2pd refused the stream, e.g. a holder that left (handlers removed)
            # before its DHT record expired; ask the next holder
            except (
                FrameError,
                asyncio.TimeoutError,
                OSError,
                ConnectionError,
                KeyError,
                P2PDaemonError,
            ) as e:
                log.info("basis fetch from %s failed: %s", peer[:12], e)
        raise BasisUnavailable(f"no live peer holds basis {version} of boundary {boundary}")
