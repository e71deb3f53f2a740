"""Fuzz the frame decoder and a stage's forward handler with hostile input, at scale.

A real ``StageRuntime`` for the tail of a 2-stage ``tiny:2`` model (it computes the loss
locally, so no network is needed) receives, through ``handle_stream`` with an in-memory
``asyncio.StreamReader`` and a writer that collects the reply, and through ``serve_forward``:
random bytes, truncated and bit-flipped valid frames, huge declared sizes, NaN payloads,
wrong shapes/codecs/boundaries/dtypes/runs/versions. Every case is classified:

* ``backward`` / ``error:<code>``: a reply came back (the code is checked against the
  defect's expected code when the case is a known defect),
* ``no_reply``: the handler swallowed an exception and closed the stream without an answer
  (the sender then waits for its hop deadline), with the swallowed exception's message,
* ``escaped``: an exception left ``handle_stream``; ``hang``: no answer within the deadline,
* ``poisoned``: the case left non-finite parameter gradients behind (they would make the
  next inner step be skipped); ``nonfinite_reply``: a backward reply carried NaN/Inf.

``KNOWN_BUGS`` lists runtime defects found by this fuzzer (signatures of the swallowed
exception); they are reported separately from new crashes.

Run:  nice -n 10 .venv/bin/python -m bench.reliability.fuzz --cases 100000   (writes bench/results/fuzz.md)
The test suite (tests/test_fuzz_handlers.py) drives the same harness through hypothesis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import re
import resource
import sys
import time
import tracemalloc
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch

from protocol.frames import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameError,
    decode_frame,
)

RUN_ID = "r"
HIDDEN = 64
VOCAB = 512
PEER = "QmFuzzPeer"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "fuzz.md"

# Runtime defects this fuzzer found (node/runtime.py; see the report). A swallowed exception
# or a "busy" reply whose message matches is counted as that bug, not as a new crash.
KNOWN_BUGS: dict[str, re.Pattern] = {
    "labels_out_of_range": re.compile(r"Target -?\d+ is out of bounds"),
    "empty_dimension": re.compile(
        r"out of bounds for dimension \d+ with size 0|cannot reshape tensor of 0 elements|"
        r"reshape tensor of 0 elements|numel\(\) == 0|size 0"
    ),
}


# ---------------------------------------------------------------------- the runtime under test


def make_runtime(hop_timeout: float = 2.0, codec: str = "dense", bans: bool = False, codec_k: int = 16):
    """A tail-stage StageRuntime of ``tiny:2`` split [[0, 1], [1, 2]], without networking.

    ``codec``: the run's link codec (``dense``, ``pca`` with a basis installed as a joiner would
    fetch it, ``lowrank``, ...). ``bans``: the node's real ban list; off, one fuzzing peer can send
    every case (banning it would hide the replies under test).
    """
    from compression.pca import fit_basis
    from node.config import NodeConfig
    from node.model.loading import load_model
    from node.model.stages import build_stage
    from node.net.bans import BanList
    from node.runtime import StageRuntime
    from node.stage.links import codec_settings
    from protocol.records import RunRecord

    ranges = [[0, 1], [1, 2]]
    model = load_model("tiny:2")[0]
    stage = build_stage(model, ranges, 1)
    desc = codec_settings(NodeConfig(codec=codec, codec_k=codec_k, pca_dtype="int8"), model)
    run = RunRecord(
        run_id=RUN_ID,
        model_name="tiny-llama-2x64",
        model_hash="fuzz",
        num_layers=2,
        hidden=HIDDEN,
        stages=ranges,
        codec=desc,
        # the limits the defect table is written against (a batch of 5 is over them)
        microbatch=4,
        batch_tokens=1024,
    )
    cfg = NodeConfig(run_id=RUN_ID, hop_timeout=hop_timeout, max_inflight=4)
    rt = StageRuntime(cfg, run, 1, stage, None, "QmTest")
    main = rt.linkio.link_in.main
    if main.needs_basis:  # the basis a joiner fetches before serving (version 1)
        mean, v = fit_basis(torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(5)), codec_k)
        main.set_basis(mean, v, 1)
    if not bans:
        rt.bans = BanList(threshold=10**9)
    return rt


class FakeWriter:
    """Collects what the handler writes; ``drain`` and ``close`` as an asyncio.StreamWriter."""

    def __init__(self):
        self.buf = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.buf += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def reply(self) -> bytes | None:
        if len(self.buf) < 8:
            return None
        n = int.from_bytes(self.buf[:8], "big")
        return bytes(self.buf[8 : 8 + n]) if len(self.buf) == 8 + n else None


class _Capture(logging.Handler):
    """The runtime logs what ``handle_stream`` swallowed at DEBUG; keep it per case."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:
            self.messages.append(str(record.msg))


