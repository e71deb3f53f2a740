import logging

import pytest
import torch

from node.config import NodeConfig
from node.join import stages_that_fit
from node.model.devices import AVERAGER_BYTES, GIB, RUNTIME_BYTES, pick_device, stage_memory_bytes


def test_cuda_request_falls_back_to_cpu_with_a_message(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="node"):
        assert pick_device("cuda") == torch.device("cpu")
    assert "falling back to CPU" in caplog.text
    assert pick_device("auto") == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")


def test_memory_estimate_formula():
    m = stage_memory_bytes(
        n_params=1000,
        n_layers=2,
        hidden=64,
        vocab=None,
        frame_tokens=16,
        max_inflight=1,
        device=torch.device("cpu"),
    )
    assert m["states"] == 16_000
    assert m["activations"] == 2 * 16 * 34 * 64 * 4 // 2
    assert m["total"] == m["states"] + m["activations"]
    tail = stage_memory_bytes(1000, 2, 64, 100, 16, 1, torch.device("cpu"))
    assert tail["activations"] - m["activations"] == 16 * 100 * 8 + 16 * 64 * 4  # logits, the waiting frame
    # the tail computes one microbatch at a time: more in flight adds their input frames only
    body4 = stage_memory_bytes(1000, 2, 64, None, 16, 4, torch.device("cpu"))
    tail4 = stage_memory_bytes(1000, 2, 64, 100, 16, 4, torch.device("cpu"))
    assert body4["activations"] == 4 * m["activations"]
    assert tail4["activations"] - tail["activations"] == 3 * 16 * 64 * 4


def test_host_estimate_counts_the_processes_and_the_larger_copy():
    alone = stage_memory_bytes(1000, 2, 64, None, 16, 1, torch.device("cpu"))
    assert alone["host"] == 12 * 1000 + RUNTIME_BYTES  # a checkpoint's clone, the processes
    outer = stage_memory_bytes(1000, 2, 64, None, 16, 1, torch.device("cpu"), outer=True)
    assert outer["host"] == 16 * 1000 + max(24 * 1000, 24 * 1000) + RUNTIME_BYTES + AVERAGER_BYTES


def test_max_memory_limits_the_stages_a_node_claims():
    mem = [{"total": 3 * GIB}, {"total": 1 * GIB}]
    assert stages_that_fit(NodeConfig(max_memory_gb=0), mem) == {0, 1}
    assert stages_that_fit(NodeConfig(max_memory_gb=2), mem) == {1}
    assert stages_that_fit(NodeConfig(max_memory_gb=0.5), mem) == set()


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cuda", torch.float32)])
def test_state_estimate_is_what_adamw_allocates(device, dtype):
    """Weights, grads and AdamW moments as torch allocates them in the dtype a node loads on that
    device (counted on the CPU: the bytes, not the device, are checked)."""
    from node.model.loading import weight_dtype

    assert weight_dtype(torch.device(device)) == dtype
    lin = torch.nn.Linear(64, 32, bias=False).to(dtype)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 64, dtype=dtype)).sum().backward()
    opt.step()
    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    used = sum(t.numel() * t.element_size() for t in [lin.weight, lin.weight.grad, *moments])
    est = stage_memory_bytes(lin.weight.numel(), 1, 64, None, 1, 1, torch.device(device))
    assert est["states"] == used
