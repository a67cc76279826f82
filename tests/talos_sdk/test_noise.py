"""talos_sdk.noise against the published Noise vectors and the noiseprotocol package."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from noise.connection import Keypair, NoiseConnection

from talos_sdk.errors import DecryptionError, MalformedFrameError, UsageError
from talos_sdk.noise import CipherState, HandshakeState, protocol_name

VECTORS = Path(__file__).parents[1] / "vectors" / "noise" / "noise_25519_chachapoly_sha256.json"


def _vectors() -> list[dict[str, Any]]:
    return list(json.loads(VECTORS.read_text())["vectors"])


def _hx(value: str | None) -> bytes | None:
    return bytes.fromhex(value) if value is not None else None


def _pattern(name: str) -> str:
    return name.split("_")[1]


def _pair(v: dict[str, Any]) -> tuple[HandshakeState, HandshakeState]:
    pattern = _pattern(v.get("protocol_name") or v["name"])
    ini = HandshakeState(
        pattern,
        True,
        prologue=bytes.fromhex(v["init_prologue"]),
        s=_hx(v.get("init_static")),
        e=_hx(v["init_ephemeral"]),
        rs=_hx(v.get("init_remote_static")),
    )
    resp = HandshakeState(
        pattern,
        False,
        prologue=bytes.fromhex(v["resp_prologue"]),
        s=_hx(v.get("resp_static")),
        e=_hx(v["resp_ephemeral"]),
        rs=_hx(v.get("resp_remote_static")),
    )
    return ini, resp


@pytest.mark.parametrize(
    "vector",
    _vectors(),
    ids=lambda v: f"{v['from']}-{_pattern(v.get('protocol_name') or v['name'])}",
)
def test_published_vector(vector: dict[str, Any]) -> None:
    ini, resp = _pair(vector)
    sides = [ini, resp]
    ciphers: list[tuple[CipherState, CipherState]] = []
    for i, msg in enumerate(vector["messages"]):
        payload = bytes.fromhex(msg["payload"])
        expected = bytes.fromhex(msg["ciphertext"])
        writer, reader = (0, 1) if i % 2 == 0 else (1, 0)
        if not ciphers:
            out = sides[writer].write_message(payload)
            assert out == expected
            assert sides[reader].read_message(out) == payload
            if ini.finished:
                assert resp.finished
                if "handshake_hash" in vector:
                    assert ini.handshake_hash == bytes.fromhex(vector["handshake_hash"])
                    assert resp.handshake_hash == ini.handshake_hash
                ciphers = [ini.split(), resp.split()]
        else:
            out = ciphers[writer][0].encrypt_with_ad(b"", payload)
            assert out == expected
            assert ciphers[reader][1].decrypt_with_ad(b"", out) == payload
    assert ciphers, "the vector finished its handshake"


def _keys() -> tuple[bytes, bytes]:
    return os.urandom(32), os.urandom(32)


def _theirs(initiator: bool, s: bytes) -> NoiseConnection:
    conn = NoiseConnection.from_name(b"Noise_XX_25519_ChaChaPoly_SHA256")
    conn.set_prologue(b"talos-test")
    conn.set_keypair_from_private_bytes(Keypair.STATIC, s)
    if initiator:
        conn.set_as_initiator()
    else:
        conn.set_as_responder()
    conn.start_handshake()
    return conn


@pytest.mark.parametrize("we_initiate", [True, False])
def test_interop_with_noiseprotocol(we_initiate: bool) -> None:
    """Both roles against an independent implementation, then transport both ways."""
    ours_s, theirs_s = _keys()
    ours = HandshakeState("XX", we_initiate, prologue=b"talos-test", s=ours_s)
    theirs = _theirs(not we_initiate, theirs_s)
    payloads = [b"one", b"two", b"three"]
    for i, payload in enumerate(payloads):
        if ours.writes_next:
            assert theirs.read_message(ours.write_message(payload)) == payload
        else:
            assert ours.read_message(theirs.write_message(payload)) == payload
        assert i < 3
    assert ours.finished and theirs.handshake_finished
    assert ours.handshake_hash == theirs.get_handshake_hash()
    their_public = X25519PrivateKey.from_private_bytes(theirs_s).public_key().public_bytes_raw()
    assert ours.rs == their_public
    send, recv = ours.split()
    for n in range(3):
        data = b"frame %d" % n
        assert theirs.decrypt(send.encrypt_with_ad(b"", data)) == data
        assert recv.decrypt_with_ad(b"", theirs.encrypt(data)) == data
    send.rekey()
    theirs.rekey_inbound_cipher()
    assert theirs.decrypt(send.encrypt_with_ad(b"", b"after rekey")) == b"after rekey"


def _run(ini: HandshakeState, resp: HandshakeState) -> Iterator[bytes]:
    sides = (ini, resp)
    turn = 0
    while not ini.finished:
        msg = sides[turn].write_message(b"p%d" % turn)
        yield msg
        sides[1 - turn].read_message(msg)
        turn = 1 - turn


def test_hfs_pair_agrees_and_mixes_the_kem() -> None:
    ini = HandshakeState("XXhfs", True, s=os.urandom(32))
    resp = HandshakeState("XXhfs", False, s=os.urandom(32))
    sizes = [len(m) for m in _run(ini, resp)]
    assert sizes[0] == 32 + 1184 + 2  # e, e1 (in the clear), payload
    assert sizes[1] == 32 + 1088 + 16 + 48 + 18  # e, ekem1, s, payload
    assert ini.handshake_hash == resp.handshake_hash
    (a_send, a_recv), (b_send, b_recv) = ini.split(), resp.split()
    assert b_recv.decrypt_with_ad(b"", a_send.encrypt_with_ad(b"", b"x")) == b"x"
    assert a_recv.decrypt_with_ad(b"", b_send.encrypt_with_ad(b"", b"y")) == b"y"
    assert protocol_name("XXhfs") == b"Noise_XXhfs_25519+MLKEM768_ChaChaPoly_SHA256"


@pytest.mark.parametrize("pattern", ["XX", "XXhfs"])
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("where", [5, -1])
def test_tampered_handshake_message_fails(pattern: str, index: int, where: int) -> None:
    """One flipped bit anywhere in any message: the handshake does not complete."""
    ini = HandshakeState(pattern, True, s=os.urandom(32))
    resp = HandshakeState(pattern, False, s=os.urandom(32))
    sides = (ini, resp)
    with pytest.raises(DecryptionError):
        for i in range(3):
            msg = bytearray(sides[i % 2].write_message(b"payload"))
            if i == index:
                msg[where] ^= 0x01
            sides[1 - i % 2].read_message(bytes(msg))


def test_wrong_prologue_fails() -> None:
    ini = HandshakeState("XX", True, prologue=b"a", s=os.urandom(32))
    resp = HandshakeState("XX", False, prologue=b"b", s=os.urandom(32))
    resp.read_message(ini.write_message())
    with pytest.raises(DecryptionError):
        ini.read_message(resp.write_message())


def test_short_and_out_of_turn_messages() -> None:
    ini = HandshakeState("XX", True, s=os.urandom(32))
    resp = HandshakeState("XX", False, s=os.urandom(32))
    with pytest.raises(MalformedFrameError):
        resp.read_message(b"\x00" * 10)
    with pytest.raises(UsageError):
        resp.write_message()
    with pytest.raises(MalformedFrameError):
        ini.read_message(b"\x00" * 64)
    with pytest.raises(UsageError):
        ini.split()
    with pytest.raises(UsageError):
        HandshakeState("KK", True)


def test_low_order_point_is_refused() -> None:
    ini = HandshakeState("XX", True, s=os.urandom(32))
    resp = HandshakeState("XX", False, s=os.urandom(32))
    with pytest.raises(DecryptionError):
        resp.read_message(ini.write_message())
        ini.read_message(bytes(32) + resp.write_message()[32:])


def test_payload_hash_matches_on_both_sides() -> None:
    ini = HandshakeState("XX", True, s=os.urandom(32))
    resp = HandshakeState("XX", False, s=os.urandom(32))
    resp.read_message(ini.write_message())
    seen: list[bytes] = []
    msg = resp.write_message(payload_for=lambda h: seen.append(h) or h)
    assert ini.read_message(msg) == seen[0] == ini.payload_hash


def test_transport_counter_replay_and_reorder_fail() -> None:
    k = os.urandom(32)
    tx, rx = CipherState(k), CipherState(k)
    c0, c1 = tx.encrypt_with_ad(b"", b"a"), tx.encrypt_with_ad(b"", b"b")
    with pytest.raises(DecryptionError):
        rx.decrypt_with_ad(b"", c1)  # reordered
    assert rx.decrypt_with_ad(b"", c0) == b"a"
    with pytest.raises(DecryptionError):
        rx.decrypt_with_ad(b"", c0)  # replayed
    assert rx.decrypt_with_ad(b"", c1) == b"b"
