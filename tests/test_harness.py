"""Smoke test of the bandwidth-capped harness (issue 5): two namespaces per run, a few seconds.

A dense and a masked (M95) swarm of a tiny emulated model run side by side, each in its own
namespaces behind a 2 Mbit/s tbf: the cap must hold (wire rate <= 1.1x the cap), the masked
run must move more tokens per second, and no namespace may be left behind. Without root or
network-namespace support the test is skipped with the reason (the one allowed skip).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from bench.netns import NetnsUnavailable, check_support, leftover_namespaces

SMOKE = [
    "--nodes", "2", "--stages", "2",
    "--model", "emulate:256:2:0",  # hidden 256, 2 layers, no compute sleep
    "--seq-len", "64", "--microbatch", "4", "--batch-tokens", "4096",
    "--max-inflight", "4", "--hop-timeout", "30", "--heartbeat", "1",
    "--rate", "2mbit", "--warmup", "2", "--seconds", "6", "--timeout", "100",
    "--skip-tcp-check",
]  # fmt: skip


def _support_reason() -> str | None:
    try:
        check_support()
    except NetnsUnavailable as e:
        return str(e)
    return None


def test_capped_smoke(tmp_path):
    reason = _support_reason()
    if reason:
        print(f"skipping the harness smoke: {reason}")
        pytest.skip(f"harness smoke needs root and network namespaces: {reason}")
    procs = {}
    runs = {"dense": ["--codec", "dense"], "mask": ["--codec", "mask", "--mask-rate", "0.95"]}
    for name, flags in runs.items():
        out = tmp_path / name
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "bench.harness", *SMOKE, *flags, "--out", str(out),
             "--results", str(tmp_path / f"{name}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    logs = {}
    for name, p in procs.items():
        try:
            logs[name], _ = p.communicate(timeout=170)
        except subprocess.TimeoutExpired:
            p.terminate()  # the harness tears its namespaces down on SIGTERM
            logs[name], _ = p.communicate(timeout=60)
            pytest.fail(f"{name} harness run timed out:\n{logs[name][-3000:]}")
        assert p.returncode == 0, f"{name}:\n{logs[name][-3000:]}"
    res = {name: json.loads((tmp_path / f"{name}.json").read_text())[-1] for name in procs}
    for name, e in res.items():
        print(f"{name}: {e['tokens_per_s']:.0f} tokens/s, wire {e['wire_utilisation']:.0%} of the cap, "
              f"{e['bytes_per_token']:.1f} B/token")
        assert e["rate_mbit"] == 2.0
        assert e["wire_utilisation"] is not None, name
        assert e["wire_utilisation"] <= 1.1, (name, e["wire_bytes_per_s"])
        assert e["link_utilisation"] <= 1.1, (name, e["egress_frame_bytes_per_s"])
        assert e["tokens_per_s"] > 0, name
    assert res["mask"]["bytes_per_token"] < res["dense"]["bytes_per_token"] / 5
    assert res["mask"]["tokens_per_s"] > res["dense"]["tokens_per_s"], (
        res["mask"]["tokens_per_s"],
        res["dense"]["tokens_per_s"],
    )
    # everything the two harnesses built is gone
    tags = {m for log in logs.values() for m in re.findall(r"\((vnh\d+)-br,", log)}
    assert len(tags) == 2, logs
    left = [n for n in leftover_namespaces() if any(n.startswith(t + "-") for t in tags)]
    assert not left, left
