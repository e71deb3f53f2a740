"""`--dp scape` in a real multi-process swarm: replicas of a stage sync sparsely every inner step."""

import asyncio
import os

import pytest
import torch

from compression.scape import next_mask, step_bytes
from node.cli import build_parser
from node.dp.scape import ScapeSync, decode_slice, encode_slice, next_lineage, winning_lineage
from node.local.launcher import read_metrics, start_node, stop_nodes, tail_steps
from node.local.report import build_report
from tests.conftest import run_swarm, wait_for

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


def _scape(timeout: float = 0.3) -> ScapeSync:
    """A real ScapeSync on a real (network-less) tail runtime's context, through its constructor."""
    from bench.reliability.fuzz import make_runtime
    from node.stage.step import StepGate

    async def routes_as_they_are() -> None:  # the test sets the routes; no DHT to read them from
        return None

    rt = make_runtime()
    return ScapeSync(rt.ctx, StepGate(4), routes_as_they_are, density=0.1, timeout=timeout)


def _grads(s: ScapeSync, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in s.params:
        p.grad = torch.randn(p.shape, generator=g)


def test_a_missing_replica_costs_one_deadline_then_is_counted():
    """A replica the routes list that never sends its values: the step waits one deadline, counts
    it missing, and goes on alone (through the public ``step``)."""
    from protocol.records import StageRecord

    s = _scape(timeout=0.3)
    s.rt.routes[s.rt.index] = {"QmSilentReplica": StageRecord(ready=True)}
    _grads(s, 0)

    async def go():
        t0 = asyncio.get_running_loop().time()
        result = await s.step(0, 1)
        return result, asyncio.get_running_loop().time() - t0

    result, waited = asyncio.run(go())
    assert result.ok and s.missing == 1 and 0.25 <= waited < 5.0, (result, s.missing, waited)


def test_winning_lineage_prefers_progress_then_majority_then_lowest_peer():
    # a replica resumed from an old checkpoint (fewer steps) never rolls the others back
    assert winning_lineage({"a": ("old", 3), "b": ("new", 7), "c": ("new", 7)}) == "new"
    assert winning_lineage({"a": ("old", 9), "b": ("new", 7), "c": ("new", 7)}) == "old"
    # equal progress (one replica went alone for a step): the majority's state
    assert winning_lineage({"a": ("x", 5), "b": ("y", 5), "c": ("y", 5)}) == "y"
    # a tie of one each: the lowest peer id's, whichever member computes it
    assert winning_lineage({"b": ("x", 5), "a": ("y", 5)}) == "y"
    # the chain: same inputs give the same lineage, any difference another one
    assert next_lineage("L", 3, "g") == next_lineage("L", 3, "g")
    assert len({next_lineage("L", 3, "g"), next_lineage("L", 4, "g"), next_lineage("M", 3, "g")}) == 3


def test_scape_state_survives_a_checkpoint(tmp_path):
    """m, err, lineage and step count after real lone steps round-trip through a checkpoint into a
    fresh replica (public state_dict / load_state_dict)."""
    from node.model.checkpoint import load_checkpoint, save_checkpoint

    a = _scape()
    for t in range(3):  # alone on the stage: plain AdamS steps move m
        _grads(a, t)
        assert asyncio.run(a.step(t, 1)).ok
    sd = a.state_dict()
    assert float(sd["m"].abs().sum()) > 0
    path = save_checkpoint(
        tmp_path,
        stage_state={"w": torch.ones(2)},
        optimizer_state={},
        extra_states={"scape": sd},
        counters={"inner_step": 3},
    )
    b = _scape()
    assert not torch.equal(b.state_dict()["m"], sd["m"])
    b.load_state_dict(load_checkpoint(path).extra_states["scape"])
    got = b.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert b.own_slice is None  # a mask agreed before the checkpoint is not trusted after it
    with pytest.raises(ValueError):  # another stage's state (another size) is refused
        b.load_state_dict({"m": torch.zeros(8), "err": torch.zeros(8)})


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
        # tail steps: the tail takes both head replicas' microbatches, so it steps about twice as
        # often as each head, and up to 3.5x under load (a fresh-clone run beside two benchmark
        # processes: heads at 5 and 4 steps when the tail reached 16); 24 leaves the heads >= 5
        # synchronised steps there too
        "24",
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
    # CRCs of the full fp32 parameter vector after every step both replicas took together: equal
    # on all of them, also after a step one took alone (a missed exchange under load, seen in 2
    # of 4 fresh-clone runs before re-anchoring), which the next exchange re-anchors
    assert c["synced_steps"] >= 5 and c["equal_steps"] == c["synced_steps"], c


def test_scape_dp_bytes_follow_density(scape_run):
    from node.model.loading import load_pretrain_model
    from node.model.stages import build_stage, default_stage_ranges

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


# slow (~70 s); SCAPE's swarm run stays in the default suite above
@pytest.mark.slow
def test_a_replica_joining_a_running_stage_is_reanchored(tmp_path):
    """A replica that joins after the stage has stepped pulls bf16 weights but not m and e; its
    first exchange re-anchors it on the running replica's state, and from then on both are
    bit-identical after every step they take together."""
    args = build_parser().parse_args(
        # --nodes 2: the head starts once the first two are up; the third joins later
        ["swarm", "--nodes", "2", "--stages", "2", "--model", MODEL, "--mode", "pretrain", "--data", "stdlib"]
        + ["--codec", "dense"]
        + ["--dp", "scape", "--density", str(DENSITY), "--dp-timeout", "10", "--lr", "3e-3"]
        + ["--seq-len", "64", "--microbatch", "4", "--batch-tokens", "512"]
    )
    run_id = f"scapejoin-{os.getpid()}"
    procs, stages = [], []
    try:
        proc, ready = start_node(args, 0, tmp_path, run_id, [], extra=["--stage", "0"])
        procs.append(proc), stages.append(ready["stage"])
        peers = [f"{ready['maddrs'][0]}/p2p/{ready['peer_id']}"]
        proc, ready = start_node(args, 1, tmp_path, run_id, peers, extra=["--stage", "1"])
        procs.append(proc), stages.append(ready["stage"])
        wait_for(lambda: tail_steps(read_metrics(tmp_path, 2), 2) >= 2, 120, "2 steps before the join")
        proc, ready = start_node(args, 2, tmp_path, run_id, peers, extra=["--stage", "1"])
        procs.append(proc), stages.append(ready["stage"])
        joiner = ready["peer_id"]

        def synced_after_join():  # steps both stage-1 replicas recorded as one group of 2
            reps = [m for m in read_metrics(tmp_path, 3) if m["stage"] == 1]
            steps = [{r["step"] for r in m["dp"]["records"] if r["group"] == 2} for m in reps]
            return len(steps) == 2 and len(steps[0] & steps[1]) >= 3

        wait_for(synced_after_join, 240, "3 synchronised steps after the join")
    finally:
        stop_nodes(procs, stages)
    rep = build_report(read_metrics(tmp_path, 3), 2)
    node = next(m for m in rep["nodes"] if m["peer_id"] == joiner)
    assert node["state_pull_bytes"] > 0
    first = next(r for r in node["dp"]["records"] if r["group"] == 2)
    assert first.get("reanchor") == "adopted", node["dp"]["records"][:3]
    donor = next(m for m in rep["nodes"] if m["stage"] == 1 and m["peer_id"] != joiner)
    assert any(r.get("reanchor") == "donor" for r in donor["dp"]["records"])
    # params, m and e in fp32 per re-anchoring: once for the join, again if a later missed exchange
    # under load made them part (seen in a fresh-clone run: a donor's state can also miss its
    # adopter's deadline, which then steps alone and is re-anchored at the next exchange)
    numel, pair = node["dp"]["numel"], (node["dp"], donor["dp"])
    received, sent = sum(d["anchor_received"] for d in pair), sum(d["anchor_bytes"] for d in pair)
    donations = sum(r.get("reanchor") == "donor" for d in pair for r in d["records"])
    adoptions = received // (12 * numel)
    assert 1 <= adoptions <= donations and received == adoptions * 12 * numel, (received, numel, donations)
    assert donations * 12 * numel <= sent <= donations * (12 * numel + HEADER), (sent, donations)
    c = rep["dp"]["consistency"]["1"]
    # the steps waited for above: the same parameters on both after every one of them
    assert c["synced_steps"] >= 3 and c["equal_steps"] == c["synced_steps"], c