_capture = _Capture()


def install_capture() -> None:
    lg = logging.getLogger("node")
    if _capture not in lg.handlers:
        lg.addHandler(_capture)
    lg.setLevel(logging.DEBUG)


# ---------------------------------------------------------------------- frames


def _wire_tensor(t: torch.Tensor) -> dict:
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}.get(t.dtype)
    name = name or str(t.dtype).removeprefix("torch.")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return {"d": name, "s": list(t.shape), "b": raw.contiguous().numpy().tobytes()}


def valid_body(rng: random.Random, batch: int | None = None, seq: int | None = None, codec=None) -> dict:
    """A forward frame body the tail accepts: activations through ``codec`` (bf16 dense when None),
    int16 packed labels."""
    from compression.codec import LinkContext

    batch = batch or rng.randint(1, 4)
    seq = seq or rng.randint(2, 16)
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    h = torch.randn(batch, seq, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = -100
    packed = ((labels.to(torch.int32) + 1).clamp_(min=0)).to(torch.int16)
    seed, version = rng.getrandbits(64), 0
    if codec is None:
        payload, codec_id = {"h": h.to(torch.bfloat16)}, "dense"
    else:
        version = codec.version or 0
        payload = codec.encode_forward(h, LinkContext(seed=seed, basis_version=version))
        codec_id = codec.codec_id
    return {
        "v": PROTOCOL_VERSION,
        "k": "forward",
        "run": RUN_ID,
        "step": rng.randrange(2**20),
        "mb": rng.getrandbits(56),
        "bd": 0,
        "path": ["QmHead"],
        "codec": codec_id,
        "seed": seed,
        "bv": version,
        "shape": [batch, seq, HIDDEN],
        "t": {**{k: _wire_tensor(v) for k, v in payload.items()}, "labels": _wire_tensor(packed)},
        "meta": {},
    }


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def prefixed(data: bytes, declared: int | None = None) -> bytes:
    return (len(data) if declared is None else declared).to_bytes(8, "big") + data


def _bin32_bomb() -> bytes:
    # a map whose "b" is a bin32 declaring 2 GiB, followed by 3 bytes: msgpack must not allocate it
    return b"\x81\xa1b\xc6\x80\x00\x00\x00abc"


def _with(body: dict, **kw) -> dict:
    out = dict(body)
    out.update(kw)
    return out


def _tensor(body: dict, name: str, spec: dict | None = None, **kw) -> dict:
    t = dict(body["t"])
    t[name] = dict(t[name], **kw) if spec is None else spec
    return _with(body, t=t)


def _resized(rng: random.Random, batch: int, seq: int) -> dict:
    return valid_body(rng, batch=batch, seq=seq)


def _nan_h(body: dict, value: float) -> dict:
    b, s, h = body["shape"]
    t = torch.randn(b, s, h).to(torch.bfloat16)
    t.view(-1)[random.Random(s).randrange(t.numel())] = value
    return _tensor(body, "h", _wire_tensor(t))


def _labels(body: dict, t: torch.Tensor) -> dict:
    return _tensor(body, "labels", _wire_tensor(t))


# name -> (build(rng) -> wire bytes for handle_stream, expected reply). Expected is a set of
# acceptable outcomes: "backward" or "error:<code>". Known bugs list today's (wrong) outcome too.
def _defects() -> dict[str, tuple]:
    V = valid_body
    D: dict[str, tuple] = {
        "ok": (lambda r: prefixed(pack(V(r))), {"backward"}),
        "ok_max_size": (lambda r: prefixed(pack(V(r, batch=4, seq=64))), {"backward"}),
        "empty_stream": (lambda r: b"", {"error:malformed"}),
        "short_header": (lambda r: b"\x00\x00\x01", {"error:malformed"}),
        "declared_too_large": (
            lambda r: prefixed(b"x" * 16, declared=MAX_FRAME_BYTES + 1 + r.randrange(2**40)),
            {"error:too_large"},
        ),
        "declared_max_u64": (lambda r: b"\xff" * 8 + b"abc", {"error:too_large"}),
        "declared_large_truncated": (
            lambda r: prefixed(pack(V(r))[:100], declared=MAX_FRAME_BYTES - r.randrange(1024)),
            {"error:malformed"},
        ),
        "truncated_frame": (
            lambda r: (lambda d: prefixed(d[: r.randrange(len(d))], declared=len(d)))(pack(V(r))),
            {"error:malformed"},
        ),
        "frame_cut_short": (
            lambda r: (lambda d: prefixed(d[: r.randrange(1, len(d))]))(pack(V(r))),
            {"error:malformed", "error:shape"},
        ),
        "not_msgpack": (lambda r: prefixed(r.randbytes(r.randrange(1, 200))), {"error:malformed"}),
        "msgpack_bin32_bomb": (lambda r: prefixed(_bin32_bomb()), {"error:malformed"}),
        "not_a_map": (lambda r: prefixed(pack([1, 2, 3])), {"error:malformed"}),
        "wrong_run": (lambda r: prefixed(pack(_with(V(r), run="other"))), {"error:wrong_run"}),
        "wrong_version": (
            lambda r: prefixed(pack(_with(V(r), v=r.choice([0, 2, 99, "1", None, 2**63])))),
            {"error:version"},
        ),
        # 1.0 == 1 and True == 1 in Python: the version must be an int, not merely equal to one
        "version_not_int": (
            lambda r: prefixed(pack(_with(V(r), v=r.choice([1.0, True])))),
            {"error:version"},
        ),
        "missing_version": (
            lambda r: prefixed(pack({k: v for k, v in V(r).items() if k != "v"})),
            {"error:version"},
        ),
        "unknown_kind": (lambda r: prefixed(pack(_with(V(r), k="exploit"))), {"error:malformed"}),
        "backward_kind": (
            lambda r: prefixed(pack(_with(V(r), k=r.choice(["backward", "error", "weights"])))),
            {"error:malformed"},
        ),
        "bad_header_int": (
            lambda r: prefixed(
                pack(
                    _with(
                        V(r), **{r.choice(["step", "mb", "bd", "seed", "bv"]): r.choice([-1, "x", 1.5, None])}
                    )
                )
            ),
            {"error:malformed"},
        ),
        "path_too_long": (lambda r: prefixed(pack(_with(V(r), path=["Qm"] * 65))), {"error:malformed"}),
        "meta_not_scalar": (lambda r: prefixed(pack(_with(V(r), meta={"x": [1]}))), {"error:malformed"}),
        "too_many_tensors": (
            lambda r: prefixed(
                pack(_with(V(r), t={f"x{i}": _wire_tensor(torch.zeros(1)) for i in range(17)}))
            ),
            {"error:malformed"},
        ),
        "bad_dtype": (
            lambda r: prefixed(
                pack(_tensor(V(r), "h", d=r.choice(["float64", "complex64", "bool", "object", "", "qint8"])))
            ),
            {"error:dtype"},
        ),
        "bytes_do_not_match_shape": (
            lambda r: prefixed(pack(_wrong_length(V(r), r))),
            {"error:shape"},
        ),
        "huge_declared_tensor": (
            lambda r: prefixed(pack(_tensor(V(r), "h", s=[2**31 - 1] * 4, b=b"\x00" * 8))),
            {"error:shape"},
        ),
        "negative_dim": (lambda r: prefixed(pack(_tensor(V(r), "h", s=[-1, 64]))), {"error:shape"}),
        "too_many_dims": (lambda r: prefixed(pack(_tensor(V(r), "h", s=[1] * 5))), {"error:malformed"}),
        "nan_payload": (lambda r: prefixed(pack(_nan_h(V(r), float("nan")))), {"error:non_finite"}),
        "inf_payload": (
            lambda r: prefixed(pack(_nan_h(V(r), r.choice([math.inf, -math.inf])))),
            {"error:non_finite"},
        ),
        "header_not_hidden": (
            lambda r: prefixed(pack(_with(V(r), shape=[1, 8, r.choice([32, 63, 65, 128])]))),
            {"error:shape"},
        ),
        "header_rank": (lambda r: prefixed(pack(_with(V(r), shape=[8, HIDDEN]))), {"error:shape"}),
        "payload_not_header": (
            lambda r: (lambda b: prefixed(pack(_with(b, shape=[b["shape"][0], b["shape"][1] + 1, HIDDEN]))))(
                V(r)
            ),
            {"error:shape", "error:malformed"},
        ),
        "labels_missing": (
            lambda r: (lambda b: prefixed(pack(_with(b, t={"h": b["t"]["h"]}))))(V(r)),
            {"error:shape"},
        ),
        "labels_wrong_shape": (
            lambda r: prefixed(pack(_labels(V(r, batch=2, seq=8), torch.zeros(2, 7, dtype=torch.int16)))),
            {"error:shape"},
        ),
        "labels_dtype": (
            lambda r: prefixed(pack(_labels(V(r, batch=2, seq=8), torch.zeros(2, 8, dtype=torch.uint8)))),
            {"error:dtype"},
        ),
        "batch_over_limit": (lambda r: prefixed(pack(_resized(r, 5, 8))), {"error:shape"}),
        "seq_over_limit": (lambda r: prefixed(pack(_resized(r, 1, 65))), {"error:shape"}),
        "wrong_boundary": (
            lambda r: prefixed(pack(_with(V(r), bd=r.choice([1, 2, 7, 2**64 - 1])))),
            {"error:malformed"},
        ),
        "unknown_codec": (
            lambda r: prefixed(pack(_with(V(r), codec=r.choice(["mask", "pca", "", "DENSE", "x" * 300])))),
            {"error:malformed"},
        ),
        "payload_missing": (
            lambda r: (lambda b: prefixed(pack(_with(b, t={"labels": b["t"]["labels"]}))))(V(r)),
            {"error:malformed"},
        ),
        # ---- defects the first fuzz run found unrejected (fixed; see bench/results/fuzz.md)
        "labels_out_of_range": (
            lambda r: prefixed(
                pack(
                    _labels(
                        V(r, batch=2, seq=8),
                        torch.full((2, 8), r.choice([VOCAB + 1, 32767, -5 + 1]), dtype=torch.int16),
                    )
                )
            ),
            {"error:range"},
        ),
        "zero_seq": (
            lambda r: prefixed(pack(_resized(r, 1, 1) | {"shape": [1, 0, HIDDEN], "t": _zero_t(1, 0)})),
            {"error:shape"},
        ),
        "zero_batch": (
            lambda r: prefixed(pack(_resized(r, 1, 1) | {"shape": [0, 4, HIDDEN], "t": _zero_t(0, 4)})),
            {"error:shape"},
        ),
        "huge_finite_values": (
            lambda r: prefixed(pack(_big_h(V(r, batch=2, seq=8), r))),
            {"error:range", "error:dtype"},  # dtype when the huge values come as fp32 on a bf16 run
        ),
        "integer_activations": (
            lambda r: prefixed(pack(_int_h(V(r, batch=2, seq=8), r))),
            {"error:dtype"},
        ),
    }
    return D


def _zero_t(batch: int, seq: int) -> dict:
    return {
        "h": _wire_tensor(torch.zeros(batch, seq, HIDDEN, dtype=torch.bfloat16)),
        "labels": _wire_tensor(torch.zeros(batch, seq, dtype=torch.int16)),
    }


def _wrong_length(body: dict, rng: random.Random) -> dict:
    right = len(body["t"]["h"]["b"])
    n = rng.choice([0, 1, right - 1, right + 1, right + 2, rng.randrange(0, 4 * right)])
    return _tensor(body, "h", b=b"\x00" * (n if n != right else right + 2))


def _big_h(body: dict, rng: random.Random) -> dict:
    b, s, h = body["shape"]
    t = torch.randn(b, s, h) * rng.choice([1e30, 3e38])
    return _tensor(body, "h", _wire_tensor(t.clamp(-3.3e38, 3.3e38)))


def _int_h(body: dict, rng: random.Random) -> dict:
    b, s, h = body["shape"]
    return _tensor(body, "h", _wire_tensor(torch.full((b, s, h), 10**18, dtype=torch.int64)))


DEFECTS = _defects()

KNOWN_BUG_NOTES = """## Runtime defects the first 100k run found (all fixed since; the cases above pin them)

- `labels_out_of_range`: label ids outside [0, vocab) pass `_check_forward`; the tail's
  cross-entropy raises IndexError, which `handle_stream` swallows (`except Exception`) and
  closes the stream with no reply: the sender waits for its hop deadline, and the frame is
  not counted as rejected.
- `empty_dimension`: a 0 batch or 0 sequence length passes `_check_forward`; seq 0 fails
  the same way (no reply), batch 0 is answered `busy` instead of `shape`.
- non-finite gradients: finite but huge activations (|x| up to 3e38, bf16 or fp32) are
  accepted; the backward leaves NaN/Inf in the parameters' .grad (the node's next inner step,
  with every honest microbatch accumulated in it, is then skipped) and the backward reply
  carries NaN/Inf.
- lax: integer activations (int8..int64) are accepted by the dense codec; `v: 1.0` and
  `v: true` pass the version check (`==`)."""
BUG_DEFECTS = ("labels_out_of_range", "zero_seq", "zero_batch", "huge_finite_values", "integer_activations")


# ---------------------------------------------------------------------- running one case


@dataclass
class Outcome:
    kind: str  # backward | error | no_reply | escaped | hang | bad_reply
    code: str | None = None
    detail: str = ""
    poisoned: bool = False
    nonfinite_reply: bool = False
    bug: str | None = None
    seconds: float = 0.0
    messages: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.kind == "error":
            return f"error:{self.code}"
        if self.kind == "no_reply":
            return f"no_reply:{self.bug or 'unknown'}"
        return self.kind


def classify_bug(text: str) -> str | None:
    for name, pat in KNOWN_BUGS.items():
        if pat.search(text):
            return name
    return None


def _grads_finite(rt) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in rt.params)


