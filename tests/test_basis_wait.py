"""A node that joins while the run's starter is still calibrating waits for the basis (node/stage/linkio.py).

The starter prints the join command, then calibrates every boundary (~40 s for the bundled model on
a CPU) before it announces a basis; a joiner that started in between used to exit at once with
BasisUnavailable. The store below is the DHT side's stand-in: it announces nothing for a while.
"""

import asyncio

import pytest

from node.stage.basis import BasisUnavailable
from node.stage.linkio import LinkIO
from protocol.records import RunRecord


class _LateStore:
    def __init__(self, announce_after: int):
        self.calls, self.after, self.fetched = 0, announce_after, []

    async def latest_version(self, boundary: int):
        self.calls += 1
        return 3 if self.calls > self.after else None

    async def fetch(self, boundary, version, codec):
        self.fetched.append((boundary, version))


def _linkio() -> LinkIO:
    run = RunRecord(
        run_id="r",
        model_name="m",
        model_hash="h",
        num_layers=2,
        hidden=64,
        stages=[[0, 1], [1, 2]],
        codec={"codec": "pca", "k": 8, "coeff_dtype": "int8"},
    )
    return LinkIO(run, 1, vocab=512, peer_id="QmTail", dense_only=False)


def test_joiner_waits_for_a_basis_that_is_announced_late(monkeypatch):
    monkeypatch.setattr("node.stage.linkio.BASIS_POLL_S", 0.01)
    io = _linkio()
    io.bases = _LateStore(announce_after=3)
    asyncio.run(io.install_bases(wait_s=5.0))
    assert io.bases.fetched == [(0, 3)] and io.bases.calls == 4


def test_joiner_gives_up_after_the_wait_with_one_line(monkeypatch):
    monkeypatch.setattr("node.stage.linkio.BASIS_POLL_S", 0.01)
    io = _linkio()
    io.bases = _LateStore(announce_after=10**9)
    with pytest.raises(BasisUnavailable, match="after 0s") as e:
        asyncio.run(io.install_bases(wait_s=0.05))
    assert "\n" not in str(e.value)
