"""`python -m node status`: the swarm's run, stages and peers, read from the DHT."""

from __future__ import annotations

import json
import sys

from node.config import NodeConfig
from node.swarm.membership import (
    JoinError,
    read_run_record,
    read_stage_records_sync,
    remove_socket_dir,
    socket_dir,
    start_dht,
)


def run_status(args) -> int:
    cfg = NodeConfig(peers=args.peers, run_id=args.run_id, join_timeout=args.join_timeout, client_mode=True)
    sockdir = socket_dir(args.run_id)
    dht = None
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            cfg.state_dir = tmp  # a throwaway identity: status is a visitor, not a member
            dht = start_dht(cfg)
            run = read_run_record(dht, args.run_id, timeout=args.join_timeout)
            if run is None:
                raise JoinError(f"no run {args.run_id!r} found at {args.peers[0]}")
            stages = read_stage_records_sync(dht, run.run_id, len(run.stages))
    except JoinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dht is not None:
            dht.shutdown()
        remove_socket_dir(sockdir)
    if args.json:
        out = {
            "run": run.to_dict(),
            "stages": {str(i): {p: r.to_dict() for p, r in s.items()} for i, s in enumerate(stages)},
        }
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"run {run.run_id}: {run.model_name} ({run.model_hash[:12]}), {run.num_layers} layers, "
        f"codec {run.codec}, protocol {run.protocol}"
    )
    for i, (rng, peers) in enumerate(zip(run.stages, stages)):
        total = sum(r.throughput for r in peers.values() if r.ready)
        print(f"stage {i} (layers {rng[0]}..{rng[1] - 1}): {len(peers)} peer(s), {total:.0f} tok/s")
        for pid, r in sorted(peers.items()):
            state = "ready" if r.ready else "loading/leaving"
            # how others reach it: dialled (direct), it dials its callers (behind NAT, through its relays)
            how = "behind NAT" + (f", relays {' '.join(x[:8] for x in r.relays)}" if r.relays else "")
            how = how if r.reach == "reverse" else "direct" + (", relays for NAT'd peers" if r.relay else "")
            print(
                f"  {pid}  {r.circuit:6s} {state:15s} {r.throughput:8.0f} tok/s  queue {r.queue}  "
                f"step {r.inner_step}  {how}"
            )
    return 0
