"""The expert-parallel group's rendezvous store, behind the cluster key.

torch's TCPStore authenticates nobody and listens on every interface; through it gloo and NCCL
exchange their addresses and NCCL its bootstrap id, so whoever reaches it can read those or
derail a rendezvous. This store speaks the same `torch.distributed.Store` interface (torch calls
it from C++ through its Python trampoline) over ZeroMQ instead:

  * rank 0 hosts `StoreServer` on a thread of its own, bound to exactly `host:port`;
  * every rank (rank 0 too) uses a `ClusterStore` client;
  * with a cluster key both ends are CURVE-keyed (ipc/cluster_auth.py): only holders of the
    key complete the handshake, everything is encrypted, and nothing recorded replays;
  * the server's receive loop survives any input: frames, sizes and fields are checked before
    anything is stored, and every drop is counted and logged (ipc/channel_guard.py);
  * keys, values and the whole store are capped, so no client can make it grow without bound.

Semantics follow TCPStore's (`add` keeps a decimal counter, `compare_set` sets when the current
value equals the expected one or when the key is absent and the expected value empty, `get` and
`wait` block until the keys exist or the timeout passes); waiting is done by polling `check`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Annotated, Callable, Union

import msgspec
import torch.distributed as dist
import zmq
from msgspec import Meta, Struct

from ipc import cluster_auth
from ipc.channel_guard import DropLog, HandshakeMonitor

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 1 << 16
MAX_STORE_BYTES = 64 << 20
_MAX_MESSAGE_BYTES = MAX_VALUE_BYTES * 2 + 64 * 1024
_POLL_S = 0.01  # how often a waiting client re-checks

Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Value = Annotated[bytes, Meta(max_length=MAX_VALUE_BYTES)]
RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class Set(Struct, frozen=True, array_like=True, tag=1):
    id: RequestId
    key: Key
    value: Value


class Get(Struct, frozen=True, array_like=True, tag=2):
    id: RequestId
    key: Key


class Add(Struct, frozen=True, array_like=True, tag=3):
    id: RequestId
    key: Key
    amount: Annotated[int, Meta(ge=-(2**62), le=2**62)]


class CompareSet(Struct, frozen=True, array_like=True, tag=4):
    id: RequestId
    key: Key
    expected: Value
    desired: Value


class Check(Struct, frozen=True, array_like=True, tag=5):
    id: RequestId
    keys: Annotated[list[Key], Meta(max_length=4096)]


class Delete(Struct, frozen=True, array_like=True, tag=6):
    id: RequestId
    key: Key


class NumKeys(Struct, frozen=True, array_like=True, tag=7):
    id: RequestId


class Reply(Struct, frozen=True, array_like=True, tag=8):
    id: RequestId
    found: bool = True
    value: bytes = b""
    number: int = 0
    error: str = ""


Request = Union[Set, Get, Add, CompareSet, Check, Delete, NumKeys]
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_REQUEST = msgspec.msgpack.Decoder(Request).decode
_DECODE_REPLY = msgspec.msgpack.Decoder(Reply).decode


class StoreError(RuntimeError):
    """The store refused a request (full, a counter that is not one)."""


class StoreTimeout(StoreError):
    """Keys still missing, or no answer from the host, when the timeout passed."""


# ---- the host ---------------------------------------------------------------------------------

class StoreServer:
    """The store's data and its receive loop, on a daemon thread of rank 0's process."""

    def __init__(self, host: str, port: int, auth: cluster_auth.ClusterAuth | None = None,
                 on_failure: Callable[[str], None] | None = None):
        auth = auth or cluster_auth.current()
        self.data: dict[str, bytes] = {}
        self.nbytes = 0
        self.drops = DropLog(cluster_auth.RENDEZVOUS_STORE)
        self.on_failure = on_failure or _exit_with
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        self.zap = auth.secure_server(self.sock, cluster_auth.RENDEZVOUS_STORE)
        self.monitor = HandshakeMonitor(self.sock, cluster_auth.RENDEZVOUS_STORE)
        try:
            self.sock.bind(cluster_auth.tcp_endpoint(self.sock, host, port))
        except (zmq.ZMQError, OSError) as exc:
            self._release()
            raise StoreError(f"cannot listen on {host}:{port}: {exc}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringserve-rendezvous-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.sock.poll(200):
                    self._handle(self.sock.recv_multipart())
                self.monitor.poll()
        except BaseException as exc:  # noqa: BLE001 - a dead store loop must not leave a half-alive group
            if not self._stop.is_set():
                self.on_failure(f"the rendezvous store's receive loop died: {type(exc).__name__}: {exc}")
        finally:
            # The loop's thread owns the socket: it releases it, so stop() never closes a socket
            # another thread is still polling (a slow exit on a loaded host outlived a 2 s join).
            self._release()

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.drops.drop(frames[0], "frames", f"{len(frames) - 1} body frames, 1 expected")
            return
        peer, raw = frames
        try:
            request = _DECODE_REQUEST(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.drops.drop(peer, "undecodable", str(exc))
            return
        try:
            reply = self.apply(request)
        except StoreError as exc:
            self.drops.drop(peer, "refused", str(exc))
            reply = Reply(request.id, False, error=str(exc))
        try:
            self.sock.send_multipart([peer, _ENCODE(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:  # that client is gone (or not reading): its own timeout tells it
            pass

    def apply(self, r: Request) -> Reply:
        """One request against the data (the receive loop's thread only)."""
        if isinstance(r, Set):
            self._put(r.key, r.value)
        elif isinstance(r, Get):
            value = self.data.get(r.key)
            return Reply(r.id, value is not None, value or b"")
        elif isinstance(r, Add):
            try:
                number = int(self.data.get(r.key, b"0")) + r.amount
            except ValueError:
                raise StoreError(f"key {r.key!r} does not hold a counter") from None
            self._put(r.key, str(number).encode())
            return Reply(r.id, number=number)
        elif isinstance(r, CompareSet):
            current = self.data.get(r.key)
            if (current is None and r.expected == b"") or (current is not None and current == r.expected):
                self._put(r.key, r.desired)
                return Reply(r.id, value=r.desired)
            return Reply(r.id, value=r.expected if current is None else current)
        elif isinstance(r, Check):
            return Reply(r.id, all(k in self.data for k in r.keys))
        elif isinstance(r, Delete):
            value = self.data.pop(r.key, None)
            self.nbytes -= 0 if value is None else len(r.key) + len(value)
            return Reply(r.id, value is not None)
        else:
            return Reply(r.id, number=len(self.data))
        return Reply(r.id)

    def _put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grown = len(value) - (len(old) if old is not None else -len(key))
        if old is None and len(self.data) >= MAX_KEYS:
            raise StoreError(f"the store holds {MAX_KEYS} keys already")
        if self.nbytes + grown > MAX_STORE_BYTES:
            raise StoreError(f"the store would exceed {MAX_STORE_BYTES} bytes")
        self.data[key] = value
        self.nbytes += grown

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)  # the loop checks the flag every 200 ms
        if self._thread.is_alive():
            logger.warning("the rendezvous store's thread did not stop within 30 s; it releases its socket when it does")

    def _release(self) -> None:
        self.monitor.close()
        self.sock.close(linger=0)
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()


