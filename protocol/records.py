"""DHT record schemas and key names.

Every value read from the DHT comes from a stranger, so it is parsed through ``from_dict``,
which checks types and ranges and raises ``RecordError`` (one line, naming the field).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from protocol.settings import (
    PARTS,
    AnchorSettings,
    DpSettings,
    FinetuneSettings,
    OuterSettings,
    RecordError,
    parse_part,
)
from protocol.version import PROTOCOL_VERSION

HEARTBEAT_S = 2.0  # the default --heartbeat; every DHT lifetime below is a count of beats
STAGE_RECORD_BEATS = 5  # expires after ~5 missed beats: a beat can queue behind MBs of frames
# Every live node re-publishes the run record every RUN_RECORD_BEATS // 3 beats, so two missed
# re-publishes are survived, while a run whose last node left is gone within this many beats.
RUN_RECORD_BEATS = 30


def stage_record_ttl(heartbeat_s: float = HEARTBEAT_S) -> float:
    """Seconds a stage record lives in the DHT: a peer that stops beating looks gone after it."""
    return STAGE_RECORD_BEATS * heartbeat_s


def run_record_ttl(heartbeat_s: float = HEARTBEAT_S) -> float:
    """Seconds the run record lives in the DHT unless a live node re-publishes it."""
    return RUN_RECORD_BEATS * heartbeat_s


def run_key(run_id: str) -> str:
    return f"vnode.{run_id}.run"


def stage_key(run_id: str, stage: int) -> str:
    return f"vnode.{run_id}.stage.{stage}"


def basis_key(run_id: str, boundary: int) -> str:
    return f"vnode.{run_id}.basis.{boundary}"


def _check(record, types: dict[str, type | tuple]) -> None:
    for name, expected in types.items():
        value = getattr(record, name)
        # bool is an int in Python; a flag where a number belongs is still a malformed record
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise RecordError(f"record field {name!r} has type {type(value).__name__}")


@dataclass
class RunRecord:
    """What a run is: published once by the first node, verified by every joiner."""

    run_id: str
    model_name: str
    model_hash: str
    num_layers: int
    hidden: int
    stages: list[list[int]]  # [start, end) decoder-layer ranges, one per stage
    codec: dict = field(default_factory=lambda: {"codec": "dense", "wire_dtype": "bfloat16"})
    dense_every: int = 0  # periodic clean step: every K-th step crosses links uncompressed
    # the typed parts (protocol.settings); on the wire each is a plain map
    outer: OuterSettings = field(default_factory=OuterSettings)
    # finetune (a pretrained or given model) | pretrain (built from scratch from a config and the seed)
    mode: str = "finetune"
    dp: DpSettings = field(default_factory=DpSettings)
    anchor: AnchorSettings = field(default_factory=AnchorSettings)
    # full fine-tuning, or LoRA adapters over a frozen base (a record without it: full)
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip: float = 1.0
    seq_len: int = 64
    microbatch: int = 8
    # > 0: a microbatch holds as many examples as fit in this many padded tokens (``microbatch``
    # no longer caps it), so a link's per-frame costs (a lowrank basis, the header) are spread over
    # about this many tokens whatever the examples' length; 0: exactly ``microbatch`` examples
    microbatch_tokens: int = 0
    batch_tokens: int = 192  # tokens a node accumulates before its inner optimizer step
    protocol: int = PROTOCOL_VERSION
    key_id: str = ""  # fingerprint of the swarm key frames must be signed with ("" = open swarm)
    # content hash of each stage's config + tensors as stored; model_hash combines them, so a node
    # verifies only the stage it serves (node.model.loading.ModelSource.stage_hash)
    stage_hashes: list[str] = field(default_factory=list)
    # the model ties its input embedding to lm_head and the run keeps the head's and the tail's
    # copies tied: they sum their gradients of it every inner step (node.dp.tied)
    tied: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> RunRecord:
        if not isinstance(d, dict):
            raise RecordError("run record is not a map")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise RecordError(f"run record has unknown fields {sorted(unknown)}")
        # the parts first: a malformed one is named by its field, not by the constructor
        parts = {name: parse_part(name, d[name]) for name in PARTS if name in d}
        try:
            rec = cls(**{**d, **parts})
        except TypeError as e:
            raise RecordError(f"run record is incomplete: {e}") from None
        _check(
            rec,
            {
                "run_id": str,
                "model_name": str,
                "model_hash": str,
                "num_layers": int,
                "hidden": int,
                "stages": list,
                "codec": dict,
                "dense_every": int,
                "mode": str,
                "seed": int,
                "lr": (int, float),
                "weight_decay": (int, float),
                "clip": (int, float),
                "seq_len": int,
                "microbatch": int,
                "microbatch_tokens": int,
                "batch_tokens": int,
                "protocol": int,
                "key_id": str,
                "stage_hashes": list,
                "tied": bool,
            },
        )
        if rec.stage_hashes and not (
            len(rec.stage_hashes) == len(rec.stages)
            and all(isinstance(h, str) and len(h) == 32 for h in rec.stage_hashes)
        ):
            raise RecordError("run record stage_hashes must be one 32-character hash per stage")
        if not isinstance(rec.codec.get("codec"), str):
            raise RecordError("run record codec settings name no codec")
        if rec.protocol != PROTOCOL_VERSION:
            raise RecordError(
                f"run speaks protocol {rec.protocol}, this node speaks {PROTOCOL_VERSION}; "
                "install the matching release"
            )
        if rec.mode not in ("finetune", "pretrain"):
            raise RecordError(f"unknown run mode {rec.mode!r}")
        prev = 0
        for r in rec.stages:
            if not (
                isinstance(r, list)
                and len(r) == 2
                and all(isinstance(x, int) for x in r)
                and r[0] == prev
                and r[1] > r[0]
            ):
                raise RecordError(f"run record stage ranges {rec.stages} are not contiguous")
            prev = r[1]
        if prev != rec.num_layers or not 1 <= len(rec.stages) <= 64:
            raise RecordError(f"run record stage ranges {rec.stages} do not cover {rec.num_layers} layers")
        if not (0 < rec.seq_len <= 65536 and 0 < rec.microbatch <= 4096 and rec.batch_tokens > 0):
            raise RecordError("run record batch settings out of range")
        if rec.microbatch_tokens and not rec.seq_len <= rec.microbatch_tokens <= 2**20:
            raise RecordError("run record microbatch_tokens must be 0 or between seq_len and 2**20")
        return rec

    def frame_fits(self, rows: int, tokens: int) -> bool:
        """Whether a (rows, tokens) microbatch is within this run's limits."""
        if not (rows >= 1 and 1 <= tokens <= self.seq_len):
            return False
        if self.microbatch_tokens:
            return rows * tokens <= self.microbatch_tokens
        return rows <= self.microbatch

    @property
    def max_frame_tokens(self) -> int:
        """The most padded tokens one microbatch may hold (memory estimates size by it)."""
        return self.microbatch_tokens or self.microbatch * self.seq_len