def _reset_grads(rt) -> None:
    rt.opt.zero_grad(set_to_none=True)


async def run_stream(rt, wire: bytes, *, eof: bool = True, timeout: float = 30.0) -> Outcome:
    """Feed ``wire`` to ``rt.handle_stream`` and classify what it answered."""
    reader = asyncio.StreamReader(limit=2**16)
    if wire:
        reader.feed_data(wire)
    if eof:
        reader.feed_eof()
    writer = FakeWriter()
    info = types.SimpleNamespace(peer_id=PEER)
    _capture.messages = []
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(rt.handle_stream(info, reader, writer), timeout)
    except asyncio.TimeoutError:
        return Outcome("hang", detail=f"no answer within {timeout}s", seconds=time.perf_counter() - t0)
    except Exception as e:  # anything leaving the handler is a crash
        return Outcome("escaped", detail=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    messages = list(_capture.messages)
    poisoned = not _grads_finite(rt)
    if poisoned:
        _reset_grads(rt)  # keep the next case independent of this one
    data = writer.reply()
    if data is None:
        text = " | ".join(messages)
        return Outcome(
            "no_reply", detail=text[-300:], bug=classify_bug(text), poisoned=poisoned, seconds=seconds
        )
    try:
        reply = decode_frame(data, run_id=RUN_ID, check_finite=False)
    except FrameError as e:
        return Outcome("bad_reply", detail=str(e), seconds=seconds)
    if reply.kind == "error":
        msg = str(reply.meta.get("message", ""))
        code = str(reply.meta.get("code"))
        bug = classify_bug(msg) if code in ("busy", "internal") else None
        return Outcome("error", code=code, detail=msg[:300], bug=bug, poisoned=poisoned, seconds=seconds)
    nonfinite = any(
        t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in reply.tensors.values()
    )
    return Outcome(reply.kind, poisoned=poisoned, nonfinite_reply=nonfinite, seconds=seconds)


async def run_serve(rt, data: bytes, timeout: float = 30.0) -> Outcome:
    """Decode ``data`` and, if it decodes, call ``rt.serve_forward`` directly."""
    try:
        frame = decode_frame(data, run_id=RUN_ID)
    except FrameError as e:
        return Outcome("error", code=e.code, detail=str(e)[:300])
    t0 = time.perf_counter()
    try:
        reply = await asyncio.wait_for(rt.serve_forward(frame), timeout)
    except asyncio.TimeoutError:
        return Outcome("hang", detail=f"serve_forward: no answer within {timeout}s")
    except FrameError as e:
        return Outcome("error", code=e.code, detail=str(e)[:300], seconds=time.perf_counter() - t0)
    except RuntimeError as e:  # handle_stream turns these into "busy"
        text = f"{type(e).__name__}: {e}"
        return Outcome("error", code="busy", detail=text[:300], bug=classify_bug(text))
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        bug = classify_bug(text)
        return Outcome("no_reply" if bug else "escaped", detail=text[:300], bug=bug)
    finally:
        if not _grads_finite(rt):
            _reset_grads(rt)
    return Outcome(reply.kind, seconds=time.perf_counter() - t0)


def decode_only(data: bytes) -> Outcome:
    try:
        decode_frame(data, run_id=RUN_ID)
    except FrameError as e:
        return Outcome("error", code=e.code)
    except Exception as e:
        return Outcome("escaped", detail=f"decode_frame: {type(e).__name__}: {e}")
    return Outcome("decoded")


# ---------------------------------------------------------------------- random mutations


MUTATION_OPS = 6


def apply_mutations(data: bytes, ops: list[tuple[int, int, bytes]]) -> bytes:
    """Apply ``(op, position, bytes)`` edits: 0 flip a bit, 1 overwrite a byte, 2 truncate,
    3 insert, 4 delete a run, 5 splice 4 bytes from elsewhere. Positions wrap around."""
    b = bytearray(data)
    for op, pos, val in ops:
        if not b:
            b += val or b"\x00"
            continue
        i = pos % len(b)
        v = val or b"\x00"
        if op == 0:
            b[i] ^= 1 << (v[0] % 8)
        elif op == 1:
            b[i] = v[0]
        elif op == 2:
            del b[i:]
        elif op == 3:
            b[i:i] = v
        elif op == 4:
            del b[i : i + 1 + v[0] % 16]
        else:
            j = (pos // len(b) + v[0]) % len(b)
            b[i : i + 4] = b[j : j + 4]
    return bytes(b)


_INTERESTING = bytes([0x00, 0xFF, 0x7F, 0x80, 0xC6, 0xDD, 0xDF, 0xC1, 0xC0, 0xCF])


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A random handful of ``apply_mutations`` edits."""
    ops = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        op = rng.randrange(MUTATION_OPS)
        if op == 1 and rng.random() < 0.5:
            val = bytes([rng.choice(_INTERESTING)])
        else:
            val = rng.randbytes(rng.randrange(1, 16))
        ops.append((op, rng.getrandbits(32), val))
    return apply_mutations(data, ops)


def huge_declared_cases() -> list[tuple[str, bytes]]:
    """Stream messages whose headers claim huge sizes but carry little: must cost nothing."""
    small = pack(valid_body(random.Random(0), batch=1, seq=2))
    return [
        ("length>limit", prefixed(small, declared=MAX_FRAME_BYTES + 1)),
        ("length=2^64-1", b"\xff" * 8 + small),
        ("length=limit,short", prefixed(small, declared=MAX_FRAME_BYTES)),
        ("bin32=2GiB", prefixed(_bin32_bomb())),
        ("array32", prefixed(b"\xdd\xff\xff\xff\xff" + b"\x00" * 16)),
        ("map32", prefixed(b"\xdf\xff\xff\xff\xff" + b"\x00" * 16)),
        ("str32", prefixed(b"\x81\xdb\x7f\xff\xff\xff" + b"a" * 16)),
        ("tensor 2^31^4", prefixed(pack(_tensor(valid_body(random.Random(1)), "h", s=[2**31 - 1] * 4)))),
    ]


def measure_peak(coro_factory, loop) -> tuple[Outcome, int]:
    """Run one case under tracemalloc; return its outcome and the peak of Python allocations."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        out = loop.run_until_complete(coro_factory())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


# ---------------------------------------------------------------------- the bench


def _expected_ok(name: str, out: Outcome) -> bool:
    label = out.label
    return label in DEFECTS[name][1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout", type=float, default=30.0, help="per-case deadline (a hang past it is reported)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    t_build = time.perf_counter()
    rt = make_runtime(hop_timeout=2.0)
    install_capture()
    logging.getLogger("node").propagate = False
    build_s = time.perf_counter() - t_build
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    counts: Counter[str] = Counter()  # mix -> cases
    outcomes: Counter[str] = Counter()  # outcome label -> cases
    per_defect: dict[str, Counter] = {n: Counter() for n in DEFECTS}
    unexpected: list[str] = []
    crashes: list[str] = []
    hangs: list[str] = []
    bugs: Counter[str] = Counter()
    poisoned = nonfinite = 0
    slowest = 0.0

    mix = [("defect", 30), ("stream_mutation", 30), ("decode_random", 15), ("decode_mutation", 15),
           ("serve_mutation", 8), ("stream_random", 2)]  # fmt: skip
    names, weights = zip(*mix)
    defect_names = list(DEFECTS)
    base_frames = [pack(valid_body(random.Random(i))) for i in range(64)]

    # memory: huge declared sizes, measured once each
    peaks = []
    for name, wire in huge_declared_cases():
        out, peak = measure_peak(lambda w=wire: run_stream(rt, w, timeout=args.timeout), loop)
        peaks.append((name, out.label, peak))

    t0 = time.perf_counter()
    last_print = t0
    for i in range(args.cases):
        kind = rng.choices(names, weights)[0]
        counts[kind] += 1
        case_seed = rng.getrandbits(32)
        r = random.Random(case_seed)
        tag = f"{kind} seed={case_seed}"
        if kind == "defect":
            dname = r.choice(defect_names)
            tag = f"defect {dname} seed={case_seed}"
            out = loop.run_until_complete(run_stream(rt, DEFECTS[dname][0](r), timeout=args.timeout))
            per_defect[dname][out.label] += 1
            if out.kind not in ("escaped", "hang") and not _expected_ok(dname, out):
                unexpected.append(f"{tag}: got {out.label} ({out.detail[:120]})")
        elif kind == "stream_mutation":
            wire = prefixed(mutate(r.choice(base_frames), r))
            if r.random() < 0.1:
                wire = mutate(wire, r)  # the length prefix too
            out = loop.run_until_complete(run_stream(rt, wire, timeout=args.timeout))
        elif kind == "stream_random":
            out = loop.run_until_complete(
                run_stream(rt, r.randbytes(r.randrange(0, 512)), timeout=args.timeout)
            )
        elif kind == "decode_random":
            out = decode_only(r.randbytes(r.randrange(0, 1024)))
        elif kind == "decode_mutation":
            out = decode_only(mutate(r.choice(base_frames), r))
        else:
            out = loop.run_until_complete(
                run_serve(rt, mutate(r.choice(base_frames), r), timeout=args.timeout)
            )
        outcomes[out.label] += 1
        slowest = max(slowest, out.seconds)
        if out.bug:
            bugs[out.bug] += 1
        if out.poisoned:
            poisoned += 1
        if out.nonfinite_reply:
            nonfinite += 1
        if out.kind == "escaped" or (out.kind == "no_reply" and not out.bug) or out.kind == "bad_reply":
            crashes.append(f"{tag}: {out.label} {out.detail[:200]}")
        if out.kind == "hang":
            hangs.append(f"{tag}: {out.detail}")
        now = time.perf_counter()
        if now - last_print > 30:
            print(f"{i + 1}/{args.cases} cases, {(i + 1) / (now - t0):.0f}/s", file=sys.stderr, flush=True)
            last_print = now
    elapsed = time.perf_counter() - t0
    loop.close()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    lines = [
        "# Fuzz run: frame decoder and the tail stage's forward handler",
        "",
        f"Command: `python -m bench.reliability.fuzz --cases {args.cases} --seed {args.seed}` "
        f"(torch {torch.__version__}, 1 thread, `nice -n 10` on a shared 2-core machine).",
        "",
        f"- cases: **{args.cases}** in {elapsed:.0f} s = **{args.cases / elapsed:.0f} cases/s** "
        f"(runtime build {build_s:.1f} s); slowest case {slowest * 1000:.0f} ms; max RSS {rss_mb:.0f} MiB",
        f"- crashes (exception escaping the handler, or a swallowed exception with no reply that is not a "
        f"known bug): **{len(crashes)}**",
        f"- hangs (no answer within {args.timeout:.0f} s): **{len(hangs)}**",
        f"- defect cases answered with an unexpected code: **{len(unexpected)}**",
        f"- known runtime bugs hit: {dict(bugs) or 'none'}; cases leaving non-finite parameter "
        f"gradients (would skip the next inner step): {poisoned}; backward replies with NaN/Inf: {nonfinite}",
        "",
        "## Mix",
        "",
        "| case kind | cases |",
        "|---|---:|",
        *[f"| {k} | {counts[k]} |" for k in names],
        "",
        "## Outcomes",
        "",
        "| outcome | cases |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in outcomes.most_common()],
        "",
        "## Structured defects (through handle_stream)",
        "",
        "| defect | expected | observed |",
        "|---|---|---|",
        *[
            f"| {n} | {', '.join(sorted(DEFECTS[n][1]))} | "
            f"{', '.join(f'{k} x{v}' for k, v in per_defect[n].most_common())} |"
            for n in DEFECTS
        ],
        "",
        "## Huge declared sizes (Python allocation peak, tracemalloc)",
        "",
        "| case | outcome | peak |",
        "|---|---|---:|",
        *[f"| {n} | {label} | {peak / 1024:.0f} KiB |" for n, label, peak in peaks],
        "",
    ]
    lines += KNOWN_BUG_NOTES.splitlines() + [""]
    if crashes or hangs or unexpected:
        lines += ["## Findings", ""] + [f"- {x}" for x in (crashes + hangs + unexpected)[:50]] + [""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 1 if crashes or hangs else 0


if __name__ == "__main__":
    sys.exit(main())
