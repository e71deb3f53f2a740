"""A basis fetch passes over a holder that no longer serves bases (node/stage/basis.py).

Found by a soak run (bench/reliability/soak.py): a late joiner picked, among the basis holders in the DHT,
the peer that had just left on SIGTERM (its handlers removed, its record not yet expired).
p2pd refused the stream with ``ControlFailure: protocols not supported: [vnode.basis]``, which
the fetch did not catch, and the joiner exited with code 2 instead of asking the next holder.
Real p2pd daemons on loopback.
"""

import asyncio

import torch

from node.stage.basis import HANDLER, BasisStore, digest


def test_fetch_skips_a_holder_without_the_handler(monkeypatch):
    from hivemind.p2p import P2P

    payload = {
        "mean": torch.randn(16),
        "V": torch.randn(16, 4),
        "version": torch.tensor([1], dtype=torch.int64),
    }
    want = digest(payload)

    async def main():
        good = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        gone = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # a leaver: no basis handler
        addrs = [str(a) for p in (good, gone) for a in await p.get_visible_maddrs()]
        cli = await P2P.create(initial_peers=addrs)
        try:
            server = BasisStore("r", None, str(good.peer_id), timeout=20)
            server.add(0, payload)
            server.p2p = good
            await good.add_binary_stream_handler(HANDLER, server.handle)
            client = BasisStore("r", None, str(cli.peer_id), timeout=20)
            client.p2p = cli

            async def holders(boundary, version):  # the DHT's answer: the leaver first
                return [(str(gone.peer_id), want), (str(good.peer_id), want)]

            client.holders = holders
            monkeypatch.setattr("node.stage.basis.random.shuffle", lambda xs: None)
            got = await asyncio.wait_for(client._download(0, 1), 60)
            assert digest(got) == want and client.bytes_fetched > 0
        finally:
            for p in (cli, gone, good):
                await p.shutdown()

    asyncio.run(main())
