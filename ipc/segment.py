"""POSIX shared-memory segments for rings: unguessable names, mode 0600, owner-only attach.

A segment is the file ``/dev/shm/<name>`` (what ``shm_open`` creates on Linux) mapped with
``mmap``. Each segment has two sibling FIFOs, ``<name>.rd`` and ``<name>.wr``, used as doorbells
(see ``ipc.doorbell``). Names are ``rsring-<owner pid>-<32 hex digits from secrets>``: the hex part
makes them unguessable, the pid lets ``remove_orphans`` clean up after an owner that was killed.

Invariants: a segment is created with O_EXCL and mode 0600; ``attach`` accepts only well-formed names,
refuses symlinks, and refuses files not owned by this user or readable by others. The owner unlinks
the segment and its FIFOs; nobody else does.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat

from ipc.doorbell import pid_running
from ipc.errors import RingError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "rsring-"
FIFO_SUFFIXES = (".rd", ".wr")
_NAME_RE = re.compile(r"^rsring-(\d+)-[0-9a-f]{32}$")
_ANY_RE = re.compile(r"^rsring-(\d+)-[0-9a-f]{32}(\.rd|\.wr)?$")


def new_name() -> str:
    """A fresh unguessable segment name carrying this process's pid."""
    return f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def check_name(name: str) -> str:
    """Return ``name`` if it is a well-formed ring name, else raise RingError (no paths, no dots)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RingError(f"not a ring segment name: {name!r}")
    return name


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, check_name(name))


def fifo_paths(name: str) -> tuple[str, str]:
    """Paths of the reader's and the writer's doorbell FIFOs."""
    base = segment_path(name)
    return base + ".rd", base + ".wr"


class Segment:
    """One mapped shared-memory segment. ``buf`` is the mmap; close() unmaps, unlink() removes."""

    def __init__(self, name: str, buf: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.buf = buf
        self.owner = owner

    @property
    def size(self) -> int:
        return len(self.buf)

    @classmethod
    def create(cls, size: int) -> "Segment":
        """Create a new segment of ``size`` bytes (zero-filled) and its doorbell FIFOs, mode 0600."""
        name = new_name()
        path = segment_path(name)
        _check_free_space(size)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size)
            for fifo in fifo_paths(name):
                os.mkfifo(fifo, 0o600)
                os.chmod(fifo, 0o600)
        except BaseException:
            os.close(fd)
            _unlink_all(name)
            raise
        os.close(fd)
        return cls(name, buf, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment by name; refuses foreign-owned or group/other-accessible files."""
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RingError(f"ring segment {name} does not exist (closed or never created)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RingError(f"ring segment {name} has unsafe owner or mode {oct(st.st_mode)}")
            buf = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, buf, owner=False)

    def close(self) -> None:
        """Unmap. Raises BufferError if a memoryview of the mapping is still alive."""
        if not self.buf.closed:
            self.buf.close()

    def unlink(self) -> None:
        """Remove the segment and its FIFOs from /dev/shm (mappings stay valid until closed)."""
        _unlink_all(self.name)


def _unlink_all(name: str) -> None:
    base = segment_path(name)
    for path in (base, *fifo_paths(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _check_free_space(size: int) -> None:
    """Fail now with a clear error instead of SIGBUS later when /dev/shm is too small."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise RingError(f"ring needs {size} bytes but {SHM_DIR} has only {free} bytes free")


def list_segments() -> list[str]:
    """Names of every ring file (segments and FIFOs) in /dev/shm, of any owner pid."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if _ANY_RE.match(e))


def remove_orphans() -> list[str]:
    """Unlink ring files whose owner process no longer exists; return what was removed.

    Meant for start-up of the process that owns rings (the server), after a crash left files behind.
    """
    removed = []
    for entry in list_segments():
        match = _ANY_RE.match(entry)
        assert match is not None
        if pid_running(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
            removed.append(entry)
        except (FileNotFoundError, PermissionError):
            pass
    if removed:
        logger.warning("removed %d orphaned ring files from %s", len(removed), SHM_DIR)
    return removed
