"""Peer programs for tests/engine/test_kv_transfer.py, run as real child processes.

The test starts them from a multiprocessing forkserver that preloads torch and NIXL (a fresh
interpreter importing torch takes seconds on a shared 2-core machine; a fork of the preloaded
server takes milliseconds), and talks to them over a multiprocessing Pipe of plain tuples.

`serve`: a prefill-like KV server. It registers regions filled deterministically from a seed
(`fill_regions`, which the test process calls too, so it checks bytes against its own copy)
and answers commands while pumping its transport: digests, bit flips, notifications, state.

`leakcheck`: a decode-like reader that measures its threads, fds and sockets before creating a
transport, connects, READs, closes, and measures again; it also checks the closed agent's own
state (metadata without memory sections, no remote agent, its old memory no longer usable).
"""
from __future__ import annotations

import gc
import os
import time

import torch

from engine.kv_transfer import digest
from engine.kv_transfer.nixl_transport import NixlTransport

DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}


def fill_regions(spec: dict, seed: int) -> dict[str, list[torch.Tensor]]:
    """spec: {region: {"tensors": n, "blocks": N, "shape": [...], "dtype": str, "fill": "random"|int}}
    → region tensors [N, *shape]; 'random' bytes come from `seed` and the region's position."""
    out = {}
    for i, name in enumerate(sorted(spec)):
        s = spec[name]
        tensors = []
        for t in range(s["tensors"]):
            x = torch.empty((s["blocks"], *s["shape"]), dtype=DTYPES[s["dtype"]])
            raw = x.view(torch.uint8)
            if s["fill"] == "random":
                g = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + t)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
            else:
                raw.fill_(int(s["fill"]))
            tensors.append(x)
        out[name] = tensors
    return out


def resources() -> dict:
    """Threads, open fds and sockets of this process."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(fds), "sockets": sockets}


def _setup(env: dict) -> None:
    os.environ.update(env)  # UCX reads its transports when the agent is created
    torch.set_num_threads(1)


def serve(conn, env: dict, name: str, port: int, spec: dict, seed: int, identity: dict) -> None:
    _setup(env)
    regions = fill_regions(spec, seed)
    transport = NixlTransport(name, port, identity=identity)
    transport.register(regions)
    conn.send(("ready", {"pid": os.getpid(), "hash": transport.layout_digest()}))
    try:
        while True:
            for peer, data in transport.notifications():
                conn.send(("notif", (peer, data)))
            if conn.poll(0.002):
                try:
                    cmd = conn.recv()
                except EOFError:  # the test process went away: never outlive it
                    return
                if _command(conn, transport, regions, cmd) == "exit":
                    return
    finally:
        transport.close()


def _command(conn, transport: NixlTransport, regions, cmd: tuple) -> str | None:
    op, *args = cmd
    if op == "digests":
        names, blocks = args
        conn.send(("digests", digest.block_digests([t for n in names for t in regions[n]], blocks)))
    elif op == "flip":
        region, tensor, block, byte, bit = args
        regions[region][tensor][block].view(torch.uint8).reshape(-1)[byte] ^= 1 << bit
        conn.send(("flipped", None))
    elif op == "notify":
        peer, data = args
        transport.send_notification(peer, data)
        conn.send(("sent", None))
    elif op == "state":
        conn.send(("state", transport.state()))
    elif op == "exit":
        return "exit"
    return None


def leakcheck(conn, env: dict, name: str, server: str, port: int, spec: dict, seed: int) -> None:
    _setup(env)
    regions = fill_regions(spec, seed + 1)  # other bytes than the server's
    expected = fill_regions(spec, seed)
    torch.zeros(4).add_(1)  # torch's lazily started threads belong to the baseline
    before = resources()
    transport = NixlTransport(name, None)
    agent = transport._agent
    empty_md = len(agent.get_agent_metadata())
    transport.register(regions)
    registered_md = len(agent.get_agent_metadata())
    transport.connect(server, "127.0.0.1", port)
    region = sorted(spec)[0]
    transport.read(server, region, [1, 2, 3], [3, 2, 1]).wait(10)
    exact = all(torch.equal(r[[3, 2, 1]], e[[1, 2, 3]]) for r, e in zip(regions[region], expected[region]))
    during = resources()
    transport.close()
    after_md = len(agent.get_agent_metadata())
    remote_left = agent.check_remote_metadata(server)
    try:
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", regions[region])
        prep_refused = False
    except Exception:
        prep_refused = True
    del agent, transport
    gc.collect()
    time.sleep(0.2)  # NIXL joins its threads in the agent's destructor; its sockets close with it
    conn.send(("result", {"before": before, "during": during, "after": resources(), "exact": exact,
                          "md": [empty_md, registered_md, after_md], "remote_left": remote_left,
                          "prep_refused": prep_refused}))
