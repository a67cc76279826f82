"""Block log validation and Merkle proofs (docs/DESIGN.md "Block validation").

Rows: ``verify_chain`` over a sealed log of signed message records, per
record, on one core and on all cores (the parallel path ``talosd chain verify``
takes), beside one raw Ed25519 verify (the per-record floor: every record
carries a sender signature); and RFC 6962 inclusion proofs for a block's worth
of records, built and verified, beside the same hashing done with bare
``hashlib``. Two rows without a raw call, each against its own first
measurement in the same run: ``verify_chain``'s peak memory at 4x the records
(flat: the log is streamed), and the sustained append + seal of 1M records
(:func:`bench_sustained`: bytes written and time per record in the windows
0-10k, 10k-100k and 100k-1M; the record index of ADR 0013 keeps them flat).

The log is built once by the main process in a temporary home that pyperf's
worker processes (its children) reopen by path, so setup is not paid per
worker. It holds 20k records so that starting the verify workers (a fork,
~20 ms) is amortised over about a second of Ed25519 work.

Wall-clock ratios on a shared 2-core machine measure the neighbours as much
as the code, so the main process also runs both paths back to back under
``getrusage`` and records CPU-time figures: records per CPU-second on one
process, and the all-cores rate those CPU seconds allow on idle cores (the
parent's serial share plus the workers' share divided by the core count).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Suite
from nacl.bindings import crypto_sign_open

from talos.chain.block import Record
from talos.chain.log import BlockLog
from talos.chain.verify import verify_chain
from talos.store import Store, Txn
from talos.writer import DirectWrites
from talos_sdk.merkle import inclusion_proof, verify_inclusion
from talos_sdk.wallet import Wallet

_T = TypeVar("_T")

RECORDS = 20_000
FAST_RECORDS = 300
BLOCK = 256  # records per block: BlockLog's default seal count
NODE = Wallet.from_seed(bytes(range(32)))
SENDER = Wallet.from_seed(bytes(range(32, 64)))


def _home(suite: Suite, records: int) -> tuple[Path, bool]:
    """The shared log folder: named after the main process so its workers find it."""
    assert suite.runner is not None
    in_worker = suite.runner.args.pipe is not None
    owner = os.getppid() if in_worker else os.getpid()
    path = Path(tempfile.gettempdir()) / f"talos-bench-chain-{owner}-{records}"
    return path, in_worker


def build_log(path: Path, records: int) -> None:
    """Seal ``records`` signed message records into blocks of :data:`BLOCK`."""
    with Store(path) as store:
        log = BlockLog(store, NODE, max_records=BLOCK)
        for start in range(0, records, BLOCK):
            with store.write(durable=False) as txn:
                for i in range(start, min(start + BLOCK, records)):
                    commitment = b"talos.msg/1|" + i.to_bytes(8, "big") + bytes(32)
                    record = Record(
                        kind="msg",
                        record_id=hashlib.sha256(commitment).digest()[:16],
                        sender=SENDER.did,
                        recipient=NODE.did,
                        commitment=commitment,
                        signature=SENDER.sign(commitment),
                        timestamp_ms=1_732_000_000_000 + i,
                    )
                    log.append(record, txn)
            log.seal()
        store.sync()


def _verify(path: Path, workers: int) -> None:
    report = verify_chain(path, NODE.did, workers=workers, parallel_threshold=0)
    if not report.ok:
        raise RuntimeError(f"bench log does not verify: {report.defects[:3]}")


def _cpu_seconds() -> tuple[float, float]:
    """User + system CPU of this process and of its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def cpu_accounting(path: Path, records: int, cores: int, rounds: int) -> tuple[float, float]:
    """(records per CPU-second on 1 process, idle-core records/s on ``cores`` processes).

    The two paths alternate so that both see the same neighbours; the best
    round of each counts (CPU time only grows under contention).
    """
    serial: list[float] = []
    parallel: list[float] = []
    for _ in range(rounds):
        me0, _ = _cpu_seconds()
        _verify(path, 1)
        me1, kids1 = _cpu_seconds()
        _verify(path, cores)  # the pool is shut down (children reaped) on return
        me2, kids2 = _cpu_seconds()
        serial.append(me1 - me0)
        parallel.append((me2 - me1) + (kids2 - kids1) / cores)
    return records / min(serial), records / min(parallel)