REACH = ("direct", "reverse")  # StageRecord.reach
MAX_RELAYS = 4  # relays one stage record may name
BASES = ("fp32", "bf16", "nf4")  # StageRecord.base: the frozen base of a LoRA stage


@dataclass
class StageRecord:
    """A peer's heartbeat for the stage it serves (subkey = its peer id)."""

    circuit: str = "fast"  # fast | anchor
    throughput: float = 0.0  # tokens/s it has measured for its own compute
    queue: int = 0  # microbatches in flight on it
    inner_step: int = 0
    outer_round: int = 0
    ready: bool = False  # layers loaded and handlers registered
    maddrs: list[str] = field(default_factory=list)
    # how peers reach it: ``direct`` (they dial its maddrs) or ``reverse`` (behind NAT: it dials
    # the peers that call it and keeps those connections open; node.swarm.reverse)
    reach: str = "direct"
    # behind NAT: the relays (peer ids of public nodes of the run) it keeps connections to, through
    # which a peer it has no connection to opens streams to it (node.net.relay)
    relays: list[str] = field(default_factory=list)
    # a public node that carries streams for NAT'd peers (``--no-relay-service`` turns it off)
    relay: bool = False
    # what the frozen base is held in under LoRA (fp32 | bf16 | nf4); "" when every weight trains
    base: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> StageRecord:
        if not isinstance(d, dict):
            raise RecordError("stage record is not a map")
        known = {f.name for f in fields(cls)}
        try:
            rec = cls(**{k: v for k, v in d.items() if k in known})  # newer fields are ignored
        except TypeError as e:
            raise RecordError(f"stage record is malformed: {e}") from None
        _check(
            rec,
            {
                "circuit": str,
                "throughput": (int, float),
                "queue": int,
                "inner_step": int,
                "outer_round": int,
                "ready": bool,
                "maddrs": list,
                "reach": str,
                "relays": list,
                "relay": bool,
                "base": str,
            },
        )
        if rec.base not in ("", *BASES):
            raise RecordError(f"unknown base dtype {rec.base!r}")
        if rec.circuit not in ("fast", "anchor"):
            raise RecordError(f"unknown circuit {rec.circuit!r}")
        if rec.reach not in REACH:
            raise RecordError(f"unknown reach {rec.reach!r}")
        if not (0 <= rec.throughput < 1e12 and 0 <= rec.queue < 1e6):
            raise RecordError("stage record load figures out of range")
        if len(rec.maddrs) > 16 or not all(isinstance(a, str) and len(a) < 512 for a in rec.maddrs):
            raise RecordError("stage record addresses malformed")
        if len(rec.relays) > MAX_RELAYS or not all(
            isinstance(a, str) and 0 < len(a) < 128 for a in rec.relays
        ):
            raise RecordError("stage record relays malformed")
        return rec
