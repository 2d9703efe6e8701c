"""The PD transfer pieces that need no second process: wire validation, digests, leases, pools.

Digests are checked against a bitwise CRC32C written here from the polynomial; the block
ranges a decode must receive against BlockManager's own allocation rule; garbage
`kv_transfer_params` against a hypothesis generator of arbitrary JSON.
"""
from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, BlockTable
from engine.kv_cache import KVCache
from engine.kv_layout import build_layout
from engine.kv_transfer import digest, kv_pools, protocol
from engine.kv_transfer.lease import LeaseTable
from engine.kv_transfer.protocol import ProtocolError
from engine.v4.checkpoint import preset_config
from ipc.kv_transfer_params import MAX_BLOCKS_PER_GROUP, KVTransferParams

HASH = "ab" * 32
PROMPT = list(range(3, 43))  # 40 tokens


def _leg2(**over) -> KVTransferParams:
    fields = dict(do_remote_prefill=True, remote_engine_id="prefill-0", remote_block_ids=[[4, 9, 2], [7, 3]],
                  remote_host="10.0.0.7", remote_port=5600, remote_request_id="r-1f2e",
                  remote_blocks_expiry_time=2000.0, remote_num_tokens=40, remote_sliding_first=1,
                  block_digests=[[1, 2, 3], [4, 5]], compat_hash=HASH, remote_first_token=17,
                  remote_prompt_hash=protocol.prompt_hash(PROMPT))
    return KVTransferParams(**{**fields, **over})


# ---- kv_transfer_params -----------------------------------------------------------------------
def test_leg1_as_vllm_toy_proxy_sends_it():
    p = protocol.parse_params({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None})
    assert p.do_remote_decode and not p.do_remote_prefill
    assert protocol.params_to_json(p) == {"do_remote_decode": True}


def test_leg2_round_trips_through_json():
    p = _leg2()
    wire = json.loads(json.dumps(protocol.params_to_json(p)))
    assert protocol.parse_params(wire) == p
    assert p.group_blocks("sliding") == ([7, 3], [4, 5])


@pytest.mark.parametrize("bad", [
    "not an object", [], {"do_remote_decode": "yes"}, {"unknown_field": 1},
    {"do_remote_decode": True, "remote_block_ids": [[1]]},  # a client never says where blocks are
    {"do_remote_decode": True, "do_remote_prefill": True},
    {"do_remote_prefill": True},  # leg 2 without the rest
])
def test_malformed_params_are_refused(bad):
    with pytest.raises(ProtocolError):
        protocol.parse_params(bad)


@pytest.mark.parametrize("field, value", [
    ("remote_block_ids", [[0, 1, 2], [7, 3]]),  # block 0 is the dummy
    ("remote_block_ids", [[-1, 1, 2], [7, 3]]),
    ("remote_block_ids", [[4, 4, 2], [7, 3]]),  # duplicate
    ("remote_block_ids", [[4, 9, 2]]),  # one group missing
    ("remote_block_ids", [list(range(1, MAX_BLOCKS_PER_GROUP + 2)), [7, 3]]),
    ("block_digests", [[1, 2], [4, 5]]),  # not aligned with the ids
    ("block_digests", [[1, 2, 2**32], [4, 5]]),
    ("remote_port", 70000), ("remote_port", "5600"), ("remote_host", "a b"), ("remote_host", ""),
    ("remote_engine_id", "../etc"), ("remote_request_id", "x" * 129), ("compat_hash", "AB" * 32),
    ("tp_size", 8), ("remote_num_tokens", 0), ("remote_num_tokens", True), ("remote_blocks_expiry_time", -1.0),
    ("remote_blocks_expiry_time", math.inf), ("digest_alg", "md5"),
])
def test_out_of_range_fields_are_refused(field, value):
    obj = protocol.params_to_json(_leg2())
    obj[field] = value
    with pytest.raises(ProtocolError):
        protocol.parse_params(obj)


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                     max_leaves=20)
_keys = st.sampled_from(list(KVTransferParams.__struct_fields__) + ["x"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _json, max_size=8) | _json)
def test_arbitrary_json_is_refused_cleanly_or_parsed_valid(obj):
    try:
        p = protocol.parse_params(obj)
    except ProtocolError:
        return
    assert protocol.parse_params(protocol.params_to_json(p)) == p  # whatever passed is self-consistent


def test_decode_gate_derives_sizes_from_its_own_prompt():
    p = _leg2()  # 40 tokens, block 16, window 24: full [0, 3), sliding [1, 3)
    blocks = protocol.expected_blocks(40, 16, 24)
    assert blocks == {"full": (0, 3), "sliding": (1, 3)}
    kw = dict(prompt_token_ids=PROMPT, blocks=blocks, compat_hash=HASH, now=1000.0)
    protocol.check_for_decode(p, **kw)
    other = PROMPT[:-1] + [99]  # same length, another prompt
    for bad in ({"prompt_token_ids": PROMPT + [1]}, {"prompt_token_ids": other}, {"compat_hash": "cd" * 32},
                {"now": 2000.0}, {"blocks": protocol.expected_blocks(40, 16, 40)},
                {"blocks": protocol.expected_blocks(40, 8, 24)}):
        with pytest.raises(ProtocolError):
            protocol.check_for_decode(p, **{**kw, **bad})
    with pytest.raises(ProtocolError, match="remote_sliding_first"):
        protocol.check_for_decode(_leg2(remote_sliding_first=0), **kw)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 64, 100])
