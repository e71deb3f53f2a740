"""Bad input is refused in one line, exit code 2, before anything starts (issue 34).

Every case runs ``python -m node ...`` as a user does, in its own session, working directory and
TMPDIR, with the Hugging Face cache in the case's directory and the Hub endpoint on a closed
loopback port (no request can leave the machine). Each must exit 2 with exactly one line on
stderr that names the input, print nothing on stdout, and leave no process of its session (no
p2pd, no DHT child) and no socket directory behind. The refusals come from the flags' metadata
(node/config.py ``opt(min=, above=, parse=)``, node/cli.py ``bounded(...)``) at parse time, and
from node/join.py / node/local/launcher.py ``check_inputs`` before any daemon or model load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CASE_LIMIT_S = 60  # a case that starts p2pd or loads a model takes longer on two loaded cores

J0 = ["join", "--join-timeout", "2", "--p2pd-timeout", "5"]  # short waits, should anything start
J = [*J0, "--model", "tiny"]


def _files(d: Path) -> None:
    """What the cases point at: bad data files, a models/ directory, partial checkpoints."""
    (d / "bad.txt").write_bytes(b"Q: 1+1=\n\xff\xfe not utf-8\n")
    (d / "bad.jsonl").write_text('{"prompt": "Q: 1+1=", "completion": " 2"}\n{"text": 7}\n')
    (d / "notjson.jsonl").write_text("{oops\n")
    (d / "empty.txt").write_text("\n\n")
    (d / "models").mkdir()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    for ckpt in (
        d / "models" / "half",  # a local directory whose second shard never arrived
        d / "hf" / "hub" / "models--acme--partial" / "snapshots" / COMMIT,  # an interrupted download
    ):
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text('{"model_type": "llama"}')
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 16)
    (d / "hf" / "hub" / "models--acme--partial" / "refs").mkdir()
    (d / "hf" / "hub" / "models--acme--partial" / "refs" / "main").write_text(COMMIT)
    (d / "models" / "noweights").mkdir()
    (d / "models" / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    (d / "afile").write_text("a file where a directory belongs\n")
    (d / "notakey").write_bytes(b"\0" * 5)  # p2pd: "proto: cannot parse invalid wire-format data"


# (id, argv, words the one line must hold, extra environment)
CASES = [
    # parse time: a flag's own range or form
    ("stage-foo", [*J, "--stage", "foo"], ["--stage", "'foo'", "auto or a stage index"], {}),
    ("heartbeat-0", [*J, "--heartbeat", "0"], ["--heartbeat", ">= 0.1"], {}),
    ("heartbeat-neg", [*J, "--heartbeat", "-1"], ["--heartbeat", "-1"], {}),
    ("max-inflight-0", [*J, "--max-inflight", "0"], ["--max-inflight", ">= 1"], {}),
    ("hop-timeout-0", [*J, "--hop-timeout", "0"], ["--hop-timeout", "> 0"], {}),
    ("lr-nan", [*J, "--lr", "nan"], ["--lr", "finite"], {}),
    ("port-word", [*J, "--port", "eighty"], ["--port", "whole number"], {}),
    ("density-0", [*J, "--dp", "scape", "--density", "0"], ["--density", "(0, 1]"], {}),
    ("outer-timeout-0", [*J, "--outer-timeout", "0"], ["--outer-timeout", "> 0"], {}),  # a part's _f range
    ("codec-choice", [*J, "--codec", "zip"], ["--codec", "'zip'", "lowrank"], {}),
    ("codec-k-ignored", [*J, "--codec", "dense", "--codec-k", "64"], ["--codec-k", "--codec dense"], {}),
    (
        "codec-k-under-tiers",
        [*J, "--lowrank-tiers", "24x8,88x4", "--codec-k", "64"],
        ["--codec-k", "--lowrank-tiers 24x8,88x4"],
        {},
    ),
    ("keep-checkpoints-0", [*J, "--keep-checkpoints", "0"], ["--keep-checkpoints", "[1, 1000]"], {}),
    # a frozen base's dtype means something under LoRA only
    ("base-dtype-full", [*J, "--base-dtype", "nf4"], ["--base-dtype nf4", "--finetune lora"], {}),
    (
        "swarm-base-dtype-full",
        ["swarm", "--base-dtype", "bf16"],
        ["--base-dtype bf16", "--finetune lora"],
        {},
    ),
    ("swarm-max-inflight-0", ["swarm", "--max-inflight", "0"], ["--max-inflight", ">= 1"], {}),
    ("swarm-hop-timeout-0", ["swarm", "--hop-timeout", "0"], ["--hop-timeout", "> 0"], {}),
    ("swarm-eval-neg", ["swarm", "--eval", "-1"], ["--eval", ">= 0", "-1"], {}),
    ("swarm-nodes-0", ["swarm", "--nodes", "0"], ["--nodes", ">= 1"], {}),
    ("eval-limit-neg", ["eval", "--model", "tiny", "--data", "arithmetic", "--limit", "-5"], ["--limit"], {}),
    (
        "generate-budget-0",
        ["generate", "--model", "tiny", "--prompt", "x", "--max-new-tokens", "0"],
        ["--max-new-tokens"],
        {},
    ),  # fmt: skip
    ("export-timeout-0", ["export", "--out", "o", "--peers", "x", "--timeout", "0"], ["--timeout"], {}),
    ("status-join-timeout-0", ["status", "--peers", "x", "--join-timeout", "0"], ["--join-timeout"], {}),
    ("join-dashboard-port", [*J, "--dashboard", "70000"], ["--dashboard", "70000"], {}),
    ("swarm-dashboard-neg", ["swarm", "--dashboard", "-2"], ["--dashboard", "-2"], {}),
    ("dashboard-port", ["dashboard", "--peers", "x", "--port", "65536"], ["--port", "65536"], {}),
    ("dashboard-peers", ["dashboard", "--peers", "nonsense", "--join-timeout", "2"], ["nonsense"], {}),
    ("dashboard-key", ["dashboard", "--peers", "x", "--swarm-key", "nope.key"], ["nope.key"], {}),
    # before the DHT starts: what the flags name
    ("stage-past-new-run", [*J, "--stage", "2"], ["--stage 2", "0..1"], {}),
    ("tiny-malformed", [*J0, "--model", "tiny:x"], ["--model tiny:x", "tiny:LAYERS"], {}),
    # a relative path under an existing directory is a path, never a Hub id to download
    ("model-relative", [*J0, "--model", "models/nope"], ["--model models/nope", "no such directory"], {}),
    ("model-dot", [*J0, "--model", "./nope"], ["--model ./nope", "no such directory"], {}),
    ("model-no-weights", [*J0, "--model", "models/noweights"], ["models/noweights", "safetensors"], {}),
    ("model-missing-shard", [*J0, "--model", "models/half"], ["models/half", "model-00002-of-00002"], {}),
    (
        "hub-partial-offline",
        [*J0, "--model", "acme/partial"],
        ["--model acme/partial", "incomplete", "model-00002-of-00002", "HF_HUB_OFFLINE"],
        {"HF_HUB_OFFLINE": "1"},
    ),
    ("data-missing", [*J, "--data", "nope.jsonl"], ["--data nope.jsonl", "not found"], {}),
    ("data-not-utf8", [*J, "--data", "bad.txt"], ["--data bad.txt", "UTF-8", "0xff"], {}),
    ("data-bad-record", [*J, "--data", "bad.jsonl"], ["--data bad.jsonl:2", "'text'"], {}),
    ("data-not-json", [*J, "--data", "notjson.jsonl"], ["--data notjson.jsonl:1", "JSON"], {}),
    ("data-empty", [*J, "--data", "empty.txt"], ["--data empty.txt", "no examples"], {}),
    ("data-dir", [*J, "--data", "models"], ["--data models", "directory"], {}),
    ("swarm-key-missing", [*J, "--swarm-key", "nokey"], ["nokey", "does not exist"], {}),
    # swarm: before node 0 is spawned (was: "node 0 died; pass --restart-dead")
    (
        "swarm-data-not-utf8",
        ["swarm", "--model", "tiny", "--data", "bad.txt"],
        ["--data bad.txt", "UTF-8"],
        {},
    ),
    ("swarm-model-missing", ["swarm", "--model", "./nope"], ["--model ./nope"], {}),
    ("swarm-nodes-lt-stages", ["swarm", "--nodes", "1", "--stages", "2"], ["--nodes 1", "--stages 2"], {}),
    # eval's own inputs
    ("eval-data-not-utf8", ["eval", "--model", "tiny", "--data", "bad.txt"], ["--data bad.txt", "UTF-8"], {}),
    # paths, names and addresses (node/inputs.py); each was an exception's name, most after p2pd started
    (
        "state-dir-file",
        [*J, "--state-dir", "afile"],
        ["--state-dir afile", "is a file", "--state-dir DIR"],
        {},
    ),
    ("state-dir-in-file", [*J, "--state-dir", "afile/s"], ["--state-dir afile/s", "afile is a file"], {}),
    (
        "identity-not-a-key",
        [*J, "--identity", "notakey"],
        ["--identity notakey", "not a libp2p private key"],
        {},
    ),
    ("identity-dir", [*J, "--identity", "models"], ["--identity models", "not a file"], {}),
    (
        "identity-in-file",
        [*J, "--identity", "afile/id.key"],
        ["--identity afile/id.key", "afile is a file"],
        {},
    ),
    ("metrics-in-file", [*J, "--metrics-file", "afile/m.json"], ["--metrics-file afile/m.json", "afile"], {}),
    (
        "metrics-no-dir",
        [*J, "--metrics-file", "nope/m.json"],
        ["--metrics-file nope/m.json", "does not exist"],
        {},
    ),
    ("metrics-a-dir", [*J, "--metrics-file", "models"], ["--metrics-file models", "is a directory"], {}),
    ("peers-not-ip4", [*J, "--peers", "/ip4/1.2.3/tcp/1"], ["--peers", "not a multiaddr"], {}),
    ("announce-maddr", [*J, "--announce-maddr", "nonsense"], ["--announce-maddr 'nonsense'", "/ip4/"], {}),
    ("host-not-ip", [*J, "--host", "999.1.1.1"], ["--host '999.1.1.1'", "0.0.0.0"], {}),
    (
        "dashboard-host-not-ip",
        [*J, "--dashboard", "8123", "--dashboard-host", "1.2.3.999"],
        ["--dashboard-host '1.2.3.999'", "not an IP address", "127.0.0.1"],
        {},
    ),
    ("run-id-path", [*J, "--run-id", "a/b"], ["--run-id 'a/b'", "letters, digits"], {}),
    ("status-run-id-path", ["status", "--peers", "x", "--run-id", "../x"], ["--run-id '../x'"], {}),
    ("emulate-malformed", [*J0, "--model", "emulate:x"], ["--model 'emulate:x'", "integers"], {}),
    ("emulate-gpu", [*J0, "--model", "emulate:64:2:1:32:tpu"], ["unknown GPU 'tpu'", "h100"], {}),
    ("swarm-report-in-file", ["swarm", "--report", "afile/r"], ["--report afile/r", "afile is a file"], {}),
    ("swarm-report-file", ["swarm", "--report", "afile"], ["--report afile", "is a file"], {}),
    ("swarm-export-in-file", ["swarm", "--export", "afile/x"], ["--export afile/x", "afile is a file"], {}),
    ("export-out-in-file", ["export", "--out", "afile/x", "--checkpoints", "models"], ["--out afile/x"], {}),
    (
        "export-out-file",
        ["export", "--out", "afile", "--checkpoints", "models", "--force"],
        ["--out afile"],
        {},
    ),
    (
        "export-out-exists",
        ["export", "--out", "models", "--checkpoints", "models"],
        ["--out models", "--force"],
        {},
    ),
    ("keygen-in-file", ["keygen", "afile/k"], ["keygen afile/k", "afile is a file"], {}),
    ("keygen-exists", ["keygen", "afile"], ["keygen afile", "already exists"], {}),
    ("keygen-no-dir", ["keygen", "nope/k"], ["keygen nope/k", "nope does not exist"], {}),
    ("health-state-dir-file", ["health", "--state-dir", "afile"], ["--state-dir afile", "is a file"], {}),
]


def _session_procs(sid: int) -> list[str]:
    """Processes of session ``sid`` still alive (a p2pd or DHT child the node left behind)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text.split("(", 1)[1].rsplit(")", 1)
        fields_ = rest.split()  # state, ppid, pgrp, session, ...
        if int(fields_[3]) == sid and fields_[0] != "Z":
            out.append(f"{stat.parent.name} {name}")
    return out


