"""Atomic checkpoints: exact round trip, a SIGKILL mid-save, corruption, retention."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from compression.outer import GaslocOuter, OuterNesterov
from compression.spectral import SpectralFilter
from node.model.checkpoint import (
    FAULT_ENV,
    MANIFEST,
    WEIGHTS_FILE,
    clone_state,
    flatten_state,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    read_latest_pointer,
    save_checkpoint,
    unflatten_state,
)

ROOT = Path(__file__).resolve().parent.parent


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def _train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(5, 8, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def test_flatten_roundtrip_adamw_state():
    model, opt = _model_and_opt()
    for s in range(2):
        _train_step(model, opt, s)
    sd = opt.state_dict()
    tensors, skel = flatten_state(sd, prefix="o.")
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    json.dumps(skel)  # the skeleton is plain JSON
    back = unflatten_state(tensors, json.loads(json.dumps(skel)))
    _assert_same(sd, back)
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert all(isinstance(k, int) for k in back["state"])


def test_flatten_edge_values():
    state = {"a": [1.5, float("inf"), None, True, "x", (1, 2)], 3: {"e": torch.empty(0)}, "n": -7}
    tensors, skel = flatten_state(state)
    back = unflatten_state(tensors, json.loads(json.dumps(skel)))
    assert back["a"][0] == 1.5 and back["a"][1] == float("inf") and back["a"][5] == (1, 2)
    assert back[3]["e"].numel() == 0 and back["n"] == -7
    with pytest.raises(TypeError):
        flatten_state({"d": torch.float32})


def test_roundtrip_continues_like_an_uninterrupted_optimizer(tmp_path):
    model, opt = _model_and_opt()
    for s in range(3):
        _train_step(model, opt, s)
    filt = SpectralFilter()
    assert filt.observe("layers.0.self_attn.q_proj.weight", torch.randn(6, 4), source_step=2, current_step=3)
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    outer.buffers = {"w": torch.randn(3)}
    gasloc = GaslocOuter()
    counters = {"inner_step": 3, "outer_round": 1, "trained_tokens": 4096, "run_id": "r", "stage": 1}
    path = save_checkpoint(
        tmp_path,
        stage_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        extra_states={
            "filter": filt.state_dict(),
            "outer": outer.state_dict(),
            "gasloc": gasloc.state_dict(),
        },
        counters={**counters, "model_hash": "abc"},
    )
    assert path.name == "ckpt-00000003"
    assert read_latest_pointer(tmp_path) == "ckpt-00000003"

    # uninterrupted: one more step
    _train_step(model, opt, 3)

    ck = load_latest(tmp_path)
    assert ck is not None and ck.step == 3 and ck.counters["trained_tokens"] == 4096
    assert ck.counters["model_hash"] == "abc"
    model2, opt2 = _model_and_opt(seed=99)  # different init: everything must come from the checkpoint
    model2.load_state_dict(ck.stage_state)
    opt2.load_state_dict(ck.optimizer_state)
    _train_step(model2, opt2, 3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    _assert_same(opt.state_dict(), opt2.state_dict())

    outer2 = OuterNesterov()
    outer2.load_state_dict(ck.extra_states["outer"])
    assert torch.equal(outer2.buffers["w"], outer.buffers["w"]) and outer2.lr == 0.7
    GaslocOuter().load_state_dict(ck.extra_states["gasloc"])
    filt2 = SpectralFilter()
    filt2.load_state_dict(ck.extra_states["filter"])
    g = torch.randn(6, 4)
    name = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(filt2.apply(name, g), filt.apply(name, g))


def _save(tmp_path, step, value=0.0, **kw):
    return save_checkpoint(
        tmp_path,
        stage_state={"w": torch.full((4, 4), float(value))},
        optimizer_state={"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        counters={"inner_step": step},
        **kw,
    )


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from node.model.checkpoint import save_checkpoint
    save_checkpoint(sys.argv[1], stage_state={"w": torch.full((64, 64), 2.0)},
                    optimizer_state={"state": {}, "param_groups": []}, counters={"inner_step": 20})
    print("finished", flush=True)
    """
)