def test_expected_blocks_match_what_block_manager_keeps(n):
    """The sliding blocks a decode must receive are the ones its own BlockManager keeps
    readable for a sequence at position n (allocate(n, n) on an empty table)."""
    layout = build_layout(preset_config("tiny"), "auto", "fp32", 16)
    manager = BlockManager(layout, 32, 32, slack=8)
    table = BlockTable()
    assert manager.allocate(table, n, n)
    want = protocol.expected_blocks(n, 16, layout.sliding_keep(8))
    assert want["full"] == (0, len(table.full))
    assert want["sliding"] == (table.sliding_first, table.sliding_first + len(table.sliding))


def test_params_mac_binds_every_field():
    key = b"shared-secret-of-the-two-engines"
    signed = protocol.sign(_leg2(), key)
    protocol.verify(protocol.parse_params(json.loads(json.dumps(protocol.params_to_json(signed)))), key)
    for forged in (msgspec.structs.replace(signed, remote_block_ids=[[4, 9, 3], [7, 3]]),
                   msgspec.structs.replace(signed, block_digests=[[1, 2, 4], [4, 5]]),
                   msgspec.structs.replace(signed, remote_request_id="r-other")):
        with pytest.raises(ProtocolError, match="does not match"):
            protocol.verify(forged, key)
    with pytest.raises(ProtocolError, match="does not match"):
        protocol.verify(signed, b"another key")
    with pytest.raises(ProtocolError, match="required"):
        protocol.verify(_leg2(), key)


# ---- notifications ---------------------------------------------------------------------------
def test_notifications_round_trip_and_refuse_garbage():
    for msg in (protocol.KVRenew(["a", "b-2"]), protocol.KVDone(["a"]), protocol.KVDone(["a"], False, "digest")):
        data = protocol.encode_notification(msg)
        assert protocol.decode_notification(data) == msg
        assert not protocol.is_handshake(data)  # msgpack never starts with 0xc1
    for bad in (b"", b"\x00", b"\xc1RSKV", protocol.encode_notification(protocol.KVRenew(["a"]))[:-1],
                msgspec.msgpack.encode([1, []]), msgspec.msgpack.encode([1, ["x"] * 1025]), msgspec.msgpack.encode([9])):
        with pytest.raises(ProtocolError):
            protocol.decode_notification(bad)


def test_handshake_geometry_is_bounded():
    geo = ["c4", "DRAM", 0, 4096, 2**20, [1 << 40] * 100]  # 100 M descriptors, as a hostile peer sends it
    too_big = protocol.HANDSHAKE_MAGIC + msgspec.msgpack.encode([2, 1, True, HASH, "", [geo]])
    with pytest.raises(ProtocolError, match="descriptors"):
        protocol.decode_handshake(too_big)
    ok = protocol.HelloReply(1, True, HASH, "", [protocol.RegionGeometry("c4", "DRAM", 0, 4096, 64, [1 << 40])])
    assert protocol.decode_handshake(protocol.encode_handshake(ok)) == ok
    with pytest.raises(ProtocolError):
        protocol.decode_handshake(protocol.HANDSHAKE_MAGIC + b"\x93\x01")


# ---- digests ---------------------------------------------------------------------------------
def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one bit at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (6, 4, 8), generator=g, dtype=torch.uint8),
            torch.randn(6, 3, 5, generator=g).to(torch.bfloat16), torch.randn(6, 7, generator=g)]


def test_block_digest_is_crc32c_over_the_blocks_bytes_in_tensor_order():
    ts, ids = _tensors(), [5, 0, 3]
    want = []
    for b in ids:
        crc = 0
        for t in ts:
            crc = _crc32c_reference(t[b].contiguous().view(torch.uint8).numpy().tobytes(), crc)
        want.append(crc)
    assert digest.block_digests(ts, ids) == want
    strided = [t.transpose(1, 2) if t.dim() == 3 else t for t in ts]  # gather path, other bytes
    assert digest.block_digests(strided, ids) == digest.block_digests([s.contiguous() for s in strided], ids)


def test_every_single_bit_flip_is_caught_in_exactly_its_block():
    ts, ids = _tensors(1), [1, 2, 4]
    expected = digest.block_digests(ts, ids)
    for ti, t in enumerate(ts):
        raw = t[2].view(torch.uint8).reshape(-1)
        for byte in range(raw.numel()):
            for bit in range(8):
                raw[byte] ^= 1 << bit
                assert digest.mismatches(ts, ids, expected) == [1], (ti, byte, bit)
                raw[byte] ^= 1 << bit
    digest.verify(ts, ids, expected)
    ts[0][4].zero_()
    with pytest.raises(digest.DigestMismatch, match="block 4"):
        digest.verify(ts, ids, expected)


