"""Atomic per-node checkpoints: a directory per save, verified by digests, never torn.

Layout of ``DIR`` (a node's checkpoint directory, e.g. ``<state_dir>/checkpoints/<run_id>``)::

    ckpt-00000120/            one complete checkpoint (name = inner step, 8 digits)
        weights.safetensors   the stage's state_dict
        optimizer.safetensors every tensor of the inner optimizer's state_dict
        extra-<name>.safetensors   every tensor of each extra state (filter, outer, compressor...)
        manifest.json         counters, the non-tensor structure of every state, a sha256 per file,
                              and a digest of the manifest itself
    ckpt-00000160/
    latest                    "ckpt-00000160\\n": the newest complete checkpoint (for people and tools)

A save writes everything into a hidden temporary directory, fsyncs every file and the
directory, renames it to its final name (atomic on POSIX), fsyncs the parent, then replaces
``latest`` (tmp + fsync + ``os.replace``) and only then deletes checkpoints beyond the newest
``keep``. A process killed at any instant therefore leaves the previous checkpoints intact
and at most a temporary directory behind, which is never a candidate and is removed by the
next save. Loading verifies the manifest digest and every file's size and sha256 before
parsing a byte of safetensors; a checkpoint that fails is skipped with one warning line and
the next older one is tried. Order is by the manifest's save sequence, not by step, so a
node whose step count went back (it adopted a peer's state on rejoin) still resumes from
its newest save. A second save at an existing step gets the name ``ckpt-<step>.<n>``.

Torch state dicts (optimizer, filter, outer optimizer, PowerSGD) are nested dicts/lists of
tensors and scalars with int or str keys: ``flatten_state`` turns one into a flat
``{name: tensor}`` map plus a JSON skeleton, ``unflatten_state`` rebuilds it exactly (floats
are stored as hex, tuples stay tuples, int keys stay ints).

Fault injection for crash tests of whole node processes (``bench/reliability/chaos.py``; a fixture cannot
reach into another process): the environment variable ``VNODE_CKPT_FAULT=<point>:<action>``
acts at the points ``"written"`` (all files fsynced in the temporary directory, before the
rename) and ``"renamed"`` (after the rename, before ``latest`` is updated), with action
``exit`` (``os._exit(17)``), ``kill`` (SIGKILL to itself) or ``pause`` (print
``VNODE_CKPT_PAUSED <point> <path>`` on stderr and sleep, so a harness can SIGKILL it).

(Over 400 lines on purpose: one on-disk format, written, verified, loaded, retained and fault-tested
here, so the argument that no write is ever torn reads in one place.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("node")

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "latest"
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
FAULT_ENV = "VNODE_CKPT_FAULT"
FAULT_POINTS = ("written", "renamed")

_CKPT_RE = re.compile(r"^ckpt-(\d{8,})(?:\.(\d+))?$")
_TMP_RE = re.compile(r"^\.(?:tmp|trash)-.*-(\d+)-[0-9a-f]{8}$|^\.latest\.tmp-(\d+)$")
_EXTRA_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_CHUNK = 1 << 20
LAST_ERROR = "last-error"  # why this directory's last save failed (removed by the next that works)
# beyond the tensors' bytes: safetensors headers, the manifest, the file system's blocks
SLACK_BYTES = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk failed verification (one line)."""


class NoSpace(CheckpointError):
    """Too little free space for a write: checked before the first byte, so nothing is half-written."""


