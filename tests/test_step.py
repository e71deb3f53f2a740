"""``node.dp.strategies.mean_and_clip`` (the one place summed microbatch gradients become the step's
mean, clipped) and ``StepGate`` (bounded in-flight work; a step only when none is in flight)."""

import asyncio

import pytest
import torch

from node.dp.strategies import RoundClock, mean_and_clip, outer_round_due
from node.stage.step import Busy, StepGate


def _summed_grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for x in batches:  # one backward per microbatch: gradients add up, as in the pipeline
        model(x).pow(2).mean().backward()


@pytest.mark.parametrize("factor", [0.5, 10.0])  # the clip binds (every entry scaled) / does not
def test_mean_and_clip_matches_the_full_batch_gradient_clipped_by_hand(factor):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    batches = [torch.randn(4, 6) for _ in range(3)]
    _summed_grads(model, batches)
    params = list(model.parameters())
    # reference: the gradient of the mean loss over the microbatches, from a separate model copy
    ref = torch.nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    torch.stack([ref(x).pow(2).mean() for x in batches]).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    norm = torch.sqrt(sum((g**2).sum() for g in want))
    clip = float(norm) * factor
    assert mean_and_clip(params, 3, clip)
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad, g * min(1.0, clip / norm), rtol=1e-5, atol=1e-7)


def test_mean_only_and_a_filter_between_mean_and_clip():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 6.0)
    seen = []
    assert mean_and_clip(list(model.parameters()), 3, None, lambda: seen.append(model.weight.grad.clone()))
    assert torch.equal(seen[0], torch.full((2, 2), 2.0))  # the filter saw the mean
    assert torch.equal(model.weight.grad, torch.full((2, 2), 2.0))  # clip=None: no clipping


def test_non_finite_gradient_is_reported():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.bias.grad[0] = float("inf")
    assert not mean_and_clip(list(model.parameters()), 2, 1.0)


# ---------------------------------------------------------------------- the step gate


def _run(coro):
    return asyncio.run(coro)


