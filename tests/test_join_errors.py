"""join fails fast and in one line when it cannot do its job."""

import re
import subprocess
import sys
import time

import pytest


def _join(*args, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "node", "join", *args], capture_output=True, text=True, timeout=timeout
    )
    return p, time.monotonic() - t0


def test_unreachable_peer_fails_within_timeout_in_one_line(tmp_path):
    p, elapsed = _join(
        "--peers",
        "/ip4/127.0.0.1/tcp/9/p2p/QmVYrYryoFJ8RGNyRYjYpHbJbJfqoPe7kA9qQeUDJePUda",
        "--join-timeout",
        "5",
        "--p2pd-timeout",
        "30",  # a loaded 2-core machine can take seconds to start p2pd; the join timeout is what we test
        "--model",
        "tiny",
        "--state-dir",
        str(tmp_path),
    )
    assert p.returncode != 0
    assert elapsed < 5 + 30 + 20
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert "bootstrap" in errors[0] or "reach" in errors[0]


def test_bad_peer_address_is_one_line(tmp_path):
    p, _ = _join(
        "--peers", "not-a-multiaddr", "--model", "tiny", "--state-dir", str(tmp_path), "--join-timeout", "5"
    )
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error:")


def _subparsers():
    import argparse

    from node.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("cmd", sorted(_subparsers()))
def test_help_documents_every_flag(cmd):
    """Every flag the parser accepts has help text and appears, as a whole word, in ``--help``."""
    import argparse

    flags = [
        (opt, a.help)
        for a in _subparsers()[cmd]._actions
        if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS  # internal (swarm's)
        for opt in a.option_strings
        if opt.startswith("--")
    ]
    out = _subparsers()[cmd].format_help()  # what `python -m node CMD --help` prints
    for flag, text in flags:
        assert text and text.strip(), f"{cmd} {flag} has no help text"
        # a whole word: --stage must not pass because --stages is documented
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), f"{cmd} --help lacks {flag}"


def test_stage_that_does_not_fit_is_refused_in_one_line(tmp_path):
    p, _ = _join("--model", "tiny", "--max-memory", "0.00001", "--state-dir", str(tmp_path))
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert "--max-memory" in p.stderr.strip().splitlines()[-1]


def test_lora_targets_of_no_layer_are_refused_before_the_run_is_published(tmp_path):
    """Found once the model's skeleton is known, before the run record: one line naming the layers
    (it was ``error: AdapterError: ...`` once the stage had loaded)."""
    p, _ = _join(
        "--model", "tiny", "--stages", "1", "--finetune", "lora", "--lora-targets", "nope_proj",
        "--state-dir", str(tmp_path), "--join-timeout", "5",
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "AdapterError" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lora-targets 'nope_proj' names no linear layer"), p.stderr
    assert "q_proj" in last
    assert "started swarm" not in p.stdout
