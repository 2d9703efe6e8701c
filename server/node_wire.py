"""What the head and its headless nodes say to each other over the node channel (ZeroMQ).

One message per ZeroMQ message, msgspec msgpack arrays with a tag, decoded into exactly these
types (nothing else decodes). A node's first message is a `NodeHello`; once welcomed it relays
its ranks' codec bytes as `RankMessage`s and says `NodeAlive` every NODE_ALIVE_S. Sizes are
bounded twice: ZeroMQ cuts a connection whose frame header announces more than the socket's cap
(before allocating), and the receiver checks the length of every message against what its
sender may send before decoding it.
"""

from __future__ import annotations

import msgspec
import zmq

from .rank_link import CHANNELS


class NodeHello(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """A headless node joins: the ranks it runs and a digest of its configuration."""

    first_rank: int
    num_ranks: int
    config_digest: str


class NodeWelcome(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """The head accepts a node: the group's generation (its ranks rendezvous under it)."""

    generation: str


class NodeRefused(msgspec.Struct, frozen=True, array_like=True, tag=3):
    reason: str


class RankMessage(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """One codec message for (or from) one rank's channel."""

    rank: int
    channel: int  # index into CHANNELS
    payload: bytes


class RankExited(msgspec.Struct, frozen=True, array_like=True, tag=5):
    rank: int
    exitcode: int
    reason: str


class NodeBye(msgspec.Struct, frozen=True, array_like=True, tag=6):
    """Head → node: stop your ranks (shutdown); node → head: my ranks have stopped."""

    reason: str


class NodeAlive(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """Node → head, every NODE_ALIVE_S: the node itself is up, even while its ranks load (a
    large checkpoint takes minutes, during which the ranks send nothing)."""


NODE_ALIVE_S = 1.0

NodeMessage = NodeHello | NodeWelcome | NodeRefused | RankMessage | RankExited | NodeBye | NodeAlive
ENCODE = msgspec.msgpack.Encoder().encode
DECODE = msgspec.msgpack.Decoder(NodeMessage).decode

# A hello is a few dozen bytes; a message from a sender not (yet) welcomed may be no longer.
MAX_HELLO_BYTES = 1024
# What a RankMessage adds to its payload (tag, rank, channel, bytes header), rounded up.
ENVELOPE_BYTES = 64
# The socket's cap before the ring capacity is known (the head lowers it to capacity + envelope).
MAX_FRAME_BYTES = 64 << 20

TO_RANK = (CHANNELS.index("requests"), CHANNELS.index("control"))
FROM_RANK = (CHANNELS.index("outputs"), CHANNELS.index("status"))

# ZeroMQ's own ping/pong (ZMTP heartbeats): a peer that stops answering is disconnected.
ZMQ_HEARTBEAT_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000


def heartbeat_socket(sock: zmq.Socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMQ_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # larger frames end the connection unread
    return sock
