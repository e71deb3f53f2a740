"""The compute thread: every tensor operation of a stage runs here, never on the event loop.

One worker thread runs, in submission order, the stage's forward and backward, the codec
math of both links and the (de)serialisation of frames, the optimizer step and snapshots.
The event loop only moves bytes and waits, so heartbeats and other streams are answered
while a frame is encoded (a lowrank codec does an eigendecomposition per frame).

The math of one hop is two calls (``node.stage.pipeline`` makes them):

* forward and encode: ``forward`` then the caller's encoder, in one submission;
* decode and backward: the caller's decoder then ``backward``, in one submission.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from protocol.frames import OutOfRange

T = TypeVar("T")


class Compute:
    """The worker thread of one stage, with the device and autocast it computes under."""

    def __init__(self, device: torch.device | None = None, cpu_bf16: bool = False) -> None:
        self.device = device or torch.device("cpu")
        self.cpu_bf16 = cpu_bf16  # a bf16 frozen base on the CPU (--base-dtype bf16) computes under autocast
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.seconds = 0.0  # time spent waiting for the thread, queueing included

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the worker thread; the event loop waits without blocking."""
        t0 = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        self.seconds += time.perf_counter() - t0
        return out

    def amp(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA (trained weights and optimizer stay fp32); fp32 on the CPU, unless its
        frozen base is bf16 (fp32 activations cannot meet bf16 weights in a matmul without it)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.cpu_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap compute
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    # ------------------------------------------------------------ stage math (in the thread)
    def forward(self, stage, x: torch.Tensor, is_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's output and, off the head, the input leaf its gradient lands on."""
        with torch.enable_grad(), self.amp():
            if is_head:
                return stage(self.to_device(x)), None
            leaf = self.to_device(x).requires_grad_(True)
            return stage(leaf), leaf

    def tail(self, stage, x: torch.Tensor, labels: torch.Tensor, is_head: bool):
        """Loss and backward of the last stage: (loss, tokens it averages over, grad of x or None)."""
        with torch.enable_grad():
            leaf = self.to_device(x).requires_grad_(not is_head)
            with self.amp():
                loss, n = stage.loss(leaf, self.to_device(labels).long())
            if not bool(torch.isfinite(loss)):  # never let one microbatch poison the step's gradients
                raise OutOfRange("the loss of this microbatch is not finite")
            loss.backward()
        return float(loss.detach()), n, (leaf.grad if not is_head else None)

    @staticmethod
    def backward(y: torch.Tensor, grad_y: torch.Tensor, leaf: torch.Tensor | None) -> torch.Tensor | None:
        y.backward(grad_y.to(y.device, y.dtype))
        return leaf.grad if leaf is not None else None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
