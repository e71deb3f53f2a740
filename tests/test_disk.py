"""Disk: a checkpoint or export that would not fit is refused before its first byte, in one line
naming the path, the bytes needed and free, and the fix; a write that fails midway leaves nothing
half-written; retention keeps the last K; export names why no checkpoint is there."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
import torch

import node.model.checkpoint as ckpt
from node.model.checkpoint import (
    LAST_ERROR,
    CheckpointError,
    NoSpace,
    list_checkpoints,
    load_latest,
    note_failure,
    save_checkpoint,
)


def _save(root: Path, step: int, n: int = 1000, keep: int = 2) -> Path:
    return save_checkpoint(
        root,
        stage_state={"w": torch.full((n,), float(step))},
        optimizer_state={"state": {}, "param_groups": []},
        counters={"inner_step": step},
        keep=keep,
    )


def _free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage

    def usage(path):
        u = real(path)
        return types.SimpleNamespace(total=u.total, used=u.used, free=free)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)


def test_retention_keeps_the_last_k(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000005", "ckpt-00000004", "ckpt-00000003"]
    _save(tmp_path, 6, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000006"]


def test_a_checkpoint_that_does_not_fit_is_refused_before_a_byte_in_one_line(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    before = sorted(p.name for p in tmp_path.iterdir())
    _free(monkeypatch, 5 << 20)  # under the 16 MB of slack alone
    with pytest.raises(NoSpace) as e:
        _save(tmp_path, 2, n=1 << 20)  # 4 MB of tensors
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg
    assert "needs 21.0 MB" in msg and "5.2 MB free" in msg and "--keep-checkpoints" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, the old one kept
    assert load_latest(tmp_path).step == 1


def test_a_write_that_fails_midway_leaves_nothing_and_says_why_in_one_line(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def full(tensors, path):  # the disk fills during the write
        Path(path).write_bytes(b"x" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(CheckpointError, match=r"checkpoint of step 2 in .* failed: No space left on device$"):
        _save(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left
    assert load_latest(tmp_path).step == 1


def test_a_failure_note_is_cleared_by_the_next_save_and_read_by_export(tmp_path):
    from node.swarm.export import ExportError, parts_from_checkpoints

    stage_dir = tmp_path / "state" / "checkpoints" / "run" / "0"
    note_failure(stage_dir, "the checkpoint of step 50 needs 1.20 GB in X, 3.1 MB free there: free space")
    cause = "; a node's last checkpoint write failed: the checkpoint of step 50 needs 1.20 GB"
    with pytest.raises(ExportError, match=f"no checkpoints found in .*{cause}") as e:
        parts_from_checkpoints([str(tmp_path / "state")])
    assert "\n" not in str(e.value)
    _save(stage_dir, 1)
    assert not (stage_dir / LAST_ERROR).exists()


def test_an_export_that_does_not_fit_is_refused_before_a_byte(tmp_path, monkeypatch):
    from node.swarm.export import ExportError, write_export

    written = []
    _free(monkeypatch, 1 << 20)
    with pytest.raises(ExportError, match=r"the export to .*out needs 21.0 MB in .*, 1.0 MB free there") as e:
        write_export(tmp_path / "out", written.append, 1024 * 1025 * 4, None, {})  # a 4 MB model
    assert written == []  # refused before the writer ran
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_keep_checkpoints_flag_is_typed_and_ranged():
    from node.argv import FlagError
    from node.cli import build_parser

    assert build_parser().parse_args(["join", "--keep-checkpoints", "1"]).keep_checkpoints == 1
    with pytest.raises(FlagError, match="--keep-checkpoints must lie in"):
        build_parser().parse_args(["join", "--keep-checkpoints", "0"])
