"""bench.reliability.soak: the schedule's rules, the summary of samples, the pass/fail verdict, and (slow) a
two-minute soak run of real node processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.reliability.soak import schedule, summarize, verdict


def test_schedule_late_join_after_three_run_record_lifetimes() -> None:
    # --heartbeat 1: the run record lives 30 s, so a join at minute 1 is 2 lifetimes: refused
    with pytest.raises(ValueError, match="run-record lifetimes"):
        schedule(10, 1.0, join_at=1.0, kill_at=0.5, leave_at=0.7)
    ev = schedule(60, 1.0, join_at=10, kill_at=0.45, leave_at=2 / 3)
    assert ev == {"end": 3600.0, "join": 600.0, "kill": 1620.0, "leave": 2400.0}
    # a longer beat stretches the lifetime: minute 10 is only 2 lifetimes of --heartbeat 10
    with pytest.raises(ValueError, match="--heartbeat 10"):
        schedule(60, 10.0, join_at=10, kill_at=0.45, leave_at=2 / 3)


def test_schedule_events_in_order() -> None:
    with pytest.raises(ValueError, match="order"):
        schedule(4, 1.0, join_at=2.0, kill_at=0.3, leave_at=0.8)  # kill at 1.2 min, before the join
    assert "kill" not in schedule(4, 1.0, join_at=1.6, kill_at=0, leave_at=0.7)


def _sample(t: float, loss: float | None, nodes: dict) -> dict:
    return {"t": t, "loss": loss, "nodes": nodes}


def _node(step: int | None, mb: int, rss: float, committed: int = 0, skipped: int = 0) -> dict:
    return {
        "inner_step": step,
        "microbatches": mb,
        "rss_mb": rss,
        "anon_mb": 2 * rss - 400,  # grows twice as fast as the RSS
        "group_rss_mb": rss + 100,
        "outer_committed": committed,
        "outer_skipped": skipped,
    }


def test_summarize_windows_joiner_and_rss() -> None:
    # 21 samples 10 s apart, loss 3.0 down to 1.0 in steps of 0.1; windows are the first and last
    # tenth of 200 s: t in [0, 20] -> 3.0, 2.9, 2.8 (mean 2.9); t in [180, 200] -> 1.2, 1.1, 1.0 (1.1)
    samples = []
    for k in range(21):
        t = 10.0 * k
        nodes = {"0": _node(k, k, 300 + k, committed=k // 5)}
        if t >= 50:  # the joiner is spawned at 50: it reports step 7 (the replicas'), trains at 80
            nodes["4"] = _node(7 if t < 80 else 8, 0 if t < 70 else 3, 200.0, skipped=1)
        if t >= 150:  # node 2's second life (a restart)
            nodes["2"] = {**_node(1, 1, 900.0 + k), "life": 1}
        samples.append(_sample(t, round(3.0 - 0.1 * k, 10), nodes))
    samples.insert(3, _sample(25.0, None, {}))  # a sample without a tail loss counts for nothing
    events = [{"kind": "join", "t": 50.0, "node": 4, "ready_s": 12.5}]
    s = summarize(samples, events, joiner=4)
    assert s["loss_start"] == pytest.approx(2.9)
    assert s["loss_end"] == pytest.approx(1.1)
    assert s["late_joiner"] == {
        "spawned": 50.0,
        "ready_s": 12.5,
        "first_microbatch_s": 20.0,
        "first_step_s": 30.0,
    }
    assert s["rss"]["0"]["start_mb"] == 300 and s["rss"]["0"]["end_mb"] == 320
    assert s["rss"]["0"]["group_end_mb"] == 420 and s["rss"]["4"]["start_t"] == 50.0
    # growth counts from the first sample 2 min after a process's first: 312 at t = 120 -> 320
    assert s["rss"]["0"]["settled_mb"] == 312 and s["rss"]["0"]["growth_mb"] == 8
    assert s["rss"]["0"]["anon_growth_mb"] == 16
    assert s["rss"]["4"]["growth_mb"] == 0  # flat from t = 170 on
    assert s["rss"]["2.1"]["growth_mb"] is None  # a restart seen for less than 2 min: no growth figure
    assert (s["outer_committed"], s["outer_skipped"]) == (4, 1)  # from the last sample: 20 // 5, and 1
    assert verdict(s) is None


def test_verdict_names_the_failure() -> None:
    ok = {
        "loss_start": 3.0,
        "loss_end": 1.0,
        "late_joiner": {"spawned": 50.0, "first_microbatch_s": 10.0, "first_step_s": 20.0},
    }
    assert verdict(ok) is None
    assert "loss did not fall" in verdict({**ok, "loss_end": 2.9})  # within 5 %: not a fall
    assert "never trained" in verdict({**ok, "late_joiner": {**ok["late_joiner"], "first_step_s": None}})
    assert "never started" in verdict({**ok, "late_joiner": {**ok["late_joiner"], "spawned": None}})
    assert "no tail loss" in verdict({**ok, "loss_start": None})


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 4 min of swarm, plus start-up, stop and checks on loaded cores
def test_soak_four_minutes(tmp_path) -> None:
    """A 4-minute soak: 4 nodes, a late join at minute 1.6 (3.2 run-record lifetimes of --heartbeat 1)
    through a live peer, a SIGKILL + --resume at 2.2, a clean SIGTERM leave at 3.2; the loss falls and
    the joiner trains (it needed ~75 s to claim a stage on loaded cores, hence 4 minutes, not 2)."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench.reliability.soak",
        "--minutes",
        "4",
        "--join-at",
        "1.6",
        "--kill-at",
        "0.55",
        "--leave-at",
        "0.8",
        "--restart-delay",
        "3",
        "--eval",
        "0",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "run"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "soak.json").read_text())
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds == ["join", "kill", "restart", "leave"], kinds
    leave = doc["events"][-1]
    assert leave["exit_code"] == 0, leave  # a clean leave exits 0 within the wait
    assert doc["summary"]["late_joiner"]["first_step_s"] is not None
    assert doc["summary"]["loss_end"] < doc["summary"]["loss_start"]
    assert (out / "soak.png").stat().st_size > 0 and "Verdict" in (out / "soak.md").read_text()
