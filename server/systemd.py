"""systemd integration without libsystemd: sd_notify, a health-gated watchdog feeder, a unit file.

Notify protocol (sd_notify(3)): when systemd starts a ``Type=notify`` service it sets
``NOTIFY_SOCKET`` to the address of an ``AF_UNIX``/``SOCK_DGRAM`` socket, either a file-system
path (``/run/systemd/notify``) or, when it starts with ``@``, a Linux abstract-namespace name
(the ``@`` stands for a leading NUL byte). A message is one datagram of UTF-8 text, newline
separated ``KEY=VALUE`` assignments: ``READY=1``, ``STOPPING=1``, ``STATUS=<text>``,
``WATCHDOG=1``, ``EXTEND_TIMEOUT_USEC=<µs>``. Without ``NOTIFY_SOCKET`` every call is a no-op
returning False. With ``NotifyAccess=main`` only the main process (the HTTP server) may notify.

Watchdog (sd_watchdog_enabled(3)): with ``WatchdogSec=`` systemd sets ``WATCHDOG_USEC`` (the
interval in µs) and ``WATCHDOG_PID`` (the process meant to ping; if it names another process
the watchdog is not ours). The service must send ``WATCHDOG=1`` at least every interval;
the recommended period is half the interval. The watchdog runs once start-up has completed
(after ``READY=1``) and keeps running while the service stops, so keep feeding during a drain.

Lifecycle the server is expected to follow: ``notify_status``/``notify_extend_timeout`` while
loading, ``notify_ready()`` once every GPU worker is loaded and warmed, a running
:class:`WatchdogFeeder` whose ``is_healthy`` says "every worker heartbeat is fresh", and
``notify_stopping()`` when SIGTERM starts the drain.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
from typing import Callable

from ipc import cluster_auth

logger = logging.getLogger(__name__)

__all__ = [
    "sd_notify", "notify_ready", "notify_stopping", "notify_status", "notify_watchdog",
    "notify_extend_timeout", "watchdog_interval_s", "WatchdogFeeder", "render_unit", "systemd_quote",
    "unit_warnings",
]


# ---- sd_notify ---------------------------------------------------------------------------------

def _notify_address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def sd_notify(message: str) -> bool:
    """Send ``message`` to ``$NOTIFY_SOCKET``; True if a datagram was sent.

    False when ``NOTIFY_SOCKET`` is unset or not a path/abstract name (e.g. ``vsock:``), or when
    sending fails (logged). Never raises for socket errors.
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    address = _notify_address(target)
    if address is None:
        logger.warning("unsupported NOTIFY_SOCKET %r; not notifying", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode("utf-8"), address)
    except OSError as e:
        logger.warning("sd_notify(%r) failed: %s", message.split("\n", 1)[0], e)
        return False
    return True


def notify_ready(status: str | None = None) -> bool:
    """``READY=1`` (plus ``STATUS=`` if given): start-up finished, the watchdog starts now."""
    msg = "READY=1"
    if status is not None:
        msg += "\nSTATUS=" + _one_line(status)
    return sd_notify(msg)


def notify_stopping(status: str | None = None) -> bool:
    """``STOPPING=1`` (plus ``STATUS=`` if given): the drain has begun."""
    msg = "STOPPING=1"
    if status is not None:
        msg += "\nSTATUS=" + _one_line(status)
    return sd_notify(msg)


def notify_status(text: str) -> bool:
    """``STATUS=<text>``, shown by ``systemctl status``; newlines become spaces."""
    return sd_notify("STATUS=" + _one_line(text))


def notify_watchdog() -> bool:
    """``WATCHDOG=1``: one keep-alive ping."""
    return sd_notify("WATCHDOG=1")


def notify_extend_timeout(usec: int) -> bool:
    """``EXTEND_TIMEOUT_USEC=<usec>``: the current start/stop phase needs up to ``usec`` µs more.

    Must be repeated before each extension runs out (e.g. every model-loading progress step).
    """
    return sd_notify(f"EXTEND_TIMEOUT_USEC={max(int(usec), 0)}")


def _one_line(text: str) -> str:
    return " ".join(str(text).splitlines())


