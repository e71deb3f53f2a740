"""`python -m node export`: assemble the swarm's model into one Hugging Face checkpoint.

Two sources of the stages' weights:

* live peers (``--peers``): one ready fast peer per stage (the most advanced) streams its
  weights in fp32 over the swarm's own authenticated ``vnode.weights`` streams; the last
  frame carries a sha256 of the snapshot (``node.swarm.weights.weights_digest``), checked here.
* checkpoint directories (``--checkpoints``): the newest checkpoint of every stage, verified
  by its manifest digests (``node.model.checkpoint``); stage layer ranges follow from the layer
  counts in stage order.

The stage-local names (``layers.j.*`` of stage [start, end), ``embed_tokens``, ``norm``,
``lm_head``) map onto the whole model's names. The checkpoint is written one stage at a time
(``write_stages``: a LoRA stage's base is read from the model's files for that stage alone and the
adapters merged onto it), in shards with an index, so the export never holds the whole model; the
run's base model fixes config, tokenizer and generation config, and its content hash must match
the run's. It is written to a hidden temporary directory next to ``--out`` and renamed into place,
so ``--out`` is either absent or complete. ``swarm_export.json`` in it names the run and
each stage's inner step.

Tied embeddings: a model that ties ``embed_tokens`` and ``lm_head`` trains one copy on the
head and one on the tail. Equal copies export tied; different copies export untied
(``tie_word_embeddings=False``, both tensors), so the file computes what the swarm computes.

(Over 400 lines: both export forms (live peers, checkpoints) share the assembly, digest checks and
the atomic Hugging Face directory writer.)
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from node.model.adapters import AdapterError, by_whole_name, is_adapter, merge_into, save_peft_adapter
from node.model.checkpoint import (
    LAST_ERROR,
    SLACK_BYTES,
    CheckpointError,
    _pid_alive,
    check_free_space,
    last_failure,
    list_checkpoints,
    load_checkpoint,
)
from node.model.loading import BUNDLED, BUNDLED_NAME, ModelSource, open_model
from node.net.rpc import open_stream
from node.net.transport import close_quietly
from node.net.wire import Wire
from node.swarm.weights import WEIGHTS_HANDLER, weights_digest
from protocol.frames import MAX_FRAME_BYTES, Frame, FrameError, decode_frame, encode_frame
from protocol.settings import FinetuneSettings, RecordError, parse_part

log = logging.getLogger("node")

EXPORT_JSON = "swarm_export.json"
ADAPTER_DIR = "adapter"  # a LoRA run's peft adapter directory, inside the merged checkpoint
EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
_LOCAL = {"embed_tokens.weight": EMBED, "norm.weight": NORM, "lm_head.weight": HEAD}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_TINY_RE = re.compile(r"^tiny-llama-(\d+)x(\d+)$")


class ExportError(RuntimeError):
    """A one-line reason the export failed, with the fix."""


@dataclass
class StagePart:
    """The weights of one stage, under its own (stage-local) parameter names."""

    index: int
    start: int
    end: int
    step: int
    tensors: dict[str, torch.Tensor]
    source: str  # peer id or checkpoint path
    digest: str = ""


@dataclass
class Assembled:
    tokenizer: object | None
    tied: bool
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- names and assembly


def global_name(name: str, start: int) -> str:
    """Stage-local parameter name -> the whole model's name (layer j of a stage starting at ``start``)."""
    m = _LAYER_RE.match(name)
    if m:
        return f"model.layers.{start + int(m.group(1))}.{m.group(2)}"
    if name in _LOCAL:
        return _LOCAL[name]
    raise ExportError(f"stage tensor {name!r} has no place in a Llama-family model")


def layer_count(tensors: dict[str, torch.Tensor]) -> int:
    idx = [int(m.group(1)) for n in tensors if (m := _LAYER_RE.match(n))]
    return max(idx) + 1 if idx else 0


