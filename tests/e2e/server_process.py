"""A real `ringserve serve` subprocess on loopback (imported by conftest and the tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

API_KEY = "test-key-123"


_HANDED_OUT: set[int] = set()  # ports given to earlier callers in this run: never given twice


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A free port p with p … p+count−1 all free (a multi-node head also listens on rpc port + 1),
    none of them handed out before in this run (the kernel may offer a port again that a process
    started by an earlier caller has not bound yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        ports = set(range(p, p + count))
        if p + count <= 65535 and not ports & _HANDED_OUT and all(_bindable(q) for q in ports - {p}):
            _HANDED_OUT.update(ports)
            return p


class Server:
    def __init__(self, model_dir: Path, *args: str, env: dict | None = None, api_key: str | None = API_KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", str(self.port),
               "--kv-cache-memory", "0.05", "--block-size", "16", "--threads-per-worker", "1", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(model_dir.parent / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready: {self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name) as f:  # also after stop() closed our handle
            return f.read()

    def get(self, path: str, key: str | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                body = r.read()
                return r.status, json.loads(body) if body.startswith(b"{") else {"text": body.decode()}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        finally:
            self.log.close()


def segments_of(pid: int) -> list[str]:
    """Shared-memory rings created by process `pid` (ring names start with rsring-<creator pid>-)."""
    from ipc.segment import list_segments

    return [n for n in list_segments() if n.startswith(f"rsring-{pid}-")]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def workers(pid: int) -> list[int]:
    """Worker processes of the server (its `python -m server.worker_entry` children),
    in rank order (they are started in it)."""
    found = []
    for child in sorted(children(pid)):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"server.worker_entry" in f.read():
                found.append(child)
    return found


class Node:
    """A real `ringserve serve --headless` subprocess (a node other than the head)."""

    def __init__(self, model_dir: Path, *args: str, log_name: str = "node"):
        cmd = [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--headless", "--kv-cache-memory", "0.05",
               "--block-size", "16", "--threads-per-worker", "1", *args]
        self.log = open(model_dir.parent / f"{log_name}-{free_port()}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name) as f:  # also after stop() closed our handle
            return f.read()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        finally:
            self.log.close()
