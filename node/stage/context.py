"""What the parts of one stage share: who this node is, its run, its transport, its view of the swarm.

Every part of the runtime (pipeline, hop client, server, step, anchors, SCAPE, lifecycle) gets
this one object instead of the runtime: what a part may read or change is what is here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from node.config import NodeConfig
from node.model.stages import Stage
from node.net.wire import Wire
from node.stage.compute import Compute
from node.stage.metrics import Metrics
from protocol.records import RunRecord, StageRecord


@dataclass
class StageContext:
    cfg: NodeConfig
    run: RunRecord
    index: int
    stage: Stage
    peer_id: str
    compute: Compute
    metrics: Metrics
    dht: Any = None
    p2p: Any = None  # hivemind P2P, set when serving starts
    wire: Wire = field(default_factory=Wire)  # signs and verifies with the swarm key, when the run has one
    inner_step: int = 0
    # the stage records of every stage, refreshed each heartbeat (node.stage.hop.HopClient.refresh_routes)
    routes: list[dict[str, StageRecord]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if not self.routes:
            self.routes = [{} for _ in range(self.n_stages)]

    @property
    def n_stages(self) -> int:
        return len(self.run.stages)

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_tail(self) -> bool:
        return self.index == self.n_stages - 1

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.stage.parameters() if p.requires_grad]
