"""The node's one LMDB environment and its named databases (docs/DESIGN.md "Storage").

Every durable thing a node keeps lives in ``<home>/store/`` as named LMDB
databases inside one environment, so one transaction can cover e.g. an inbox
row *and* its block-log record. The helpers here are deliberately thin: a typed
transaction wrapper (:class:`Txn`) and the two ways to open it.

Durability ("nothing acknowledged before it is committed"): the environment is
opened with LMDB ``sync=False, metasync=False`` (MDB_NOSYNC), and
``write(durable=True)`` calls ``env.sync(True)`` (one ``fdatasync``) after the
commit returns. ``write(durable=False)`` commits to the OS page cache only; it
survives a crash of *this process* at once, and a crash of the machine once the
next durable commit or :meth:`Store.sync` has run. Measured here: a
commit + ``env.sync(True)`` costs ~0.20 ms against ~0.26 ms for LMDB's own
``sync=True`` commit (two flushes), and a non-durable commit a few µs. The
price (LMDB docs, MDB_NOSYNC): if the *machine* loses power between a
non-durable commit and the next sync, the file system may have reordered the
writes; docs/PROTOCOL.md "Block log" records this trade-off.

A home is held by one process: LMDB itself allows many, so an exclusive
``flock`` on ``<path>/talos.lock`` turns a second opener (this process or
another) into a clear :class:`~talos_sdk.errors.StorageError`.

The store holds private keys, ratchet state and the plaintext inbox, and
docs/security.md relies on the file system keeping them from other local
users: the folder is 0700 and LMDB's files 0600, tightened again on every open
so a home created by an older version (0755/0644) is fixed in place.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import lmdb

from talos_sdk.errors import StorageError, StorageFullError, UsageError

__all__ = ["DEFAULT_DATABASES", "Store", "Txn"]

#: Named databases every node home has. Other layers add theirs with
#: ``Store(extra_databases=...)``.
DEFAULT_DATABASES: tuple[str, ...] = (
    "blocks",  # height (u64 BE) -> encoded Block
    "block_records",  # height (u64 BE) || index (u32 BE) -> encoded Record
    "records",  # record id -> height (u64 BE) || index (u32 BE)
    "records_b",  # the same; a rewrite of the index builds the one not in use (ADR 0013)
    "pending",  # sequence (u64 BE) -> tagged encoded Record (chain/pending.py), not yet sealed
    "quarantine",  # record id -> reason || encoded Record (failed sealing checks)
    "sessions",
    "prekeys",
    "outbox",
    "inbox",
    "peers",
    "transfers",
    "meta",
)

#: Owner-only modes for the store folder and LMDB's files (see module docstring).
DIR_MODE = 0o700
FILE_MODE = 0o600


class StoreInUseError(StorageError):
    """Another process (or another Store here) holds the home's lock."""


def _full_error(map_size: int) -> StorageFullError:
    return StorageFullError(
        f"LMDB map full (map_size={map_size} bytes); the transaction was rolled back "
        "and nothing was written. Raise map_size in the home's config.json and restart "
        'the node (docs/operations.md "Configuration").'
    )