def test_gate_caps_inflight_microbatches():
    async def main():
        gate = StepGate(cap=2)
        await gate.enter(1.0)
        await gate.enter(1.0)
        with pytest.raises(asyncio.TimeoutError):  # a third waits for a slot
            await gate.enter(0.1)
        waiter = asyncio.create_task(gate.enter(2.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await gate.exit()  # a slot frees: the waiter gets it
        await asyncio.wait_for(waiter, 1.0)
        assert gate.inflight == 2

    _run(main())


def test_step_runs_only_when_nothing_is_inflight_and_holds_new_work_back():
    async def main():
        gate = StepGate(cap=4)
        events: list[str] = []
        await gate.enter(1.0)

        async def step():
            events.append(f"step with {gate.inflight} in flight")
            await asyncio.sleep(0.1)
            events.append("step done")

        stepping = asyncio.create_task(gate.run_exclusive(step, 2.0))
        await asyncio.sleep(0.05)
        assert events == []  # the microbatch in flight drains first
        assert not await gate.run_exclusive(step, 1.0)  # a second step while one is pending: refused
        late = asyncio.create_task(gate.enter(2.0))  # new work waits for the step
        await asyncio.sleep(0.05)
        assert not late.done()
        await gate.exit()
        assert await asyncio.wait_for(stepping, 2.0)
        await asyncio.wait_for(late, 1.0)
        assert events == ["step with 0 in flight", "step done"]

    _run(main())


def test_step_gives_up_when_inflight_work_never_drains():
    async def main():
        gate = StepGate(cap=2)
        await gate.enter(1.0)
        ran = []

        async def step():
            ran.append(1)

        assert not await gate.run_exclusive(step, 0.1)
        assert ran == [] and not gate.stepping
        await gate.enter(0.5)  # the gate is open again for work

    _run(main())


def test_refusing_gate_turns_work_away_at_once():
    async def main():
        gate = StepGate(cap=1)
        await gate.enter(1.0)
        waiter = asyncio.create_task(gate.enter(5.0))  # waiting for the only slot
        await asyncio.sleep(0.05)
        await gate.set_refusing(True)  # an outer round begins: the waiter leaves now, not in 5 s
        with pytest.raises(Busy):
            await asyncio.wait_for(waiter, 0.5)
        with pytest.raises(Busy):
            await gate.enter(1.0)
        await gate.set_refusing(False)
        await gate.exit()
        await gate.enter(0.5)

    _run(main())


def _simulate_rounds(
    rates: list[float],
    every: int,
    ticks: int,
    follow: bool,
    gone: dict[int, range] | None = None,
    start: list[int] | None = None,
    hidden: dict[int, range] | None = None,
    patience: float = 2.5,
) -> list[dict[int, int]]:
    """Replicas stepping at ``rates`` steps per tick (a tick: a heartbeat), each seeing the others'
    step of one tick ago; replica j is dead during ``gone[j]`` (no step, no record), its record is
    missed by the others' reads during ``hidden[j]`` (it steps on), and its count starts at
    ``start[j]``. Per replica, round index -> the tick it entered that round (entering one twice
    fails: it would wait out the timeout alone)."""
    pos = [float(x) for x in start or [0] * len(rates)]
    seen = [int(p) for p in pos]  # what each replica's stage record announced last tick
    clocks = [RoundClock() for _ in rates]
    gone, hidden = gone or {}, hidden or {}
    entered: list[dict[int, int]] = [{} for _ in rates]
    for tick in range(ticks):
        announced = list(seen)
        for i, rate in enumerate(rates):
            if tick in gone.get(i, ()):
                continue
            before = int(pos[i])
            pos[i] += rate
            if int(pos[i]) == before:
                continue  # no inner step finished this tick: no look at the rounds
            unseen = [j for j in range(len(rates)) if tick in gone.get(j, ()) or tick in hidden.get(j, ())]
            peers = [s for j, s in enumerate(announced) if j != i and j not in unseen]
            due = outer_round_due(int(pos[i]), peers if follow else [], every, clocks[i], tick, patience)
            if due is not None:
                assert due not in entered[i], f"replica {i} entered round {due} again at tick {tick}"
                entered[i][due] = tick
        seen = [int(p) for p in pos]
    return entered


def test_replicas_at_different_rates_enter_each_round_together():
    # two heads that share the same tails: one gets twice the other's microbatches
    fast, slow = _simulate_rounds([1.0, 0.5], every=5, ticks=62, follow=True)
    assert sorted(fast) == list(range(1, 13)) and sorted(slow) == sorted(fast)
    # the slower replica enters the round the faster one is in, a heartbeat plus a step later
    assert all(0 <= slow[r] - fast[r] <= 2 for r in fast), (fast, slow)
    # each replica's own count alone: the slow one reaches round r at twice the fast one's tick
    fast, slow = _simulate_rounds([1.0, 0.5], every=5, ticks=60, follow=False)
    assert max(slow[r] - fast[r] for r in slow) > 10


def test_equal_rates_take_each_round_once_and_a_lone_replica_keeps_its_cadence():
    a, b = _simulate_rounds([1.0, 1.0], every=4, ticks=40, follow=True)
    assert a == b and sorted(a) == list(range(1, 11))
    (alone,) = _simulate_rounds([1.0], every=4, ticks=40, follow=True)
    assert alone == {r: 4 * r - 1 for r in range(1, 11)}


def test_when_the_furthest_replica_dies_the_others_take_rounds_on_their_own_counts():
    # replica 0 has stepped 100 more times than replica 1 (a joiner counts from 0); 0 dies at tick 20
    ahead, behind = _simulate_rounds(
        [1.0, 1.0], every=5, ticks=60, follow=True, gone={0: range(20, 100)}, start=[100, 0]
    )
    assert ahead == {21: 4, 22: 9, 23: 14, 24: 19}
    assert all(behind[r] - ahead[r] == 1 for r in (21, 22, 23)), behind  # together, a beat apart
    # 0 entered round 24 and died. Once it stayed gone 2.5 beats, 1 follows its own count (step 25 at
    # tick 24): a round every 5 steps. Before the fix: none until its count passed 0's (step 125)
    assert {r: t for r, t in behind.items() if r < 21} == {r: 24 + 5 * (r - 5) for r in range(5, 13)}, behind


def test_a_replica_hidden_for_a_read_is_not_left_behind():
    # replica 0 leads by 50 steps; for one beat the other's reads miss its record (it steps on)
    a, b = _simulate_rounds([1.0, 1.0], every=5, ticks=60, follow=True, start=[50, 0])
    a2, b2 = _simulate_rounds(
        [1.0, 1.0], every=5, ticks=60, follow=True, start=[50, 0], hidden={0: range(31, 33)}
    )
    assert (a2, b2) == (a, b)  # the same rounds at the same beats: 1 waited for 0 to come back (1 was in 16)
    # following at once instead: 1 would take round 16 again once 0's record was back
    with pytest.raises(AssertionError, match="entered round 16 again"):
        _simulate_rounds([1.0, 1.0], every=5, ticks=60, follow=True, start=[50, 0], hidden={0: range(31, 33)},
                         patience=0)  # fmt: skip
