"""KV transfer for prefill/decode disaggregation (pull, as vLLM's NixlConnector does it).

A prefill server computes a prompt's KV, holds its blocks under a lease (`lease.py`) and hands
`kv_transfer_params` (`protocol.py`) to the proxy; the decode server connects to it once
(`nixl_transport.py`: NIXL metadata plus a compatibility-hash handshake), READs the blocks by
index, re-digests them (`digest.py`) and only then uses them. `kv_pools.py` maps ringserve's KV
pools and block tables onto transport regions and block lists.

The NIXL import is deferred to `nixl_transport`, so the protocol, digest and lease modules load
without it (the front process parses `kv_transfer_params` and never imports torch or NIXL).
"""