class Txn:
    """One LMDB transaction addressed by database *name* (see :data:`DEFAULT_DATABASES`)."""

    __slots__ = ("_dbs", "_map_size", "raw")

    def __init__(
        self, raw: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], map_size: int
    ) -> None:
        self.raw = raw
        self._dbs = dbs
        self._map_size = map_size

    def _db(self, name: str) -> lmdb._Database:
        try:
            return self._dbs[name]
        except KeyError:
            raise UsageError(f"unknown store database {name!r}") from None

    def get(self, db: str, key: bytes) -> bytes | None:
        """Value under ``key`` or ``None``."""
        # One expression, no typing.cast call: this and put() are the per-item cost
        # bench_storage compares to raw lmdb (cast alone was ~8 % of a get).
        try:
            return self.raw.get(key, None, self._dbs[db])
        except KeyError:
            raise UsageError(f"unknown store database {db!r}") from None

    def put(
        self, db: str, key: bytes, value: bytes, *, overwrite: bool = True, append: bool = False
    ) -> bool:
        """Store ``value``; with ``overwrite=False`` returns False if ``key`` exists.

        ``append=True`` (LMDB ``MDB_APPEND``, for keys that only grow): returns
        False and writes nothing unless ``key`` is above every key present.
        """
        try:
            return self.raw.put(key, value, True, overwrite, append, self._dbs[db])
        except KeyError:
            raise UsageError(f"unknown store database {db!r}") from None
        except lmdb.MapFullError:
            raise _full_error(self._map_size) from None
        except lmdb.BadValsizeError as exc:
            raise UsageError(f"key size not accepted by LMDB: {exc}") from None

    def put_many(
        self, db: str, items: Iterable[tuple[bytes, bytes]], *, append: bool = False
    ) -> None:
        """Store many pairs with one cursor (the batched block write path).

        ``append=True`` (LMDB ``MDB_APPEND``): the keys are in order and above
        every key present, so pages are filled and written in sequence; a key
        out of order is :class:`UsageError`.
        """
        cur = self.raw.cursor(db=self._db(db))
        try:
            consumed, added = cur.putmulti(items, overwrite=True, append=append)
        except lmdb.MapFullError:
            raise _full_error(self._map_size) from None
        finally:
            cur.close()
        if append and consumed != added:
            # py-lmdb skips a key out of order in append mode instead of raising;
            # raising here aborts the caller's transaction, so nothing is written.
            raise UsageError(f"put_many(append=True) on {db!r}: keys not in ascending order")

    def delete(self, db: str, key: bytes) -> bool:
        """Remove ``key``; False if it was not there."""
        return bool(self.raw.delete(key, db=self._db(db)))

    def items(
        self, db: str, start: bytes | None = None, *, reverse: bool = False
    ) -> Generator[tuple[bytes, bytes], None, None]:
        """Pairs in key order from ``start`` (inclusive), or in reverse from the end."""
        cur = self.raw.cursor(db=self._db(db))
        try:
            if reverse:
                ok = cur.last() if start is None else _seek_at_or_before(cur, start)
                if not ok:
                    return
                yield from cur.iterprev(keys=True, values=True)
            else:
                ok = cur.first() if start is None else cur.set_range(start)
                if not ok:
                    return
                yield from cur.iternext(keys=True, values=True)
        finally:
            cur.close()

    def last(self, db: str) -> tuple[bytes, bytes] | None:
        """The pair with the greatest key, or ``None`` if the database is empty."""
        cur = self.raw.cursor(db=self._db(db))
        try:
            return (bytes(cur.key()), bytes(cur.value())) if cur.last() else None
        finally:
            cur.close()

    def count(self, db: str) -> int:
        """Number of entries in ``db``."""
        return int(self.raw.stat(self._db(db))["entries"])

    def clear(self, db: str) -> None:
        """Remove every entry of ``db``."""
        self.raw.drop(self._db(db), delete=False)


def _seek_at_or_before(cur: lmdb.Cursor, key: bytes) -> bool:
    if cur.set_range(key):
        return True if cur.key() == key else cur.prev()
    return cur.last()


