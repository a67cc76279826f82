"""The sealed link channel and its handshake (docs/adr/0011-noise-link-channel.md).

Run ``python bench/bench_link.py`` (any pyperf option works; ``--fast`` for a
smoke run). Rows: a link frame sealed and opened by :class:`LinkChannel`
(35 B, an ACK-sized frame, and 64 KiB) beside one raw ChaCha20-Poly1305
encrypt + decrypt of the same bytes in the same run (targets 0.5x and 0.9x);
complete in-memory link handshakes per second, classical Noise XX and hybrid
XXhfs with ML-KEM-768, both with Ed25519 identities, beside the X25519
exchange floor.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from talos.link.channel import LinkChannel
from talos.link.handshake import LinkHandshake, Role
from talos_sdk.noise import CipherState
from talos_sdk.wallet import Wallet

SIZES = {"35 B": 35, "64 KiB": 64 * 1024}
_NONCE = struct.Struct("<4xQ")


def bench_seal_open(suite: Suite) -> None:
    """Seal on one channel and open on its peer, beside raw AEAD encrypt + decrypt."""
    key_ab, key_ba = os.urandom(32), os.urandom(32)
    a = LinkChannel(CipherState(key_ab), CipherState(key_ba))
    b = LinkChannel(CipherState(key_ba), CipherState(key_ab))
    aead = ChaCha20Poly1305(key_ab)
    for label, size in SIZES.items():
        frame = os.urandom(size)
        tag = label.replace(" ", "")
        counter = [0]

        def raw(frame: bytes = frame, counter: list[int] = counter) -> bytes:
            nonce = _NONCE.pack(counter[0])
            counter[0] += 1
            return aead.decrypt(nonce, aead.encrypt(nonce, frame, None), None)

        def ours(frame: bytes = frame) -> bytes:
            return b.open(a.seal(frame))

        suite.pair(
            f"link.seal_open.{tag}",
            f"LinkChannel seal + open {label}",
            raw,
            ours,
            raw_label=f"ChaCha20-Poly1305 encrypt + decrypt {label}",
        )


def _handshake(ini_wallet: Wallet, res_wallet: Wallet, pq: bool) -> None:
    ini = LinkHandshake(ini_wallet, Role.INITIATOR, pq=pq)
    res = LinkHandshake(res_wallet, Role.RESPONDER)
    data = ini.start()
    sides = (res, ini)
    turn = 0
    while data is not None:
        data = sides[turn].receive(data)
        turn = 1 - turn
    assert ini.done and res.done


def bench_handshakes(suite: Suite) -> None:
    """Both sides of one complete link handshake per call (in memory, no sockets)."""
    a, b = Wallet.from_seed(b"\x01" * 32), Wallet.from_seed(b"\x02" * 32)
    suite.single(
        "link.handshake.classical",
        "link handshake, Noise XX + Ed25519 identities (both sides)",
        lambda: _handshake(a, b, False),
    )
    suite.single(
        "link.handshake.hybrid",
        "link handshake, Noise XXhfs ML-KEM-768 + Ed25519 identities (both sides)",
        lambda: _handshake(a, b, True),
    )
    x, y = x25519.X25519PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    y_pub = y.public_key()
    suite.floor("link.x25519.exchange", "OpenSSL X25519 exchange", lambda: x.exchange(y_pub))


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    bench_seal_open(suite)
    bench_handshakes(suite)
    suite.finish()


if __name__ == "__main__":
    main()
