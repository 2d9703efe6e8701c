"""Shared-memory IPC between the server and per-GPU workers: rings, messages and their codec. No torch."""
from ipc.codec import decode, encode
from ipc.errors import (
    CorruptSlot,
    DecodeError,
    EncodeError,
    IpcError,
    MessageTooLarge,
    PeerDied,
    RingClosed,
    RingError,
    RingTimeout,
)
from ipc.messages import (
    Abort,
    Error,
    Finished,
    Heartbeat,
    Message,
    SamplingParamsMsg,
    Shutdown,
    Submit,
    TokenDelta,
    WorkerReady,
)
from ipc.ring import RingConfig, RingReader, RingStats, RingWriter
from ipc.segment import remove_orphans

__all__ = [
    "Abort", "CorruptSlot", "DecodeError", "EncodeError", "Error", "Finished", "Heartbeat", "IpcError",
    "Message", "MessageTooLarge", "PeerDied", "RingClosed", "RingConfig", "RingError", "RingReader",
    "RingStats", "RingTimeout", "RingWriter", "SamplingParamsMsg", "Shutdown", "Submit", "TokenDelta",
    "WorkerReady", "decode", "encode", "remove_orphans",
]