def adapters_of(parts: list[StagePart]) -> dict[str, torch.Tensor]:
    """Every stage's LoRA adapters under whole-model names (empty for a full fine-tuning run)."""
    return {k: v for p in parts for k, v in by_whole_name(p.tensors, p.start).items()}


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def stage_state(
    part: StagePart, source: ModelSource, ranges: list[list[int]], finetune
) -> dict[str, torch.Tensor]:
    """Stage ``part``'s tensors of the exported model, in fp32 under whole-model names.

    A full fine-tuning stage holds all its tensors; a LoRA stage holds its adapters only, and they
    are merged onto its base, read from the model's files for this stage alone. Raises ExportError
    naming a tensor the stage lacks, one the model does not have, or a shape that does not fit.
    """
    from node.model.stages import build_stage

    want = dict(build_stage(source._meta_model(), ranges, part.index).named_parameters())
    adapters = by_whole_name(part.tensors, part.start)
    out: dict[str, torch.Tensor] = {}
    if adapters:
        if finetune is None or finetune.mode != "lora":
            raise ExportError("the stages hold LoRA adapters but the run names no LoRA settings")
        base = source.load_stage(ranges, part.index, torch.device("cpu"), torch.float32)
        out = {global_name(n, part.start): p.detach() for n, p in base.named_parameters()}
        del base
    for name, t in part.tensors.items():
        if is_adapter(name):
            continue
        if name not in want:
            raise ExportError(f"stage {part.index} holds {name!r}, which the run's model does not have")
        if tuple(t.shape) != tuple(want[name].shape):
            raise ExportError(
                f"stage {part.index}: {name} has shape {list(t.shape)}, the model {list(want[name].shape)}"
            )
        out[global_name(name, part.start)] = t.detach().to(torch.float32).cpu()
    if adapters:
        try:
            merge_into(out, adapters, finetune)
        except AdapterError as e:
            raise ExportError(f"cannot merge the adapters: {e}") from None
    missing = sorted({global_name(n, part.start) for n in want} - set(out))
    if missing:
        raise ExportError(
            f"stage {part.index} lacks {len(missing)} tensors of the model (first: {missing[0]}); a stage "
            "is missing or was split differently"
        )
    return out


def check_cover(parts: list[StagePart], layers: int) -> None:
    spans = sorted((p.start, p.end) for p in parts)
    if spans[0][0] != 0 or spans[-1][1] != layers or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ExportError(f"the stages' layers {spans} do not cover the model's {layers}; a stage is missing")


SHARD_BYTES = 1 << 30  # the exported checkpoint's shards: a stage's tensors in files of at most this


def _plan_shards(
    parts: list[StagePart], source: ModelSource, shard_bytes: int
) -> list[tuple[int, list[str]]]:
    """(stage index, whole-model tensor names) of every shard, in order: a stage's tensors in files
    of at most ``shard_bytes`` (safetensors serialises a file in memory, so a shard bounds that copy)."""
    from node.model.stages import build_stage

    ranges = [[p.start, p.end] for p in parts]
    plan: list[tuple[int, list[str]]] = []
    for part in parts:
        meta = build_stage(source._meta_model(), ranges, part.index)
        size = 0
        plan.append((part.index, []))
        for name, t in meta.named_parameters():
            n = t.numel() * 4
            if size and size + n > shard_bytes:
                plan.append((part.index, []))
                size = 0
            plan[-1][1].append(global_name(name, part.start))
            size += n
    return plan


