"""Tied embeddings stay tied across processes (issue 14 item 2): one step of a 2-stage swarm
equals one step of the whole model, and the head's and the tail's copies stay bit-identical."""

import asyncio
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from node.dp.strategies import mean_and_clip
from node.dp.tied import partner_gradient, tied_payload
from node.model.checkpoint import load_latest
from node.model.data import ByteTokenizer, Example, collate, tokenize
from node.model.loading import tiny_config
from node.model.stages import causal_lm_loss, default_stage_ranges
from protocol.frames import FrameError
from tests.conftest import wait_for

LR = 1e-3
SEQ = 32
TEXT = "Q: 12+34=\nA: 46"


def _join(tmp, name: str, model_dir, data, *extra: str) -> subprocess.Popen:
    d = tmp / name
    d.mkdir()
    cmd = [
        sys.executable, "-m", "node", "join",
        "--model", str(model_dir), "--stages", "2", "--run-id", "tied-test",
        "--codec", "dense", "--wire-dtype", "float32",
        "--lr", str(LR), "--clip", "1e9", "--seq-len", str(SEQ), "--microbatch", "1",
        "--batch-tokens", "1", "--max-inflight", "1", "--max-steps", "1", "--checkpoint-every", "1",
        "--data", str(data), "--threads", "1",
        "--state-dir", str(d / "state"), "--metrics-file", str(d / "metrics.json"),
        "--ready-file", str(d / "ready.json"),
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(d / "out.txt", "w"), stderr=subprocess.STDOUT)


def _full_name(name: str, start: int) -> str:
    if name.startswith("layers."):
        idx, rest = name.split(".", 2)[1:]
        return f"model.layers.{start + int(idx)}.{rest}"
    return name if name.startswith("lm_head") else "model." + name


def test_two_stage_swarm_step_equals_whole_model_step(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=2, tie=True)).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)  # tied: stores no lm_head
    data = tmp_path / "data.txt"
    data.write_text(TEXT + "\n")  # one example: every microbatch is this one

    procs = [_join(tmp_path, "a", model_dir, data)]
    try:
        ready = tmp_path / "a" / "ready.json"
        wait_for(lambda: ready.exists() or procs[0].poll() is not None, 240, "the first node's ready file")
        assert ready.exists(), (tmp_path / "a" / "out.txt").read_text()[-3000:]
        peers = json.loads(ready.read_text())["maddrs"]
        procs.append(_join(tmp_path, "b", model_dir, data, "--peers", *peers))
        for p, n in zip(procs, "ab"):
            assert p.wait(timeout=400) == 0, (tmp_path / n / "out.txt").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    metrics = {m["role"]: m for m in (json.loads((tmp_path / n / "metrics.json").read_text()) for n in "ab")}
    assert set(metrics) == {"head", "tail"}
    for m in metrics.values():
        assert m["inner_step"] == 1 and m["tied"]["exchanged"] == 1 and m["tied"]["missed"] == 0
    # the head sends ids + rows of its batch's tokens, the tail the dense V x H lm_head gradient
    v, h = model.config.vocab_size, model.config.hidden_size
    assert metrics["tail"]["tied"]["bytes_sent"] > 4 * v * h > metrics["head"]["tied"]["bytes_sent"]

    # the whole model, one step of AdamW on the same microbatch
    ids, labels = collate([tokenize(ByteTokenizer(v), Example(TEXT, ""), SEQ)], v - 1)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    causal_lm_loss(ref(input_ids=ids).logits, labels)[0].backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt.step()
    want = dict(ref.named_parameters())

    got: dict[str, list[torch.Tensor]] = {}
    for n in "ab":
        m = json.loads((tmp_path / n / "metrics.json").read_text())
        ck = load_latest(os.path.join(m["state_dir"], "checkpoints", "tied-test", f"stage-{m['stage']}"))
        assert ck is not None and ck.counters["inner_step"] == 1
        start = default_stage_ranges(model, 2)[m["stage"]][0]
        for name, t in ck.stage_state.items():
            full = _full_name(name, start)
            got.setdefault("model.embed_tokens.weight" if full == "lm_head.weight" else full, []).append(t)
    assert set(got) == set(want)
    for name, tensors in got.items():
        for t in tensors:
            torch.testing.assert_close(t, want[name].detach(), rtol=0, atol=1e-5, msg=name)
    head_copy, tail_copy = got["model.embed_tokens.weight"]
    assert torch.equal(head_copy, tail_copy)  # the copies stay bit-identical
    before = model.model.embed_tokens.weight.detach()
    assert (head_copy - before).abs().max() > 10 * 1e-5  # the step moved them (lr 1e-3, Adam)


