"""Which torch device a node computes on."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("node")


def pick_device(choice: str) -> torch.device:
    """auto: CUDA when present, else CPU (with a message); cuda without CUDA falls back the same way."""
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, not {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if choice == "cuda":
        log.warning("--device cuda: CUDA is not available on this machine; falling back to CPU")
    return torch.device("cpu")