@pytest.mark.parametrize("point", ["written", "renamed"])
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path, point):
    _save(tmp_path, 10, value=1.0)
    env = {**os.environ, FAULT_ENV: f"{point}:pause", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if line.startswith("VNODE_CKPT_PAUSED") or not line:
                break
        assert line.startswith(f"VNODE_CKPT_PAUSED {point}"), line
        proc.send_signal(signal.SIGKILL)  # killed between write and rename (or rename and pointer)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    ck = load_latest(tmp_path)
    assert ck is not None
    if point == "written":  # the new one never got its name: the previous one loads
        assert ck.step == 10 and torch.equal(ck.stage_state["w"], torch.full((4, 4), 1.0))
        assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    else:  # renamed but `latest` not yet updated: the new one is complete and wins
        assert ck.step == 20
        assert read_latest_pointer(tmp_path) == "ckpt-00000010"

    # the next save (resume continues the step count) cleans the dead writer's leftovers
    nxt = _save(tmp_path, ck.step + 1, value=3.0)
    assert load_latest(tmp_path).step == ck.step + 1 and nxt.name == f"ckpt-{ck.step + 1:08d}"
    assert not any(p.name.startswith((".tmp-", ".trash-")) for p in tmp_path.iterdir())


def test_corrupted_file_is_detected_and_skipped(tmp_path, caplog):
    _save(tmp_path, 1, value=1.0)
    newest = _save(tmp_path, 2, value=2.0)
    f = newest / WEIGHTS_FILE
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # one flipped bit inside the tensor bytes
    f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="node"):
        ck = load_latest(tmp_path)
    assert ck.step == 1 and torch.equal(ck.stage_state["w"], torch.full((4, 4), 1.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ckpt-00000002" in warnings[0] and "sha256" in warnings[0]
    assert "\n" not in warnings[0]


def test_torn_and_tampered_manifests_are_skipped(tmp_path):
    _save(tmp_path, 1, value=1.0)
    p2 = _save(tmp_path, 2, value=2.0, keep=3)
    p3 = _save(tmp_path, 3, value=3.0, keep=3)
    # a truncated file (torn write) and a manifest edited without its digest
    (p3 / WEIGHTS_FILE).write_bytes((p3 / WEIGHTS_FILE).read_bytes()[:40])
    man = json.loads((p2 / MANIFEST).read_bytes())
    man["counters"]["inner_step"] = 999
    (p2 / MANIFEST).write_text(json.dumps(man))
    assert load_latest(tmp_path).step == 1
    for p in (p2, p3):
        with pytest.raises(Exception, match="corrupted|bytes|digest"):
            load_checkpoint(p)
    (tmp_path / "ckpt-00000001" / MANIFEST).unlink()
    assert load_latest(tmp_path) is None


def test_retention_keeps_n_and_orders_by_save_not_step(tmp_path):
    for s in (5, 6, 7, 8):
        _save(tmp_path, s)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000008", "ckpt-00000007"]
    for s in (1, 2, 3):
        _save(tmp_path, s, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003", "ckpt-00000002", "ckpt-00000001"]
    # the step went back (the node adopted a peer's state): the newest save still wins
    _save(tmp_path, 2, value=9.0, keep=3)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["ckpt-00000002.1", "ckpt-00000003", "ckpt-00000002"]
    ck = load_latest(tmp_path)
    assert ck.path.name == "ckpt-00000002.1" and ck.stage_state["w"][0, 0] == 9.0
    assert read_latest_pointer(tmp_path) == "ckpt-00000002.1"


def test_shared_storage_and_views_are_saved(tmp_path):
    base = torch.arange(12.0)
    state = {"a": base, "tied": base, "view": base[2:6], "t": base.view(3, 4).t()}
    save_checkpoint(tmp_path, stage_state=state, optimizer_state={}, counters={"inner_step": 0})
    ck = load_latest(tmp_path)
    for k, v in state.items():
        assert torch.equal(ck.stage_state[k], v)


def test_clone_state_is_a_detached_snapshot():
    model, opt = _model_and_opt()
    _train_step(model, opt, 0)
    snap = clone_state({"w": model.state_dict(), "o": opt.state_dict()})
    _train_step(model, opt, 1)
    assert not torch.equal(snap["w"]["0.weight"], model.state_dict()["0.weight"])
    assert isinstance(snap["o"]["param_groups"][0]["betas"], tuple)
