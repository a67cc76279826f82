"""The node's LMDB store beside raw py-lmdb on the same data (docs/DESIGN.md "Performance targets").

Rows (docs/DESIGN.md "Performance targets", row LMDB block store): a batched append of
records through :class:`talos.store.Store` (one write transaction,
``put_many``) against the same batch through a raw ``lmdb`` cursor; random
point reads through a ``Store.read()`` snapshot against a raw read
transaction; and one durable commit (commit + fsync), the floor under every
acknowledged message. Both environments live in temporary folders on the same
file system with the same flags.
"""

from __future__ import annotations

import atexit
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lmdb
from _common import Suite

from talos.store import Store

BATCH = 1000  # records per write transaction: a sealed block's worth
READS = 1000  # point reads per read transaction
VALUE_SIZE = 200  # bytes: an encoded record (ids, DIDs, commitment hash, signature)
PRELOADED = 100_000
DB = "block_records"
_KEY = struct.Struct(">Q")
_VALUE = bytes(range(256)) * (VALUE_SIZE // 256 + 1)


def _value(i: int) -> bytes:
    return _KEY.pack(i) + _VALUE[: VALUE_SIZE - 8]


def _tmpdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


class _Appender:
    """Appends the next batch of monotonically keyed records on each call."""

    def __init__(self, start: int) -> None:
        self.next = start

    def batch(self) -> list[tuple[bytes, bytes]]:
        first = self.next
        self.next += BATCH
        return [(_KEY.pack(i), _value(i)) for i in range(first, first + BATCH)]


def _preload(
    items: list[tuple[bytes, bytes]], store: Store, env: lmdb.Environment, db: lmdb._Database
) -> None:
    with store.write(durable=True) as txn:
        txn.put_many(DB, items)
    with env.begin(write=True, db=db) as raw:
        raw.cursor().putmulti(items)
    env.sync(True)


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    fast = suite.fast
    preloaded = 2_000 if fast else PRELOADED
    store = Store(_tmpdir("talos-bench-store-"), map_size=4 << 30)
    # Same flags as Store (MDB_NOSYNC + explicit fsync) so only our layer differs.
    env = lmdb.open(
        str(_tmpdir("talos-bench-rawlmdb-")),
        map_size=4 << 30,
        max_dbs=4,
        sync=False,
        metasync=False,
        readahead=False,
    )
    db = env.open_db(DB.encode())
    atexit.register(env.close)
    atexit.register(store.close)
    _preload([(_KEY.pack(i), _value(i)) for i in range(preloaded)], store, env, db)

    # The batch is built inside both calls: the same Python work on either side.
    ours_app, raw_app = _Appender(preloaded), _Appender(preloaded)

    def ours_append() -> None:
        with store.write(durable=False) as txn:
            txn.put_many(DB, ours_app.batch())

    def raw_append() -> None:
        with env.begin(write=True, db=db) as txn:
            txn.cursor().putmulti(raw_app.batch())

    suite.pair(
        "store.append.batch",
        f"Store.write + put_many, {BATCH} x {VALUE_SIZE} B (per record)",
        raw_append,
        ours_append,
        raw_label=f"lmdb cursor.putmulti, {BATCH} x {VALUE_SIZE} B (per record)",
        per_call=BATCH,
    )

    rng = random.Random(6)
    keys = [_KEY.pack(rng.randrange(preloaded)) for _ in range(READS)]

    def ours_read() -> None:
        with store.read() as txn:
            for k in keys:
                txn.get(DB, k)

    def raw_read() -> None:
        with env.begin(db=db) as txn:
            for k in keys:
                txn.get(k)

    suite.pair(
        "store.read.random",
        f"Store.read + get, {READS} random keys (per read)",
        raw_read,
        ours_read,
        raw_label=f"lmdb txn.get, {READS} random keys (per read)",
        per_call=READS,
    )

    sync_key = _KEY.pack(2**63)
    sync_value = _value(0)

    def ours_sync_commit() -> None:
        with store.write(durable=True) as txn:
            txn.put(DB, sync_key, sync_value)

    def raw_sync_commit() -> None:
        with env.begin(write=True, db=db) as txn:
            txn.put(sync_key, sync_value)
        env.sync(True)

    suite.pair(
        "store.sync_commit",
        "Store.write(durable=True), one record",
        raw_sync_commit,
        ours_sync_commit,
        raw_label="lmdb commit + env.sync(True), one record",
    )
    suite.finish()


if __name__ == "__main__":
    main()
