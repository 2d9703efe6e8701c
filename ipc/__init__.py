"""Shared-memory IPC between the server and per-device workers: rings, messages, codec. No torch."""
from ipc.codec import InvalidField, check, decode, encode
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
    Finished,
    Heartbeat,
    Message,
    Parked,
    SamplingParams,
    Shutdown,
    StepOutputs,
    Submit,
    TokenDelta,
    Wake,
    WorkerReady,
)
from ipc.ring import RingConfig, RingReader, RingStats, RingWriter
from ipc.segment import remove_orphans

__all__ = [
    "Abort", "CorruptSlot", "DecodeError", "EncodeError", "Finished", "Heartbeat", "InvalidField", "IpcError",
    "Message", "MessageTooLarge", "Parked", "PeerDied", "RingClosed", "RingConfig", "RingError", "RingReader", "RingStats",
    "RingTimeout", "RingWriter", "SamplingParams", "Shutdown", "StepOutputs", "Submit", "TokenDelta", "Wake", "WorkerReady",
    "check", "decode", "encode", "remove_orphans",
]