def bench_validation(suite: Suite) -> None:
    """Whole-log validation per record, one process vs every core."""
    records = FAST_RECORDS if suite.fast else RECORDS
    path, in_worker = _home(suite, records)
    if not in_worker:
        shutil.rmtree(path, ignore_errors=True)
        build_log(path, records)
        atexit.register(shutil.rmtree, path, True)
    commitment = b"x" * 52
    signed = SENDER.sign(commitment) + commitment
    suite.floor(
        "chain.record_sig.floor",
        "libsodium Ed25519 verify, one record's signature",
        partial(crypto_sign_open, signed, SENDER.public_key),
    )
    suite.single(
        "chain.validate.1core",
        f"verify_chain, {records} records, 1 process (per record)",
        partial(_verify, path, 1),
        per_call=records,
    )
    cores = os.cpu_count() or 1
    suite.single(
        "chain.validate.allcores",
        f"verify_chain, {records} records, {cores} processes (per record)",
        partial(_verify, path, cores),
        per_call=records,
    )
    if not in_worker and suite.is_main_process:
        one, idle = cpu_accounting(path, records, cores, 1 if suite.fast else 5)
        suite.record(
            "chain.validate.1core.cpu",
            f"verify_chain, 1 process, records per CPU-second ({records} records)",
            one,
            "ops/s",
            row=False,
        )
        suite.record(
            "chain.validate.allcores.cpu",
            f"verify_chain, {cores} processes, idle-core estimate from CPU time",
            idle,
            "ops/s",
            raw="chain.validate.1core.cpu",
        )


_VERIFY_CHILD = """
import sys
from talos.chain.verify import verify_chain
report = verify_chain(sys.argv[1], sys.argv[2], workers=2, parallel_threshold=0)
sys.exit(0 if report.ok and report.records == int(sys.argv[3]) else 1)
"""


def _anon_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def verify_peak_memory(path: Path, records: int) -> int:
    """Peak anonymous memory (bytes) of ``verify_chain`` on 2 workers, parent + workers.

    Sampled every 20 ms from outside (a sampling thread inside would make the
    pool use a forkserver). Anonymous memory only: the pages of the LMDB map a
    walk touches are page cache, shared and dropped under pressure, and they
    grow with the file whatever the verifier keeps.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", _VERIFY_CHILD, str(path), NODE.did, str(records)]
    )
    peak = 0
    while proc.poll() is None:
        try:
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            kids = []
        peak = max(peak, _anon_kib(proc.pid) + sum(_anon_kib(int(k)) for k in kids))
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"verify_chain child failed on {records} records")
    return peak * 1024


def bench_verify_memory(suite: Suite) -> None:
    """Peak memory of a whole-log verify at two log sizes: flat means ratio ~1."""
    small, large = (FAST_RECORDS, 4 * FAST_RECORDS) if suite.fast else (RECORDS, 4 * RECORDS)
    if not suite.is_main_process or (suite.runner and suite.runner.args.pipe is not None):
        return
    mems = []
    for records in (small, large):
        path = Path(tempfile.mkdtemp(prefix=f"talos-bench-chain-mem-{records}-"))
        atexit.register(shutil.rmtree, path, True)
        build_log(path, records)
        mems.append(verify_peak_memory(path, records))
        shutil.rmtree(path, ignore_errors=True)
    suite.record(
        "chain.verify.small.rss",
        f"verify_chain peak anonymous memory, {small} records (parent + 2 workers)",
        mems[0],
        "B",
        row=False,
    )
    suite.record(
        "chain.verify.large.rss",
        f"verify_chain peak anonymous memory, {large} records (parent + 2 workers)",
        mems[1],
        "B",
        raw="chain.verify.small.rss",
    )


SUSTAINED_RECORDS = 1_000_000
FAST_SUSTAINED_RECORDS = 20_000
GROUP = 16  # records per write transaction, as a node's group commit appends them
#: The windows measured: records [0, N/100), [N/100, N/10), [N/10, N), i.e.
#: 0-10k, 10k-100k and 100k-1M. Each spans several record-index batches
#: (talos/chain/record_index.py: a batch every ~1/4 of the log), so its bytes
#: per record are the amortised cost, not whether a batch fell inside it.
WINDOWS = ((0, 100), (100, 10), (10, 1))
WINDOW_NAMES = ("first", "mid", "last")


def _io_counters(path: Path) -> dict[str, int]:
    """Write counters: this process's /proc/self/io and the device under ``path``.

    ``wchar``: bytes handed to write(2), i.e. the pages LMDB writes. ``write_bytes``:
    page-cache bytes this process dirtied; the kernel charges a whole folio when
    its first page is dirtied, so on ext4 with large folios one 4 KiB page
    rewritten inside a region once written in one 2 MiB run counts 2 MiB while
    the device gets 4 KiB plus journal (checked here: 100 such rewrites, each
    fsynced, moved 0.6 MB on the device and counted 200 MB). ``device``:
    bytes written to the block device holding ``path`` (/sys/dev/block, all
    processes: exact only on an otherwise idle machine), 0 if unknown.
    """
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value)
    dev = os.stat(path).st_dev
    try:
        stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
        out["device"] = int(stat[6]) * 512
    except (OSError, IndexError, ValueError):
        out["device"] = 0
    return out


def _bounds(records: int) -> list[tuple[int, int]]:
    """Window edges, rounded to whole groups."""
    edge = [0 if d == 0 else records // d // GROUP * GROUP for d, _ in WINDOWS] + [records]
    return [(edge[i], edge[i + 1]) for i in range(len(WINDOWS))]


class _TimedWrites(DirectWrites):
    """The log's writes, with the longest seal transaction (the time a node's one
    writer thread is held by a seal: commit and fsync included) kept."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.longest_seal = 0.0

    def run(self, fn: Callable[[Txn], _T], *, durable: bool = True, kind: str = "write") -> _T:
        start = time.perf_counter()
        try:
            return super().run(fn, durable=durable, kind=kind)
        finally:
            if kind == "seal":
                self.longest_seal = max(self.longest_seal, time.perf_counter() - start)


