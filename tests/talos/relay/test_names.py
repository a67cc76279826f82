"""Relay names: opaque tokens, nkeys cross-checked against the independent ``nkeys`` package."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from talos.relay.names import RelayNames, crc16_xmodem, nkey_public, nkey_seed, relay_token
from talos.relay.serverconf import render_server_config, user_entry
from talos_sdk.errors import DIDError
from talos_sdk.wallet import Wallet


def test_crc16_xmodem_check_value() -> None:
    # The catalogue check value of CRC-16/XMODEM (Greg Cook's CRC RevEng catalogue).
    assert crc16_xmodem(b"123456789") == 0x31C3


def test_nkeys_agree_with_the_nkeys_package() -> None:
    nkeys = pytest.importorskip("nkeys")
    wallet = Wallet.from_seed(bytes(range(32)))
    pair = nkeys.from_seed(bytearray(nkey_seed(wallet.seed).encode()))
    assert pair.public_key.decode() == nkey_public(wallet.public_key)
    assert nkey_public(wallet.public_key).startswith("U")
    # Signing the server's nonce with the nkey is signing with the node's identity.
    assert pair.sign(b"nonce") == wallet.sign(b"nonce")


def test_token_is_stable_opaque_and_per_did() -> None:
    a, b = Wallet.from_seed(bytes(32)), Wallet.from_seed(bytes([1]) * 32)
    ta = relay_token(a.did)
    assert ta == relay_token(a.did) and ta != relay_token(b.did)
    assert len(ta) == 32 and ta.isalnum() and ta.lower() == ta
    names = RelayNames.for_did(a.did)
    for subject in (names.link, names.mailbox, names.stream, names.inbox_prefix):
        assert a.did not in subject and a.did.removeprefix("did:key:") not in subject
    with pytest.raises(DIDError):
        relay_token("did:key:nonsense")


def test_permissions_subscribe_only_to_own_subjects() -> None:
    wallet = Wallet.from_seed(bytes(32))
    names = RelayNames.for_did(wallet.did)
    entry = user_entry(wallet.did)
    subscribe = entry["permissions"]["subscribe"]["allow"]  # type: ignore[index]
    assert subscribe == [names.link, f"{names.inbox_prefix}.>"]
    text = render_server_config([wallet.did], host="127.0.0.1", port=4222, store_dir="/x")
    assert json.dumps(nkey_public(wallet.public_key)) in text
    assert "jetstream" in text


DID2 = Wallet.from_seed(bytes([6]) * 32).did


def test_relay_config_command_is_accepted_by_nats_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from talos.cli import main
    from talos.node import init_home
    from tests.talos.relay.natsd import nats_server_binary

    binary = nats_server_binary()
    init_home(tmp_path / "n")
    other = Wallet.from_seed(bytes([5]) * 32).did
    code = main(
        ["relay-config", other, "--node-home", str(tmp_path / "n"), "--store-dir", str(tmp_path)]
    )
    assert code == 0
    conf = tmp_path / "nats.conf"
    conf.write_text(capsys.readouterr().out)
    checked = subprocess.run(
        [binary, "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert main(["relay-config"]) == 1  # nothing named: a clear error
    # A store too small for every mailbox is said, not left to show as a node without one.
    assert main(["relay-config", other, "--max-store", "100M", "--mailbox-mb", "64"]) == 0
    assert "holds 1 of the 1 mailboxes" not in capsys.readouterr().err
    assert main(["relay-config", other, DID2, "--max-store", "100M", "--mailbox-mb", "64"]) == 0
    assert "--max-store 100M holds 1 of the 2 mailboxes of 64 MiB" in capsys.readouterr().err


def test_relay_urls_are_checked() -> None:
    from pydantic import ValidationError

    from talos.config import NodeConfig, parse_relay_url
    from talos_sdk.errors import UsageError

    assert parse_relay_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    for bad in ["ws://h:1", "nats://h", "nats://u:p@h:1", "nats://h:1/x", "nats://h:x"]:
        with pytest.raises(UsageError):
            parse_relay_url(bad)
    with pytest.raises(ValidationError, match="nats://HOST:PORT"):
        NodeConfig(relays=("http://h:1",))


def test_the_publisher_account_is_read_from_the_relay_header() -> None:
    from talos.relay.names import REQUEST_INFO_HEADER, publisher_account

    names = RelayNames.for_did(Wallet.generate().did)
    assert names.account == f"TALOS_{names.token.upper()}"
    # As nats-server 2.15 writes it on a message crossing a service import.
    stamped = json.dumps({"acc": names.account, "rtt": 462787})
    assert publisher_account({REQUEST_INFO_HEADER: stamped}) == names.account
    assert publisher_account(None) is None  # from within the receiver's own account
    assert publisher_account({"Other": "x"}) is None
    for broken in ["", "{", "[]", '{"rtt": 1}', '{"acc": 7}', "[" * 100_000, " " * 5000]:
        assert publisher_account({REQUEST_INFO_HEADER: broken}) == ""  # matches no account


def test_the_own_account_is_read_from_the_user_info_answer() -> None:
    from talos.relay.names import user_info_account

    # The shape of nats-server 2.15's answer on $SYS.REQ.USER.INFO (fields cut).
    answer = {"server": {"name": "N"}, "data": {"user": "U", "account": "TALOS_X"}}
    assert user_info_account(json.dumps(answer).encode()) == "TALOS_X"
    for broken in [b"", b"{", b"[]", b'{"data": 1}', b'{"data": {"account": 2}}', b"[" * 100_000]:
        assert user_info_account(broken) is None