def watchdog_interval_s() -> float | None:
    """The watchdog interval in seconds, or None when this process need not ping.

    Same rules as sd_watchdog_enabled(3): ``WATCHDOG_USEC`` must be a positive integer, and if
    ``WATCHDOG_PID`` is set it must equal ``os.getpid()``. Ping every ``interval / 2``.
    """
    raw = os.environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        logger.warning("ignoring invalid WATCHDOG_USEC=%r", raw)
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            logger.warning("ignoring invalid WATCHDOG_PID=%r", pid)
            return None
    return usec / 1_000_000


class WatchdogFeeder:
    """Sends ``WATCHDOG=1`` every half interval, but only while ``is_healthy()`` is True.

    The server passes a check such as "every worker's heartbeat is fresh": when a worker hangs,
    the pings stop and systemd kills and restarts the service after ``WatchdogSec``. A blocked
    event loop stops the pings too. An exception from ``is_healthy`` counts as unhealthy.

    ``interval_s`` is the full watchdog interval; by default :func:`watchdog_interval_s`.
    :meth:`start` does nothing (returns False) when no watchdog is configured.
    """

    def __init__(self, is_healthy: Callable[[], bool], *, interval_s: float | None = None) -> None:
        self._is_healthy = is_healthy
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.pings = 0           # WATCHDOG=1 datagrams sent
        self.skipped = 0         # periods without a ping because the check failed

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> bool:
        """Start the feeding task on the running loop; False when the watchdog is off."""
        if self.running:
            return True
        interval = self._interval_s if self._interval_s is not None else watchdog_interval_s()
        if interval is None or interval <= 0:
            logger.info("systemd watchdog not enabled; not feeding")
            return False
        self._task = asyncio.get_running_loop().create_task(self._run(interval / 2), name="sd-watchdog")
        logger.info("feeding the systemd watchdog every %.3f s", interval / 2)
        return True

    async def stop(self) -> None:
        """Cancel the task and wait for it to end."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    def _healthy(self) -> bool:
        try:
            return bool(self._is_healthy())
        except Exception:
            logger.exception("watchdog health check raised; treating as unhealthy")
            return False

    async def _run(self, period: float) -> None:
        was_healthy = True
        while True:
            if self._healthy():
                if not was_healthy:
                    logger.warning("health check passes again; resuming watchdog pings")
                was_healthy = True
                if notify_watchdog():
                    self.pings += 1
            else:
                if was_healthy:
                    logger.error("health check failed; withholding watchdog pings")
                was_healthy = False
                self.skipped += 1
            await asyncio.sleep(period)


# ---- unit file ---------------------------------------------------------------------------------

_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def systemd_quote(arg: str) -> str:
    """Quote one argument for an ``ExecStart=`` line.

    Plain words stay bare; anything else is put in double quotes with ``\\`` and ``"``
    backslash-escaped, which systemd and a POSIX shell (and ``shlex.split``) read identically.
    Then ``%`` becomes ``%%`` (systemd specifiers) and ``$`` becomes ``$$`` (systemd variable
    expansion); shlex does not undo those two, systemd does. Control characters (newlines
    included) cannot be written in a unit line and raise ValueError.
    """
    if any(ord(c) < 32 or ord(c) == 127 for c in arg):
        raise ValueError(f"argument {arg!r} contains a control character")
    if arg and _SAFE_ARG.match(arg):
        out = arg
    else:
        out = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return out.replace("%", "%%").replace("$", "$$")


_DEVICE_ALLOW = (
    # /dev/nvidia0..N, /dev/nvidiactl, /dev/nvidia-uvm*, /dev/nvidia-caps/*: the char- form takes a
    # /proc/devices group name and may use globs (a /dev/ path may not), so it also covers GPU
    # nodes created after start; the explicit paths document the nodes in use.
    ("char-nvidia*", "rw"),
    ("/dev/nvidiactl", "rw"),
    ("/dev/nvidia-uvm", "rw"),
    ("/dev/nvidia-uvm-tools", "rw"),
    # /dev/infiniband/uverbs*, umad*, issm* (groups infiniband_verbs, infiniband_mad); rdma_cm is a
    # misc device, so it is listed by path rather than allowing every misc device.
    ("char-infiniband*", "rw"),
    ("/dev/infiniband/rdma_cm", "rw"),
)


UNIT_ROLES = {  # role → (unit file name, description)
    "server": ("ringserve.service", "ringserve OpenAI-compatible inference server"),
    "head": ("ringserve-head.service", "ringserve head node (HTTP server, ranks from 0, rendezvous for the others)"),
    "headless": ("ringserve-node.service", "ringserve headless node (its ranks of a multi-node group; no HTTP)"),
    # PD disaggregation: one unit per side, and the proxy clients talk to.
    "prefill": ("ringserve-prefill.service", "ringserve prefill server (computes prompts, hands their KV over NIXL)"),
    "decode": ("ringserve-decode.service", "ringserve decode server (generates from KV read over NIXL)"),
    "proxy": ("ringserve-proxy.service", "ringserve PD proxy (OpenAI endpoint in front of prefill and decode)"),
}


# Beyond @system-service: NUMA placement (CUDA, NCCL and UCX pin host buffers to a node) and
# cross-memory attach (UCX's and NCCL's intra-node copies between processes); a call the filter
# refuses fails with EPERM rather than killing the process, so a missing one shows in the log.
SYSCALL_FILTER = ("@system-service", "mbind", "get_mempolicy", "set_mempolicy", "migrate_pages", "move_pages",
                  "process_vm_readv", "process_vm_writev", "pidfd_getfd")


def render_unit(serve_args: list[str], *, exec_path: str, user: str | None, drain_timeout_s: float,
                watchdog_s: float = 60, working_dir: str | None = None,
                start_timeout_s: float = 3600, restart_sec: float = 15, role: str = "server",
                command: str = "serve", cluster_key_file: str | None = None) -> str:
    """Return a systemd service unit that runs ``<exec_path> serve <serve_args...>`` on one node.

    ``role``: "server" (one node), "head" (a multi-node group's node with the HTTP server) or
    "headless" (any other node of it). Each node of a group gets its own unit; any of them
    failing (exit non-zero) fails the group, and each restarts on its own: the head starts a
    new generation and the nodes join it. PD disaggregation: "prefill" and "decode" (a server
    with that --kv-role) and "proxy" (``command`` "proxy": no GPU, no shared memory).

    ``exec_path`` is the absolute path of the ``ringserve`` executable; ``serve_args`` are the
    arguments after ``serve`` (this node's flags). ``user=None`` uses ``DynamicUser=yes``.
    ``TimeoutStopSec`` is the drain timeout plus a margin of max(30 s, 10 %), so ``KillMode=mixed``
    only SIGKILLs the cgroup after the drain had its chance. ``watchdog_s=0`` disables the
    watchdog. ``start_timeout_s`` bounds model loading; the server may extend it with
    :func:`notify_extend_timeout`. ``cluster_key_file`` (an absolute path on the node) is handed to
    the service with ``LoadCredential=`` (ipc/cluster_auth.py finds it in
    ``$CREDENTIALS_DIRECTORY``): never on the command line, unreadable by other services.
    """
    if not os.path.isabs(exec_path):
        raise ValueError(f"exec_path must be absolute, got {exec_path!r}")
    if working_dir is not None and not os.path.isabs(working_dir):
        raise ValueError(f"working_dir must be absolute, got {working_dir!r}")
    if drain_timeout_s < 0 or watchdog_s < 0 or start_timeout_s <= 0 or restart_sec < 0:
        raise ValueError("timeouts must be non-negative (start_timeout_s positive)")
    if user is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", user):
        raise ValueError(f"invalid user name {user!r}")
    if role not in UNIT_ROLES:
        raise ValueError(f"role must be one of {', '.join(UNIT_ROLES)}, got {role!r}")
    if cluster_key_file is not None and not os.path.isabs(cluster_key_file):
        raise ValueError(f"cluster_key_file must be absolute, got {cluster_key_file!r}")
    unit_name, description = UNIT_ROLES[role]

    stop_timeout = math.ceil(drain_timeout_s + max(30.0, 0.1 * drain_timeout_s))
    exec_line = " ".join(systemd_quote(a) for a in [exec_path, command, *serve_args])
    identity = [f"User={user}", "RemoveIPC=yes"] if user else ["DynamicUser=yes"]
    devices = [f"DeviceAllow={node} {mode}" for node, mode in _DEVICE_ALLOW] if role != "proxy" else []
    credential = ([f"LoadCredential={cluster_auth.CREDENTIAL_NAME}:{_plain_value(cluster_key_file)}"]
                  if cluster_key_file else [])
    pd_notes = {
        "prefill": ["# PD: decode servers must reach this node's NIXL listener (the KV side channel:",
                    "# --kv-transfer-port + rank, TCP) and the UCX data ports; UCX_TLS / UCX_NET_DEVICES in a",
                    "# drop-in pick transports."],
        "decode": ["# PD: this node READs from the prefill servers' KV side channels and UCX ports."],
        "proxy": ["# PD: the proxy only needs to reach the prefill and decode servers' HTTP ports."],
    }.get(role, [])

    lines = [
        f"# {unit_name}, generated by `ringserve` (server/systemd.py).",
        "#",
        "# Install on the node it was rendered for (its serve flags are in ExecStart):",
        f"#   install -m 0644 {unit_name} /etc/systemd/system/{unit_name}",
        f"#   systemd-analyze verify /etc/systemd/system/{unit_name}",
        f"#   systemctl daemon-reload && systemctl enable --now {unit_name}",
        *(["# Multi-node: every node of the group must be able to reach the head's rpc port and the",
           "# next one (the rendezvous store); the ranks' collectives use further ports (gloo/NCCL, on",
           "# the interface toward the head; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in a drop-in override it)."]
          if role in ("head", "headless") else []),
        *pd_notes,
        *(["# The cluster key (`ringserve cluster-key --out FILE`, the same file on every node of the group",
           "# or PD pair, mode 0600, owned by root) reaches the service as a credential (LoadCredential=)."]
          if cluster_key_file else []),
        "# Model weights must be readable by the service user outside /home (ProtectHome=yes),",
        "# e.g. under /var/lib/ringserve (StateDirectory). Load nvidia-uvm at boot: the service",
        "# cannot load kernel modules. With User=, use a dedicated account: RemoveIPC=yes deletes that",
        "# user's shared memory when the unit stops (this is what cleans up rings of a dead server).",
        "# To fence the API port, add IPAddressDeny=any + IPAddressAllow=<clients> in a drop-in.",
        f"# Check with `systemctl status {unit_name}` and `journalctl -u {unit_name}`.",
        "",
        "[Unit]",
        f"Description={description}",
        "Wants=network-online.target",
        "After=network-online.target nvidia-persistenced.service",
        "StartLimitIntervalSec=3600",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_line}",
        *([f"WorkingDirectory={_plain_value(working_dir)}"] if working_dir else []),
        "Restart=on-failure",
        f"RestartSec={_num(restart_sec)}",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStartSec={math.ceil(start_timeout_s)}",
        f"TimeoutStopSec={stop_timeout}",
        f"WatchdogSec={_num(watchdog_s)}",
        *identity,
        "StateDirectory=ringserve",
        "CacheDirectory=ringserve",
        "Environment=RINGSERVE_CACHE_DIR=%C/ringserve",
        "Environment=XDG_CACHE_HOME=%C/ringserve/xdg",
        "Environment=HOME=%S/ringserve",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=1048576",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "UMask=0077",
        "SystemCallArchitectures=native",
        f"SystemCallFilter={' '.join(SYSCALL_FILTER)}",
        "SystemCallErrorNumber=EPERM",
        *credential,
        "DevicePolicy=closed",
        *devices,
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def _plain_value(value: str) -> str:
    """A whole-line value (a path): only specifiers need escaping; control characters are refused."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"value {value!r} contains a control character")
    return value.replace("%", "%%")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def unit_warnings(serve_args: list[str], role: str, cluster_key_file: str | None) -> list[str]:
    """What a rendered unit would expose that its flags do not protect (printed at render time)."""
    def value(flag: str) -> str | None:
        for i, a in enumerate(serve_args):
            if a == flag and i + 1 < len(serve_args):
                return serve_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    out = []
    host = value("--host")
    if role != "headless" and host in _WILDCARDS and value("--api-key") is None:
        out.append(f"--host {host} without --api-key: every interface of this machine serves the API with no "
                   f"authentication (add --api-key, or fence the port with IPAddressAllow= in a drop-in)")
    if role in ("head", "headless", "prefill", "decode") and cluster_key_file is None \
            and "--insecure-cluster" not in serve_args:
        out.append(f"a {role} unit without a cluster key: its internal channels listen on loopback only, so other "
                   f"machines cannot join (make one with `ringserve cluster-key --out FILE`, copy it to every node, "
                   f"and render with --cluster-key-file FILE)")
    return out
