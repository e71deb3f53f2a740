"""All settings of a node in one typed place; the CLI fills it, nothing else reads flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# DiLoCo H (bench/results/diloco_h.md, 4 replicas vs one at equal tokens): H=10 ends at held-out loss
# 1.10, close to H=50's 1.04 and far from H=1's 1.80, at 15 rounds in 150 steps. We take 10, not 50:
# a volunteer that leaves loses its un-averaged steps and a joiner adopts the outer state of the last
# round, so fewer steps between rounds lose less under churn, and a 40-step demo sees 4 rounds, not 0.
# The price is 5x H=50's outer bytes (rank-16 PowerSGD: ~9x below dense fp32 either way).
DEFAULT_OUTER_EVERY = 10


def default_state_dir() -> str:
    return os.environ.get("NODE_STATE_DIR", str(Path.home() / ".local" / "share" / "volunteer-node"))


@dataclass
class NodeConfig:
    # swarm membership
    peers: list[str] = field(default_factory=list)
    run_id: str = "default"
    new_run: bool = False  # with --peers: start run_id on that DHT (refused if the run exists)
    stage: str = "auto"  # auto | stage index
    circuit: str = "fast"
    # network
    host: str = "127.0.0.1"
    port: int = 0
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None
    swarm_key: str | None = None  # file with the shared secret; frames without its tag are refused
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    p2pd_timeout: float = 15.0  # p2pd start-up; the most common failure of hivemind swarms
    join_timeout: float = 30.0  # reaching the bootstrap peers and reading the run record
    hop_timeout: float = 30.0  # one hop's compute + reply, multiplied by the hops still ahead
    # the run (used when this node starts a new swarm; joiners read it from the DHT)
    model: str = "bundled"
    stages: int = 2
    # the best >= 10x configuration measured (bench/results/quality.md): PCA k = 96, int8
    codec: str = "pca"
    wire_dtype: str = "bfloat16"
    mask_rate: float = 0.95
    mask_rescale: bool = False
    codec_k: int = 96  # pca / topk / bottleneck: coefficients or channels per token (pca: <= hidden)
    pca_dtype: str = "int8"  # pca / lowrank coefficients
    lowrank_basis: str = "bfloat16"  # lowrank: the per-frame basis' dtype
    calibration_tokens: int = 2048  # tokens the run's starter uses to fit a basis codec
    dense_every: int = 0
    # data-parallel outer rounds (DESIGN 4.3)
    # inner steps between outer rounds (0 = replicas never average); a stage with one replica skips them
    outer_every: int = DEFAULT_OUTER_EVERY
    powersgd_rank: int = 16  # 0 = uncompressed pseudo-gradients
    group_size: int = 2
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_mode: str = "diloco"
    outer_timeout: float = 20.0
    # pretraining from scratch (DESIGN 4.4) and per-step sparse DP (DESIGN 4.5)
    mode: str = "finetune"  # finetune | pretrain (a Llama-style model built from scratch with the run seed)
    subspace_rank: int = 0  # --codec subspace: k numbers per token at every boundary (needs pretrain)
    dp: str = "diloco"  # diloco (outer rounds, --outer-every) | scape (sparse sync every inner step)
    density: float = 0.1  # scape: share of each tensor's coordinates synchronised per step
    dp_timeout: float = 10.0  # scape: seconds to wait for the other replicas' step before going alone
    # anchor priors (DESIGN 4.2): the fast nodes' filter, the anchors' staleness and packet rank
    ap_alpha: float = 0.3
    ap_tau: float = 1e-3
    ap_beta: float = 0.95
    ap_tau_relative: bool = False
    ap_max_staleness: int = 30
    anchor_pull_every: int = 20
    anchor_rank: int = 16  # a dense (uncompressed) step every K steps; 0 = never
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip: float = 1.0
    seq_len: int = 64
    microbatch: int = 8
    batch_tokens: int = 192
    # this node
    data: str = "arithmetic"
    device: str = "auto"
    threads: int = 0
    max_memory_gb: float = (
        0.0  # refuse stages whose estimate exceeds this; 0 = no limit  # torch threads; 0 = torch's default
    )
    max_inflight: int = 4
    wait_peers: int = 0  # head: start driving data once this many peers are ready (local swarms)
    max_steps: int = 0  # stop after this many inner steps (0 = run until stopped)
    state_dir: str = field(default_factory=default_state_dir)
    metrics_file: str | None = None
    checkpoint_every: int = 50  # inner steps between checkpoints (and one at exit); 0 = never
    resume: bool = False  # continue from this node's newest checkpoint of the run
    ready_file: str | None = None  # written once the stage is claimed (used by `swarm`)
    heartbeat_s: float = 2.0
    rebalance: bool = True  # move to an empty or starved stage when that lifts the bottleneck
