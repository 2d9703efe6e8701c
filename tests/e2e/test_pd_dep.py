"""PD disaggregation across expert-parallel groups: a DEP2 prefill server handing over to a DEP4
decode server through the proxy (real processes, NIXL over UCX tcp on loopback).

Every rank has its own NIXL agent, so the ranks need no mapping table: the prefill server's
router picks the rank that prefills, the params name that rank's agent and listener, and
whichever decode rank its router picks READs from it (connecting once per prefill rank). Six
requests of different lengths must give the prefill server's own plain (colocated) output.

Opt-in (RINGSERVE_SLOW_E2E=1): eight processes take minutes to boot on a 2-core machine.
"""
from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: PD disaggregation needs NIXL")
if os.environ.get("RINGSERVE_SLOW_E2E") != "1":
    pytest.skip("six worker processes: set RINGSERVE_SLOW_E2E=1 to run", allow_module_level=True)

from server_process import API_KEY, children, segments_of  # noqa: E402
from test_pd import COMMON, UCX_ENV, Proxy, _Deferred, _holds_nothing, _kv  # noqa: E402


def test_dep2_prefill_hands_over_to_a_dep4_decode(model_dir):
    import aiohttp

    os.environ.update(UCX_ENV)
    ep = ("--enable-expert-parallel", "--kv-connect-timeout", "20")  # handshakes wait for busy lockstep loops
    pre = _Deferred(model_dir, *COMMON, *ep, "--dp", "2", "--kv-role", "prefill", "--kv-transfer", "nixl")
    dec = _Deferred(model_dir, *COMMON, *ep, "--dp", "4", "--kv-role", "decode", "--kv-transfer", "nixl")
    proxy = Proxy(model_dir.parent, [pre.url], [dec.url])
    procs = [pre, dec, proxy]
    try:
        for p in procs:
            p.wait_ready(300)

        async def run(url: str) -> list[str]:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            async with aiohttp.ClientSession(headers=headers) as s:
                async def one(i: int) -> str:
                    body = {"model": "tiny", "prompt": [(5 * i + 3 * j) % 200 + 1 for j in range(20 + 7 * i)],
                            "max_tokens": 5, "temperature": 0, "ignore_eos": True}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["choices"][0]["text"]

                return await asyncio.gather(*(one(i) for i in range(6)))

        assert asyncio.run(run(proxy.url)) == asyncio.run(run(pre.url))
        rank_loads = [r["kv_transfer"]["loaded"] for r in dec.get("/kv_transfer/stats", API_KEY)[1]["ranks"]]
        assert sum(rank_loads) == 6 and _kv(dec)["failed"] == 0
        _holds_nothing(pre, dec)
        assert proxy.stop() == 0
        for s in (pre, dec):
            pid = s.proc.pid
            assert s.stop() == 0, s.output()
            assert not segments_of(pid) and not children(pid)
    finally:
        for p in procs:
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, 9)
