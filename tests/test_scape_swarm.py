"""`--dp scape` in a real multi-process swarm: replicas of a stage sync sparsely every inner step."""

import asyncio

import pytest
import torch

from compression.scape import next_mask, step_bytes
from node.scape import ScapeSync, decode_slice, encode_slice
from tests.conftest import run_swarm

MODEL, DENSITY, HEADER = "tiny:2:128", 0.1, 400  # a scape frame's header is ~150 B


@pytest.mark.parametrize("density", [0.001, 0.1, 0.5])
def test_mask_slices_survive_the_wire_encoding(density):
    numel, world, segs = 10_007, 3, [5000, 7, 5000]
    scores = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    for rank in range(world):
        idx = next_mask(scores, density, (rank, world), segs)
        enc = encode_slice(idx, rank, world, numel)
        # indices when they are smaller than a bitmap of the slice, as step_bytes counts
        assert ("i" in enc) == (idx.numel() * 4 <= (len(range(rank, numel, world)) + 7) // 8)
        assert torch.equal(decode_slice(enc, rank, world, numel), idx)


def test_a_missing_replica_costs_one_deadline_then_is_counted():
    s = object.__new__(ScapeSync)  # only the inbox side: no runtime needed
    s.inbox, s._cond, s.timeout, s.missing = {}, None, 0.3, 0

    async def go():
        t0 = asyncio.get_running_loop().time()
        got = await s._collect("values", 3, ["peerA"])
        return got, asyncio.get_running_loop().time() - t0

    got, waited = asyncio.run(go())
    assert got == {} and s.missing == 1 and 0.25 <= waited < 2.0


def test_scape_state_survives_a_checkpoint(tmp_path):
    from node.checkpoint import load_checkpoint, save_checkpoint

    s = object.__new__(ScapeSync)
    s.m, s.err = torch.zeros(7), torch.zeros(7)
    m, err = torch.randn(7), torch.randn(7)
    path = save_checkpoint(
        tmp_path,
        stage_state={"w": torch.ones(2)},
        optimizer_state={},
        extra_states={"scape": {"m": m, "err": err}},
        counters={"inner_step": 3},
    )
    s.load_state_dict(load_checkpoint(path).extra_states["scape"])
    assert torch.equal(s.m, m) and torch.equal(s.err, err) and s.own_slice is None
    with pytest.raises(ValueError):
        s.load_state_dict({"m": torch.zeros(8), "err": torch.zeros(8)})


@pytest.fixture(scope="module")
def scape_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scape") / "run"
    # 3 nodes, 2 stages: one stage gets 2 replicas, which must sync every step
    return run_swarm(
        out,
        "--nodes",
        "3",
        "--stages",
        "2",
        "--steps",
        "10",
        "--model",
        MODEL,
        "--mode",
        "pretrain",
        "--data",
        "stdlib",
        "--dp",
        "scape",
        "--density",
        str(DENSITY),
        # both replicas stay alive here: a generous deadline keeps a loaded CI machine from
        # sending one replica on alone (which would make the replicas differ for a step)
        "--dp-timeout",
        "60",
        "--lr",
        "3e-3",
        "--seq-len",
        "64",
        "--microbatch",
        "4",
        "--batch-tokens",
        "512",
        timeout=300,
    )


def _replicas(rep):
    stage = next(s for s, peers in rep["stages"].items() if len(peers) == 2)
    return int(stage), [m for m in rep["nodes"] if m["stage"] == int(stage)]


def test_scape_swarm_trains_and_keeps_replicas_identical(scape_run):
    loss = scape_run["loss"]
    assert len(loss) >= 10 and sum(loss[-3:]) / 3 < 0.8 * loss[0], loss
    dp = scape_run["dp"]
    assert dp["mode"] == "scape" and dp["bytes"] > 0 and dp["bytes_per_token"] > 0
    stage, _ = _replicas(scape_run)
    c = dp["consistency"][str(stage)]
    # CRCs of the full fp32 parameter vector after each step both replicas took together, up to
    # the first step a replica took alone (a missed exchange under load: from there they differ,
    # nothing re-anchors them yet; seen in 2 of 4 fresh-clone runs, so it is not asserted away)
    assert c["synced_before_alone"] >= 1 and c["equal_before_alone"] == c["synced_before_alone"], c


def test_scape_dp_bytes_follow_density(scape_run):
    from node.model import load_pretrain_model
    from node.stages import build_stage, default_stage_ranges

    stage, nodes = _replicas(scape_run)
    model = load_pretrain_model(MODEL, seed=0)[0]
    params = [p for p in build_stage(model, default_stage_ranges(model, 2), stage).parameters()]
    segs = [p.numel() for p in params]
    numel = sum(segs)
    sparse_ref = step_bytes(numel, DENSITY, 2, segments=segs)
    for m in nodes:
        synced = [r for r in m["dp"]["records"] if r["group"] == 2]
        dense = [r for r in synced if r["dense"]]
        sparse = [r for r in synced if not r["dense"] and r["mask_bytes"]]
        assert dense and dense[0]["step"] == 0 and len(sparse) >= 2, synced
        for r in dense:  # step 0: every coordinate in bf16
            assert r["nnz"] == numel and 2 * numel <= r["values_bytes"] <= 2 * numel + HEADER
        for r in sparse:
            assert r["nnz"] == sparse_ref["nnz"]
            assert sparse_ref["values"] <= r["values_bytes"] <= sparse_ref["values"] + HEADER
            # this replica's slice of the next mask: a bitmap of half the vector at d = 0.1
            assert abs(r["mask_bytes"] - sparse_ref["exchange"]) <= HEADER + len(segs)
            assert r["values_bytes"] + r["mask_bytes"] < (DENSITY + 0.05) * dense[0]["values_bytes"]