def check_free_space(path: str | os.PathLike, need: int, what: str, fix: str) -> None:
    """Raise ``NoSpace`` naming ``path``, the bytes ``what`` needs and the bytes free, and ``fix``,
    unless the file system holding ``path`` (or its nearest existing parent) has ``need`` free."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise NoSpace(f"{what} needs {_gb(need)} in {path}, {_gb(free)} free there: {fix}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def tensor_bytes(files: Mapping[str, Mapping[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for tensors in files.values() for t in tensors.values())


@dataclass
class Checkpoint:
    """A verified checkpoint, tensors on the CPU.

    Restore with ``stage.load_state_dict(ck.stage_state)``, ``opt.load_state_dict(ck.optimizer_state)``,
    ``filter.load_state_dict(ck.extra_states["filter"])`` and so on; ``counters`` is the dict saved.
    """

    path: Path
    step: int
    seq: int
    stage_state: dict[str, torch.Tensor]
    optimizer_state: dict
    extra_states: dict[str, dict]
    counters: dict


# ---------------------------------------------------------------------- state flattening


def flatten_state(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into ``({name: tensor}, json_skeleton)``.

    Supported: dict (str or int keys), list, tuple, Tensor, None, bool, int, float, str.
    Tensor names are ``prefix + running index``. Raises TypeError naming the path of
    anything else (a torch.dtype, a custom object...).
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"{prefix}{len(tensors)}"
            tensors[name] = x
            return {"t": name}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return {"f": x.hex()}
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state key {k!r} at {where or '/'} is not a str or int")
                items.append([k, enc(v, f"{where}/{k}")])
            return {"d": items}
        if isinstance(x, list):
            return {"l": [enc(v, f"{where}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"u": [enc(v, f"{where}/{i}") for i, v in enumerate(x)]}
        raise TypeError(f"cannot checkpoint a {type(x).__name__} at {where or '/'}")

    skeleton = enc(state, "")
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Inverse of ``flatten_state``. Raises CheckpointError on a skeleton that does not fit."""

    def dec(s: Any) -> Any:
        if s is None or isinstance(s, (bool, int, str)):
            return s
        if isinstance(s, dict) and len(s) == 1:
            ((tag, v),) = s.items()
            if tag == "t":
                if v not in tensors:
                    raise CheckpointError(f"state refers to a missing tensor {v!r}")
                return tensors[v]
            if tag == "f" and isinstance(v, str):
                return float.fromhex(v)
            if tag == "d" and isinstance(v, list):
                out = {}
                for item in v:
                    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                        raise CheckpointError("malformed dict entry in a state skeleton")
                    out[item[0]] = dec(item[1])
                return out
            if tag == "l" and isinstance(v, list):
                return [dec(x) for x in v]
            if tag == "u" and isinstance(v, list):
                return tuple(dec(x) for x in v)
        raise CheckpointError(f"malformed state skeleton node {str(s)[:80]}")

    return dec(skeleton)


def clone_state(state: Any) -> Any:
    """A deep copy of a nested state with every tensor detached and cloned to the CPU.

    Take it where the tensors are consistent (the compute thread, right after an optimizer
    step, no microbatch in flight), then hand it to ``save_checkpoint`` on another thread
    while training continues.
    """
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(clone_state(v) for v in state)
    return state


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor name {name!r} is not a str")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if t.numel():
            seen.add(ptr)
        out[name] = t
    return out


