"""The head's NodeChannel over real ZeroMQ sockets, against a scripted node (a DEALER that speaks
the node vocabulary): a node that keeps saying NodeAlive stays up however long its ranks take to
load; a node that goes silent has its ranks declared exited after node_timeout_s."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from engine.distributed.group import pick_free_port
from server.links import DECODE, ENCODE, NodeAlive, NodeChannel, NodeHello, NodeWelcome


async def _joined_node(port: int, first_rank: int, num_ranks: int, digest: str):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    await sock.send(ENCODE(NodeHello(first_rank, num_ranks, digest)))
    return ctx, sock


async def _scenario(alive_for_s: float, timeout_s: float) -> tuple[bool, float | None]:
    """A node joins, says NodeAlive every 0.2 s for `alive_for_s`, then nothing. Returns whether its
    rank was still up when it stopped talking, and how long after that the head declared it gone."""
    port = pick_free_port()
    channel = NodeChannel("127.0.0.1", port, node_timeout_s=timeout_s)
    ctx, sock = await _joined_node(port, 1, 1, "digest")
    try:
        (link,) = await channel.accept([(1, 1)], "digest", "gen", capacity=1 << 20, timeout=10)
        assert isinstance(DECODE(await asyncio.wait_for(sock.recv(), 5)), NodeWelcome)
        loop = asyncio.get_running_loop()
        until = loop.time() + alive_for_s
        while loop.time() < until:
            await sock.send(ENCODE(NodeAlive()))
            silent_since = loop.time()
            await asyncio.sleep(0.2)
        up_while_talking = link.is_alive()
        while link.is_alive() and loop.time() - silent_since < timeout_s + 5:
            await asyncio.sleep(0.05)
        gone_after = None if link.is_alive() else loop.time() - silent_since
        return up_while_talking, gone_after
    finally:
        sock.close(linger=0)
        ctx.term()
        await channel.close()


def test_a_node_that_says_alive_outlives_the_silence_timeout_and_a_silent_one_does_not():
    up, gone_after = asyncio.run(_scenario(alive_for_s=2.0, timeout_s=1.0))  # talking for twice the timeout
    assert up, "a node sending NodeAlive was declared gone while its ranks (say) were loading"
    assert gone_after is not None and 0.9 <= gone_after <= 3.5, gone_after


@pytest.mark.parametrize("timeout_s", [1.0])
def test_silence_is_reported_with_the_reason(timeout_s):
    async def run():
        port = pick_free_port()
        channel = NodeChannel("127.0.0.1", port, node_timeout_s=timeout_s)
        ctx, sock = await _joined_node(port, 2, 2, "d")
        try:
            links = await channel.accept([(2, 2)], "d", "gen", capacity=1 << 20, timeout=10)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s + 5
            while any(link.is_alive() for link in links) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            return [(link.exitcode, link.reason) for link in links]
        finally:
            sock.close(linger=0)
            ctx.term()
            await channel.close()

    for code, reason in asyncio.run(run()):
        assert code == 1 and "sent nothing" in reason
