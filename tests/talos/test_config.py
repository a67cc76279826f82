"""Node config, peer addresses and home layout (talos/config.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from talos.config import Home, NodeConfig, default_home, parse_listen, parse_peer_addr
from talos_sdk.did import did_from_public_key
from talos_sdk.errors import DIDError, UsageError

DID = did_from_public_key(bytes(range(32)))


def test_peer_addr_round_trip() -> None:
    addr = parse_peer_addr(f"ws://127.0.0.1:4100#{DID}")
    assert addr.url == "ws://127.0.0.1:4100"
    assert addr.did == DID
    assert str(addr) == f"ws://127.0.0.1:4100#{DID}"


@pytest.mark.parametrize(
    ("addr", "match"),
    [
        ("http://127.0.0.1:1#x", "must look like"),
        ("ws://127.0.0.1#" + DID, "needs a port"),
        ("ws://127.0.0.1:99999#" + DID, "bad port"),
        ("ws://127.0.0.1:1", "needs the peer's DID"),
    ],
)
def test_bad_peer_addr(addr: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_peer_addr(addr)


def test_peer_addr_with_malformed_did() -> None:
    with pytest.raises(DIDError):
        parse_peer_addr("ws://127.0.0.1:1#did:key:nope")


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1", ":80", "h:x"):
        with pytest.raises(UsageError, match="HOST:PORT"):
            parse_listen(bad)
    with pytest.raises(UsageError, match="port 70000 out of range"):
        parse_listen("h:70000")


def test_home_files(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert home.load_config() == NodeConfig()
    cfg = NodeConfig(listen="127.0.0.1:0", peers=(f"ws://h:1#{DID}",))
    home.save_config(cfg)
    assert home.load_config() == cfg
    token = home.create_api_token()
    assert home.api_token() == token
    assert stat.S_IMODE(home.token_file.stat().st_mode) == 0o600
    assert home.read_node_info() is None
    home.write_node_info({"listen": "ws://127.0.0.1:5"})
    assert home.read_node_info() == {"listen": "ws://127.0.0.1:5"}


def test_invalid_config_is_a_clear_error(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.config_file.write_text('{"no_such_option": 1}')
    with pytest.raises(UsageError, match="invalid config"):
        home.load_config()


def test_missing_token_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="talosd init"):
        Home(tmp_path).api_token()


def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TALOS_HOME", str(tmp_path))
    assert default_home() == tmp_path
    monkeypatch.delenv("TALOS_HOME")
    assert default_home() == Path.home() / ".talos"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.1", "::"])
def test_the_control_api_host_must_be_loopback_when_the_config_is_read(host: str) -> None:
    with pytest.raises(ValueError, match="api_host"):
        NodeConfig(api_host=host)
    assert NodeConfig(api_host="::1").api_host == "::1"