def sustained_append_seal(path: Path, records: int) -> list[tuple[float, ...]]:
    """Append ``records`` unsigned node records in groups, sealing as a node does.

    Returns, for each window of :func:`_bounds`: page-cache bytes dirtied per
    record, write(2) bytes per record, append seconds per record, append +
    seal seconds per record, device bytes per record (see
    :func:`_io_counters`) and the longest seal transaction (the writer held by
    one seal: a step of an index rewrite, ADR 0013, commit, fsync). Records
    are node-authored (no sender signature to check at sealing), ~400 bytes
    each, so the figures are the log's storage cost rather than Ed25519's.
    """
    extra = bytes(200)
    bounds = _bounds(records)
    starts = {a: i for i, (a, _) in enumerate(bounds)}
    ends = {b: i for i, (_, b) in enumerate(bounds)}
    windows: list[tuple[float, ...]] = []
    with Store(path, map_size=16 << 30) as store:
        writes = _TimedWrites(store)
        log = BlockLog(store, NODE, max_records=BLOCK, writes=writes)
        io0, t0, appending = _io_counters(path), time.perf_counter(), 0.0
        for first in range(0, records, GROUP):
            if first in starts:
                store.sync()
                io0, t0, appending = _io_counters(path), time.perf_counter(), 0.0
                writes.longest_seal = 0.0
            batch = [
                Record(
                    kind="mcp",
                    record_id=hashlib.sha256(i.to_bytes(8, "big")).digest()[:16],
                    sender=NODE.did,
                    recipient=SENDER.did,
                    commitment=b"talos.mcp/1|" + i.to_bytes(8, "big") + bytes(32),
                    signature=b"",
                    timestamp_ms=1_732_000_000_000 + i,
                    extra=extra,
                )
                for i in range(first, min(first + GROUP, records))
            ]
            a = time.perf_counter()
            with store.write(durable=False) as txn:
                for record in batch:
                    log.append(record, txn)
            appending += time.perf_counter() - a
            log.seal_if_due()
            done = first + len(batch)
            if done in ends:
                log.seal()
                a, b = bounds[ends[done]]
                io1, t1, n = _io_counters(path), time.perf_counter(), b - a
                windows.append(
                    (
                        (io1["write_bytes"] - io0["write_bytes"]) / n,
                        (io1["wchar"] - io0["wchar"]) / n,
                        appending / n,
                        (t1 - t0) / n,
                        (io1["device"] - io0["device"]) / n,
                        writes.longest_seal,
                    )
                )
    return windows


