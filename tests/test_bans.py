"""BanList: strikes within a window ban a peer for a while; pure logic, injected time."""

from __future__ import annotations

import pytest

from node.net.bans import BanList


def test_threshold_within_window_bans_then_expires():
    b = BanList(threshold=3, window_s=10, ban_s=100)
    assert not b.record_bad("A", now=0) and not b.record_bad("A", now=1)
    assert not b.is_banned("A", now=2)
    assert b.record_bad("A", now=2)
    assert b.is_banned("A", now=2) and b.is_banned("A", now=101.9)
    assert b.banned_until("A", now=50) == 102 and b.banned(now=50) == ["A"]
    assert not b.record_bad("A", now=50)  # strikes while banned do not extend the ban
    assert not b.is_banned("A", now=102) and b.strikes("A", now=102) == 0
    assert not b.is_banned("B", now=2)
    assert b.bans_total == 1


def test_strikes_outside_the_window_do_not_add_up():
    b = BanList(threshold=3, window_s=10, ban_s=100)
    for t in (0, 6, 12, 18, 24):  # never 3 within 10 s
        assert not b.record_bad("A", now=t)
    assert not b.is_banned("A", now=25) and b.strikes("A", now=25) == 2


def test_good_frames_forgive_strikes():
    b = BanList(threshold=3, window_s=60, ban_s=100)
    for t in range(20):  # an honest peer with one defect in two frames
        b.record_bad("A", now=t)
        b.record_good("A", now=t + 0.5)
    assert not b.is_banned("A", now=20)
    for t in range(3):  # a peer sending only garbage
        b.record_bad("B", now=t)
    assert b.is_banned("B", now=3)


def test_peer_ids_are_strings_and_memory_is_bounded():
    class PeerID:
        def __str__(self):
            return "QmX"

    b = BanList(threshold=1, window_s=10, ban_s=5, max_peers=4)
    assert b.record_bad(PeerID(), now=0) and b.is_banned("QmX", now=1)
    b2 = BanList(threshold=2, window_s=10, ban_s=5, max_peers=100)
    for i in range(10_000):
        b2.record_bad(f"p{i}", now=i * 0.001)
    assert len(b2) <= 100
    for i in range(1000):
        b.record_bad(f"q{i}", now=2)
    assert len(b) <= 4
    b.prune(now=100)
    assert len(b) == 0


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        BanList(threshold=0)
