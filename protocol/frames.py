"""Wire frames between pipeline stages: a msgpack map with a versioned header and tensors.

A frame is validated completely before any tensor memory is allocated: the byte length is
checked against the limit before unpacking, msgpack is told the same limits, every header
field is type-checked, and each tensor's declared dtype and shape must match its byte
length exactly. Anything else raises a ``FrameError`` subclass naming the cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import torch

from protocol.version import PROTOCOL_VERSION

MAX_FRAME_BYTES = 256 * 1024 * 1024  # a 32 x 2048 x 2048 fp32 activation is 512 MiB; stay well below RAM
MAX_TENSORS = 16
MAX_DIMS = 4
MAX_PATH = 64
# elements of any declared shape, zero dimensions aside: a (T, H) activation a node could decode
# (8 GiB of fp32); beyond it torch's own size arithmetic overflows int64 and raises untyped errors
MAX_ELEMENTS = 2**31

KINDS = (
    "forward",
    "backward",
    "error",
    "basis",
    "weights",
    "anchor",
    "scape",
    "tied",
    "metrics",
    "dialback",
    "relay",
    "punch",
)

# Only these dtypes may arrive over the wire (no object, no complex, nothing exotic).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class FrameError(ValueError):
    """A frame was rejected; ``code`` is a stable short name sent back in error replies."""

    code = "malformed"


class FrameTooLarge(FrameError):
    code = "too_large"


class UnknownVersion(FrameError):
    code = "version"


class WrongRun(FrameError):
    code = "wrong_run"


class BadDtype(FrameError):
    code = "dtype"


class ShapeMismatch(FrameError):
    code = "shape"


class NonFinite(FrameError):
    code = "non_finite"


class MalformedFrame(FrameError):
    code = "malformed"


class OutOfRange(FrameError):
    """Finite values so large (or labels so far outside the vocabulary) that they would poison training."""

    code = "range"


# Activations and gradients beyond this are refused: their squares overflow fp32 in RMSNorm
# and in the loss, so one hostile frame would make a whole step's gradients non-finite.
MAX_ABS_VALUE = 1e6


def check_magnitude(t: torch.Tensor, what: str, limit: float = MAX_ABS_VALUE) -> None:
    if t.numel() and t.is_floating_point() and float(t.abs().max()) > limit:
        raise OutOfRange(f"{what} holds values beyond ±{limit:g}")


def check_payload_magnitude(
    tensors: dict[str, torch.Tensor], what: str, limit: float = MAX_ABS_VALUE
) -> None:
    """Every floating payload tensor within ±limit, checked *before* decoding.

    Why on the payload, not the decoded activations: every codec's decode is linear with a
    bounded operator (identity, scatter, orthonormal basis, int × checked scale), so a bounded
    payload gives a bounded input, and the payload of a compressed link is ~20x smaller than
    the dense tensor (the decoded check was a fifth of a masked node's CPU time).
    """
    for t in tensors.values():
        check_magnitude(t, what, limit)


@dataclass
class Frame:
    """One message on a pipeline link."""

    kind: str  # forward | backward | error
    run_id: str
    step: int = 0
    microbatch: int = 0
    boundary: int = 0
    path: list[str] = field(default_factory=list)  # peer ids the microbatch has visited
    codec: str = "dense"
    seed: int = 0  # 64-bit mask seed; codecs without randomness ignore it
    basis_version: int = 0
    shape: list[int] = field(default_factory=list)  # shape of the dense tensor the payload encodes
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, float | int | str] = field(default_factory=dict)  # loss, tokens, error text...


def _tensor_to_wire(t: torch.Tensor) -> dict:
    t = t.detach().contiguous().cpu()
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise BadDtype(f"dtype {t.dtype} cannot be sent; allowed: {', '.join(WIRE_DTYPES)}")
    # bf16 has no numpy twin: send its raw bytes through a same-width integer view.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return {"d": name, "s": list(t.shape), "b": raw.numpy().tobytes()}


def encode_frame(frame: Frame, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    if frame.kind not in KINDS:
        raise MalformedFrame(f"unknown frame kind {frame.kind!r}")
    body = {
        "v": PROTOCOL_VERSION,
        "k": frame.kind,
        "run": frame.run_id,
        "step": int(frame.step),
        "mb": int(frame.microbatch),
        "bd": int(frame.boundary),
        "path": list(frame.path),
        "codec": frame.codec,
        "seed": int(frame.seed) & 0xFFFFFFFFFFFFFFFF,
        "bv": int(frame.basis_version),
        "shape": [int(x) for x in frame.shape],
        "t": {k: _tensor_to_wire(v) for k, v in frame.tensors.items()},
        "meta": dict(frame.meta),
    }
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > max_bytes:
        raise FrameTooLarge(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    return data


def _expect(cond: bool, msg: str, err: type[FrameError] = MalformedFrame) -> None:
    if not cond:
        raise err(msg)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_dims(shape, what: str) -> None:
    _expect(
        isinstance(shape, list) and len(shape) <= MAX_DIMS, f"{what}: shape must be a list of <= {MAX_DIMS}"
    )
    _expect(
        all(_is_int(x) and 0 <= x < 2**31 for x in shape),
        f"{what}: shape entries must be small ints",
        ShapeMismatch,
    )
    # zeros aside: [2^31-1, 2^31-1, 2^31-1, 0] holds no bytes, but torch cannot even build its view
    _expect(
        math.prod(x for x in shape if x) <= MAX_ELEMENTS,
        f"{what}: shape {shape} has more than {MAX_ELEMENTS} elements",
        ShapeMismatch,
    )


def _tensor_from_wire(name: str, spec, check_finite: bool) -> torch.Tensor:
    _expect(isinstance(spec, dict) and set(spec) == {"d", "s", "b"}, f"tensor {name!r}: malformed spec")
    dtype_name, shape, raw = spec["d"], spec["s"], spec["b"]
    _expect(
        isinstance(dtype_name, str) and dtype_name in WIRE_DTYPES,
        f"tensor {name!r}: dtype {dtype_name!r} not allowed",
        BadDtype,
    )
    _check_dims(shape, f"tensor {name!r}")
    _expect(isinstance(raw, bytes), f"tensor {name!r}: data must be bytes")
    dtype = WIRE_DTYPES[dtype_name]
    numel = math.prod(shape)
    _expect(
        numel * dtype.itemsize == len(raw),
        f"tensor {name!r}: {len(raw)} bytes do not hold shape {shape} of {dtype_name}",
        ShapeMismatch,
    )
    if dtype == torch.bfloat16:
        t = (
            torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16)
            if raw
            else torch.empty(0, dtype=torch.bfloat16)
        )
    else:
        t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    t = t.reshape(shape)
    if check_finite and dtype_name in _FLOAT_DTYPES and not bool(torch.isfinite(t).all()):
        raise NonFinite(f"tensor {name!r} holds NaN or Inf")
    return t


def decode_frame(
    data: bytes,
    *,
    run_id: str | None = None,
    max_bytes: int = MAX_FRAME_BYTES,
    check_finite: bool = True,
) -> Frame:
    """Parse and validate a frame. Raises a ``FrameError`` subclass on any defect."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedFrame("frame must be bytes")
    if len(data) > max_bytes:
        raise FrameTooLarge(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=max_bytes,
            max_str_len=4096,
            max_array_len=MAX_PATH + MAX_DIMS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"not a msgpack frame ({type(e).__name__})") from None
    _expect(isinstance(body, dict), "frame must be a map")
    version = body.get("v")
    _expect(
        type(version) is int and version == PROTOCOL_VERSION,  # not 1.0, not True
        f"protocol version {version!r} is not {PROTOCOL_VERSION}; upgrade the older node",
        UnknownVersion,
    )
    kind = body.get("k")
    _expect(kind in KINDS, f"unknown frame kind {kind!r}")
    run = body.get("run")
    _expect(isinstance(run, str), "run id must be a string")
    if run_id is not None and run != run_id:
        raise WrongRun(f"frame for run {run!r}, this node serves run {run_id!r}")
    for key in ("step", "mb", "bd", "seed", "bv"):
        _expect(_is_int(body.get(key)) and 0 <= body[key] < 2**64, f"header field {key!r} must be a uint64")
    path = body.get("path")
    _expect(
        isinstance(path, list) and len(path) <= MAX_PATH and all(isinstance(p, str) for p in path),
        "path must be a list of peer ids",
    )
    _expect(isinstance(body.get("codec"), str), "codec must be a string")
    _check_dims(body.get("shape"), "frame")
    tensors = body.get("t")
    _expect(isinstance(tensors, dict) and len(tensors) <= MAX_TENSORS, "tensors must be a small map")
    meta = body.get("meta")
    _expect(
        isinstance(meta, dict)
        and all(isinstance(k, str) for k in meta)
        and all(isinstance(v, (int, float, str)) for v in meta.values()),
        "meta must map str to scalars",
    )
    decoded = {}
    for name, spec in tensors.items():
        _expect(isinstance(name, str), "tensor names must be strings")
        decoded[name] = _tensor_from_wire(name, spec, check_finite)
    return Frame(
        kind=kind,
        run_id=run,
        step=body["step"],
        microbatch=body["mb"],
        boundary=body["bd"],
        path=path,
        codec=body["codec"],
        seed=body["seed"],
        basis_version=body["bv"],
        shape=body["shape"],
        tensors=decoded,
        meta=meta,
    )


def error_frame(run_id: str, err: Exception) -> Frame:
    code = err.code if isinstance(err, FrameError) else "internal"
    return Frame(kind="error", run_id=run_id, meta={"code": code, "message": str(err)[:500]})


LABEL_TENSORS = ("labels", "label_at")  # the names a FORWARD frame's labels travel under


def _code_labels(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """2 bytes per label when the vocabulary fits (id + 1, 0 = ignored), else int32."""
    if vocab < 2**16 - 1:
        coded = (ids.to(torch.int32) + 1).clamp_(min=0)  # IGNORE_INDEX (-100) -> 0
        return torch.where(coded > 32767, coded - 65536, coded).to(torch.int16)
    return ids.to(torch.int32)


def _uncode_labels(t: torch.Tensor, ignore_index: int) -> torch.Tensor:
    if t.dtype == torch.int16:
        ids = (t.to(torch.int32) & 0xFFFF) - 1
        return torch.where(ids < 0, torch.full_like(ids, ignore_index), ids).long()
    if t.dtype in (torch.int32, torch.int64):
        return t.long()
    raise BadDtype(f"labels must be int16 or int32, not {t.dtype}")


_BITS = 2 ** torch.arange(8, dtype=torch.int32)


def pack_labels(labels: torch.Tensor, vocab: int, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """A microbatch's labels on the wire, whichever of two layouts is smaller.

    Dense: one coded label per position (``labels``, shape (batch, tokens)). Sparse: a bit per
    position saying whether it is labelled (``label_at``, uint8) and the labelled positions' ids
    only (``labels``, 1-D). Fine-tuning labels only the answers (a tenth of the positions or
    fewer), so the sparse layout costs ~0.3 B/token where the dense one costs 2 -- at a ≥ 10x
    link that is the difference between 2% and 0.3% of its bytes. Pretraining labels every
    position and stays dense.
    """
    labelled = labels != ignore_index
    width = 2 if vocab < 2**16 - 1 else 4
    n, n_lab = labels.numel(), int(labelled.sum())
    if -(-n // 8) + n_lab * width >= n * width:
        return {"labels": _code_labels(labels, vocab)}
    flat = labelled.reshape(-1)
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.int32)
    bits[:n] = flat.to(torch.int32)
    return {
        "label_at": (bits.view(-1, 8) * _BITS).sum(1).to(torch.uint8),
        "labels": _code_labels(labels.reshape(-1)[flat], vocab),
    }


def check_labels(tensors: dict[str, torch.Tensor], shape: list[int]) -> None:
    """The labels of a FORWARD frame whose activations are ``shape`` (batch, tokens, ...) are
    present and sized for it (header-level: no label is decoded). ShapeMismatch otherwise."""
    labels, at = tensors.get("labels"), tensors.get("label_at")
    rows_tokens = list(shape[:2])
    if labels is None:
        raise ShapeMismatch("labels missing")
    if at is None:
        if list(labels.shape) != rows_tokens:
            raise ShapeMismatch(f"labels {list(labels.shape)} are not (batch, tokens) {rows_tokens}")
        return
    n = rows_tokens[0] * rows_tokens[1] if len(rows_tokens) == 2 else -1
    if at.dtype != torch.uint8 or list(at.shape) != [-(-n // 8)] or labels.dim() != 1:
        raise ShapeMismatch(f"sparse labels are not sized for (batch, tokens) {rows_tokens}")


def unpack_labels(
    tensors: dict[str, torch.Tensor], shape: list[int], ignore_index: int = -100
) -> torch.Tensor:
    """(batch, tokens) labels from either layout of ``pack_labels`` (checked by ``check_labels``)."""
    check_labels(tensors, shape)
    labels, at = tensors["labels"], tensors.get("label_at")
    if at is None:
        return _uncode_labels(labels, ignore_index)
    rows, tokens = shape[0], shape[1]
    flat = ((at.to(torch.int32).unsqueeze(1) & _BITS) != 0).reshape(-1)
    if bool(flat[rows * tokens :].any()) or int(flat.sum()) != labels.numel():
        raise ShapeMismatch("sparse labels: the position bits do not match the labels sent")
    out = torch.full((rows * tokens,), ignore_index, dtype=torch.long)
    out[flat[: rows * tokens]] = _uncode_labels(labels, ignore_index)
    return out.reshape(rows, tokens)
