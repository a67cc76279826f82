"""Tests for talos/store.py against a real LMDB environment in a tmp dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from talos.store import DEFAULT_DATABASES, Store
from talos_sdk.errors import StorageError, StorageFullError, UsageError


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_put_get_survives_reopen(tmp_path: Path) -> None:
    with Store(tmp_path) as store, store.write() as txn:
        txn.put("inbox", b"m1", b"hello")
        txn.put("meta", b"v", b"1")
    with Store(tmp_path) as store, store.read() as txn:
        assert txn.get("inbox", b"m1") == b"hello"
        assert txn.get("meta", b"v") == b"1"
        assert txn.get("inbox", b"absent") is None


def test_default_and_extra_databases(tmp_path: Path) -> None:
    with Store(tmp_path, extra_databases=["policy", "inbox"]) as store:
        assert set(DEFAULT_DATABASES) <= set(store.databases)
        assert store.databases.count("inbox") == 1
        with store.write() as txn:
            txn.put("policy", b"a", b"b")
        with store.read() as txn:
            assert txn.get("policy", b"a") == b"b"


def test_unknown_database_is_usage_error(tmp_path: Path) -> None:
    with Store(tmp_path) as store, store.read() as txn, pytest.raises(UsageError, match="nope"):
        txn.get("nope", b"k")


def test_exception_aborts_transaction(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with pytest.raises(RuntimeError), store.write() as txn:
            txn.put("outbox", b"a", b"1")
            raise RuntimeError("boom")
        with store.read() as txn:
            assert txn.get("outbox", b"a") is None


def test_put_no_overwrite_and_delete(tmp_path: Path) -> None:
    with Store(tmp_path) as store, store.write() as txn:
        assert txn.put("peers", b"p", b"1", overwrite=False)
        assert not txn.put("peers", b"p", b"2", overwrite=False)
        assert txn.get("peers", b"p") == b"1"
        assert txn.delete("peers", b"p")
        assert not txn.delete("peers", b"p")


def test_iteration_last_count_clear(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with store.write(durable=False) as txn:
            txn.put_many("blocks", [(k(i), bytes([i])) for i in range(10)])
        store.sync()
        with store.read() as txn:
            assert [key for key, _ in txn.items("blocks")] == [k(i) for i in range(10)]
            assert [v for _, v in txn.items("blocks", k(7))] == [b"\x07", b"\x08", b"\x09"]
            assert [v for _, v in txn.items("blocks", k(2), reverse=True)] == [
                b"\x02",
                b"\x01",
                b"\x00",
            ]
            assert next(v for _, v in txn.items("blocks", reverse=True)) == b"\x09"
            assert list(txn.items("blocks", k(99))) == []
            assert txn.last("blocks") == (k(9), b"\x09")
            assert txn.last("outbox") is None
            assert txn.count("blocks") == 10
        with store.write() as txn:
            txn.clear("blocks")
            assert txn.count("blocks") == 0


def test_reverse_seek_between_keys(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with store.write() as txn:
            for i in (1, 3, 5):
                txn.put("meta", k(i), b"")
        with store.read() as txn:
            assert [key for key, _ in txn.items("meta", k(4), reverse=True)] == [k(3), k(1)]
            assert next(key for key, _ in txn.items("meta", k(9), reverse=True)) == k(5)
            assert list(txn.items("meta", k(0), reverse=True)) == []


def test_map_full_rolls_back_and_store_keeps_working(tmp_path: Path) -> None:
    store = Store(tmp_path, map_size=128 << 10)
    with store.write() as txn:
        txn.put("inbox", b"keep", b"safe")
    with pytest.raises(StorageFullError, match="map_size=131072") as info, store.write() as txn:
        for i in range(10_000):
            txn.put("inbox", k(i), b"x" * 1000)
    assert "Raise" in str(info.value)
    with store.read() as txn:
        assert txn.get("inbox", b"keep") == b"safe"
        assert txn.count("inbox") == 1  # nothing of the failed batch is visible
    with store.write() as txn:
        txn.put("inbox", b"after", b"ok")
    store.close()
    with Store(tmp_path, map_size=128 << 10) as store, store.read() as txn:
        assert txn.get("inbox", b"after") == b"ok"
        assert txn.count("inbox") == 2


def test_map_full_in_put_many(tmp_path: Path) -> None:
    with Store(tmp_path, map_size=128 << 10) as store:
        with pytest.raises(StorageFullError), store.write() as txn:
            txn.put_many("blocks", ((k(i), b"y" * 2000) for i in range(1000)))
        with store.read() as txn:
            assert txn.count("blocks") == 0


def test_put_many_append_mode_refuses_keys_out_of_order(tmp_path: Path) -> None:
    """MDB_APPEND: keys in order go in; one out of order aborts the whole transaction."""
    with Store(tmp_path) as store:
        with store.write() as txn:
            txn.put_many("records", [(k(i), b"v") for i in (2, 3)], append=True)
        with pytest.raises(UsageError, match="not in ascending order"), store.write() as txn:
            txn.put_many("records", [(k(4), b"v"), (k(1), b"v")], append=True)
        with store.read() as txn:
            assert [key for key, _ in txn.items("records")] == [k(2), k(3)]


def test_second_open_in_same_process_is_storage_error(tmp_path: Path) -> None:
    with Store(tmp_path), pytest.raises(StorageError, match="already open"):
        Store(tmp_path)
    # released on close: opening again works
    Store(tmp_path).close()


def test_open_held_by_another_process_is_storage_error(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from talos.store import Store\n"
        "from talos_sdk.errors import StorageError\n"
        "try:\n"
        "    Store(Path(sys.argv[1]))\n"
        "except StorageError as e:\n"
        "    print('REFUSED', e)\n"
        "    sys.exit(3)\n"
    )
    with Store(tmp_path):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 3, out.stderr
    assert "already open" in out.stdout
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_nested_write_is_usage_error(tmp_path: Path) -> None:
    with (
        Store(tmp_path) as store,
        store.write(),
        pytest.raises(UsageError, match="nested"),
        store.write(),
    ):
        pass


def test_closed_store_is_usage_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(UsageError, match="closed"), store.read():
        pass


def test_not_durable_mode_still_commits(tmp_path: Path) -> None:
    with Store(tmp_path, sync=False) as store:
        with store.write(durable=True) as txn:
            txn.put("meta", b"a", b"1")
        with store.read() as txn:
            assert txn.get("meta", b"a") == b"1"


def test_path_that_is_a_file_is_storage_error(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create"):
        Store(target)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_new_store_is_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    with Store(folder):
        pass
    assert _mode(folder) == 0o700
    for name in ("data.mdb", "lock.mdb", "talos.lock"):
        assert _mode(folder / name) == 0o600, name


def test_open_tightens_a_world_readable_store(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    with Store(folder):
        pass
    # A home written by an older version: 0755 folder, 0644 files.
    folder.chmod(0o755)
    for name in ("data.mdb", "lock.mdb", "talos.lock"):
        (folder / name).chmod(0o644)
    with Store(folder):
        pass
    assert _mode(folder) == 0o700
    for name in ("data.mdb", "lock.mdb", "talos.lock"):
        assert _mode(folder / name) == 0o600, name


def test_a_lock_held_for_a_moment_is_waited_for(tmp_path: Path) -> None:
    """A starting node waits out an offline command that holds the home for a moment."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from talos.store import Store\n"
        "with Store(Path(sys.argv[1])):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(0.5)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(StorageError, match="already open"):
            Store(tmp_path)  # no wait: refused at once
        Store(tmp_path, lock_wait=30).close()  # taken once the holder let go
    finally:
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()