def _tied_grads():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 4))
    dense = torch.randn(16, 4)
    sparse = torch.zeros(16, 4)
    sparse[[1, 5, 9]] = torch.randn(3, 4)
    return p, dense, sparse


def test_payload_round_trips_exactly_and_sparse_rows_only():
    p, dense, sparse = _tied_grads()
    head = tied_payload(sparse, from_head=True)
    assert head["ids"].tolist() == [1, 5, 9] and head["rows"].shape == (3, 4)
    assert torch.equal(partner_gradient(head, p, from_head=True), sparse)
    assert torch.equal(partner_gradient(tied_payload(dense, from_head=False), p, from_head=False), dense)


@pytest.mark.parametrize(
    "tensors, from_head, match",
    [
        ({"grad": torch.zeros(16, 5)}, False, "shape"),
        ({"grad": torch.zeros(16, 4, dtype=torch.float64)}, False, "float32"),
        ({"grad": torch.zeros(16, 4), "x": torch.zeros(1)}, False, "one"),
        ({"ids": torch.tensor([1, 16]), "rows": torch.zeros(2, 4)}, True, r"in \[0, 16\)"),
        ({"ids": torch.tensor([-1]), "rows": torch.zeros(1, 4)}, True, "in"),
        ({"ids": torch.tensor([3, 3]), "rows": torch.zeros(2, 4)}, True, "distinct"),
        ({"ids": torch.tensor([3]), "rows": torch.zeros(2, 4)}, True, "rows"),
        ({"ids": torch.tensor([3], dtype=torch.int32), "rows": torch.zeros(1, 4)}, True, "int64"),
        ({"rows": torch.zeros(1, 4)}, True, "'ids'"),
    ],
)
def test_partner_gradient_that_does_not_fit_is_refused(tensors, from_head, match):
    p, _, _ = _tied_grads()
    with pytest.raises(FrameError, match=match):
        partner_gradient(tensors, p, from_head)


def test_clip_treats_the_tied_tensor_alike_on_both_sides():
    """The head's other parameters differ from the tail's (here: a large and a small gradient); the
    tied tensor is clipped by its own norm on both, so both copies take the same clipped gradient."""
    torch.manual_seed(1)
    own_h, own_t = torch.randn(16, 4), torch.randn(16, 4)
    sides = []
    for own, partner, other in ((own_h, own_t, 100.0), (own_t, own_h, 0.01)):
        tied = torch.nn.Parameter(torch.zeros(16, 4))
        rest = torch.nn.Parameter(torch.zeros(8))
        tied.grad, rest.grad = own * 2, torch.full((8,), other) * 2  # summed over 2 microbatches
        assert mean_and_clip([rest, tied], 2, 1.0, tied=(tied, partner.clone()))
        sides.append((tied.grad, rest.grad))
    (g_head, r_head), (g_tail, r_tail) = sides
    assert torch.equal(g_head, g_tail)
    total = own_h + own_t
    torch.testing.assert_close(g_head, total / total.norm(), rtol=1e-6, atol=0)  # clipped to norm 1
    torch.testing.assert_close(r_head.norm(), torch.tensor(1.0))  # the rest by their own norm
    torch.testing.assert_close(r_tail, torch.full((8,), 0.01))  # under the clip: unchanged


class _Gate:
    def __init__(self) -> None:
        self.refused = 0

    async def set_refusing(self, refusing: bool) -> None:
        self.refused += refusing


