"""Key files: a wallet's private seed at rest (docs/DESIGN.md "Conventions": created 0600).

Format, version 1, JSON::

    {"format": "talos-key", "version": 1, "suite": "ed25519", "did": "did:key:z6Mk...",
     "secret": "<base64 seed>"}                                   # no passphrase
    {"format": "talos-key", "version": 1, "suite": "ed25519", "did": "did:key:z6Mk...",
     "kdf": {"name": "scrypt", "n": 32768, "r": 8, "p": 1, "salt": "<base64 16 B>"},
     "cipher": {"name": "chacha20-poly1305", "nonce": "<base64 12 B>"},
     "ciphertext": "<base64 seed + tag>"}                        # with a passphrase

With a passphrase the key is scrypt (RFC 7914) of the NFC-normalised UTF-8
passphrase, the seed is sealed with ChaCha20-Poly1305 (RFC 8439), and the AEAD's
associated data is the RFC 8785 canonical JSON of every field except
``ciphertext``, so no header field (DID, KDF cost, suite) can be altered unnoticed.
The DID is stored in clear so a node can say who it is without the passphrase.
Suite ``ed25519-mldsa65`` (:class:`~talos_sdk.wallet.HybridWallet`) stores the same
32-byte seed (the ML-DSA-65 key is derived from it) plus a clear ``key_id`` field,
the hybrid key fingerprint, checked against the key after loading. Fields the
owner adds (``extra``, e.g. a node's ``hybrid_since``) are kept in the header,
authenticated like the rest when the key is sealed; decoding ignores them.

:func:`encode_key_file` / :func:`decode_key_file` are pure (bytes <-> wallet);
:func:`write_private_file` / :func:`read_private_file` do the file I/O, and
:func:`save_wallet` / :func:`load_wallet` are the one-call forms.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import unicodedata
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from talos_sdk.canonical import canonical_json_bytes
from talos_sdk.errors import KeyFileError, UsageError, WrongPassphraseError
from talos_sdk.wallet import Wallet, register_suite, suite_wallet_class

__all__ = [
    "DEFAULT_SCRYPT_N",
    "decode_key_file",
    "encode_key_file",
    "load_wallet",
    "read_private_file",
    "register_suite",
    "save_wallet",
    "write_private_file",
]

FORMAT = "talos-key"
VERSION = 1
DEFAULT_SCRYPT_N = 2**15  # ~32 MiB, ~0.1 s here: RFC 7914 interactive-login class
_SCRYPT_R = 8
_SCRYPT_P = 1
_SALT_LEN = 16
_NONCE_LEN = 12
_MAX_FILE = 64 * 1024
# Bounds on costs read from a file, so a hostile file cannot demand gigabytes.
_MIN_N, _MAX_N = 2**10, 2**20
_MAX_SCRYPT_MEMORY = 256 * 1024 * 1024
_OWN_FIELDS = frozenset({"kdf", "cipher", "secret", "ciphertext"})


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(doc: dict[str, Any], key: str, value: Any, length: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise KeyFileError(f"key file field {key!r} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"key file field {key!r} is not valid base64") from None
    if length is not None and len(raw) != length:
        raise KeyFileError(f"key file field {key!r} must be {length} bytes, got {len(raw)}")
    return raw


def _passphrase_bytes(passphrase: str | bytes) -> bytes:
    if isinstance(passphrase, str):
        # NFC so the same passphrase typed on different systems gives the same key.
        return unicodedata.normalize("NFC", passphrase).encode("utf-8")
    if isinstance(passphrase, bytes | bytearray):
        return bytes(passphrase)
    raise UsageError(f"passphrase must be str, bytes or None, not {type(passphrase).__name__}")


def _check_scrypt(n: Any, r: Any, p: Any) -> tuple[int, int, int]:
    for name, v in (("n", n), ("r", r), ("p", p)):
        if type(v) is not int or v < 1:
            raise KeyFileError(f"scrypt parameter {name} must be a positive integer")
    if n & (n - 1) or not _MIN_N <= n <= _MAX_N:
        raise KeyFileError(f"scrypt n must be a power of two in [2**10, 2**20], got {n}")
    if r > 32 or p > 16 or 128 * n * r > _MAX_SCRYPT_MEMORY:
        raise KeyFileError(f"scrypt cost n={n} r={r} p={p} is beyond the accepted bound")
    return n, r, p


def _derive(passphrase: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase)


def encode_key_file(
    wallet: Wallet,
    passphrase: str | bytes | None = None,
    *,
    rng: Callable[[int], bytes] = os.urandom,
    scrypt_n: int = DEFAULT_SCRYPT_N,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """Serialise ``wallet`` to key-file bytes, sealed under ``passphrase`` if one is given;
    ``extra`` header fields (JSON values) are kept beside the key's own."""
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "suite": wallet.suite,
        "did": wallet.did,
        **wallet.key_file_header(),
    }
    for name, value in (extra or {}).items():
        if name in header or name in _OWN_FIELDS:
            raise UsageError(f"key file field {name!r} is the format's own")
        header[name] = value
    if passphrase is None:
        doc = {**header, "secret": _b64(wallet.private_bytes())}
    else:
        secret = _passphrase_bytes(passphrase)
        if not secret:
            raise UsageError("empty passphrase; use passphrase=None for an unencrypted key file")
        try:
            _check_scrypt(scrypt_n, _SCRYPT_R, _SCRYPT_P)
        except KeyFileError as exc:
            raise UsageError(str(exc)) from None
        salt, nonce = rng(_SALT_LEN), rng(_NONCE_LEN)
        if len(salt) != _SALT_LEN or len(nonce) != _NONCE_LEN:
            raise UsageError("rng returned the wrong number of bytes")
        header["kdf"] = {
            "name": "scrypt",
            "n": scrypt_n,
            "r": _SCRYPT_R,
            "p": _SCRYPT_P,
            "salt": _b64(salt),
        }
        header["cipher"] = {"name": "chacha20-poly1305", "nonce": _b64(nonce)}
        key = _derive(secret, salt, scrypt_n, _SCRYPT_R, _SCRYPT_P)
        sealed = ChaCha20Poly1305(key).encrypt(
            nonce, wallet.private_bytes(), canonical_json_bytes(header)
        )
        doc = {**header, "ciphertext": _b64(sealed)}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def decode_key_file(data: bytes, passphrase: str | bytes | None = None) -> Wallet:
    """Rebuild the wallet from key-file bytes.

    Raises :class:`WrongPassphraseError` if the passphrase does not open it,
    :class:`KeyFileError` if it is encrypted and no passphrase was given, or if
    it is corrupt or in a format or version we do not know.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError("not a Talos key file (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KeyFileError("not a Talos key file (missing format 'talos-key')")
    if doc.get("version") != VERSION:
        raise KeyFileError(f"unsupported key file version {doc.get('version')!r}")
    suite = doc.get("suite")
    cls = suite_wallet_class(suite)
    if cls is None:
        raise KeyFileError(f"unknown wallet suite {suite!r} in key file")
    if not isinstance(doc.get("did"), str):
        raise KeyFileError("key file has no 'did' string")

    if "secret" in doc:
        seed = _unb64(doc, "secret", doc["secret"])
    elif "ciphertext" in doc:
        seed = _open_sealed(doc, passphrase)
    else:
        raise KeyFileError("key file holds neither 'secret' nor 'ciphertext'")
    try:
        wallet = cls.from_seed(seed)
    except UsageError as exc:
        raise KeyFileError(f"key file secret is invalid: {exc}") from None
    if wallet.did != doc["did"]:
        raise KeyFileError("key file DID does not match its key (file corrupted or edited)")
    for name, value in wallet.key_file_header().items():
        if doc.get(name) != value:
            raise KeyFileError(
                f"key file {name!r} does not match its key (file corrupted or edited)"
            )
    return wallet


def _open_sealed(doc: dict[str, Any], passphrase: str | bytes | None) -> bytes:
    if passphrase is None:
        raise KeyFileError("key file is encrypted: a passphrase is needed to open it")
    kdf, cipher = doc.get("kdf"), doc.get("cipher")
    if not isinstance(kdf, dict) or kdf.get("name") != "scrypt":
        raise KeyFileError(f"unsupported key file kdf {kdf!r}")
    if not isinstance(cipher, dict) or cipher.get("name") != "chacha20-poly1305":
        raise KeyFileError(f"unsupported key file cipher {cipher!r}")
    n, r, p = _check_scrypt(kdf.get("n"), kdf.get("r"), kdf.get("p"))
    salt = _unb64(doc, "kdf.salt", kdf.get("salt"))
    if not 8 <= len(salt) <= 64:
        raise KeyFileError(f"scrypt salt of {len(salt)} bytes is out of range")
    nonce = _unb64(doc, "cipher.nonce", cipher.get("nonce"), _NONCE_LEN)
    sealed = _unb64(doc, "ciphertext", doc["ciphertext"])
    header = {k: v for k, v in doc.items() if k != "ciphertext"}
    try:
        ad = canonical_json_bytes(header)
    except UsageError:
        raise KeyFileError("key file header is not canonicalisable JSON") from None
    key = _derive(_passphrase_bytes(passphrase), salt, n, r, p)
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, sealed, ad)
    except InvalidTag:
        raise WrongPassphraseError(
            "wrong passphrase for key file (or its header was modified)"
        ) from None


def write_private_file(path: Path, data: bytes, *, overwrite: bool = False) -> None:
    """Atomically create ``path`` holding ``data``, mode 0600, durable on return.

    Written to a temporary name opened with O_EXCL and 0600, fsynced, then put in
    place; without ``overwrite`` an existing file is never replaced (the final
    step is a hard link, which fails if the name exists, so there is no race).
    """
    path = Path(path)
    if not overwrite and path.exists():
        raise KeyFileError(f"{path} already exists; pass overwrite=True to replace it")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise KeyFileError(f"cannot create key file in {path.parent}: {exc.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)  # umask can only narrow; make the mode exact anyway
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileError(
                    f"{path} already exists; pass overwrite=True to replace it"
                ) from None
            os.unlink(tmp)
    except OSError as exc:
        raise KeyFileError(f"cannot write key file {path}: {exc.strerror}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # The rename/link is only durable once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_private_file(path: Path) -> bytes:
    """Read a key file, refusing anything absurdly large for one."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except FileNotFoundError:
        raise KeyFileError(f"no key file at {path}") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    if len(data) > _MAX_FILE:
        raise KeyFileError(f"{path} is larger than {_MAX_FILE} bytes; not a key file")
    return data


def save_wallet(
    wallet: Wallet,
    path: str | os.PathLike[str],
    passphrase: str | bytes | None = None,
    *,
    overwrite: bool = False,
    rng: Callable[[int], bytes] = os.urandom,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``wallet`` to a 0600 key file at ``path`` (refuses to overwrite unless asked)."""
    data = encode_key_file(wallet, passphrase, rng=rng, extra=extra)
    write_private_file(Path(path), data, overwrite=overwrite)


def load_wallet(path: str | os.PathLike[str], passphrase: str | bytes | None = None) -> Wallet:
    """Read a key file written by :func:`save_wallet`."""
    return decode_key_file(read_private_file(Path(path)), passphrase)