class Store:
    """One LMDB environment per node home with the named databases of the node."""

    def __init__(
        self,
        path: Path,
        map_size: int = 1 << 30,
        sync: bool = True,
        *,
        extra_databases: Iterable[str] = (),
        lock_wait: float = 0.0,
    ) -> None:
        self.path = Path(path)
        self.map_size = map_size
        self._durable = sync
        self._local = threading.local()
        names = list(DEFAULT_DATABASES)
        names += [n for n in extra_databases if n not in names]
        try:
            self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            self.path.chmod(DIR_MODE)
        except OSError as exc:
            raise StorageError(f"cannot create the store folder {self.path}: {exc}") from exc
        self._lock_file = self._take_home_lock(lock_wait)
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                max_dbs=len(names) + 4,
                sync=False,  # flushed explicitly, see module docstring
                metasync=False,
                lock=True,
                readahead=False,
                max_spare_txns=4,
                mode=FILE_MODE,
            )
        except lmdb.Error as exc:
            self._release_home_lock()
            raise StorageError(f"cannot open the store at {self.path}: {exc}") from exc
        self._tighten_files()
        try:
            with self.env.begin(write=True) as txn:
                self._dbs = {n: self.env.open_db(n.encode(), txn=txn) for n in names}
        except lmdb.MapFullError:
            self.close()
            raise _full_error(map_size) from None
        self.env.sync(True)
        self.closed = False

    def _tighten_files(self) -> None:
        # lmdb's mode= applies only to files it creates; an older home keeps 0644 otherwise.
        for name in ("data.mdb", "lock.mdb", "talos.lock"):
            try:
                (self.path / name).chmod(FILE_MODE)
            except FileNotFoundError:
                continue

    def _take_home_lock(self, wait: float) -> IO[bytes]:
        """The home's lock; held by another process, retried for ``wait`` seconds (an
        offline ``talosd`` command holds it for a moment, a node for as long as it runs)."""
        fd = os.open(self.path / "talos.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        fh = os.fdopen(fd, "ab")  # held for the Store's life
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                fh.close()
                raise StoreInUseError(
                    f"the store at {self.path} is already open (by this or another process); "
                    "stop the other process using it (talosd run, talosd mcp, talos-proxy) "
                    "or use another home; if a node is just starting there, run the command "
                    "again in a moment"
                ) from None
        fh.truncate(0)
        fh.write(str(os.getpid()).encode())
        fh.flush()
        return fh

    def _release_home_lock(self) -> None:
        fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
        self._lock_file.close()

    @property
    def databases(self) -> tuple[str, ...]:
        """Names of the databases this store opened."""
        return tuple(self._dbs)

    @contextmanager
    def read(self) -> Iterator[Txn]:
        """A read-only snapshot."""
        self._check_open()
        raw = self.env.begin(write=False)
        try:
            yield Txn(raw, self._dbs, self.map_size)
        finally:
            raw.abort()

    @contextmanager
    def write(self, durable: bool = True) -> Iterator[Txn]:
        """A write transaction, committed on success and aborted on any exception.

        ``durable=True`` returns only after the commit is on disk (fsync);
        ``durable=False`` is for group commit (see the module docstring).
        """
        self._check_open()
        if getattr(self._local, "writing", False):
            # LMDB's writer mutex is per environment: a nested writer would deadlock.
            raise UsageError("nested write transaction on the same store")
        self._local.writing = True
        try:
            with self._committing(self.env.begin(write=True)) as txn:
                yield txn
        finally:
            self._local.writing = False
        if durable and self._durable:
            self.env.sync(True)

    @contextmanager
    def nested(self, parent: Txn) -> Iterator[Txn]:
        """A child of the open write transaction ``parent`` (LMDB nested transaction).

        On success its writes join ``parent`` (durable only when ``parent``
        commits); on an exception they are dropped and ``parent`` stays usable:
        the store writer's group commit runs each job in one, so a failing job
        fails alone.
        """
        with self._committing(self.env.begin(write=True, parent=parent.raw)) as txn:
            yield txn

    @contextmanager
    def _committing(self, raw: lmdb.Transaction[bytes]) -> Iterator[Txn]:
        """``raw`` as a :class:`Txn`: committed on success, aborted on any exception."""
        try:
            yield Txn(raw, self._dbs, self.map_size)
        except BaseException:
            raw.abort()
            raise
        try:
            raw.commit()
        except lmdb.MapFullError:
            raise _full_error(self.map_size) from None

    def sync(self) -> None:
        """Flush every committed transaction to disk."""
        self._check_open()
        self.env.sync(True)

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError(f"the store at {self.path} is closed")

    def close(self) -> None:
        """Flush and close; the home can then be opened again."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        env = getattr(self, "env", None)
        if env is not None:
            if self._durable:
                env.sync(True)
            env.close()
        self._release_home_lock()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