def test_a_side_waits_only_for_a_partner_that_pairs_with_it():
    """Each side judges "one head, one tail" from its own DHT view, and the views can differ (seen:
    a tail that saw one of two heads waited 30 s for it at every step, refusing the heads' work,
    and the run stalled). Real p2pd daemons on loopback, three TiedExchanges with chosen views:
    the tail sees only head 1, head 1 sees its replica head 2. The tail must step at once without
    holding its gate, and not offer its (dense) gradient again for REPAIR_EVERY steps; a head and a
    tail that see only each other still exchange exactly, the one that sends first waiting."""
    from hivemind.p2p import P2P

    from node.config import NodeConfig
    from node.dp.tied import REPAIR_EVERY, TIED_HANDLER, TiedExchange
    from node.stage.compute import Compute
    from node.stage.context import StageContext
    from node.stage.metrics import Metrics
    from protocol.records import RunRecord, StageRecord

    run = RunRecord(
        run_id="views", model_name="m", model_hash="h", num_layers=2, hidden=4, stages=[[0, 1], [1, 2]]
    )
    _, dense, sparse = _tied_grads()

    async def main():
        peers = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
        addrs = [str(a) for a in await peers[0].get_visible_maddrs()]
        peers += [await P2P.create(initial_peers=addrs) for _ in range(2)]
        h1, h2, t = (str(p.peer_id) for p in peers)
        ready = StageRecord(circuit="fast", ready=True)
        try:
            sides = []
            for p2p, index in zip(peers, (0, 0, 1)):
                ctx = StageContext(
                    NodeConfig(), run, index, None, str(p2p.peer_id), Compute(), Metrics(), p2p=p2p
                )
                ex = TiedExchange(ctx, torch.nn.Parameter(torch.zeros(16, 4)), 20.0, _no_refresh)
                await p2p.add_binary_stream_handler(TIED_HANDLER, ex.handle)
                sides.append(ex)
            head1, _, tail = sides
            head1.ctx.routes = [{h1: ready, h2: ready}, {t: ready}]
            tail.ctx.routes = [{h1: ready}, {t: ready}]  # head 2 not (yet, or no longer) in its view

            gate, t0 = _Gate(), asyncio.get_running_loop().time()
            assert await asyncio.wait_for(tail.exchange(0, dense, gate), 10) is None
            assert asyncio.get_running_loop().time() - t0 < 5 and gate.refused == 0
            m = tail.ctx.metrics
            assert (m.tied_unpaired, m.tied_missed, m.tied_exchanged) == (1, 0, 0) and not head1.inbox
            sent = m.tied_bytes_sent
            assert sent > dense.numel() * 4
            for step in range(1, REPAIR_EVERY):  # declined: no dense gradient each step
                assert await tail.exchange(step, dense, gate) is None
            assert m.tied_bytes_sent == sent and m.tied_unpaired == REPAIR_EVERY
            assert await tail.exchange(REPAIR_EVERY, dense, gate) is None  # then it offers again
            assert m.tied_bytes_sent == 2 * sent

            head1.ctx.routes = [{h1: ready}, {t: ready}]  # head 2 left: both views agree now
            head1.ctx.inner_step = tail.ctx.inner_step = REPAIR_EVERY + 1
            head_gate = _Gate()

            async def tail_late():
                await asyncio.sleep(1.0)  # the head offers first (ending the tail's pause) and waits
                return await tail.exchange(REPAIR_EVERY + 1, dense, gate)

            got_head, got_tail = await asyncio.wait_for(
                asyncio.gather(head1.exchange(REPAIR_EVERY + 1, sparse, head_gate), tail_late()), 30
            )
            assert torch.equal(got_tail, sparse) and torch.equal(got_head, dense)
            assert head_gate.refused == 1 and m.tied_exchanged == head1.ctx.metrics.tied_exchanged == 1

            # the tail ends step 12 unpaired (head 1 sees head 2 again); head 1's view then agrees
            # and it offers step 12 late: the tail has ended that step, so the head must not wait
            step = REPAIR_EVERY + 2
            head1.ctx.routes = [{h1: ready, h2: ready}, {t: ready}]
            assert await tail.exchange(step, dense, gate) is None
            head1.ctx.routes = [{h1: ready}, {t: ready}]
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(head1.exchange(step, sparse, head_gate), 10) is None
            assert asyncio.get_running_loop().time() - t0 < 5 and head_gate.refused == 1
        finally:
            for p in peers:
                await p.shutdown()

    asyncio.run(main())


async def _no_refresh() -> None:
    pass
