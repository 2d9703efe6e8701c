"""KV transfer for prefill/decode disaggregation (pull, as vLLM's NixlConnector does it).

A prefill server computes a prompt's KV, holds its blocks under a lease (`lease.py`) and hands
`kv_transfer_params` (`ipc/kv_transfer_params.py`; parsed, signed and checked in `protocol.py`)
to the proxy; the decode server connects to it once (transport metadata over the keyed side
channel, `side_channel.py`, then a compatibility-hash handshake, `handshake.py`), READs the
planned bytes of its blocks, re-digests them (`digest.py`) and only then uses them. `kv_pools.py`
maps ringserve's KV pools and block tables onto transport regions and block lists.

The transport is a seam: `transport.py` says what the connector needs (`KVTransport`),
`peer_transport.py` implements the protocol over a data plane's primitives, `nixl_transport.py`
is NIXL's data plane, and `registry.py` maps `--kv-transfer` to it. The NIXL import is deferred
to `nixl_transport`, so the protocol, digest, lease and registry modules load without it (the
front process parses `kv_transfer_params` and never imports torch or NIXL).
"""