# ---- leases ----------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_expires_unless_renewed_and_release_ends_it():
    clock = Clock()
    leases = LeaseTable(clock, max_hold_s=100.0)
    leases.hold("a", {"full": [3, 4]}, ttl_s=30.0)
    leases.hold("b", {"full": [5]}, ttl_s=30.0)
    clock.now = 120.0
    assert leases.renew("a") and leases.expired() == []  # 'a' now lives to 150
    clock.now = 130.0
    assert leases.expired() == [("b", {"full": [5]})]  # nobody renewed 'b'
    clock.now = 140.0
    assert leases.renew("a")  # → 170
    clock.now = 165.0
    assert leases.expired() == [] and "a" in leases
    assert leases.release("a") == {"full": [3, 4]} and leases.release("a") is None
    assert leases.expired(clock.now + 1000) == [] and len(leases) == 0


def test_expired_returns_each_lease_once_and_renew_cannot_revive_it():
    clock = Clock()
    leases = LeaseTable(clock)
    leases.hold("a", [1, 2], ttl_s=30.0)
    clock.now += 30.0
    assert not leases.renew("a")  # at its expiry the blocks are the prefill's to free
    assert leases.expired() == [("a", [1, 2])]
    assert leases.expired() == [] and not leases.renew("a") and leases.release("a") is None


def test_renewals_cannot_hold_blocks_past_the_cap():
    clock = Clock()
    leases = LeaseTable(clock, max_hold_s=90.0)
    leases.hold("a", [1], ttl_s=30.0)
    while clock.now < 100.0 + 89.0:
        clock.now += 10.0
        leases.renew("a")
    assert leases.remaining("a") <= 190.0 - clock.now + 1e-9
    clock.now = 190.0
    assert leases.expired() == [("a", [1])]
    with pytest.raises(ValueError):
        leases.hold("b", [1], ttl_s=0)
    leases.hold("b", [1], ttl_s=5)
    with pytest.raises(KeyError):
        leases.hold("b", [2], ttl_s=5)
    assert leases.next_expiry() == 195.0


# ---- pools -----------------------------------------------------------------------------------
def _cache(kv_dtype: str = "auto", block_size: int = 16) -> KVCache:
    cfg = preset_config("tiny")
    layout = build_layout(cfg, kv_dtype, "fp32", block_size)
    return KVCache(cfg, layout, 12, 10, torch.float32)


def test_pool_regions_and_groups_cover_every_pool_tensor():
    cache = _cache()
    regions = kv_pools.pool_regions(cache)
    assert set(regions) == set(cache.pools)
    for name, tensors in regions.items():
        assert len(tensors) == len(cache.pools[name].spec.layers)
        assert all(t.is_contiguous() and t.shape[0] == tensors[0].shape[0] for t in tensors)
    groups = kv_pools.group_regions(cache.layout)
    assert sorted(groups["full"] + groups["sliding"]) == sorted(cache.pools)
    assert len(kv_pools.group_tensors(cache, "full")) == sum(len(regions[n]) for n in groups["full"])


def test_compat_identity_changes_with_what_changes_kv():
    from engine.kv_transfer.regions import compat_hash

    cfg = preset_config("tiny")
    ident = lambda kv, bs, model="m@1", dt="fp32": compat_hash(  # noqa: E731
        kv_pools.compat_identity(cfg, build_layout(cfg, kv, dt, bs), model_id=model, compute_dtype=dt), [])
    base = ident("auto", 16)
    assert base == ident("auto", 16)
    assert len({base, ident("bf16", 16), ident("auto", 32), ident("auto", 16, model="m@2"),
                ident("auto", 16, dt="bf16")}) == 5
    other = preset_config("tiny", sliding_window=16)
    assert compat_hash(kv_pools.compat_identity(other, build_layout(other, "auto", "fp32", 16), model_id="m@1",
                                                compute_dtype="fp32"), []) != base


def test_handoff_blocks_are_the_tables_blocks_in_range():
    cache = _cache()
    seq = cache.new_sequence()
    for start in range(0, 40, 7):  # a chunked prefill of 40 tokens
        assert cache.allocate(seq, start, min(start + 7, 40))
    keep = cache.layout.sliding_keep(8)
    out = kv_pools.handoff_blocks(seq.table, 40, 16, keep)
    assert out["full"] == (0, seq.table.full[:3])
    first = max(0, 40 - keep) // 16
    assert out["sliding"] == (first, [seq.table.sliding_id(i) for i in range(first, 3)])
    with pytest.raises(ValueError):
        kv_pools.handoff_blocks(seq.table, 60, 16, keep)