def _run(case, root: Path) -> dict:
    cid, argv, _, env_extra = case
    d = root / cid
    d.mkdir()
    _files(d)
    # short: p2pd's unix socket paths must fit in 108 bytes, so a node that did start would really
    # start (and be caught by the checks below) rather than fail on a long pytest path
    tmp = Path(tempfile.mkdtemp(prefix="bi-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "NODE_STATE_DIR", "PYTHONPATH"))}
    env.update(
        PYTHONPATH=str(REPO),  # the code under test, whatever the working directory
        TMPDIR=str(tmp),
        HF_HOME=str(d / "hf"),
        HF_ENDPOINT="http://127.0.0.1:9",  # closed loopback port: a download attempt fails, never leaves
        NODE_STATE_DIR=str(d / "state"),
        NODE_CACHE=os.environ.get("NODE_CACHE", str(Path.home() / ".cache" / "volunteer-node")),
        CUDA_VISIBLE_DEVICES="",
        **env_extra,
    )
    t0 = time.monotonic()
    # output to files, not pipes: a child left behind holds inherited pipes open, and waiting for
    # their end would wait for it to exit, hiding it from the check below
    with open(d / "stdout", "w") as out_f, open(d / "stderr", "w") as err_f:
        p = subprocess.Popen(
            [sys.executable, "-m", "node", *argv],
            cwd=d,
            env=env,
            stdout=out_f,
            stderr=err_f,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            p.wait(timeout=CASE_LIMIT_S * 2)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    out, err = (d / "stdout").read_text(), (d / "stderr").read_text()
    elapsed = time.monotonic() - t0
    left = _session_procs(p.pid)
    if left:
        os.killpg(p.pid, 9)  # do not leave them for the next test either
    leftovers = sorted(x.name for x in tmp.iterdir())
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "rc": p.returncode,
        "out": out,
        "err": err,
        "elapsed": elapsed,
        "left": left,
        "tmp": leftovers,
        "report": (d / "runs").exists(),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """Every selected case's run, three at a time (each is mostly Python start-up)."""
    chosen = {
        item.callspec.params["case"][0]
        for item in request.session.items
        if "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    todo = [c for c in CASES if c[0] in chosen]
    root = tmp_path_factory.mktemp("bad-input")
    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip([c[0] for c in todo], pool.map(lambda c: _run(c, root), todo)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, results):
    cid, argv, words, _ = case
    r = results[cid]
    lines = r["err"].strip().splitlines()
    shown = f"{cid}: rc {r['rc']}, stderr:\n{r['err'][-3000:]}\nstdout:\n{r['out'][-1000:]}"
    assert r["rc"] == 2, shown
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert "Traceback" not in r["err"] and "Error:" not in lines[0], shown  # no exception class name
    for w in words:
        assert w in lines[0], (w, shown)
    assert r["out"] == "", shown  # nothing started: no "started swarm", no swarm report line
    assert not r["left"], f"{cid} left processes behind: {r['left']}"
    assert not [t for t in r["tmp"] if t.startswith("vnode-")], f"{cid} left socket dirs {r['tmp']}"
    assert not r["report"], f"{cid}: swarm wrote a report before refusing"
    assert r["elapsed"] < CASE_LIMIT_S, f"{cid} took {r['elapsed']:.0f}s: it started something first"


def test_device_cuda_without_cuda_means_the_same_for_eval_and_join(monkeypatch, caplog):
    """One decision for every command (node.model.devices.pick_device says why): --device cuda on a
    machine without CUDA warns once and runs on the CPU; eval used to refuse while join fell back."""
    import torch

    from node.model import evaluate
    from node.model.devices import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for pick in (evaluate.pick, pick_device):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="node"):
            assert pick("cuda") == torch.device("cpu")
        assert [r.getMessage() for r in caplog.records] == [
            "--device cuda: CUDA is not available on this machine; falling back to CPU"
        ]


def test_eval_device_cuda_without_cuda_runs_with_one_warning(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    argv = ["eval", "--model", "tiny", "--data", "arithmetic", "--limit", "2", "--max-new-tokens", "2"]
    p = subprocess.run(
        [sys.executable, "-m", "node", *argv, "--device", "cuda"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert "--device cuda" in line and "falling back to CPU" in line
    assert "2 examples" in p.stdout


def test_eval_limit_takes_the_first_n(tmp_path, capsys):
    """--limit N scores N examples (a negative N used to drop N from the end instead)."""
    from node.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}", "completion": " a"}) + "\n" for i in range(7)))
    argv = ["eval", "--model", "tiny", "--data", str(data), "--max-new-tokens", "1", "--device", "cpu"]
    assert main([*argv, "--limit", "3"]) == 0
    assert "tiny: 3 examples" in capsys.readouterr().out
    assert main([*argv, "--limit", "-5"]) == 2
    assert "--limit must be >= 0, got -5" in capsys.readouterr().err


def test_unwritable_paths_are_refused_in_one_line(tmp_path, monkeypatch):
    """A directory this user cannot write (as root every directory is writable, so os.access is
    told so here): the state dir, an output's parent, a key file's directory."""
    from node import inputs
    from node.argv import FlagError

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(inputs.os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    for check, words in (
        (lambda: inputs.check_state_dir(str(ro)), ["--state-dir", "not writable", "--state-dir DIR"]),
        (lambda: inputs.check_state_dir(str(ro / "s")), [f"{ro} is not writable"]),
        (lambda: inputs.check_new_dir("--out", str(ro / "x"), may_exist=False), ["--out", "not writable"]),
        (lambda: inputs.check_new_file("keygen", str(ro / "k"), may_exist=False), ["keygen", "not writable"]),
    ):
        with pytest.raises(FlagError) as e:
            check()
        assert len(str(e.value).splitlines()) == 1
        for w in words:
            assert w in str(e.value), (w, str(e.value))
    inputs.check_state_dir(str(tmp_path / "new" / "state"))  # made when it can be
    assert (tmp_path / "new" / "state").is_dir()


def test_identity_check_takes_the_key_a_node_writes(tmp_path):
    """A key hivemind generates passes; a damaged default key is refused with the way out."""
    from hivemind.p2p import P2P

    from node.argv import FlagError
    from node.inputs import check_identity

    key = tmp_path / "id.key"
    P2P.generate_identity(str(key))
    check_identity(str(key), str(tmp_path))
    check_identity(None, str(tmp_path / "fresh"))  # no key yet: p2pd makes one
    (tmp_path / "identity.key").write_bytes(b"")  # e.g. a crash while it was written
    with pytest.raises(FlagError, match=r"identity key .*identity.key \(in --state-dir\).*delete it"):
        check_identity(None, str(tmp_path))
