"""The cluster key: made once by `ringserve cluster-key`, found where the docs say (flag, the two
variables, a systemd credential), refused when malformed, and handed to systemd units as a
credential, never on the command line; the hardened unit; the render-time warnings."""
from __future__ import annotations

import re
import stat

import pytest

from ipc import cluster_auth
from server.cli import main
from ipc.cluster_auth import ClusterAuth, ClusterKeyError
from server.systemd import render_unit


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_cluster_key_command_writes_a_private_file_once_and_prints_the_key_once(tmp_path, capsys):
    path = tmp_path / "cluster.key"
    assert main(["cluster-key", "--out", str(path)]) == 0
    out, err = capsys.readouterr()
    key = path.read_text().strip()
    assert out.strip() == key and re.fullmatch(r"[0-9a-f]{64}", key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "copy that file" in err
    assert main(["cluster-key", "--out", str(path)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err and path.read_text().strip() == key
    assert main(["cluster-key"]) == 0
    other = capsys.readouterr().out.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", other) and other != key


def test_the_key_is_found_flag_first_then_variables_then_the_systemd_credential(tmp_path):
    a, b, cred = (tmp_path / n for n in ("a.key", "b.key", "creds"))
    cred.mkdir()
    keys = {}
    for path in (a, b, cred / cluster_auth.CREDENTIAL_NAME):
        keys[path] = cluster_auth.generate_key()
        cluster_auth.write_key_file(path, keys[path])
    env = {cluster_auth.KEY_FILE_ENV: str(b), cluster_auth.KEY_ENV: "ab" * 32, "CREDENTIALS_DIRECTORY": str(cred)}
    assert cluster_auth.load(str(a), environ=env).key.hex() == keys[a]
    assert cluster_auth.load(None, environ=env).key.hex() == keys[b]
    del env[cluster_auth.KEY_FILE_ENV]
    assert cluster_auth.load(None, environ=env).key == bytes.fromhex("ab" * 32)
    del env[cluster_auth.KEY_ENV]
    assert cluster_auth.load(None, environ=env).key.hex() == keys[cred / cluster_auth.CREDENTIAL_NAME]
    assert cluster_auth.load(None, environ={}).key is None


@pytest.mark.parametrize("text, fragment", [("not hex at all", "not hex"), ("abcd", "at least 32")])
def test_a_malformed_key_is_one_clear_error(tmp_path, text, fragment):
    path = tmp_path / "bad.key"
    path.write_text(text)
    with pytest.raises(ClusterKeyError, match=fragment):
        cluster_auth.load(str(path), environ={})
    with pytest.raises(ClusterKeyError, match="cannot read"):
        cluster_auth.load(str(tmp_path / "missing.key"), environ={})


def test_each_channel_gets_its_own_keys_and_the_policy_keeps_keyless_listeners_on_loopback():
    auth = ClusterAuth(bytes(range(32)))
    node, store = auth.curve_keys(cluster_auth.NODE_CHANNEL), auth.curve_keys(cluster_auth.RENDEZVOUS_STORE)
    assert len({node.server_public, node.client_public, store.server_public, store.client_public}) == 4
    assert auth.mac_key(cluster_auth.KV_PARAMS_MAC) != auth.mac_key("other")
    assert ClusterAuth(bytes(range(32))).curve_keys(cluster_auth.NODE_CHANNEL) == node  # both sides derive alike
    keyless = ClusterAuth(None)
    for host in ("127.0.0.1", "localhost", "::1"):
        keyless.check_listen(host, "x")
    with pytest.raises(ClusterKeyError, match="no cluster key"):
        keyless.check_listen("10.0.0.5", "the node port")
    ClusterAuth(None, insecure=True).check_listen("10.0.0.5", "x")
    auth.check_listen("0.0.0.0", "x")


def test_units_load_the_key_as_a_credential_and_are_hardened(capsys):
    assert main(["systemd-unit", "--cluster-key-file", "/etc/ringserve/cluster.key", "--", "/m", "--dp", "2",
                 "--data-parallel-size-local", "1", "--data-parallel-address", "10.0.0.1"]) == 0
    out, err = capsys.readouterr()
    d = _directives(out)
    assert d["LoadCredential"] == [f"{cluster_auth.CREDENTIAL_NAME}:/etc/ringserve/cluster.key"]
    assert "cluster" not in d["ExecStart"][0] and "ringserve-head.service" in out and err == ""
    for key, value in {"SystemCallArchitectures": "native", "RestrictNamespaces": "yes", "RestrictRealtime": "yes",
                       "ProtectClock": "yes", "ProtectHostname": "yes", "ProtectProc": "invisible",
                       "UMask": "0077", "SystemCallErrorNumber": "EPERM"}.items():
        assert d[key] == [value], key
    assert d["SystemCallFilter"][0].split()[0] == "@system-service" and "mbind" in d["SystemCallFilter"][0]
    # The key never on the command line: as a serve flag inside the unit, it is refused.
    assert main(["systemd-unit", "--", "--cluster-key-file", "/k"]) == 2
    assert "LoadCredential" in capsys.readouterr().err
    with pytest.raises(ValueError):
        render_unit([], exec_path="/x", user=None, drain_timeout_s=1, cluster_key_file="relative.key")


def test_rendering_warns_about_an_open_api_and_about_a_group_without_a_key(capsys):
    assert main(["systemd-unit", "--", "--host", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "warning: --host 0.0.0.0 without --api-key" in err
    assert main(["systemd-unit", "--", "--host", "0.0.0.0", "--api-key", "k"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["systemd-unit", "--", "--headless", "--dp", "2", "--data-parallel-size-local", "1",
                 "--data-parallel-start-rank", "1"]) == 0
    assert "headless unit without a cluster key" in capsys.readouterr().err


def test_pd_without_nixl_or_off_loopback_without_a_key_is_one_line(monkeypatch):
    import argparse
    import dataclasses

    from engine.kv_transfer import registry
    from engine.kv_transfer.config import KVTransferConfig
    from server import pd

    args = argparse.Namespace(host="127.0.0.1")
    nixl = registry.entry("nixl")
    monkeypatch.setitem(registry.TRANSPORTS, "nixl", dataclasses.replace(nixl, modules=("no_such_nixl_wheel",)))
    with pytest.raises(ValueError, match=r"needs NIXL, which is not installed: pip install 'ringserve\[pd\]'"):
        pd.check_pd_listeners(args, KVTransferConfig(role="decode"), ClusterAuth(None))
    monkeypatch.setitem(registry.TRANSPORTS, "nixl", dataclasses.replace(nixl, modules=("zmq",)))  # an installed wheel
    pd.check_pd_listeners(args, KVTransferConfig(role="prefill", host="127.0.0.1"), ClusterAuth(None))
    with pytest.raises(ClusterKeyError, match="KV side channel"):
        pd.check_pd_listeners(args, KVTransferConfig(role="prefill", host="10.0.0.7"), ClusterAuth(None))
    pd.check_pd_listeners(args, KVTransferConfig(role="prefill", host="10.0.0.7"), ClusterAuth(bytes(32)))
    pd.check_pd_listeners(argparse.Namespace(host="0.0.0.0"), KVTransferConfig(role="decode"), ClusterAuth(None, True))
    pd.check_pd_listeners(args, None, ClusterAuth(None))  # no PD: nothing to check