# ---------------------------------------------------------------------- file-system helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"sha256": h.hexdigest(), "bytes": size}


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fault(point: str, path: Path) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    want, _, action = spec.partition(":")
    if want != point:
        return
    if action == "exit":
        os._exit(17)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "pause":
        print(f"VNODE_CKPT_PAUSED {point} {path}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)


# ---------------------------------------------------------------------- listing


def _parse_name(name: str) -> tuple[int, int] | None:
    m = _CKPT_RE.match(name)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def _read_manifest(path: Path) -> dict:
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError as e:
        raise CheckpointError(f"no readable manifest ({type(e).__name__})") from None
    try:
        man = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError("manifest is not valid JSON") from None
    if not isinstance(man, dict) or not isinstance(man.get("digest"), str):
        raise CheckpointError("manifest has no digest")
    body = {k: v for k, v in man.items() if k != "digest"}
    if hashlib.sha256(_canonical(body)).hexdigest() != man["digest"]:
        raise CheckpointError("manifest digest mismatch")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {body.get('format')!r} is not {FORMAT}")
    for key, typ in (("step", int), ("seq", int), ("files", dict), ("counters", dict), ("structure", dict)):
        if not isinstance(body.get(key), typ):
            raise CheckpointError(f"manifest field {key!r} missing or malformed")
    return body


def _manifest_seq(path: Path) -> int:
    try:
        return _read_manifest(path)["seq"]
    except CheckpointError:
        return -1


def list_checkpoints(dirpath: str | os.PathLike) -> list[Path]:
    """Checkpoint directories (complete by name, not yet verified), newest save first.

    A directory whose manifest does not verify sorts last (it will fail ``load_checkpoint``).
    """
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        parsed = _parse_name(p.name)
        if parsed is not None and p.is_dir():
            found.append((_manifest_seq(p), parsed, p))
    found.sort(key=lambda x: (x[0], x[1]), reverse=True)
    return [p for _, _, p in found]


# ---------------------------------------------------------------------- saving


def save_checkpoint(
    dirpath: str | os.PathLike,
    *,
    stage_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping,
    extra_states: Mapping[str, Mapping] | None = None,
    counters: Mapping[str, Any],
    step: int | None = None,
    keep: int = 2,
) -> Path:
    """Write one complete checkpoint atomically and return its directory.

    ``step`` defaults to ``counters["inner_step"]``. ``extra_states`` maps a short name
    (``[A-Za-z0-9_]``: "filter", "outer", "compressor"...) to a state_dict. ``counters`` must
    be JSON (ints, floats, strings, lists, dicts). Older checkpoints beyond the newest
    ``keep`` are deleted only after this one and ``latest`` are durable. Blocking I/O: call it
    off the event loop, at a point where the tensors do not change (see the README/runtime).
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    extra_states = dict(extra_states or {})
    for name in extra_states:
        if not _EXTRA_NAME_RE.match(name):
            raise ValueError(f"extra state name {name!r} must match [A-Za-z0-9_]{{1,64}}")
    counters = dict(counters)
    if step is None:
        step = counters.get("inner_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int (got {step!r})")
    try:
        _canonical(counters)
    except (TypeError, ValueError) as e:
        raise ValueError(f"counters must be plain JSON: {e}") from None

    root = Path(dirpath)
    root.mkdir(parents=True, exist_ok=True)
    _cleanup_stale(root)
    existing = list_checkpoints(root)
    seq = max([time.time_ns()] + [_manifest_seq(p) + 1 for p in existing])

    # everything tensor-valued, with the skeletons that put it back together
    files: dict[str, dict[str, torch.Tensor]] = {WEIGHTS_FILE: _prepare_tensors(stage_state)}
    opt_tensors, opt_skel = flatten_state(optimizer_state)
    files[OPTIMIZER_FILE] = _prepare_tensors(opt_tensors)
    structure: dict[str, Any] = {"optimizer": opt_skel, "extra": {}}
    for name, sd in extra_states.items():
        t, skel = flatten_state(sd)
        files[f"extra-{name}.safetensors"] = _prepare_tensors(t)
        structure["extra"][name] = skel

    # the old checkpoints go only once this one is durable, so the whole of it must fit now
    check_free_space(
        root,
        tensor_bytes(files) + SLACK_BYTES,
        f"the checkpoint of step {step}",
        "free space there, lower --keep-checkpoints, or point --state-dir at a larger disk "
        "(the previous checkpoints are kept)",
    )
    base = f"ckpt-{step:08d}"
    tmp = root / f".tmp-{base}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        digests = {}
        for fname, tensors in files.items():
            save_file(tensors, str(tmp / fname))
            digests[fname] = _fsync_and_hash(tmp / fname)
        body = {
            "format": FORMAT,
            "step": step,
            "seq": seq,
            "created": time.time(),
            "counters": counters,
            "files": digests,
            "structure": structure,
        }
        manifest = {**body, "digest": hashlib.sha256(_canonical(body)).hexdigest()}
        with open(tmp / MANIFEST, "wb") as f:
            f.write(_canonical(manifest))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _fault("written", tmp)

        final = root / base
        n = 0
        while final.exists():  # a second save at this step: never replace a complete checkpoint
            n += 1
            final = root / f"{base}.{n}"
        os.rename(tmp, final)
    except OSError as e:  # a disk that filled meanwhile: one line, nothing left half-written
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"writing the checkpoint of step {step} in {root} failed: {e.strerror or e}"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _fault("renamed", final)

    tmp_ptr = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp_ptr, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_ptr, root / LATEST)
    _fsync_dir(root)

    _retain(root, final, keep)
    (root / LAST_ERROR).unlink(missing_ok=True)
    return final


def note_failure(dirpath: str | os.PathLike, why: str) -> None:
    """Leave why a save failed in ``dirpath`` (``LAST_ERROR``), for export to name the real cause
    when no checkpoint is there; best effort: on a full disk even this small write may fail."""
    try:
        Path(dirpath).mkdir(parents=True, exist_ok=True)
        (Path(dirpath) / LAST_ERROR).write_text(why + "\n")
    except OSError:
        pass


def last_failure(dirpath: str | os.PathLike) -> str | None:
    """The failure ``note_failure`` left in ``dirpath``, if any."""
    try:
        return (Path(dirpath) / LAST_ERROR).read_text().strip() or None
    except OSError:
        return None


def _retain(root: Path, newest: Path, keep: int) -> None:
    others = [p for p in list_checkpoints(root) if p != newest]
    for old in others[keep - 1 :]:
        _remove_dir(root, old)


def _remove_dir(root: Path, path: Path) -> None:
    # rename first: a crash mid-delete must not leave a half-deleted dir under a checkpoint name
    trash = root / f".trash-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except OSError as e:
        log.warning("could not remove old checkpoint %s: %s", path, e)
        return
    shutil.rmtree(trash, ignore_errors=True)


def _cleanup_stale(root: Path) -> None:
    """Remove temporary and trash directories left by writers that died."""
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if not m or _pid_alive(int(m.group(1) or m.group(2))):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------------- loading


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check the manifest digest and every file's size and sha256; return the manifest.

    Raises CheckpointError (one line) on any defect. Reads every byte once.
    """
    path = Path(path)
    man = _read_manifest(path)
    listed = man["files"]
    if WEIGHTS_FILE not in listed or OPTIMIZER_FILE not in listed:
        raise CheckpointError("manifest lists no weights or optimizer file")
    for fname, meta in listed.items():
        if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
            raise CheckpointError(f"manifest lists a bad file name {fname!r}")
        if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"manifest entry for {fname} is malformed")
        f = path / fname
        try:
            size = f.stat().st_size
        except OSError:
            raise CheckpointError(f"{fname} is missing") from None
        if size != meta.get("bytes"):
            raise CheckpointError(f"{fname} has {size} bytes, manifest says {meta.get('bytes')}")
        digest, _ = _hash_file(f)
        if digest != meta["sha256"]:
            raise CheckpointError(f"{fname} is corrupted (sha256 mismatch)")
    return man


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify and load one checkpoint directory; raises CheckpointError on any defect."""
    path = Path(path)
    man = verify_checkpoint(path)
    structure = man["structure"]
    try:
        stage_state = load_file(str(path / WEIGHTS_FILE))
        optimizer_state = unflatten_state(load_file(str(path / OPTIMIZER_FILE)), structure["optimizer"])
        extra = {}
        for name, skel in structure.get("extra", {}).items():
            fname = f"extra-{name}.safetensors"
            if fname not in man["files"]:
                raise CheckpointError(f"extra state {name!r} has no file")
            extra[name] = unflatten_state(load_file(str(path / fname)), skel)
    except CheckpointError:
        raise
    except Exception as e:  # a digest-valid but unparsable file: written by a buggy or foreign tool
        raise CheckpointError(f"unreadable checkpoint data: {type(e).__name__}: {e}") from None
    return Checkpoint(
        path=path,
        step=man["step"],
        seq=man["seq"],
        stage_state=stage_state,
        optimizer_state=optimizer_state,
        extra_states=extra,
        counters=man["counters"],
    )


def load_latest(dirpath: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None if there is none.

    Each one that fails is skipped with a one-line warning; it is never loaded.
    """
    for path in list_checkpoints(dirpath):
        try:
            return load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path.name, e)
    return None


def read_latest_pointer(dirpath: str | os.PathLike) -> str | None:
    """The name ``latest`` points at (informational: ``load_latest`` does not rely on it)."""
    try:
        name = (Path(dirpath) / LATEST).read_text().strip()
    except OSError:
        return None
    return name if _parse_name(name) else None


def checkpoint_dir(state_dir: str | os.PathLike, run_id: str, stage: int) -> str:
    """Where a node keeps its checkpoints of one run and stage."""
    return os.path.join(state_dir, "checkpoints", run_id, f"stage-{stage}")


def newest_for_run(state_dir: str | os.PathLike, run_id: str) -> Checkpoint | None:
    """This node's newest complete checkpoint of ``run_id``, whatever stage it served."""
    root = Path(state_dir) / "checkpoints" / run_id
    found = [ck for d in sorted(root.glob("stage-*")) if (ck := load_latest(d)) is not None]
    return max(found, key=lambda ck: ck.path.stat().st_mtime, default=None)