def bench_sustained(suite: Suite) -> None:
    """Block log append + seal to a million records: write volume and time per record, flat?"""
    if not suite.is_main_process or (suite.runner and suite.runner.args.pipe is not None):
        return
    records = FAST_SUSTAINED_RECORDS if suite.fast else SUSTAINED_RECORDS
    path = Path(tempfile.mkdtemp(prefix="talos-bench-chain-sustained-"))
    atexit.register(shutil.rmtree, path, True)
    measured = sustained_append_seal(path, records)
    shutil.rmtree(path, ignore_errors=True)
    names = (
        ("write_bytes", "page-cache bytes dirtied per record (write_bytes, whole folios)", "B"),
        ("wchar", "bytes LMDB passes to write(2) per record", "B"),
        ("append", "append per record (groups of 16)", "s"),
        ("total", "append + seal per record", "s"),
        ("device", "device bytes written per record (whole machine)", "B"),
        ("hold", "longest seal transaction (writer held: index step, commit, fsync)", "s"),
    )
    spans = [f"records {a:,}-{b:,}" for a, b in _bounds(records)]
    for i, (name, label, unit) in enumerate(names):
        for w, when in enumerate(WINDOW_NAMES):
            suite.record(
                f"chain.sustained.{name}.{when}",
                f"block log {label}, {spans[w]}",
                max(measured[w][i], 1e-9),
                unit,
                raw=None if w == 0 else f"chain.sustained.{name}.first",
                row=w > 0,
            )


def _raw_leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _raw_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 root for a power-of-two leaf count: the hashing a proof build needs."""
    level = [_raw_leaf(x) for x in leaves]
    while len(level) > 1:
        level = [
            hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest()
            for i in range(0, len(level), 2)
        ]
    return level[0]


def _raw_verify(leaf: bytes, index: int, proof: list[bytes], root: bytes) -> bool:
    """Path hashing of RFC 9162 section 2.1.3.2 for a power-of-two tree, no checks."""
    h = _raw_leaf(leaf)
    for sibling in proof:
        if index & 1:
            h = hashlib.sha256(b"\x01" + sibling + h).digest()
        else:
            h = hashlib.sha256(b"\x01" + h + sibling).digest()
        index >>= 1
    return h == root


def bench_merkle(suite: Suite) -> None:
    """Inclusion proofs over one block of records."""
    leaves = [hashlib.sha256(i.to_bytes(4, "big")).digest() * 4 for i in range(BLOCK)]
    index = 77
    proof = list(inclusion_proof(leaves, index))
    root = _raw_root(leaves)
    if not verify_inclusion(leaves[index], index, BLOCK, proof, root):
        raise RuntimeError("merkle root of this script and talos_sdk.merkle disagree")
    if not _raw_verify(leaves[index], index, proof, root):
        raise RuntimeError("raw proof check disagrees with talos_sdk.merkle")
    suite.pair(
        "merkle.proof.build",
        f"inclusion_proof, {BLOCK} leaves",
        partial(_raw_root, leaves),
        partial(inclusion_proof, leaves, index),
        raw_label=f"hashlib tree hash, {BLOCK} leaves",
    )
    suite.pair(
        "merkle.proof.verify",
        f"verify_inclusion, {BLOCK} leaves",
        partial(_raw_verify, leaves[index], index, proof, root),
        partial(verify_inclusion, leaves[index], index, BLOCK, proof, root),
        raw_label=f"hashlib audit path, {BLOCK} leaves",
    )


def main() -> None:
    """Register every row, run them, print the table, write the results JSON."""
    suite = Suite.create(__file__)
    bench_validation(suite)
    bench_merkle(suite)
    bench_verify_memory(suite)
    bench_sustained(suite)
    suite.finish()


if __name__ == "__main__":
    main()
