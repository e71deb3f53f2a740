import time

from node.swarm.health import check_health, write_health


def test_health_states(tmp_path):
    ok, msg = check_health(str(tmp_path))
    assert not ok and "missing" in msg
    write_health(str(tmp_path), {"serving": False, "state": "loading"})
    ok, msg = check_health(str(tmp_path))
    assert not ok and "not serving" in msg
    write_health(str(tmp_path), {"serving": True, "stage": 1, "peer_id": "Qm", "inner_step": 3})
    assert check_health(str(tmp_path))[0]
    ok, msg = check_health(str(tmp_path), now=time.time() + 3600)
    assert not ok and "ago" in msg
