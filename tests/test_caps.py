"""node.net.caps: the bounds every handler's streams pass before a byte is read (pure, time injected)."""

from __future__ import annotations

import pytest

from node.net.caps import Caps, Limits, OverCap
from node.swarm.recheck import RouteRecheck


def test_per_peer_bound_refuses_that_peer_only_and_is_not_struck():
    caps = Caps(Limits(per_peer=2, total=10))
    caps.admit("a", now=0)
    caps.admit("a", now=0)
    with pytest.raises(OverCap, match="over 2 concurrent streams") as e:
        caps.admit("a", now=0)
    assert not e.value.strike and e.value.code == "busy"
    caps.admit("b", now=0)  # another peer is not refused because of a
    caps.release("a")
    caps.admit("a", now=0)  # a released stream makes room again
    assert caps.active == 3 and caps.refused == 1


def test_node_wide_bound_holds_against_minted_peer_ids():
    caps = Caps(Limits(per_peer=1, total=3))
    for i in range(3):
        caps.admit(f"minted{i}", now=0)
    with pytest.raises(OverCap, match="serves 3 such streams at once") as e:
        caps.admit("minted3", now=0)
    assert not e.value.strike
    caps.release("minted0")
    caps.admit("honest", now=0)


def test_rate_is_a_token_bucket_and_is_struck():
    caps = Caps(Limits(per_peer=1, total=1, rate=1.0, burst=3))
    for t in (0.0, 0.1, 0.2):  # the burst
        with caps.hold("a", now=t):
            pass
    with pytest.raises(OverCap, match=r"over 1 requests/s") as e:
        caps.admit("a", now=0.3)
    assert e.value.strike and caps.active == 0  # a refusal holds nothing
    with caps.hold("b", now=0.3):  # another key has its own bucket
        pass
    with caps.hold("a", now=1.3):  # one token back after 1 s
        pass
    with pytest.raises(OverCap):
        caps.admit("a", now=1.4)


def test_concurrency_is_checked_before_the_rate_and_costs_no_token():
    caps = Caps(Limits(per_peer=1, total=5, rate=1.0, burst=1))
    caps.admit("a", now=0)
    for _ in range(5):  # refused for concurrency: no token spent, no strike
        with pytest.raises(OverCap) as e:
            caps.admit("a", now=0)
        assert not e.value.strike
    caps.release("a")
    caps.admit("b", now=0)
    caps.release("b")
    with caps.hold("a", now=1.0):  # its bucket refilled; the refused tries cost it nothing
        pass


def test_tracked_keys_are_bounded():
    caps = Caps(Limits(per_peer=1, total=1, rate=1.0, burst=2), max_peers=100)
    for i in range(1000):
        with caps.hold(f"minted{i}", now=0):
            pass
    assert len(caps._tokens) <= 100 and caps.active == 0 and not caps._held


def test_limits_are_checked():
    with pytest.raises(ValueError):
        Limits(per_peer=2, total=1)
    with pytest.raises(ValueError):
        Limits(per_peer=1, total=1, burst=0.5)


def test_route_recheck_refreshes_at_most_every_few_seconds(monkeypatch):
    import asyncio

    import node.swarm.recheck as recheck

    now = [100.0]
    monkeypatch.setattr(recheck.time, "monotonic", lambda: now[0])
    calls = []

    async def refresh() -> None:
        calls.append(now[0])

    r = RouteRecheck(refresh, every_s=2.0)

    async def main():
        for _ in range(50):  # a flood of unknown senders within one second
            await r()
            now[0] += 0.02
        now[0] += 2.0
        await r()

    asyncio.run(main())
    assert len(calls) == 2 and r.refreshes == 2
