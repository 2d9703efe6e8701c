"""The cluster secret: who may speak on ringserve's internal channels.

One secret (32 random bytes, written as 64 hex digits) is shared by every node of a multi-node
group and by both sides of a prefill/decode pair. Every internal listener is keyed from it:

  * the node channel (head ↔ headless nodes, server/links.py, server/node.py),
  * the rendezvous store of the expert-parallel group (engine/distributed/rendezvous_store.py), through which
    gloo and NCCL exchange their addresses and NCCL its bootstrap id,
  * the KV side channel that hands a prefill's NIXL metadata to a decode
    (engine/kv_transfer/side_channel.py),
  * and the HMAC over `kv_transfer_params` (engine/kv_transfer/protocol.py).

Each channel gets its own keys, derived with HKDF-SHA256 (RFC 5869) under the channel's name.
The ZeroMQ channels use CURVE: a server key pair and a client key pair derived from the secret;
the server admits (through a ZAP handler) only clients presenting the derived client key.
CURVE rather than an HMAC per frame, because (1) it authenticates in the handshake, so a
stranger's bytes never reach a decoder and a 256 MiB frame from one is never read; (2) it
encrypts, and prompts and completions cross the node channel; (3) each session runs on fresh
ephemeral keys with per-message nonces, so a recorded session or hello replays to nothing; and
(4) it is libsodium inside libzmq, not cryptography written here.

Where the secret comes from, first found wins: `--cluster-key-file PATH`, the file named by
$RINGSERVE_CLUSTER_KEY_FILE, the hex secret in $RINGSERVE_CLUSTER_KEY, the systemd credential
`ringserve-cluster-key` (units load it with `LoadCredential=`, server/systemd.py: never on the
command line). Worker processes inherit the environment: the server exports the file's path,
never the secret itself.

Without a secret, every internal listener must be on a loopback address (one machine: only its
own processes can connect), unless `--insecure-cluster` says the network is trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

KEY_FILE_ENV = "RINGSERVE_CLUSTER_KEY_FILE"
KEY_ENV = "RINGSERVE_CLUSTER_KEY"
KEY_BYTES = 32
CREDENTIAL_NAME = "ringserve-cluster-key"  # LoadCredential= name in the rendered units

# Channel names: HKDF `info` labels and ZAP domains. Changing one changes every derived key.
NODE_CHANNEL = "node-channel"
RENDEZVOUS_STORE = "rendezvous-store"
KV_SIDE_CHANNEL = "kv-side-channel"
KV_PARAMS_MAC = "kv-transfer-params"


class ClusterKeyError(ValueError):
    """A missing, unreadable or malformed key, or a listener the key policy forbids (one line)."""


# ---- the secret -----------------------------------------------------------------------------

def generate_key() -> str:
    """A fresh secret, as the 64 hex digits a key file holds."""
    return secrets.token_hex(KEY_BYTES)


def write_key_file(path: Path, key_hex: str) -> None:
    """Create `path` with mode 0600 holding the key; an existing file is never overwritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ClusterKeyError(f"{path} already exists; remove it first or choose another path") from None
    except OSError as exc:
        raise ClusterKeyError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(key_hex + "\n")


def parse_key(text: str, where: str) -> bytes:
    """The secret from its hex text (surrounding whitespace ignored): at least 32 bytes."""
    value = text.strip()
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ClusterKeyError(f"the cluster key in {where} is not hex "
                              f"(make one with `ringserve cluster-key`)") from None
    if len(key) < KEY_BYTES:
        raise ClusterKeyError(f"the cluster key in {where} has {len(key)} bytes; at least {KEY_BYTES} are needed")
    return key


def read_key_file(path: str | os.PathLike) -> bytes:
    p = Path(path)
    try:
        text = p.read_text()
        mode = p.stat().st_mode
    except OSError as exc:
        raise ClusterKeyError(f"cannot read the cluster key file {p}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("the cluster key file %s is readable by other users (mode %o); chmod 600 it", p,
                       stat.S_IMODE(mode))
    return parse_key(text, str(p))


