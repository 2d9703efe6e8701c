"""`RankLink`: how the engine client reaches one rank, wherever it runs (server/links.py)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Callable

CHANNELS = ("requests", "control", "outputs", "status")


class RankLink(ABC):
    def __init__(self, rank: int):
        self.rank = rank

    @abstractmethod
    async def send(self, channel: str, data: bytes, timeout: float) -> None:
        """Deliver `data` on 'requests' or 'control' (waits, bounded, while the channel is full)."""

    @abstractmethod
    def send_now(self, channel: str, data: bytes, timeout: float) -> None:
        """Best-effort synchronous send (shutdown)."""

    @abstractmethod
    async def recv(self, channel: str, timeout: float) -> bytes:
        """The next message on 'outputs' or 'status'; RingClosed once the rank closed it."""

    @abstractmethod
    def poll(self, channel: str) -> bytes | None:
        """The next message if one is there now."""

    @abstractmethod
    def capacity(self, channel: str) -> int:
        """Largest message the channel takes."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @property
    @abstractmethod
    def exitcode(self) -> int | None: ...

    @abstractmethod
    def watch_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Call `callback` once, on `loop`, when the rank has exited."""

    @abstractmethod
    def unwatch_exit(self) -> None:
        """Stop watching (shutdown: an exit we asked for is not a failure)."""

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    async def wait_exit(self, timeout: float) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Release what the link holds (rings unlinked, fds closed)."""