def write_stages(
    path: Path, parts: list[StagePart], source: ModelSource, finetune, shard_bytes: int = SHARD_BYTES
) -> bool:
    """The merged model into ``path`` as a sharded Hugging Face checkpoint, one stage at a time (its
    tensors in shards of at most ``shard_bytes``), so at most one stage is in memory, never the whole
    base in fp32; with its index, config and generation config. Returns whether the embeddings stay tied.

    Tied embeddings: a model that ties ``embed_tokens`` and ``lm_head`` trains one copy on the
    head and one on the tail; equal copies export tied (lm_head not stored), different ones untied.
    """
    from safetensors.torch import save_file

    config = copy.deepcopy(source.config)
    tie_config = bool(getattr(config, "tie_word_embeddings", False))
    check_cover(parts, config.num_hidden_layers)
    parts = sorted(parts, key=lambda p: p.index)
    ranges = [[p.start, p.end] for p in parts]
    plan = _plan_shards(parts, source, shard_bytes)
    weight_map: dict[str, str] = {}
    total, embed, tied = 0, None, tie_config
    for part in parts:
        state = stage_state(part, source, ranges, finetune)
        if tie_config:
            if EMBED in state:
                embed = _digest(state[EMBED])
            if HEAD in state:
                if embed is not None and _digest(state[HEAD]) == embed:
                    del state[HEAD]  # the same tensor as the embedding: stored once, as a tied model is
                else:
                    tied = False
        for j, (index, names) in enumerate(plan):
            shard = {n: state.pop(n).contiguous() for n in names if index == part.index and n in state}
            if not shard:
                continue
            file = f"model-{j + 1:05d}-of-{len(plan):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update(dict.fromkeys(shard, file))
            del shard
        if state:
            raise ExportError(
                f"stage {part.index} holds tensors the model has no place for: {sorted(state)[:3]}"
            )
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1
        )
    )
    if tie_config:
        config.tie_word_embeddings = tied
    config.dtype = torch.float32
    config.save_pretrained(path)
    gen = source.path / "generation_config.json" if source.path is not None else None
    if gen is not None and gen.exists():
        shutil.copy(gen, path / "generation_config.json")
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(path)
    return tied


def export_bytes(source: ModelSource) -> int:
    """The fp32 bytes of the exported model (the free-space check before the first byte)."""
    return sum(p.numel() * 4 for p in source.skeleton.parameters())


# ---------------------------------------------------------------------- writing