def _exit_with(reason: str) -> None:
    """Rank 0 cannot serve its group without the store: end the process with the cause (its
    server sees the worker exit 1 and goes down with it)."""
    logger.critical("%s; exiting", reason)
    os._exit(1)


# ---- every rank -------------------------------------------------------------------------------

class ClusterStore(dist.Store):
    """A client of a StoreServer, usable wherever torch takes a Store. `stop_waiting()` returning
    True ends any wait early with StoreTimeout (a rank whose server is gone stops waiting)."""

    def __init__(self, host: str, port: int, timeout: timedelta, auth: cluster_auth.ClusterAuth | None = None,
                 stop_waiting: Callable[[], bool] | None = None):
        super().__init__()
        self.set_timeout(timeout)
        self.where = f"{host}:{port}"
        self.stop_waiting = stop_waiting or (lambda: False)
        auth = auth or cluster_auth.current()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        auth.secure_client(self._sock, cluster_auth.RENDEZVOUS_STORE)
        self._sock.connect(cluster_auth.tcp_endpoint(self._sock, host, port))
        self._lock = threading.Lock()  # torch may call from several threads; one request at a time
        self._next_id = 0

    # -- torch's Store interface -----------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call(lambda i: Set(i, key, _bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        reply = self._call(lambda i: Get(i, key))
        if not reply.found:
            raise StoreTimeout(f"key {key!r} vanished from the store at {self.where}")
        return reply.value

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda i: Add(i, key, amount)).number

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(lambda i: CompareSet(i, key, _bytes(expected), _bytes(desired))).value

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda i: Check(i, list(keys))).found

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline or self.stop_waiting():
                raise StoreTimeout(f"keys {list(keys)} not in the store at {self.where} after {limit:g} s")
            time.sleep(_POLL_S)

    def delete_key(self, key: str) -> bool:
        return self._call(lambda i: Delete(i, key)).found

    def num_keys(self) -> int:
        return self._call(lambda i: NumKeys(i)).number

    # -- the wire -----------------------------------------------------------------------------------
    def _call(self, make: Callable[[int], Request]) -> Reply:
        """Send one request and wait for its reply (replies to requests given up on are skipped)."""
        with self._lock:
            self._next_id += 1
            request = make(self._next_id)
            deadline = time.monotonic() + self.timeout.total_seconds()
            self._send(_ENCODE(request), deadline)
            while (left := deadline - time.monotonic()) > 0 and not self.stop_waiting():
                if not self._sock.poll(max(1, int(min(left, 0.5) * 1000))):
                    continue
                try:
                    reply = _DECODE_REPLY(self._sock.recv())
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if reply.id != request.id:
                    continue
                if reply.error:
                    raise StoreError(f"the store at {self.where}: {reply.error}")
                return reply
        raise StoreTimeout(f"no answer from the rendezvous store at {self.where} "
                           f"within {self.timeout.total_seconds():g} s")

    def _send(self, data: bytes, deadline: float) -> None:
        """Queue a request; with no connection to queue it on (the host refused our handshake,
        or is not up since a connection failed), wait for one, bounded like the reply."""
        while True:
            try:
                self._sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() >= deadline or self.stop_waiting():
                    raise StoreTimeout(f"no answer from the rendezvous store at {self.where} "
                                       f"within {self.timeout.total_seconds():g} s") from None
                time.sleep(_POLL_S)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
