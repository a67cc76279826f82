"""The identity key at rest: where a passphrase comes from, unlocking, changing it.

The key file format (scrypt + ChaCha20-Poly1305) is docs/PROTOCOL.md "Key
files", implemented in :mod:`talos_sdk.keyfile`. This module is the node's
policy around it (docs/security.md "Keys at rest"): ``talosd init`` asks for
a passphrase on a terminal or takes ``--passphrase-file`` / ``TALOS_PASSPHRASE``,
and an unencrypted key only by the explicit ``--no-passphrase``; ``talosd
run``, the offline commands and ``talos-proxy`` unlock by the same means.

A terminal prompt is only ever shown when standard input is a terminal:
``talos-proxy connect`` speaks MCP on its standard input, which must never be
read for a passphrase.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from talos_sdk.errors import KeyFileError, UsageError, WrongPassphraseError
from talos_sdk.keyfile import load_wallet, read_private_file, save_wallet
from talos_sdk.wallet import Wallet

__all__ = [
    "NEW_PASSPHRASE_ENV",
    "PASSPHRASE_ENV",
    "PassphraseNeededError",
    "change_passphrase",
    "hybrid_since",
    "is_encrypted",
    "key_file_did",
    "key_file_suite",
    "new_key_passphrase",
    "unlock",
]

PASSPHRASE_ENV = "TALOS_PASSPHRASE"
NEW_PASSPHRASE_ENV = "TALOS_NEW_PASSPHRASE"
#: Key file field: the first block height a hybrid identity signs hybrid (0 for one
#: made hybrid by ``talosd init``). Kept there, under the seal, rather than only in
#: the store: a row in the audited store would let whoever rewrites the log say that
#: its hybrid blocks never began (docs/PROTOCOL.md "Block log").
HYBRID_SINCE_FIELD = "hybrid_since"


class PassphraseNeededError(UsageError):
    """No passphrase could be had without a terminal, and none was given another way."""


def _read_doc(path: Path) -> dict[str, object]:
    try:
        doc = json.loads(read_private_file(path))
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"{path} is not a Talos key file (not JSON)") from None
    if not isinstance(doc, dict):
        raise KeyFileError(f"{path} is not a Talos key file")
    return doc


def is_encrypted(path: Path) -> bool:
    """Whether the key file at ``path`` is sealed under a passphrase."""
    return "ciphertext" in _read_doc(path)


def key_file_did(path: Path) -> str:
    """The DID a key file names in clear (no passphrase needed; not verified)."""
    did = _read_doc(path).get("did")
    if not isinstance(did, str):
        raise KeyFileError(f"{path} has no 'did' string")
    return did


def hybrid_since(path: Path) -> int | None:
    """The key file's ``hybrid_since`` (None if it has none). Read it right after the
    key was unlocked: the seal vouches for the header only as it was then."""
    value = _read_doc(path).get(HYBRID_SINCE_FIELD)
    return value if type(value) is int and value >= 0 else None


def key_file_suite(path: Path) -> str:
    """The suite a key file names in clear (``ed25519``, ``ed25519-mldsa65``)."""
    suite = _read_doc(path).get("suite")
    if not isinstance(suite, str):
        raise KeyFileError(f"{path} has no 'suite' string")
    return suite


def read_passphrase_file(path: str | os.PathLike[str]) -> str:
    """The first line of ``path`` without its line ending; empty is an error."""
    try:
        with open(path, encoding="utf-8") as fh:
            line = fh.readline()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read passphrase file {path}: {exc}") from None
    passphrase = line.rstrip("\r\n")
    if not passphrase:
        raise UsageError(f"passphrase file {path} is empty")
    return passphrase


def _from_env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C ends a prompt at once, even under an event loop.

    asyncio's runner handles SIGINT by cancelling its main task, which cannot
    happen while the loop's thread is blocked reading the terminal: the read
    resumed, and Ctrl-C did nothing until Enter. Python's own handler raises
    KeyboardInterrupt out of the read instead. Only the main thread may set it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is not None:  # None: a handler set outside Python, which we cannot restore
            signal.signal(signal.SIGINT, before)


def _prompt(prompt: str, *, confirm: bool) -> str | None:
    """Ask on the terminal; None when standard input is not one."""
    try:
        interactive = sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError, OSError):  # closed or replaced standard input
        interactive = False
    if not interactive:
        return None
    try:
        with _interruptible():
            first = getpass.getpass(prompt)
            if confirm and getpass.getpass("repeat passphrase: ") != first:
                raise UsageError("the two passphrases differ; nothing was written")
    except EOFError:  # Ctrl-D at the prompt
        raise UsageError("no passphrase given (end of input at the prompt)") from None
    if not first:
        if confirm:  # a new key: sealing it under nothing is a choice of its own
            raise UsageError("empty passphrase; use --no-passphrase to store the key unencrypted")
        raise UsageError("empty passphrase: the identity key is sealed; type its passphrase")
    return first


def new_key_passphrase(
    *,
    passphrase_file: str | None,
    no_passphrase: bool,
    env: str = PASSPHRASE_ENV,
    command: str = "talosd init",
    flag: str = "--passphrase-file",
    what: str = "passphrase",
) -> str | None:
    """The passphrase a new identity key is sealed under; None only if opted out.

    Order: ``--passphrase-file``, ``--no-passphrase``, the environment variable
    ``env``, a terminal prompt (twice). Without any: PassphraseNeededError.
    """
    if passphrase_file is not None and no_passphrase:
        raise UsageError(f"{flag} and --no-passphrase exclude each other")
    if passphrase_file is not None:
        return read_passphrase_file(passphrase_file)
    if no_passphrase:
        return None
    passphrase = _from_env(env) or _prompt(f"{what} for the identity key: ", confirm=True)
    if passphrase is None:
        raise PassphraseNeededError(
            f"{command} needs a {what} for the identity key and there is no terminal "
            f"to ask on: give {flag} FILE or set {env}, "
            "or pass --no-passphrase to store the key unencrypted"
        )
    return passphrase


def unlock(path: Path, *, passphrase_file: str | None = None) -> Wallet:
    """Load the identity key at ``path``, asking for its passphrase only if it has one.

    Order: ``passphrase_file``, ``TALOS_PASSPHRASE``, a terminal prompt. Raises
    PassphraseNeededError (none to be had), WrongPassphraseError, KeyFileError.
    """
    if not is_encrypted(path):
        return load_wallet(path)
    if passphrase_file is not None:
        passphrase: str | None = read_passphrase_file(passphrase_file)
        source = f"from --passphrase-file {passphrase_file}"
    elif (passphrase := _from_env(PASSPHRASE_ENV)) is not None:
        source = f"from ${PASSPHRASE_ENV}"
    else:
        return _unlock_at_prompt(path)
    try:
        return load_wallet(path, passphrase)
    except WrongPassphraseError:
        # Name the file and where the passphrase came from: a stale $TALOS_PASSPHRASE
        # left in a shell is the usual cause, and the bare error does not show it.
        raise _wrong(path, source) from None


#: Passphrases a terminal user may type before the unlock fails (as sudo and ssh allow).
PROMPT_TRIES = 3


def _unlock_at_prompt(path: Path) -> Wallet:
    for attempt in range(1, PROMPT_TRIES + 1):
        passphrase = _prompt(f"passphrase for {path}: ", confirm=False)
        if passphrase is None:
            raise PassphraseNeededError(
                f"the identity key {path} is encrypted and there is no terminal to ask for "
                f"its passphrase: give --passphrase-file FILE or set {PASSPHRASE_ENV}"
            )
        try:
            return load_wallet(path, passphrase)
        except WrongPassphraseError:
            if attempt == PROMPT_TRIES:
                raise _wrong(path, f"typed at the prompt, {PROMPT_TRIES} times") from None
            print("that does not open the key; try again", file=sys.stderr)
    raise AssertionError("unreachable")  # the loop returns or raises


def _wrong(path: Path, source: str) -> WrongPassphraseError:
    return WrongPassphraseError(
        f"wrong passphrase for the identity key {path} (passphrase {source}), "
        "or the file's header was modified"
    )


def change_passphrase(
    path: Path,
    *,
    passphrase_file: str | None,
    new_passphrase_file: str | None,
    no_passphrase: bool,
) -> bool:
    """Re-seal the key at ``path`` under a new passphrase (or none); True if it is sealed.

    The current one comes as for :func:`unlock`; the new one from
    ``new_passphrase_file``, ``TALOS_NEW_PASSPHRASE`` or the terminal, or
    ``no_passphrase``. The file is replaced atomically, 0600.
    """
    wallet = unlock(path, passphrase_file=passphrase_file)
    since = hybrid_since(path)
    new = new_key_passphrase(
        passphrase_file=new_passphrase_file,
        no_passphrase=no_passphrase,
        env=NEW_PASSPHRASE_ENV,
        command="talosd passphrase",
        flag="--new-passphrase-file",
        what="new passphrase",
    )
    extra = None if since is None else {HYBRID_SINCE_FIELD: since}
    save_wallet(wallet, path, new, overwrite=True, extra=extra)
    return new is not None
