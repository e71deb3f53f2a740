"""A fixed sample of a stage's weights, so the dashboard can estimate how far replicas drift.

The report measures the replicas' distance after a run, from the outer models they leave on
disk; live, each node sends ``PROBE_N`` of its stage's moving parameters, at coordinates every
replica of the stage draws alike (seeded by the run seed and the stage index, parameters in name
order). With P parameters, sqrt(P / n · Σ (a_i − b_i)²) over the n sampled coordinates is an
unbiased estimate of the squared distance's root (``node.watch.state.replica_distance``): 4 KiB a
reply, where the whole vector is the model.

Read on the event loop, not the compute thread: a frame ahead of it there would hold the answer
for seconds. A probe taken during an optimizer step may mix tensors before and after it, which
an estimate on a dashboard can carry; the report's figure is the exact one.
"""

from __future__ import annotations

import torch

from node.model.adapters import moving_parameters

PROBE_N = 1024


class Probe:
    def __init__(self, stage: torch.nn.Module, seed: int, index: int, n: int = PROBE_N) -> None:
        named = sorted(moving_parameters(stage).items())
        self.params = [p for _, p in named]
        self.size = sum(p.numel() for p in self.params)
        g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) & (2**63 - 1))
        flat = (
            torch.randint(self.size, (min(n, self.size),), generator=g).sort().values if self.size else None
        )
        # (parameter, offsets inside it) for the sampled flat coordinates
        self.where: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        start = 0
        for p in self.params:
            if flat is not None:
                inside = flat[(flat >= start) & (flat < start + p.numel())] - start
                if inside.numel():
                    self.where.append((p, inside))
            start += p.numel()

    def sample(self) -> tuple[int, torch.Tensor]:
        """(P, the sampled values in fp32)."""
        with torch.no_grad():
            parts = [p.detach().reshape(-1)[i].float().cpu() for p, i in self.where]
        return self.size, torch.cat(parts) if parts else torch.zeros(0)
