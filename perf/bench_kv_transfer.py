"""KV transfer benchmark: NIXL READ over UCX tcp on loopback vs memcpy of the same bytes.

A spawned server process registers one region shaped like a V4 pool (`--tensors` layers of
`--block-bytes` per block; default 21 × 37,376 B = the fp8 c4 pool at block size 256); this
process READs block sets of a few sizes from it (random block ids, so NIXL cannot merge
descriptors) and reports median GB/s next to a torch gather/scatter copy of the same blocks
(what a local copy would cost) and a flat memcpy of the same byte count, plus the CRC32C
digest rate the decode side pays to verify what it read. Also: connect (metadata +
handshake) time and the latency of a one-block READ.

Run: ``python perf/bench_kv_transfer.py [--quick] [--json OUT]`` (sets UCX_TLS=tcp unless set).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from engine.kv_transfer import digest  # noqa: E402
from engine.kv_transfer.nixl_transport import NixlTransport, unique_name  # noqa: E402
from perf.machine import cpu_model  # noqa: E402


def _region(num_blocks: int, tensors: int, block_bytes: int, fill: int) -> list[torch.Tensor]:
    return [torch.full((num_blocks, block_bytes), fill, dtype=torch.uint8) for _ in range(tensors)]


def serve(conn, name: str, port: int, num_blocks: int, tensors: int, block_bytes: int) -> None:
    torch.set_num_threads(1)
    t = NixlTransport(name, port)
    t.register({"pool": _region(num_blocks, tensors, block_bytes, 7)})
    conn.send("ready")
    while not conn.poll(0.001):
        t.pump()  # answers the handshake
    t.close()


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tensors", type=int, default=21)
    ap.add_argument("--block-bytes", type=int, default=584 * 64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [4, 32] if args.quick else [4, 32, 256]
    reps = 3 if args.quick else 5
    num_blocks = max(sizes) + 8
    torch.set_num_threads(1)

    ctx = mp.get_context("spawn")
    name, port = unique_name("bench-prefill"), _free_port()
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(child, name, port, num_blocks, args.tensors, args.block_bytes))
    server.start()
    results: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "ucx_tls": os.environ["UCX_TLS"],
                     "tensors": args.tensors, "block_bytes": args.block_bytes, "rows": []}
    try:
        if not parent.poll(120):
            raise RuntimeError("server did not start")
        parent.recv()
        local = _region(num_blocks, args.tensors, args.block_bytes, 0)
        t = NixlTransport(unique_name("bench-decode"), None)
        t.register({"pool": local})
        start = time.perf_counter()
        t.connect(name, "127.0.0.1", port)
        results["connect_ms"] = (time.perf_counter() - start) * 1e3
        results["one_block_read_ms"] = _median_s(lambda: t.read(name, "pool", [1], [2]).wait(30), 20) * 1e3
        src = _region(num_blocks, args.tensors, args.block_bytes, 7)  # local copy for the memcpy baselines
        g = torch.Generator().manual_seed(0)
        for n in sizes:
            ids = (torch.randperm(num_blocks - 1, generator=g)[:n] + 1).tolist()
            dst_ids = (torch.randperm(num_blocks - 1, generator=g)[:n] + 1).tolist()
            nbytes = n * args.tensors * args.block_bytes
            read_s = _median_s(lambda: t.read(name, "pool", ids, dst_ids, timeout_s=300).wait(300), reps)
            assert all(bool((x[dst_ids] == 7).all()) for x in local), "READ result is wrong"
            idx, didx = torch.tensor(ids), torch.tensor(dst_ids)

            def gather():  # what the same block move costs inside one process
                for s, d in zip(src, local):
                    d.index_copy_(0, didx, s.index_select(0, idx))

            flat_src, flat_dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            gather_s = _median_s(gather, reps)
            memcpy_s = _median_s(lambda: flat_dst.copy_(flat_src), reps)
            digest_s = _median_s(lambda: digest.block_digests(local, dst_ids), reps)
            results["rows"].append({"blocks": n, "bytes": nbytes, "read_gbps": nbytes / read_s / 1e9,
                                    "gather_gbps": nbytes / gather_s / 1e9, "memcpy_gbps": nbytes / memcpy_s / 1e9,
                                    "digest_gbps": nbytes / digest_s / 1e9})
        t.close()
    finally:
        parent.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join()
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print(r: dict) -> None:
    print(f"# CPU: {r['cpu']} ({r['cores']} cores); UCX_TLS={r['ucx_tls']}; loopback; host memory")
    print(f"# region: {r['tensors']} tensors x {r['block_bytes']} B per block; random block ids; medians")
    print(f"connect (metadata + handshake): {r['connect_ms']:.0f} ms; "
          f"one-block READ ({r['tensors']} descriptors): {r['one_block_read_ms']:.2f} ms")
    print(f"{'blocks':>7} {'MiB':>8} {'READ GB/s':>10} {'gather GB/s':>12} {'memcpy GB/s':>12} "
          f"{'READ/memcpy':>12} {'crc32c GB/s':>12}")
    for row in r["rows"]:
        print(f"{row['blocks']:>7} {row['bytes'] / 2**20:>8.1f} {row['read_gbps']:>10.3f} {row['gather_gbps']:>12.3f} "
              f"{row['memcpy_gbps']:>12.3f} {row['read_gbps'] / row['memcpy_gbps']:>12.3f} {row['digest_gbps']:>12.3f}")


if __name__ == "__main__":
    main()
