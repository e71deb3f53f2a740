"""The demo's headline path (``make demo``: ``swarm --eval N``) on the tiny model: the held-out
split, the score before and after, the final exact-match line; and what the watch prints before
the first step (it used to print ``loss nan``)."""

from __future__ import annotations

from node.local.launcher import progress
from tests.conftest import run_swarm


def _m(stage: int, losses: list[float] = (), step: int = 0) -> dict:
    return {"stage": stage, "step_losses": list(losses), "inner_step": step, "circuit": "fast"}


def test_progress_says_what_the_swarm_waits_for_before_a_loss():
    assert progress([], 3, 2, 40).startswith("starting: 3 nodes loading")
    assert progress([_m(0)], 3, 2, 40) == "waiting for stages: 1/3 nodes serving, stage 1 not yet"
    assert progress([_m(1)], 3, 3, 40) == "waiting for stages: 1/3 nodes serving, stages 0, 2 not yet"
    assert progress([_m(0), _m(1)], 2, 2, 40).startswith("every stage served (2/2 nodes)")
    line = progress([_m(0), _m(1, [2.5, 2.25], step=2)], 2, 2, 40)
    assert line == "step 2/40  loss 2.250"
    assert all("nan" not in progress(ms, 2, 2, 40) for ms in ([], [_m(0)], [_m(0), _m(1)]))


def test_swarm_eval_export_prints_the_held_out_lines_and_prunes_checkpoints(tmp_path):
    report, model = tmp_path / "run", tmp_path / "model"
    report.mkdir()
    args = ["--nodes", "2", "--stages", "2", "--steps", "3", "--model", "tiny:2", "--eval", "6"]
    rep = run_swarm(report, *args, "--export", str(model), timeout=240)
    out = (report / "swarm.out").read_text()
    assert "held out 6 problems (trained on the other" in out and "before training: loss" in out, out
    last = out.strip().splitlines()[-1]  # the held-out line comes last: what a demo user looks for
    assert last.startswith("exact match on 6 held-out problems: 0.00 -> "), out
    ev = rep["eval"]
    assert ev["n"] == 6 and ev["em_before"] == 0.0 and 0.0 <= ev["em_after"] <= 1.0
    assert ev["loss_after"] != ev["loss_before"]  # the exported model is the trained one, not the base
    assert "nan" not in out
    # the export written, the nodes' checkpoints (most of a demo's disk) are gone, nothing else
    assert (model / "config.json").exists() and "removed the nodes' checkpoints" in out
    assert (
        not list((report / "nodes").glob("*/checkpoints")) and (report / "nodes" / "0" / "node.log").exists()
    )