def _clean_stale(out: Path) -> None:
    """Temporary directories of earlier exports to ``out`` whose process died (SIGKILL, power loss)."""
    pat = re.compile(rf"^\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    if not out.parent.is_dir():
        return
    for p in out.parent.iterdir():
        m = pat.match(p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def write_export(
    out: str | os.PathLike,
    write: Callable[[Path], None],
    weights: int,
    tokenizer,
    info: dict,
    replace: bool = False,
    adapter: Callable[[Path], None] | None = None,
) -> Path:
    """Write the HF checkpoint (``write(dir)``, ``weights`` bytes) into a hidden temporary sibling of
    ``out``, then rename it into place.

    Any exception (an interrupt included) removes the temporary directory.
    """
    out = Path(out).absolute()
    if out.exists() and not replace:
        raise ExportError(f"{out} already exists; pass a new --out, or --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    # the whole export must fit before the first byte: a full disk would leave only a stack trace
    try:
        check_free_space(
            out.parent,
            weights + SLACK_BYTES,
            f"the export to {out}",
            "free space, or pass an --out on a larger disk",
        )
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        write(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_JSON).write_text(json.dumps(info, indent=1))
        if adapter is not None:
            adapter(tmp / ADAPTER_DIR)
        if out.exists():  # --force: move the old one aside first; a directory rename cannot replace
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        if isinstance(e, OSError):  # the disk filled meanwhile, a permission: one line, its cause
            raise ExportError(f"writing the export to {out} failed: {e.strerror or e}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- the base model


def model_spec(run_model_name: str) -> str | None:
    """The ``--model`` value that loads a run's model, from the name in its run record (None: unknown)."""
    if run_model_name == BUNDLED_NAME:
        return BUNDLED
    m = _TINY_RE.match(run_model_name)
    return f"tiny:{m.group(1)}:{m.group(2)}" if m else None


def load_base(spec: str, seed: int, ranges: list[list[int]], want_hash: str, what: str):
    """(source, tokenizer) of ``spec``, whose run hash over ``ranges`` must be the run's (no weight is
    loaded: export reads each stage's base from it as it writes that stage)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours is the transfer's; transformers' load/save bars are noise
    source = open_model(spec, seed=seed)
    got = source.run_hashes(ranges)[0]  # the run record's model hash: config and every stage's tensors
    if got != want_hash:
        raise ExportError(
            f"--model {spec} ({source.name}, hash {got[:12]}) is not the model {what} trains (hash "
            f"{want_hash[:12]}); pass the same --model (and --seed for tiny models) as the swarm"
        )
    return source, source.tokenizer()


# ---------------------------------------------------------------------- from checkpoints


def _stage_dirs(path: Path) -> list[Path]:
    """Directories holding ckpt-* checkpoints under ``path`` (a state dir, checkpoints dir or stage dir)."""
    if (path / "manifest.json").exists():
        return [path.parent]
    if any(p.name.startswith("ckpt-") for p in path.iterdir()):
        return [path]
    return sorted({p.parent for p in path.rglob("ckpt-*") if p.is_dir()})


def parts_from_checkpoints(dirs: list[str], run_id: str | None = None) -> tuple[list[StagePart], dict]:
    """The newest checkpoint of every stage in ``dirs`` (node state dirs, checkpoint dirs).

    Every stage 0..S-1 must be present, the last holding ``lm_head``; the newest checkpoint of a
    stage must verify (a corrupted one is an error, not silently replaced by an older one).
    Returns the parts and the counters (run id, model hash) they share.
    """
    found: dict[str, dict[int, tuple]] = {}
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise ExportError(f"--checkpoints {d}: not a directory")
        for sd in _stage_dirs(p):
            ckpts = list_checkpoints(sd)
            if not ckpts:
                continue
            try:
                ck = load_checkpoint(ckpts[0])
            except CheckpointError as e:
                raise ExportError(
                    f"checkpoint {ckpts[0]} failed verification: {e}; remove it to export the older one"
                ) from None
            c = ck.counters
            key = str(c.get("run_id"))
            prev = found.setdefault(key, {}).get(int(c["stage"]))
            if prev is None or ck.step > prev[0].step:
                found[key][int(c["stage"])] = (ck, c)
    if not found:
        raise ExportError(f"no checkpoints found in {' '.join(dirs)}{_write_failures(dirs)}")
    if run_id is None:
        if len(found) > 1:
            raise ExportError(f"checkpoints of several runs ({', '.join(sorted(found))}): pass --run-id")
        run_id = next(iter(found))
    if run_id not in found:
        raise ExportError(f"no checkpoints of run {run_id!r} in {' '.join(dirs)} (found: {', '.join(found)})")
    stages = found[run_id]
    hashes = {c.get("model_hash") for _, c in stages.values()}
    if len(hashes) > 1:
        raise ExportError(f"the checkpoints of run {run_id} are of different models")
    parts, start = [], 0
    for i in range(max(stages) + 1):
        if i not in stages:
            raise ExportError(
                f"no checkpoint of stage {i} of run {run_id} in {' '.join(dirs)}; add the state "
                f"directory of a node that served it{_write_failures(dirs)}"
            )
        ck, c = stages[i]
        n = c["layers"][1] - c["layers"][0] if "layers" in c else layer_count(ck.stage_state)
        parts.append(StagePart(i, start, start + n, ck.step, dict(ck.stage_state), str(ck.path)))
        start += n
    finetune = _finetune_of(stages[0][1])
    # a LoRA stage holds adapters only: assembly checks the layers cover the model
    full = finetune.mode == "full"
    if full and "lm_head.weight" not in parts[-1].tensors and "norm.weight" not in parts[-1].tensors:
        raise ExportError(
            f"no checkpoint of stage {len(parts)} or later (the tail is missing) of run {run_id} in "
            f"{' '.join(dirs)}; add the state directories of the nodes that served them"
        )
    return parts, {"run_id": run_id, "model_hash": hashes.pop(), "finetune": finetune}


def _write_failures(dirs: list[str]) -> str:
    """Why the nodes' last checkpoint writes failed, as a clause ('' if none did): a missing
    checkpoint is then explained by its cause (a full disk), not only by its absence."""
    failed = sorted({why for d in dirs for f in Path(d).rglob(LAST_ERROR) if (why := last_failure(f.parent))})
    return f"; a node's last checkpoint write failed: {failed[0]}" if failed else ""


def _finetune_of(counters: dict) -> FinetuneSettings:
    """The LoRA settings a checkpoint was trained with (full fine-tuning for older checkpoints)."""
    try:
        return parse_part("finetune", counters["finetune"]) if "finetune" in counters else FinetuneSettings()
    except RecordError as e:
        raise ExportError(f"checkpoint counters: {e}") from None


# ---------------------------------------------------------------------- from live peers


@dataclass
class _Visitor:
    """What a weights request needs of a node: its p2p, wire and run (``node.net.rpc.request`` style)."""

    p2p: object
    wire: Wire
    run_id: str


async def pull_stage(
    v: _Visitor, peer: str, index: int, timeout: float, progress=None
) -> tuple[int, dict, str]:
    """fp32 weights of one peer's stage: (its inner step, tensors, digest), digest checked."""
    # not rpc.request: the frames are read one by one, for the progress callback
    reader, writer = await open_stream(v.p2p, peer, WEIGHTS_HANDLER, timeout)
    named: dict[str, torch.Tensor] = {}
    try:
        req = Frame(kind="weights", run_id=v.run_id, meta={"dtype": "float32"})
        await v.wire.send(writer, encode_frame(req), timeout)
        while True:
            reply = decode_frame(await v.wire.recv(reader, MAX_FRAME_BYTES, timeout), run_id=v.run_id)
            if reply.kind == "error":  # refused (busy: its visitors' pulls are spent): say why
                raise FrameError(f"{reply.meta.get('code')}: {reply.meta.get('message', '')}")
            if reply.kind != "weights":
                raise FrameError(f"expected weights, got a {reply.kind} frame")
            named.update(reply.tensors)
            if progress is not None:
                progress(sum(t.numel() * t.element_size() for t in reply.tensors.values()))
            if reply.meta.get("last"):
                step, digest = reply.step, str(reply.meta.get("digest", ""))
                break
    finally:
        close_quietly(writer)
    if not digest:
        raise ExportError(f"peer {peer[:12]} of stage {index} sends no weights digest; it runs an older node")
    if weights_digest(named) != digest:
        raise ExportError(f"stage {index} from peer {peer[:12]}: weights digest mismatch")
    return step, named, digest


async def _pull_all(v: _Visitor, run, routes, bytes_per_stage: list[int], timeout: float) -> list[StagePart]:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    parts = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),  # stdout keeps only the result line
    ) as bar:
        for i, (start, end) in enumerate(run.stages):
            peers = sorted(
                ((p, r) for p, r in routes[i].items() if r.ready and r.circuit == "fast"),
                key=lambda kv: -kv[1].inner_step,
            )
            if not peers:
                raise ExportError(
                    f"stage {i} (layers {start}..{end - 1}) has no live peer; wait for one to join, or "
                    "export offline with --checkpoints"
                )
            task = bar.add_task(f"stage {i}", total=bytes_per_stage[i])
            last_error = ""
            for peer, _ in peers:
                bar.reset(task, total=bytes_per_stage[i])
                try:
                    step, named, digest = await pull_stage(
                        v, peer, i, timeout, progress=lambda n, t=task: bar.advance(t, n)
                    )
                    parts.append(StagePart(i, start, end, step, named, peer, digest))
                    break
                except (ExportError, FrameError, asyncio.TimeoutError, OSError, ConnectionError) as e:
                    last_error = str(e) or type(e).__name__
                    log.info("weights of stage %d from %s failed: %s", i, peer[:12], last_error)
            else:
                raise ExportError(f"no peer of stage {i} delivered its weights ({last_error})")
    return parts


def stage_bytes(base: torch.nn.Module, ranges: list[list[int]]) -> list[int]:
    """fp32 bytes of every stage's parameters (the progress bar's totals)."""
    size = {n: t.numel() * 4 for n, t in base.state_dict().items()}
    out = []
    for i, (start, end) in enumerate(ranges):
        n = sum(
            v
            for k, v in size.items()
            if (m := re.match(r"^model\.layers\.(\d+)\.", k)) and start <= int(m.group(1)) < end
        )
        n += size.get(EMBED, 0) if i == 0 else 0
        n += size.get(NORM, 0) + size.get(HEAD, 0) if i == len(ranges) - 1 else 0
        out.append(n)
    return out


def export_from_peers(
    out: str | os.PathLike,
    peers: list[str],
    run_id: str = "default",
    swarm_key: str | None = None,
    model: str | None = None,
    timeout: float = 60.0,
    replace: bool = False,
) -> Assembled:
    """Join the DHT as a visitor, pull every stage from a live peer, write the checkpoint to ``out``."""
    from node.config import NodeConfig
    from node.swarm.membership import (
        JoinError,
        read_run_record,
        read_stage_records_sync,
        remove_socket_dir,
        socket_dir,
        start_dht,
    )
    from protocol.auth import key_id, load_swarm_key

    key = load_swarm_key(swarm_key) if swarm_key else None
    sockdir = socket_dir(run_id)
    dht = None
    try:
        with tempfile.TemporaryDirectory() as state:
            # a throwaway identity: the exporter is a visitor, not a member
            cfg = NodeConfig(
                peers=peers, run_id=run_id, join_timeout=timeout, client_mode=True, state_dir=state
            )
            dht = start_dht(cfg)
            run = read_run_record(dht, run_id, timeout=timeout)
            if run is None:
                raise ExportError(
                    f"no run {run_id!r} found at {peers[0]} within {timeout:.0f}s; check --run-id"
                )
            if run.key_id and (key is None or key_id(key) != run.key_id):
                raise ExportError(
                    "this swarm only answers holders of its swarm key: pass --swarm-key FILE"
                    if key is None
                    else "--swarm-key is not this swarm's key (fingerprints differ)"
                )
            if run.mode != "finetune":
                raise ExportError(f"export handles fine-tuning runs; run {run_id} is a {run.mode} run")
            spec = model or model_spec(run.model_name)
            if spec is None:
                raise ExportError(
                    f"the run trains {run.model_name}: pass --model with that checkpoint directory"
                )
            base, tok = load_base(spec, run.seed, run.stages, run.model_hash, f"run {run_id}")
            routes = read_stage_records_sync(dht, run.run_id, len(run.stages))

            async def pull() -> list[StagePart]:
                p2p = await dht.replicate_p2p()
                v = _Visitor(p2p, Wire(key), run.run_id)
                return await _pull_all(v, run, routes, stage_bytes(base.skeleton, run.stages), timeout)

            parts = asyncio.run(pull())
    except JoinError as e:
        raise ExportError(str(e)) from None
    finally:
        if dht is not None:
            dht.shutdown()
        remove_socket_dir(sockdir)
    info = {"run_id": run.run_id, "model_hash": run.model_hash, "finetune": run.finetune}
    return _finish(out, parts, base, tok, info, "peers", replace)


def export_from_checkpoints(
    out: str | os.PathLike,
    dirs: list[str],
    run_id: str | None = None,
    model: str = BUNDLED,
    seed: int = 0,
    replace: bool = False,
) -> Assembled:
    """Assemble ``out`` offline from the newest checkpoint of every stage found in ``dirs``."""
    parts, run = parts_from_checkpoints(dirs, run_id)
    ranges = [[p.start, p.end] for p in parts]
    base, tok = load_base(model, seed, ranges, run["model_hash"], f"the checkpoints of run {run['run_id']}")
    return _finish(out, parts, base, tok, run, "checkpoints", replace)


def _finish(out, parts, base: ModelSource, tok, run: dict, source: str, replace: bool) -> Assembled:
    tie_config = bool(getattr(base.config, "tie_word_embeddings", False))
    finetune = run.get("finetune") or FinetuneSettings()
    adapters = adapters_of(parts)
    tied = tie_config

    def write(path: Path) -> None:
        nonlocal tied
        tied = write_stages(path, parts, base, finetune)

    info = {
        "run_id": run["run_id"],
        "base_model_hash": run["model_hash"],
        "source": source,
        "stages": [
            {"index": p.index, "layers": [p.start, p.end], "inner_step": p.step, "from": p.source}
            for p in parts
        ],
        "exported_at": time.time(),
    }
    adapter = None
    if adapters:  # the merged checkpoint, and the adapters alone for peft on the base model
        info["finetune"] = asdict(finetune)
        info["adapter"] = ADAPTER_DIR

        def adapter(path: Path) -> None:
            save_peft_adapter(path, adapters, finetune, str(getattr(base.config, "_name_or_path", "") or ""))

    def write_all(path: Path) -> None:
        write(path)
        # "untied": the base model ties them, but the head's and the tail's copies trained apart
        info["embeddings"] = "tied" if tied else "untied" if tie_config else "separate"

    write_export(out, write_all, export_bytes(base), tok, info, replace=replace, adapter=adapter)
    return Assembled(tok, tied, info)
