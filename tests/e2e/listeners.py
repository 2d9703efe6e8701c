"""Which TCP ports a tree of processes listens on, and at which address (from /proc, as `ss -ltnp`
would say): how the tests check that every listener binds the address it was given."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant of it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        todo += [int(k) for k in kids]
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pids: list[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of `pids` holds."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pids[0]}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in owner:
                addr, port = local.split(":")
                found.add((_address(addr), int(port, 16), owner[inode]))
    return found


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind the port now (with SO_REUSEADDR, as every server socket here
    does: connections of the previous holder in TIME_WAIT do not count, a listener does)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
