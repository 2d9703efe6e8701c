"""The KV transport seam: a transport that is not NIXL (tests/engine/inproc_transport.py, one
module and one registry line) runs the whole transfer protocol — side channel, handshake,
compatibility hash, geometry, transfer states and errors — and carries a prefill/decode pair of
engines end to end, selected by `--kv-transfer` / `KVTransferConfig.transport` alone.

References: the bytes a READ lands are compared with the source tensors' own bytes (torch
slicing), and the disaggregated request's tokens and logprobs with a colocated engine's.
"""
from __future__ import annotations

import argparse
import socket
import time

import msgspec
import pytest
import torch

from engine.kv_transfer import protocol, registry
from engine.kv_transfer.config import KVTransferConfig
from engine.kv_transfer.regions import unique_name
from engine.kv_transfer.transport import IncompatiblePeer, KVTransport, TransferFailed
from tests.engine.inproc_transport import NAME, InProcTransport

SHAPES = {"c4": ([3, 8, 4, 24], torch.uint8), "swa": ([2, 6, 16, 8], torch.float32)}  # [tensors, blocks, ...]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _regions(seed: int, shapes=SHAPES) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, ([n, *shape], dtype) in shapes.items():
        if dtype == torch.uint8:
            out[name] = [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for _ in range(n)]
        else:
            out[name] = [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]
    return out


def _pair(identity=None, reader_identity=None, reader_shapes=SHAPES):
    port = _free_port()
    server = registry.open_transport(NAME, unique_name("prefill"), port, identity=identity or {"model": "m"})
    reader = registry.open_transport(NAME, unique_name("decode"), None,
                                     identity=reader_identity or identity or {"model": "m"})
    server.register(_regions(1))
    reader.register(_regions(2, reader_shapes))
    return server, reader, port


def _connect(reader, server, port: int, expected_hash: str | None = None) -> None:
    """Connect while the server pumps (one thread drives both ends here)."""
    pending = reader.start_connect(server.name, "127.0.0.1", port, expected_hash, timeout_s=10)
    while pending.poll() == "pending":
        server.notifications()
        time.sleep(0.002)


def _poll(transfer, server, limit: int = 50) -> int:
    """Poll a READ to its end while the server pumps; the number of polls it took."""
    for i in range(1, limit):
        server.notifications()
        if transfer.poll() == "done":
            return i
    raise AssertionError("READ did not finish")


def test_the_registry_selects_the_transport_the_flag_names():
    assert NAME in registry.transport_names() and "nixl" in registry.transport_names()
    assert registry.transport_class(NAME) is InProcTransport and issubclass(InProcTransport, KVTransport)
    registry.check_installed(NAME)
    config = KVTransferConfig(transport=NAME)
    assert msgspec.json.decode(config.to_json(), type=KVTransferConfig) == config  # as it travels to a worker
    with pytest.raises(ValueError, match="unknown KV transport 'mooncake'"):
        KVTransferConfig(transport="mooncake")
    with pytest.raises(msgspec.ValidationError, match="unknown KV transport"):
        msgspec.json.decode(b'{"transport": "mooncake"}', type=KVTransferConfig)
    from server.pd import add_pd_args, kv_transfer_config_from

    p = argparse.ArgumentParser()
    add_pd_args(p)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(["--kv-role", "prefill", "--kv-transfer", NAME])
    assert kv_transfer_config_from(args, None).transport == NAME


def test_the_protocol_connects_and_reads_over_a_data_plane_without_nixl():
    server, reader, port = _pair()
    try:
        assert server.layout_digest() == reader.layout_digest()  # same identity, same geometry
        _connect(reader, server, port)
        assert reader.is_connected(server.name) and reader.peers() == [server.name]
        server.notifications()
        assert server.served() == [reader.name]
        src, dst = server._regions, reader._regions
        before = {n: [t.clone() for t in r.tensors] for n, r in dst.items()}
        c4_bytes, swa_bytes = src["c4"].block_bytes, src["swa"].block_bytes
        spans = [("c4", 1, 5, 0, c4_bytes), ("c4", 2, 7, 16, 40), ("swa", 0, 3, 64, swa_bytes - 64)]
        done = protocol.encode_notification(protocol.KVDone(["lease-1"]))
        t = reader.read_spans(server.name, spans, done, timeout_s=10)
        assert t.state == "pending" and t.nbytes == 3 * c4_bytes + 3 * 40 + 2 * (swa_bytes - 64)
        assert _poll(t, server) > 1  # pending first, like a real READ
        expected = {n: [b.clone() for b in before[n]] for n in before}
        for region, lblock, rblock, offset, nbytes in spans:
            for e, s in zip(expected[region], src[region].tensors):
                e[lblock].view(-1).view(torch.uint8)[offset:offset + nbytes] = \
                    s[rblock].view(-1).view(torch.uint8)[offset:offset + nbytes]
        for n in dst:  # the spans landed, and nothing else changed
            for got, want in zip(dst[n].tensors, expected[n]):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), n
        assert server.notifications() == [(reader.name, done)]  # the READ's completion notice
        assert reader.state()["pending_transfers"] == 0
    finally:
        reader.close()
        server.close()
    assert reader.state()["closed"] and server.state()["regions"] == []


