"""server.systemd: notify datagrams, health-gated watchdog pings, the rendered unit file."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from server import systemd as sd
from server.systemd import WatchdogFeeder, render_unit


def _recv_all(sock: socket.socket) -> list[bytes]:
    out = []
    sock.setblocking(False)
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


@pytest.fixture
def notify_path(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


@pytest.fixture
def notify_abstract(monkeypatch):
    name = f"ringserve-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield sock
    sock.close()


@pytest.mark.parametrize("which", ["notify_path", "notify_abstract"])
def test_notify_payloads(which, request):
    sock = request.getfixturevalue(which)
    calls = [
        (lambda: sd.sd_notify("FOO=1\nBAR=2"), b"FOO=1\nBAR=2"),
        (sd.notify_ready, b"READY=1"),
        (lambda: sd.notify_ready("serving 2 GPUs"), b"READY=1\nSTATUS=serving 2 GPUs"),
        (sd.notify_stopping, b"STOPPING=1"),
        (lambda: sd.notify_stopping("draining"), b"STOPPING=1\nSTATUS=draining"),
        (lambda: sd.notify_status("loading shard 3/40\nalmost"), b"STATUS=loading shard 3/40 almost"),
        (sd.notify_watchdog, b"WATCHDOG=1"),
        (lambda: sd.notify_extend_timeout(90_000_000), b"EXTEND_TIMEOUT_USEC=90000000"),
        (lambda: sd.notify_status("µ-ünïcode"), "STATUS=µ-ünïcode".encode()),
    ]
    for call, expected in calls:
        assert call() is True
        assert sock.recv(4096) == expected


def test_notify_without_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd.notify_ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")        # not supported here
    assert sd.notify_watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "missing.sock"))
    assert sd.notify_status("x") is False                       # send fails: logged, no raise
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sd.sd_notify("READY=1") is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sd.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    assert sd.watchdog_interval_s() == 60.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sd.watchdog_interval_s() == 60.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))    # meant for another process
    assert sd.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_PID", "nope")
    assert sd.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "abc"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert sd.watchdog_interval_s() is None


def test_watchdog_feeder_pings_only_while_healthy(notify_path, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "100000")               # 0.1 s -> ping every 0.05 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    state = {"healthy": True}

    def check() -> bool:
        if state["healthy"] is None:
            raise RuntimeError("heartbeat table broken")
        return state["healthy"]

    async def scenario() -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
        feeder = WatchdogFeeder(check)
        assert feeder.start() is True
        assert feeder.start() is True                           # idempotent
        await asyncio.sleep(0.3)
        healthy = _recv_all(notify_path)
        state["healthy"] = False                                # a worker heartbeat went stale
        stale = _recv_all(notify_path)                          # pings already sent before the flip
        await asyncio.sleep(0.3)
        unhealthy = _recv_all(notify_path)
        state["healthy"] = None                                 # a raising check counts as unhealthy
        await asyncio.sleep(0.2)
        raising = _recv_all(notify_path)
        state["healthy"] = True
        await asyncio.sleep(0.2)
        recovered = _recv_all(notify_path)
        await feeder.stop()
        assert not feeder.running
        await asyncio.sleep(0.15)
        assert _recv_all(notify_path) == []                     # stopped: no more pings
        assert feeder.skipped >= 4
        assert feeder.pings == len(healthy) + len(stale) + len(recovered)
        return healthy, unhealthy, raising, recovered

    healthy, unhealthy, raising, recovered = asyncio.run(scenario())
    assert len(healthy) >= 2 and set(healthy) == {b"WATCHDOG=1"}
    assert unhealthy == [] and raising == []
    assert len(recovered) >= 1 and set(recovered) == {b"WATCHDOG=1"}


def test_watchdog_feeder_off_without_watchdog(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)

    async def scenario() -> None:
        feeder = WatchdogFeeder(lambda: True)
        assert feeder.start() is False
        assert not feeder.running
        await feeder.stop()                                      # harmless

    asyncio.run(scenario())


# ---- unit file ---------------------------------------------------------------------------------

TRICKY_ARGS = ["--model", "/var/lib/ringserve/My Model", "--served-model-name", "it's \"v4\" flash",
               "--api-key-file", "/etc/ringserve/key", "--chat-template", "a\\b", "--tag", "",
               "--tp", "8", "--host", "0.0.0.0", "--note", "50% $HOME ${X} `id`", ";", "naïve"]


def _unit(serve_args: list[str] = TRICKY_ARGS, **kw) -> str:
    args = dict(exec_path="/usr/local/bin/ringserve", user="ringserve", drain_timeout_s=120.0,
                working_dir="/var/lib/ringserve")
    args.update(kw)
    return render_unit(serve_args, **args)


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_unit_has_required_directives():
    unit = _unit()
    d = _directives(unit)
    required = {
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillMode": "mixed",
        "WatchdogSec": "60", "LimitMEMLOCK": "infinity", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "StateDirectory": "ringserve", "CacheDirectory": "ringserve",
        "ProtectHome": "yes", "PrivateTmp": "yes", "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK", "CapabilityBoundingSet": "",
        "DevicePolicy": "closed", "User": "ringserve", "WorkingDirectory": "/var/lib/ringserve",
    }
    for key, value in required.items():
        assert d.get(key) == [value], key
    for key in ("RestartSec", "StartLimitIntervalSec", "StartLimitBurst", "TimeoutStartSec", "LimitNOFILE"):
        assert len(d.get(key, [])) == 1 and int(d[key][0]) > 0, key
    assert int(d["LimitNOFILE"][0]) >= 65536
    assert int(d["TimeoutStartSec"][0]) >= 1800                 # model loading is slow
    assert int(d["TimeoutStopSec"][0]) >= 120 + 30              # drain + margin
    assert "Environment" in d and any(v.startswith("RINGSERVE_CACHE_DIR=") for v in d["Environment"])
    allowed = [v.split()[0] for v in d["DeviceAllow"]]
    for node in ("char-nvidia*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                 "char-infiniband*"):
        assert node in allowed, node
    assert all(v.split()[1] == "rw" for v in d["DeviceAllow"])
    assert unit.index("[Unit]") < unit.index("StartLimitBurst") < unit.index("[Service]")
    assert unit.index("[Service]") < unit.index("Type=notify") < unit.index("[Install]")
    assert "install on the node it was rendered for" in unit.lower()  # how to deploy it is documented


def test_unit_has_no_forbidden_directives():
    d = _directives(_unit())
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "DynamicUser"):
        assert key not in d, key
    assert _directives(_unit(user=None)).get("DynamicUser") == ["yes"]
    assert "User" not in _directives(_unit(user=None))


def test_unit_timeouts_scale():
    assert _directives(_unit(drain_timeout_s=600))["TimeoutStopSec"] == ["660"]
    assert _directives(_unit(drain_timeout_s=0))["TimeoutStopSec"] == ["30"]
    assert _directives(_unit(watchdog_s=0))["WatchdogSec"] == ["0"]
    assert _directives(_unit(watchdog_s=7.5))["WatchdogSec"] == ["7.5"]


def _systemd_unescape(line: str) -> str:
    """Undo the two escapes systemd resolves that a shell does not ($$ and %%)."""
    return line.replace("$$", "$").replace("%%", "%")


def test_execstart_round_trips_through_shlex():
    d = _directives(_unit())
    argv = shlex.split(_systemd_unescape(d["ExecStart"][0]))
    assert argv == ["/usr/local/bin/ringserve", "serve", *TRICKY_ARGS]
    # Bare $/% would be expanded by systemd: they must be doubled in the unit line.
    assert re.search(r"(?<!\$)\$(?!\$)", d["ExecStart"][0].replace("$$", "")) is None
    assert "50%% $$HOME $${X}" in d["ExecStart"][0]
    # Paths with spaces work as the executable too.
    d = _directives(_unit(exec_path="/opt/ring serve/bin/ringserve", serve_args=[]))
    assert shlex.split(d["ExecStart"][0]) == ["/opt/ring serve/bin/ringserve", "serve"]


def test_unit_rejects_bad_input():
    with pytest.raises(ValueError):
        _unit(exec_path="ringserve")
    with pytest.raises(ValueError):
        _unit(working_dir="relative/dir")
    with pytest.raises(ValueError):
        _unit(serve_args=["--x", "line\nbreak"])
    with pytest.raises(ValueError):
        _unit(user="root; rm -rf /")
    with pytest.raises(ValueError):
        _unit(drain_timeout_s=-1)


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # The executable must exist for verify; the venv's python stands in for ringserve.
    unit = render_unit(TRICKY_ARGS, exec_path=sys.executable, user=None, drain_timeout_s=120,
                       working_dir=str(tmp_path))
    path = tmp_path / "ringserve.service"
    path.write_text(unit)
    try:
        proc = subprocess.run([tool, "verify", "--man=no", str(path)], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"systemd-analyze cannot run here: {e}")
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "ringserve.service" in line]
    if proc.returncode != 0 and not ours:
        pytest.skip(f"systemd-analyze cannot run in this container: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0 and ours == [], proc.stdout + proc.stderr


def test_unit_roles_of_a_multi_node_group():
    head = _unit(serve_args=["--dp", "4", "--data-parallel-size-local", "2"], role="head")
    node = _unit(serve_args=["--headless", "--data-parallel-start-rank", "2"], role="headless")
    assert "ringserve-head.service" in head and "head node" in _directives(head)["Description"][0]
    assert "ringserve-node.service" in node and "headless node" in _directives(node)["Description"][0]
    for unit in (head, node):  # every node restarts on its own; the group re-forms under a new generation
        assert _directives(unit)["Restart"] == ["on-failure"] and "GLOO_SOCKET_IFNAME" in unit
    assert "GLOO_SOCKET_IFNAME" not in _unit()
    with pytest.raises(ValueError):
        _unit(role="worker")


def test_unit_roles_of_pd_disaggregation():
    """One unit per PD side; the proxy runs `ringserve proxy` without GPU device access."""
    pre = _unit(serve_args=["--kv-role", "prefill", "--kv-transfer", "nixl"], role="prefill")
    dec = _unit(serve_args=["--kv-role", "decode", "--kv-transfer", "nixl"], role="decode")
    proxy = _unit(serve_args=["--prefill", "http://p:8001", "--decode", "http://d:8002"], role="proxy",
                  command="proxy")
    assert "ringserve-prefill.service" in pre
    assert "ringserve-decode.service" in dec
    assert _directives(pre)["ExecStart"][0].split()[:2] == ["/usr/local/bin/ringserve", "serve"]
    assert _directives(proxy)["ExecStart"][0].split()[:2] == ["/usr/local/bin/ringserve", "proxy"]
    assert "DeviceAllow" in _directives(pre) and "DeviceAllow" not in _directives(proxy)
    assert "NIXL listener" in pre and "GLOO_SOCKET_IFNAME" not in pre
    for unit in (pre, dec, proxy):
        assert _directives(unit)["Restart"] == ["on-failure"]


def test_systemd_unit_command_infers_and_checks_the_pd_role(capsys):
    from server.cli import main

    assert main(["systemd-unit", "--", "--kv-role", "decode", "--kv-transfer", "nixl"]) == 0
    assert "ringserve-decode.service" in capsys.readouterr().out
    assert main(["systemd-unit", "--role", "proxy", "--", "--prefill", "http://p:1", "--decode", "http://d:2"]) == 0
    assert " proxy --prefill" in capsys.readouterr().out
    assert main(["systemd-unit", "--role", "prefill", "--", "--kv-role", "decode", "--kv-transfer", "nixl"]) != 0
    assert "--role prefill does not match" in capsys.readouterr().err
    assert main(["systemd-unit", "--", "--kv-role", "prefill"]) != 0
    assert "needs --kv-transfer nixl" in capsys.readouterr().err
