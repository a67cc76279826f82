"""Tests for talos_sdk.keyfile: real files in tmp dirs, 0600, atomicity, every bad input."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

import talos_sdk.wallet as wallet_module
from talos_sdk.errors import KeyFileError, UsageError, WrongPassphraseError
from talos_sdk.keyfile import (
    DEFAULT_SCRYPT_N,
    decode_key_file,
    encode_key_file,
    load_wallet,
    read_private_file,
    register_suite,
    save_wallet,
    write_private_file,
)
from talos_sdk.wallet import Wallet

FAST_N = 2**10  # the lowest cost the format accepts: keeps tests quick


def _fixed_rng(n: int) -> bytes:
    return bytes([7]) * n


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_save_load_plain(tmp_path: Path) -> None:
    w = Wallet.generate()
    path = tmp_path / "id.key"
    save_wallet(w, path)
    assert _mode(path) == 0o600
    doc = json.loads(path.read_text())
    assert doc["format"] == "talos-key" and doc["version"] == 1 and doc["did"] == w.did
    loaded = load_wallet(path)
    assert loaded.seed == w.seed and loaded.did == w.did


def test_save_load_encrypted_default_cost(tmp_path: Path) -> None:
    w = Wallet.generate()
    path = tmp_path / "id.key"
    save_wallet(w, path, "correct horse")
    assert _mode(path) == 0o600
    text = path.read_text()
    assert base64.b64encode(w.seed).decode() not in text
    assert json.loads(text)["kdf"]["n"] == DEFAULT_SCRYPT_N
    assert load_wallet(path, "correct horse").seed == w.seed
    assert load_wallet(str(path), b"correct horse").seed == w.seed


def test_mode_is_0600_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        save_wallet(Wallet.generate(), tmp_path / "k")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "k") == 0o600


def test_encoding_is_deterministic_with_injected_rng() -> None:
    w = Wallet.from_seed(bytes(32))
    a = encode_key_file(w, "pw", rng=_fixed_rng, scrypt_n=FAST_N)
    assert a == encode_key_file(w, "pw", rng=_fixed_rng, scrypt_n=FAST_N)
    assert decode_key_file(a, "pw").seed == bytes(32)


def test_passphrase_is_nfc_normalised() -> None:
    w = Wallet.generate()
    data = encode_key_file(w, "caf\u00e9", scrypt_n=FAST_N)  # precomposed é
    assert decode_key_file(data, "cafe\u0301").seed == w.seed  # e + combining acute


def test_wrong_passphrase() -> None:
    data = encode_key_file(Wallet.generate(), "right", scrypt_n=FAST_N)
    with pytest.raises(WrongPassphraseError, match="wrong passphrase"):
        decode_key_file(data, "wrong")
    with pytest.raises(WrongPassphraseError):
        decode_key_file(data, "")


def test_encrypted_without_passphrase() -> None:
    data = encode_key_file(Wallet.generate(), "pw", scrypt_n=FAST_N)
    with pytest.raises(KeyFileError, match="a passphrase is needed") as info:
        decode_key_file(data)
    assert not isinstance(info.value, WrongPassphraseError)


def _edit(data: bytes, **changes: Any) -> bytes:
    doc = json.loads(data)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "changes",
    [
        {"did": Wallet.from_seed(bytes(32)).did},
        {"kdf": {"name": "scrypt", "n": 2**11, "r": 8, "p": 1, "salt": "BwcHBwcHBwcHBwcHBwcHBw=="}},
        {"extra": "field"},
    ],
)
def test_header_is_bound_by_the_aead(changes: dict[str, Any]) -> None:
    data = encode_key_file(Wallet.generate(), "pw", rng=_fixed_rng, scrypt_n=FAST_N)
    with pytest.raises(WrongPassphraseError):
        decode_key_file(_edit(data, **changes), "pw")


def test_tampered_ciphertext() -> None:
    data = encode_key_file(Wallet.generate(), "pw", scrypt_n=FAST_N)
    sealed = bytearray(base64.b64decode(json.loads(data)["ciphertext"]))
    sealed[0] ^= 1
    with pytest.raises(WrongPassphraseError):
        decode_key_file(_edit(data, ciphertext=base64.b64encode(sealed).decode()), "pw")


PLAIN = encode_key_file(Wallet.from_seed(bytes(32)))
SEALED = encode_key_file(Wallet.from_seed(bytes(32)), "pw", rng=_fixed_rng, scrypt_n=FAST_N)
_SALT = "BwcHBwcHBwcHBwcHBwcHBw=="


@pytest.mark.parametrize(
    ("data", "passphrase", "message"),
    [
        (b"", None, "not JSON"),
        (b"\xff\xfe", None, "not JSON"),
        (b"[1, 2]", None, "missing format"),
        (b'{"format": "pem"}', None, "missing format"),
        (_edit(PLAIN, version=2), None, "unsupported key file version 2"),
        (_edit(PLAIN, version=...), None, "unsupported key file version None"),
        (_edit(PLAIN, suite="rsa"), None, "unknown wallet suite 'rsa'"),
        (_edit(PLAIN, did=...), None, "no 'did' string"),
        (_edit(PLAIN, secret=...), None, "neither 'secret' nor 'ciphertext'"),
        (_edit(PLAIN, secret="not base64!"), None, "'secret' is not valid base64"),
        (_edit(PLAIN, secret=12), None, "'secret' must be a base64 string"),
        (_edit(PLAIN, secret="AAAA"), None, "secret is invalid: .*got 3"),
        (_edit(PLAIN, did=Wallet.from_seed(bytes([1]) * 32).did), None, "DID does not match"),
        (_edit(SEALED, kdf={"name": "argon2id"}), "pw", "unsupported key file kdf"),
        (_edit(SEALED, kdf="scrypt"), "pw", "unsupported key file kdf"),
        (_edit(SEALED, cipher={"name": "aes"}), "pw", "unsupported key file cipher"),
        (
            _edit(SEALED, kdf={"name": "scrypt", "n": 2**30, "r": 8, "p": 1, "salt": _SALT}),
            "pw",
            "power of two in",
        ),
        (
            _edit(SEALED, kdf={"name": "scrypt", "n": 1000, "r": 8, "p": 1, "salt": _SALT}),
            "pw",
            "power of two in",
        ),
        (
            _edit(SEALED, kdf={"name": "scrypt", "n": 2**20, "r": 32, "p": 1, "salt": _SALT}),
            "pw",
            "beyond the accepted bound",
        ),
        (
            _edit(SEALED, kdf={"name": "scrypt", "n": 2**10, "r": "8", "p": 1, "salt": _SALT}),
            "pw",
            "parameter r must be a positive integer",
        ),
        (
            _edit(SEALED, kdf={"name": "scrypt", "n": 2**10, "r": 8, "p": 1, "salt": "AA=="}),
            "pw",
            "salt of 1 bytes",
        ),
        (
            _edit(SEALED, cipher={"name": "chacha20-poly1305", "nonce": "AAAA"}),
            "pw",
            "'cipher.nonce' must be 12 bytes, got 3",
        ),
        (_edit(SEALED, extra=float("nan")), "pw", "not canonicalisable"),
    ],
)
def test_corrupt_files(data: bytes, passphrase: str | None, message: str) -> None:
    with pytest.raises(KeyFileError, match=message) as info:
        decode_key_file(data, passphrase)
    assert not isinstance(info.value, WrongPassphraseError)


def test_bad_passphrase_arguments() -> None:
    w = Wallet.generate()
    with pytest.raises(UsageError, match="empty passphrase"):
        encode_key_file(w, "")
    with pytest.raises(UsageError, match="passphrase must be str, bytes or None"):
        encode_key_file(w, 1234)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="power of two"):
        encode_key_file(w, "pw", scrypt_n=3)
    with pytest.raises(UsageError, match="rng returned the wrong number of bytes"):
        encode_key_file(w, "pw", rng=lambda n: b"x", scrypt_n=FAST_N)


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    first, second = Wallet.generate(), Wallet.generate()
    save_wallet(first, path)
    with pytest.raises(KeyFileError, match="already exists; pass overwrite=True"):
        save_wallet(second, path)
    assert load_wallet(path).did == first.did
    save_wallet(second, path, overwrite=True)
    assert load_wallet(path).did == second.did
    assert _mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.key"]  # no temp files left


def test_write_into_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot create key file"):
        write_private_file(tmp_path / "nope" / "id.key", b"x")


def test_read_errors(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="no key file at"):
        load_wallet(tmp_path / "missing.key")
    with pytest.raises(KeyFileError, match="cannot read key file"):
        read_private_file(tmp_path)  # a directory
    big = tmp_path / "big.key"
    big.write_bytes(b" " * (64 * 1024 + 1))
    with pytest.raises(KeyFileError, match="larger than"):
        load_wallet(big)


class _LabWallet(Wallet):
    suite = "lab-test"


def test_one_suite_registry_serves_wallets_and_key_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wallet_module, "_WALLET_SUITES", dict(wallet_module._WALLET_SUITES))
    seed = bytes(range(32))
    doc = json.loads(encode_key_file(_LabWallet(seed), None))
    with pytest.raises(KeyFileError, match="unknown wallet suite 'lab-test'"):
        decode_key_file(json.dumps(doc).encode(), None)
    with pytest.raises(UsageError, match="unknown wallet suite 'lab-test'"):
        Wallet.generate(suite="lab-test")
    register_suite("lab-test", _LabWallet)  # keyfile's name for wallet.register_suite
    assert register_suite is wallet_module.register_suite
    loaded = decode_key_file(json.dumps(doc).encode(), None)
    assert type(loaded) is _LabWallet and loaded.did == _LabWallet(seed).did
    assert type(Wallet.from_seed(seed, suite="lab-test")) is _LabWallet
