"""`ringserve serve` as one side of prefill/decode disaggregation: its flags, the identity of its
weights (part of the KV compatibility hash), and the `/kv_transfer/stats` route.

`--kv-role prefill|decode|both --kv-transfer nixl` gives every rank a KV connector
(engine/kv_connector.py) over the transport `--kv-transfer` names (engine/kv_transfer/registry.py;
NIXL today). The prefill ranks serve their transport metadata on the KV side channel
(engine/kv_transfer/side_channel.py, keyed with the cluster key) at `--kv-transfer-host`,
port `--kv-transfer-port` + rank (or a free port each); a decode reaches them there.
DeepSeek-V4.1 moves only its global records (compressed KV, index keys); the decode rebuilds the
sliding state by replaying the prompt's last positions (engine/kv_transfer/plan.py
`replay_policy`). No torch here: this runs in the HTTP process.
"""
from __future__ import annotations

import argparse
import hashlib
import socket
from pathlib import Path

from aiohttp import web

from engine.kv_transfer import registry
from engine.kv_transfer.config import FAILURE_POLICIES, ROLES, KVTransferConfig

from ipc.cluster_auth import ClusterAuth

_SAMPLE = 64 << 10  # bytes hashed at each sampled offset of a weight file


def add_pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--kv-role", choices=ROLES, default="both",
                   help="prefill: compute prompts and hold their KV for a decode server; decode: generate from a "
                        "prefill's KV; both: colocated (default), and either side on request")
    g.add_argument("--kv-transfer", choices=registry.transport_names(), default=None,
                   help="KV transport between prefill and decode servers (needed for --kv-role prefill|decode)")
    g.add_argument("--kv-load-failure-policy", choices=FAILURE_POLICIES, default="fail",
                   help="decode: when a KV transfer fails or a block fails its digest, fail the request (default) "
                        "or recompute its prompt locally")
    g.add_argument("--kv-transfer-host", default=None,
                   help="address decode servers reach this prefill's KV side channel at (default: --host, or this "
                        "machine's address when --host is a wildcard)")
    g.add_argument("--kv-transfer-port", type=int, default=0,
                   help="KV side-channel port of rank 0 (rank r: port + r); 0 = a free port per rank")
    g.add_argument("--kv-lease-timeout", type=float, default=30.0,
                   help="prefill: seconds unread KV blocks stay held without a decode's renewal")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="decode: seconds one KV READ may take")
    g.add_argument("--kv-connect-timeout", type=float, default=10.0,
                   help="decode: seconds the transport metadata exchange and compatibility handshake with a prefill may take")
    g.add_argument("--kv-peer-idle-timeout", type=float, default=120.0,
                   help="forget a silent KV peer (a decode that died, an unused prefill) after this many seconds")
    g.add_argument("--kv-replay-tokens", type=int, default=0,
                   help="move only global rows and recompute the last N prompt positions on the decode; "
                        "0 (default) = V4: move window and compressor rows too; V4.1: replay the window "
                        "stack's receptive field (exact). A smaller N is a bounded, approximate replay")


def kv_transfer_config_from(args: argparse.Namespace, model_dir: Path | None) -> KVTransferConfig | None:
    """The engine's KV connector config from the flags; None for a plain colocated server.
    ValueError naming the flag when they do not fit together. `model_dir` None: flags only
    (no weight fingerprint)."""
    if args.kv_transfer is None:
        if args.kv_role != "both":
            raise ValueError(f"--kv-role {args.kv_role} needs --kv-transfer nixl")
        return None
    if not 0 <= args.kv_transfer_port <= 65535 - max(1, args.dp):
        raise ValueError(f"--kv-transfer-port must leave room for {args.dp} ranks below 65536")
    for flag, value in (("--kv-lease-timeout", args.kv_lease_timeout), ("--kv-transfer-timeout",
                        args.kv_transfer_timeout), ("--kv-peer-idle-timeout", args.kv_peer_idle_timeout),
                       ("--kv-connect-timeout", args.kv_connect_timeout)):
        if not 0 < value <= 86400:
            raise ValueError(f"{flag} must be in (0, 86400] seconds, got {value}")
    if args.kv_replay_tokens < 0:
        raise ValueError("--kv-replay-tokens must be ≥ 0")
    return KVTransferConfig(role=args.kv_role, transport=args.kv_transfer, host=advertised_host(args),
                            port=args.kv_transfer_port, failure_policy=args.kv_load_failure_policy,
                            lease_s=args.kv_lease_timeout, transfer_timeout_s=args.kv_transfer_timeout,
                            connect_timeout_s=args.kv_connect_timeout,
                            model_id=model_fingerprint(model_dir) if model_dir else "", idle_peer_s=args.kv_peer_idle_timeout,
                            replay_tokens=args.kv_replay_tokens)


def check_pd_listeners(args: argparse.Namespace, kv: KVTransferConfig | None, auth: ClusterAuth) -> None:
    """Before anything starts: the transport's library is installed, and without a cluster key
    (nothing then authenticates a PD peer) the KV side channel — it hands out this engine's
    transport metadata, memory keys included — and, on a decode, the HTTP port (where unsigned
    kv_transfer_params would be believed) are on loopback."""
    if kv is None:
        return
    registry.check_installed(kv.transport)
    if kv.prefills:
        auth.check_listen(kv.host, f"the KV side channel (--kv-transfer-host {kv.host})")
    if kv.decodes:
        auth.check_listen(args.host, f"a {kv.role} server taking kv_transfer_params (--host {args.host})")


def advertised_host(args: argparse.Namespace) -> str:
    if args.kv_transfer_host:
        return args.kv_transfer_host
    if args.host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1" if args.host == "localhost" else args.host


def model_fingerprint(model_dir: Path) -> str:
    """Name + a hash of the config and of sampled bytes of every weight file: two servers with
    other weights (another seed, another revision) never exchange KV. Reads ≈ 6 × 64 KiB a file."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(6):
                f.seek(max(0, (size - _SAMPLE) * i // 5))
                h.update(f.read(_SAMPLE))
    return f"{model_dir.name}@{h.hexdigest()[:24]}"


def add_kv_routes(app: web.Application, client) -> None:
    """GET /kv_transfer/stats: every rank's connector state (from its last heartbeat)."""

    async def stats(request: web.Request) -> web.Response:
        ranks = []
        for r in client.ranks:
            beat = r.last_beat
            kv = beat.kv_transfer if beat is not None else None
            ranks.append({"rank": r.index, "alive": r.alive, "kv_blocks_used": beat.kv_blocks_used if beat else None,
                          "kv_transfer": {f: getattr(kv, f) for f in kv.__struct_fields__} if kv else None})
        return web.json_response({"ranks": ranks})

    app.router.add_get("/kv_transfer/stats", stats)
