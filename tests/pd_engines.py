"""What the PD tests share: NIXL over UCX tcp on loopback, decode pools poisoned so that a record
the transfer missed cannot pass for a zero, and stepping a prefill/decode pair to a finish."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


@contextmanager
def ucx_environment():
    """UCX_ENV in os.environ (inherited by child processes too), the previous values restored after."""
    saved = {k: os.environ.get(k) for k in UCX_ENV}
    os.environ.update(UCX_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def poison_pools(engine) -> None:
    """Every pool block but block 0 (the zeroed dummy block) filled with 0xFF bytes."""
    for pool in engine.cache.pools.values():
        for t in pool.tensors.values():
            t[1:].view(torch.uint8).fill_(0xFF)


def collect(engine, others: tuple, rid: int, timeout_s: float = 60.0):
    """Step `engine` (and tick the others) until request `rid` finishes: (tokens, logprobs, Finished)."""
    tokens, logprobs, end = [], [], time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < end, f"request {rid} did not finish"
        out = engine.step()
        for e in others:
            e.step()
        for d in out.deltas:
            if d.request_id == rid:
                tokens += d.token_ids
                logprobs += d.logprobs or []
        for f in out.finished:
            if f.request_id == rid:
                return tokens, logprobs, f


def wait_for_leases(pre, dec, timeout_s: float = 60.0) -> None:
    """Step both engines until the prefill holds no lease (released, or expired); the bound is
    wide because a lease may have to run out on a loaded machine."""
    end = time.monotonic() + timeout_s
    while pre.connector.prefill.leases:
        assert time.monotonic() < end, "the prefill still holds a lease"
        pre.step()
        dec.step()
