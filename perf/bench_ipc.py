"""IPC benchmark: ShmRing vs multiprocessing.Pipe vs ZeroMQ (ipc://), plus memcpy, idle CPU and
the message codec (encode + decode of the messages a request and a step send).

One-way latency is half the round trip of a ping-pong with a spawned echo process; throughput is a
one-way stream of 1 MiB messages. Run: ``python perf/bench_ipc.py [--quick] [--json OUT]``.
Goals: ring p50 <= 1/5 of ZeroMQ's; 1 MiB throughput >= 0.5 x memcpy; idle reader < 2% of a core.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ipc import codec  # noqa: E402
from ipc.messages import Finished, SamplingParams, StepOutputs, Submit, TokenDelta  # noqa: E402
from ipc.ring import RingConfig, RingReader, RingWriter  # noqa: E402
from perf.machine import cpu_model  # noqa: E402

MIB = 1 << 20
_ZMQ_IDS = itertools.count()
LAT_CFG = RingConfig(slot_bytes=8192, num_slots=16)
BIG_CFG = RingConfig(slot_bytes=MIB + 64, num_slots=4)  # 4 MiB: stays in the shared cache


# ---- child processes ----------------------------------------------------------------------------
def ring_echo(req: str, rep: str, n: int) -> None:
    r, w = RingReader.attach(req, LAT_CFG), RingWriter.attach(rep, LAT_CFG)
    for _ in range(n):
        with r.acquire_read() as view:
            w.put(view)
    w.close(), r.close()


def pipe_echo(conn, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(conn.recv_bytes())


def zmq_echo(addr: str, n: int) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(addr)
    for _ in range(n):
        sock.send(sock.recv())
    sock.close(linger=1000)


def ring_source(name: str, n: int, size: int) -> None:
    w = RingWriter.attach(name, BIG_CFG)
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    for _ in range(n):
        w.put(data)
    w.close()


def pipe_source(conn, n: int, size: int) -> None:
    data = bytes(size)
    for _ in range(n):
        conn.send_bytes(data)


def zmq_source(addr: str, n: int, size: int) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(addr)
    data = bytes(size)
    for _ in range(n):
        sock.send(data)
    sock.close(linger=5000)


def ring_idle(name: str, seconds: float, conn) -> None:
    r = RingReader.attach(name)
    t0, w0 = os.times(), time.monotonic()
    try:
        r.get(timeout=seconds)
    except TimeoutError:
        pass
    t1 = os.times()
    conn.send(((t1.user - t0.user + t1.system - t0.system) / (time.monotonic() - w0)))
    r.close()


# ---- measurements ---------------------------------------------------------------------------------
def one_way_us(samples_ns: list[int]) -> tuple[float, float]:
    a = np.asarray(samples_ns) / 2e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def lat_ring(ctx, size: int, n: int, warm: int) -> tuple[float, float]:
    req, rep = RingWriter.create(LAT_CFG), RingReader.create(LAT_CFG)
    p = ctx.Process(target=ring_echo, args=(req.name, rep.name, n + warm))
    p.start()
    msg, out = os.urandom(size), []
    for i in range(n + warm):
        t = time.perf_counter_ns()
        req.put(msg)
        with rep.acquire_read():
            pass
        if i >= warm:
            out.append(time.perf_counter_ns() - t)
    p.join(), req.close(), rep.close()
    return one_way_us(out)


def lat_pipe(ctx, size: int, n: int, warm: int) -> tuple[float, float]:
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_echo, args=(b, n + warm))
    p.start()
    msg, out = os.urandom(size), []
    for i in range(n + warm):
        t = time.perf_counter_ns()
        a.send_bytes(msg)
        a.recv_bytes()
        if i >= warm:
            out.append(time.perf_counter_ns() - t)
    p.join()
    return one_way_us(out)


def _zmq_pair(tmp: str):
    import zmq

    addr = f"ipc://{tmp}/bench-{next(_ZMQ_IDS)}.sock"  # fresh endpoint: no stale peer reconnects
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)  # a crashed child must not hang the benchmark
    sock.setsockopt(zmq.RCVHWM, 4)  # bounded queues, like the ring's 4 slots (else ~1 GB queued)
    sock.bind(addr)
    return sock, addr


def lat_zmq(ctx, size: int, n: int, warm: int, tmp: str) -> tuple[float, float]:
    sock, addr = _zmq_pair(tmp)
    p = ctx.Process(target=zmq_echo, args=(addr, n + warm))
    p.start()
    msg, out = os.urandom(size), []
    for i in range(n + warm):
        t = time.perf_counter_ns()
        sock.send(msg)
        sock.recv()
        if i >= warm:
            out.append(time.perf_counter_ns() - t)
    p.join(), sock.close(linger=0)
    return one_way_us(out)


def tput(ctx, kind: str, n: int, tmp: str, zero_copy: bool = False) -> float:
    """GB/s of 1 MiB messages, timed at the receiver from the first to the last message."""
    size = MIB
    if kind == "ring":
        r = RingReader.create(BIG_CFG)
        p = ctx.Process(target=ring_source, args=(r.name, n + 1, size))
        p.start()
        r.get(timeout=30)
        t = time.perf_counter()
        for _ in range(n):
            if zero_copy:
                with r.acquire_read(timeout=30):
                    pass
            else:
                r.get(timeout=30)
        dt = time.perf_counter() - t
        p.join(), r.close()
    elif kind == "pipe":
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=pipe_source, args=(b, n + 1, size))
        p.start()
        a.recv_bytes()
        t = time.perf_counter()
        for _ in range(n):
            a.recv_bytes()
        dt = time.perf_counter() - t
        p.join()
    else:
        sock, addr = _zmq_pair(tmp)
        p = ctx.Process(target=zmq_source, args=(addr, n + 1, size))
        p.start()
        sock.recv()
        t = time.perf_counter()
        for _ in range(n):
            sock.recv()
        dt = time.perf_counter() - t
        p.join(), sock.close(linger=0)
    return n * size / dt / 1e9


def memcpy_gbs(size: int, reps: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return size * reps / (time.perf_counter() - t) / 1e9


def idle_cpu(ctx, seconds: float) -> float:
    w = RingWriter.create(RingConfig(slot_bytes=256, num_slots=4))
    a, b = ctx.Pipe()
    p = ctx.Process(target=ring_idle, args=(w.name, seconds, b))
    p.start()
    frac = a.recv()
    p.join(), w.close()
    return 100 * frac


def codec_messages() -> dict[str, object]:
    delta = TokenDelta(7, [1234])
    top5 = TokenDelta(7, [1, 2, 3, 4], [-0.1] * 4, [[(i, -0.5)] * 5 for i in range(4)])
    return {
        "Submit, 1k-token prompt": Submit(7, list(range(1000)), SamplingParams(max_tokens=64, seed=3)),
        "StepOutputs, 1 delta of 1 token": StepOutputs([delta], []),
        "StepOutputs, 4 tokens + top-5 logprobs": StepOutputs([top5], []),
        "StepOutputs, 64 deltas + 8 finishes": StepOutputs([TokenDelta(i, [i]) for i in range(64)],
                                                           [Finished(i, "stop", 100, 20) for i in range(8)]),
    }


def codec_us(msg, reps: int) -> tuple[float, float]:
    """(encode µs, decode µs), best of 5 rounds."""
    raw = codec.encode(msg)
    enc = min(_timed(lambda: codec.encode(msg), reps) for _ in range(5))
    dec = min(_timed(lambda: codec.decode(raw), reps) for _ in range(5))
    return enc, dec


def _timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--runs", type=int, default=3, help="repeat each measurement, report the median")
    ap.add_argument("--json", help="append results as one JSON line to this file")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    n_lat, n_big = (2000, 200) if args.quick else (20000, 1000)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as tmp:
        for size, label in ((64, "64B"), (4096, "4KB")):
            for kind, fn in (("ring", lat_ring), ("pipe", lat_pipe), ("zmq", lat_zmq)):
                extra = (tmp,) if kind == "zmq" else ()
                runs = [fn(ctx, size, n_lat, 500, *extra) for _ in range(args.runs)]
                res[f"{kind}_{label}_p50_us"] = med([r[0] for r in runs])
                res[f"{kind}_{label}_p99_us"] = med([r[1] for r in runs])
                progress(f"{kind} {label} latency p50 {res[f'{kind}_{label}_p50_us']:.1f} us")
        for kind in ("ring", "pipe", "zmq"):
            res[f"{kind}_1MB_GBps"] = med([tput(ctx, kind, n_big, tmp) for _ in range(args.runs)])
            progress(f"{kind} 1 MiB throughput {res[f'{kind}_1MB_GBps']:.2f} GB/s")
        res["ring_zero_copy_1MB_GBps"] = med([tput(ctx, "ring", n_big, tmp, True) for _ in range(args.runs)])
    res["memcpy_1MB_GBps"] = med([memcpy_gbs(MIB, 2000) for _ in range(args.runs)])
    res["memcpy_256MB_GBps"] = med([memcpy_gbs(256 * MIB, 4) for _ in range(args.runs)])
    res["idle_reader_cpu_pct"] = idle_cpu(ctx, 3.0 if args.quick else 10.0)
    report(res)
    print(f"\n{'codec (msgspec msgpack)':<40}{'bytes':>8}{'encode us':>11}{'decode us':>11}")
    for name, msg in codec_messages().items():
        enc, dec = codec_us(msg, 2000 if args.quick else 20000)
        res[f"codec_{name}_us"] = enc + dec
        print(f"{name:<40}{len(codec.encode(msg)):>8}{enc:>11.2f}{dec:>11.2f}")
    if args.json:
        res.update(host=platform.node(), cpus=os.cpu_count() or 0, python=platform.python_version())
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def report(r: dict[str, float]) -> None:
    print(f"ringserve IPC, {cpu_model()}, {os.cpu_count()} CPUs")
    print(f"{'one-way latency (us)':<28}{'ring':>10}{'Pipe':>10}{'ZeroMQ':>10}{'ring/ZMQ':>10}")
    for label in ("64B", "4KB"):
        for q in ("p50", "p99"):
            ring, pipe, zmq = (r[f"{k}_{label}_{q}_us"] for k in ("ring", "pipe", "zmq"))
            print(f"{label + ' ' + q:<28}{ring:>10.1f}{pipe:>10.1f}{zmq:>10.1f}{ring / zmq:>10.2f}")
    print(f"\n{'1 MiB throughput (GB/s)':<28}{'ring':>10}{'Pipe':>10}{'ZeroMQ':>10}{'ring/ZMQ':>10}")
    ring, pipe, zmq = (r[f"{k}_1MB_GBps"] for k in ("ring", "pipe", "zmq"))
    print(f"{'copying get()':<28}{ring:>10.2f}{pipe:>10.2f}{zmq:>10.2f}{ring / zmq:>10.2f}")
    print(f"{'zero-copy acquire_read()':<28}{r['ring_zero_copy_1MB_GBps']:>10.2f}")
    print(f"\nmemcpy 1 MiB (cache-hot) {r['memcpy_1MB_GBps']:.2f} GB/s; 256 MiB (DRAM) {r['memcpy_256MB_GBps']:.2f} GB/s")
    print(f"ring get() / memcpy: {ring / r['memcpy_1MB_GBps']:.2f} (hot), {ring / r['memcpy_256MB_GBps']:.2f} (DRAM)")
    print(f"idle reader: {r['idle_reader_cpu_pct']:.3f}% of a core")
    goals = [
        ("p50 64B <= 1/5 ZeroMQ", r["ring_64B_p50_us"] <= r["zmq_64B_p50_us"] / 5),
        ("p50 4KB <= 1/5 ZeroMQ", r["ring_4KB_p50_us"] <= r["zmq_4KB_p50_us"] / 5),
        ("1 MiB >= 0.5 x memcpy (hot)", ring >= 0.5 * r["memcpy_1MB_GBps"]),
        ("1 MiB >= 0.5 x memcpy (DRAM)", ring >= 0.5 * r["memcpy_256MB_GBps"]),
        ("idle reader < 2% of a core", r["idle_reader_cpu_pct"] < 2.0),
    ]
    print("\ngoals: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in goals))


if __name__ == "__main__":
    main()