def test_a_different_identity_or_geometry_is_an_incompatible_peer():
    server, reader, port = _pair(identity={"model": "m@1"}, reader_identity={"model": "m@2"})
    try:
        with pytest.raises(IncompatiblePeer, match="refused us: compatibility hash"):
            _connect(reader, server, port)
        assert not reader.is_connected(server.name) and not server.served()
    finally:
        reader.close()
        server.close()
    smaller = {**SHAPES, "swa": ([2, 6, 16, 4], torch.float32)}
    server, reader, port = _pair(reader_shapes=smaller)
    try:  # the reader expects the server's hash (so the server accepts) but its own geometry differs
        with pytest.raises(IncompatiblePeer, match="region swa: 2 tensors of 512 B blocks, we have 2 of 256 B"):
            _connect(reader, server, port, expected_hash=server.layout_digest())
        assert not reader.is_connected(server.name)
    finally:
        reader.close()
        server.close()


def test_a_read_fails_when_its_peer_goes_or_stalls_and_the_peer_is_dropped():
    server, reader, port = _pair()
    try:
        _connect(reader, server, port)
        block = server._regions["c4"].block_bytes
        with pytest.raises(ValueError, match="outside a"):  # spans are checked against both geometries
            reader.read_spans(server.name, [("c4", 1, 1, 8, block)])
        with pytest.raises(KeyError, match="idx"):
            reader.read_spans(server.name, [("idx", 1, 1, 0, 8)])
        reader.stall = True
        t = reader.read_spans(server.name, [("c4", 1, 1, 0, 8)], timeout_s=0.0)
        with pytest.raises(TransferFailed, match="timed out") as failed:
            _poll(t, server)
        assert failed.value.cause == "timeout" and t.state == "failed"
        assert not reader.is_connected(server.name)  # disconnected: nothing more can land from it
        reader.stall = False
        _connect(reader, server, port)
        t = reader.read_spans(server.name, [("c4", 1, 1, 0, 8)], timeout_s=10)
        server.close()
        with pytest.raises(TransferFailed, match="went away"):
            t.poll()
        assert not reader.is_connected(server.name) and reader.state()["pending_transfers"] == 0
        late = reader.read_spans(server.name, [("c4", 1, 1, 0, 8)])  # not connected: failed, not raised
        with pytest.raises(TransferFailed, match="not connected"):
            late.poll()
    finally:
        reader.close()
        server.close()


def test_a_prefill_decode_pair_runs_over_the_transport_its_config_names(checkpoint_factory):
    """The connector (kv_connector, decode and prefill sides) reaches the transport only through
    the registry and the protocol: two engines disaggregate over the in-process transport and
    the decode's tokens and logprobs equal a colocated engine's."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.kv_connector import attach_connector
    from engine.weights import load_model
    from ipc.kv_transfer_params import KVTransferParams
    from ipc.messages import SamplingParams
    from pd_engines import collect, poison_pools, wait_for_leases

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: no oversubscription
    model = load_model(checkpoint_factory("tiny-upstream", index_topk=64), dtype=torch.float32, progress=False)
    engine = dict(max_num_seqs=2, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, block_size=16)
    kv = KVTransferConfig(transport=NAME, model_id="tiny@test", lease_s=5.0)
    pre = Engine(model, EngineConfig(**engine, kv_transfer=msgspec.structs.replace(kv, role="prefill")))
    dec = Engine(model, EngineConfig(**engine, kv_transfer=msgspec.structs.replace(kv, role="decode")))
    col = Engine(model, EngineConfig(**engine))
    attach_connector(pre)
    attach_connector(dec)
    poison_pools(dec)  # a row the transfer missed would decode as NaN, not as a zero
    try:
        assert isinstance(pre.connector.ctx.transport, InProcTransport)
        assert isinstance(dec.connector.ctx.transport, InProcTransport)
        prompt = torch.randint(2, 500, (37,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
        pre.add_request(1, prompt, params, KVTransferParams(do_remote_decode=True))
        _, _, held = collect(pre, (dec,), 1, timeout_s=180)  # first steps compile kernels: slow on a loaded machine
        assert held.kv_transfer_params is not None and held.kv_transfer_params.remote_engine_id == pre.connector.ctx.name
        dec.add_request(2, prompt, params, held.kv_transfer_params)
        tokens, logprobs, done = collect(dec, (pre,), 2, timeout_s=180)
        col.add_request(3, prompt, params)
        want_tokens, want_logprobs, _ = collect(col, (), 3, timeout_s=180)
        assert done.reason == "length" and tokens == want_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4)
        assert dec.connector.ctx.transport.reads_posted == 1 and dec.connector.ctx.counters.loaded == 1
        wait_for_leases(pre, dec)  # the READ's completion notice releases the lease
        assert pre.connector.ctx.counters.released == 1 and pre.connector.ctx.counters.expired == 0
        for e in (pre, dec):
            assert (e.cache.manager.full.num_used, e.cache.manager.sliding.num_used) == (0, 0)
    finally:
        dec.connector.close()
        pre.connector.close()
        torch.set_num_threads(threads)