def derive(key: bytes, purpose: str, size: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) of the secret for one purpose: independent keys per channel."""
    prk = hmac.new(b"ringserve-cluster/1", key, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < size:
        block = hmac.new(prk, block + purpose.encode() + bytes([counter]), hashlib.sha256).digest()
        out, counter = out + block, counter + 1
    return out[:size]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
        except OSError:
            return False


def tcp_endpoint(sock: zmq.Socket, host: str, port: int) -> str:
    """The ZeroMQ endpoint for `host`:`port` (a name resolved, IPv4 first; IPv6 enabled on `sock`
    when that is what it resolves to): what both bind and connect take."""
    if host in ("*", "0.0.0.0"):
        return f"tcp://{host}:{port}"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    addr = infos[0][4][0]
    if ":" in addr:
        sock.setsockopt(zmq.IPV6, 1)
        addr = f"[{addr}]"
    return f"tcp://{addr}:{port}"


# ---- the policy and the keys of one process ---------------------------------------------------

@dataclass(frozen=True)
class CurveKeys:
    """Z85 keys of one channel, as libzmq takes them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _curve_pair(seed: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(seed)  # any 32 bytes are a Curve25519 secret (libsodium clamps them)
    return zmq.curve_public(secret), secret


@dataclass(frozen=True)
class ClusterAuth:
    """The secret (or its absence) and what it allows: how every internal channel is keyed."""

    key: bytes | None = None
    insecure: bool = False  # no key, yet listeners off loopback: the operator vouches for the network
    source: str = ""  # where the key came from, for the start-up line

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def mac_key(self, purpose: str) -> bytes | None:
        return derive(self.key, purpose) if self.key is not None else None

    def curve_keys(self, channel: str) -> CurveKeys:
        assert self.key is not None, "curve_keys needs a cluster key"
        server = _curve_pair(derive(self.key, channel + "/server"))
        client = _curve_pair(derive(self.key, channel + "/client"))
        return CurveKeys(*server, *client)

    def check_listen(self, host: str, what: str) -> None:
        """Refuse a listener off loopback when nothing authenticates its peers."""
        if self.keyed or self.insecure or is_loopback(host):
            return
        raise ClusterKeyError(
            f"{what} would listen on {host} with no cluster key: give every node the same key "
            f"(--cluster-key-file, made by `ringserve cluster-key`), or --insecure-cluster on a trusted network")

    def describe(self) -> str:
        """The line the server prints at start."""
        if self.keyed:
            return (f"internal channels authenticated and encrypted with the cluster key from {self.source} "
                    f"(ZeroMQ CURVE; kv_transfer_params signed)")
        if self.insecure:
            return ("internal channels NOT authenticated (--insecure-cluster): anyone who reaches the node port, "
                    "the rendezvous store or the KV side channel can join or read them; trusted networks only")
        return ("no cluster key: internal channels are unauthenticated, so they listen on loopback only "
                "(multi-node and PD across machines need --cluster-key-file)")

    # -- ZeroMQ ----------------------------------------------------------------------------------
    def secure_server(self, sock: zmq.Socket, channel: str) -> "ZapHandler | None":
        """Make `sock` a CURVE server for `channel` (before bind). Returns the ZAP handler that
        admits only holders of the key; the caller stops it when the socket closes. No key: None."""
        if not self.keyed:
            return None
        keys = self.curve_keys(channel)
        zap = ZapHandler(sock.context, channel, keys.client_public)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        sock.zap_domain = channel.encode()
        return zap

    def secure_client(self, sock: zmq.Socket, channel: str) -> None:
        """Make `sock` a CURVE client of `channel`'s server (before connect). No key: nothing."""
        if not self.keyed:
            return
        keys = self.curve_keys(channel)
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public


class ZapHandler:
    """ZeroMQ's authentication hook for one channel (pyzmq's ThreadAuthenticator, on a thread of
    its own, so it answers even while the event loop is busy): only the derived client key passes."""

    def __init__(self, context: zmq.Context, channel: str, client_public: bytes):
        from zmq.auth.thread import ThreadAuthenticator

        self.channel, self.client_public = channel, client_public
        self.refused = 0
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("ringserve.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(channel, self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = domain == self.channel and hmac.compare_digest(client_key, self.client_public)
        self.refused += not ok
        return ok

    def stop(self) -> None:
        self._auth.stop()


# ---- the process's configuration --------------------------------------------------------------

_configured: ClusterAuth | None = None


def key_path(key_file: str | None = None, environ: dict | None = None) -> str | None:
    """The key file to read, if the key comes from one: the flag, $RINGSERVE_CLUSTER_KEY_FILE, or
    (when neither, nor $RINGSERVE_CLUSTER_KEY, is given) the systemd credential."""
    env = os.environ if environ is None else environ
    if key_file or env.get(KEY_FILE_ENV):
        return key_file or env[KEY_FILE_ENV]
    credentials = env.get("CREDENTIALS_DIRECTORY")
    if not env.get(KEY_ENV) and credentials and (Path(credentials) / CREDENTIAL_NAME).is_file():
        return str(Path(credentials) / CREDENTIAL_NAME)
    return None


def load(key_file: str | None = None, insecure: bool = False, environ: dict | None = None) -> ClusterAuth:
    """The key from the flag, else from the environment (see the module docstring)."""
    env = os.environ if environ is None else environ
    path = key_path(key_file, env)
    if path is not None:
        return ClusterAuth(read_key_file(path), insecure, path)
    if env.get(KEY_ENV):
        return ClusterAuth(parse_key(env[KEY_ENV], f"${KEY_ENV}"), insecure, f"${KEY_ENV}")
    return ClusterAuth(None, insecure)


def configure(key_file: str | None, insecure: bool) -> ClusterAuth:
    """Load this server's key (ClusterKeyError names what is wrong) and make it what `current()`
    returns; the worker processes it starts find it through the environment."""
    global _configured
    auth = load(key_file, insecure)
    path = key_path(key_file)
    if path is not None:
        os.environ[KEY_FILE_ENV] = str(Path(path).resolve())  # the path, never the secret
    _configured = auth
    return auth


def current() -> ClusterAuth:
    """This process's cluster auth: what `configure` set, else what the environment gives (a
    worker process, or a library user who set the variables)."""
    global _configured
    if _configured is None:
        _configured = load()
    return _configured
