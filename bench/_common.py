"""Shared machinery of the bench/ suite (docs/DESIGN.md "Performance targets").

Every figure we publish is measured next to the raw call it wraps, in the same
run, so the ratio -- not the absolute number -- is what counts. A script builds
a :class:`Suite`, registers rows with :meth:`Suite.pair` (ours beside its raw
floor) or :meth:`Suite.floor` (a raw figure on its own), then calls
:meth:`Suite.finish`, which prints a table and writes
``bench/results/<script>.json`` for ``run_all.py``.

Microbenchmarks run through :mod:`pyperf` (all of its options work, e.g.
``-o out.json`` to keep the pyperf JSON). ``--fast`` replaces pyperf's own
``--fast``: everything runs once, in-process, with tiny loop counts, so CI can
run every script in seconds to prove it still works. Latency benches that are
not microbenchmarks record their figures with :meth:`Suite.record` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# Overridable so tests and parallel runs do not share one results folder.
RESULTS_DIR = Path(os.environ.get("TALOS_BENCH_RESULTS", BENCH_DIR / "results"))

# pyperf re-runs the script in worker processes; a fresh clone without an
# editable install still finds the packages when run from anywhere.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import pyperf  # noqa: E402  (after the sys.path fix on purpose)

FAST_FLAG = "--fast"
# In --fast mode pyperf runs as its own single worker in this process.
FAST_PYPERF_ARGS = ["--worker", "--loops", "2", "--warmups", "0", "--values", "1"]

# Units of a recorded metric. "s" is lower-is-better time (per operation or a
# latency quantile); "B/s" and "ops/s" are higher-is-better rates; "B" a size.
TIME_UNITS = frozenset({"s"})
RATE_UNITS = frozenset({"B/s", "ops/s"})


@dataclass(frozen=True, slots=True)
class Metric:
    """One measured figure, as stored in a results JSON file."""

    key: str
    label: str
    value: float
    unit: str

    def rate(self) -> float:
        """Higher-is-better view of the metric: operations (or bytes) per second."""
        if self.unit in TIME_UNITS:
            return 1.0 / self.value if self.value > 0 else float("inf")
        return self.value


@dataclass(frozen=True, slots=True)
class Row:
    """A line of the printed table: our figure, optionally beside its raw floor."""

    ours: str
    raw: str | None = None


@dataclass(slots=True)
class Suite:
    """Collects the rows of one bench script; see the module docstring."""

    script: str
    fast: bool
    runner: pyperf.Runner | None
    metrics: dict[str, Metric] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    samples: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def create(cls, script_file: str, *, pyperf_runner: bool = True) -> Suite:
        """Parse ``--fast`` off ``sys.argv`` and set up pyperf (if the script uses it)."""
        fast = FAST_FLAG in sys.argv
        if fast:
            sys.argv = [a for a in sys.argv if a != FAST_FLAG]
            if pyperf_runner:
                sys.argv.extend(FAST_PYPERF_ARGS)
        runner = pyperf.Runner() if pyperf_runner else None
        if runner is not None:
            runner.parse_args()
        return cls(script=Path(script_file).stem, fast=fast, runner=runner)

    @property
    def is_main_process(self) -> bool:
        """False in pyperf's spawned workers, which must not print tables or write results."""
        if self.runner is None:
            return True
        return self.runner.args.worker_task is None

    def _time(self, label: str, fn: Callable[[], object], per_call: int) -> float | None:
        """pyperf's mean seconds per item of ``fn`` (None in a worker process)."""
        if self.runner is None:
            raise RuntimeError("this suite was created without a pyperf runner")
        # inner_loops makes pyperf report time per item of a batched call.
        bench = self.runner.bench_func(label, fn, inner_loops=per_call)
        return bench.mean() if bench is not None and self.is_main_process else None

    def _bench(self, key: str, label: str, fn: Callable[[], object], per_call: int) -> None:
        mean = self._time(label, fn, per_call)
        if mean is not None:
            self.metrics[key] = Metric(key, label, mean, "s")

    def pair(
        self,
        key: str,
        label: str,
        raw_fn: Callable[[], object],
        ours_fn: Callable[[], object],
        *,
        raw_label: str,
        raw_key: str | None = None,
        per_call: int = 1,
    ) -> None:
        """Benchmark ``ours_fn`` and the raw call it wraps, back to back in this run.

        In the order raw, ours, ours, raw, each side's figure the mean of its two
        runs: a machine that speeds up or slows down during the pair (another
        process, a frequency change) then moves both sides alike. Measured in
        one order only, two identical calls read 0.83-0.89x each other here.
        ``per_call`` is the number of items one call handles (a batch), so the
        figures are per item.
        """
        raw_key = raw_key or key + ".raw"
        sides = ((raw_key, raw_label, raw_fn), (key, label, ours_fn))
        runs: dict[str, list[float]] = {raw_key: [], key: []}
        for turn, (side_key, side_label, fn) in enumerate((*sides, *reversed(sides))):
            mean = self._time(f"{side_label} ({'ab'[turn // 2]})", fn, per_call)
            if mean is not None:
                runs[side_key].append(mean)
        for side_key, side_label, _ in sides:
            if runs[side_key]:
                self.metrics[side_key] = Metric(
                    side_key, side_label, statistics.fmean(runs[side_key]), "s"
                )
        self.rows.append(Row(ours=key, raw=raw_key))

    def floor(self, key: str, label: str, fn: Callable[[], object], *, per_call: int = 1) -> None:
        """Benchmark a raw call that has no wrapper of ours (a floor shown on its own)."""
        self._bench(key, label, fn, per_call)
        self.rows.append(Row(ours=key))

    def single(self, key: str, label: str, fn: Callable[[], object], *, per_call: int = 1) -> None:
        """Benchmark one of our calls that has no raw counterpart."""
        self.floor(key, label, fn, per_call=per_call)

    def record(
        self,
        key: str,
        label: str,
        value: float,
        unit: str,
        *,
        raw: str | None = None,
        row: bool = True,
    ) -> None:
        """Store a figure measured outside pyperf (latency quantiles, MB/s, RSS).

        ``row=False`` keeps a floor that is only shown as the raw side of another row.
        """
        self.metrics[key] = Metric(key, label, value, unit)
        if row:
            self.rows.append(Row(ours=key, raw=raw))

    def record_samples(self, key: str, samples: Sequence[float]) -> None:
        """Keep a latency distribution (seconds) for run_all.py's plots."""
        self.samples[key] = list(samples)

    def finish(self) -> Path | None:
        """Print the table and write the results JSON (main process only)."""
        if not self.is_main_process:
            return None
        print()
        print(format_table(self.metrics, self.rows))
        return write_results(self.script, self.fast, self.metrics, self.rows, self.samples)


def machine_description() -> dict[str, str]:
    """What the figures were measured on: CPU, cores, Python, crypto libraries."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = {
        "cpu": cpu,
        "cores": str(os.cpu_count() or 0),
        "os": platform.platform(),
        "python": platform.python_implementation() + " " + platform.python_version(),
    }
    try:
        import cryptography
        from cryptography.hazmat.backends.openssl.backend import backend

        desc["cryptography"] = f"{cryptography.__version__} ({backend.openssl_version_text()})"
    except ImportError:
        pass
    for mod in ("nacl", "lmdb", "websockets", "orjson", "pydantic", "pyperf"):
        try:
            desc[mod] = str(__import__(mod).__version__)
        except (ImportError, AttributeError):
            continue
    return desc


def write_results(
    script: str,
    fast: bool,
    metrics: dict[str, Metric],
    rows: Sequence[Row] = (),
    samples: dict[str, list[float]] | None = None,
) -> Path:
    """Write ``bench/results/<script>.json``, the input of run_all.py."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{script}.json"
    doc = {
        "script": script,
        "fast": fast,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_description(),
        "metrics": {k: asdict(m) for k, m in metrics.items()},
        "rows": [asdict(r) for r in rows],
        "samples": samples or {},
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def load_results(path: Path) -> dict[str, Any]:
    """Read a results JSON file back; metrics become :class:`Metric` objects."""
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["metrics"] = {k: Metric(**v) for k, v in doc["metrics"].items()}
    doc["rows"] = [Row(**r) for r in doc.get("rows", [])]
    doc.setdefault("samples", {})
    return doc


def format_value(m: Metric) -> tuple[str, str]:
    """Human form of a metric: (time per op or figure, rate when it is a time)."""
    if m.unit == "s":
        return format_seconds(m.value), f"{format_rate(m.rate())}/s"
    if m.unit == "B/s":
        return f"{m.value / 1e6:,.1f} MB/s", ""
    if m.unit == "B":
        if m.value < 1e6:  # per-link memory and the like
            return f"{m.value / 1e3:,.1f} kB", ""
        return f"{m.value / 1e6:,.1f} MB", ""
    if m.unit == "ops/s":
        return "", f"{format_rate(m.value)}/s"
    return f"{m.value:g} {m.unit}", ""


def format_seconds(s: float) -> str:
    """Seconds with a unit that keeps 3 significant figures readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def format_rate(r: float) -> str:
    """A rate such as ``1.23M`` or ``45.6k``."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if r >= scale:
            return f"{r / scale:.3g}{suffix}"
    return f"{r:.3g}"


def ratio(ours: Metric, raw: Metric) -> float:
    """Our rate divided by the raw rate: 1.0 means no overhead at all."""
    return ours.rate() / raw.rate()


def format_table(metrics: dict[str, Metric], rows: Sequence[Row]) -> str:
    """The readable table every script prints: raw floor row, then ours with the ratio."""
    lines: list[tuple[str, str, str, str]] = [("benchmark", "time/value", "rate", "ours/raw")]
    for row in rows:
        ours = metrics.get(row.ours)
        raw = metrics.get(row.raw) if row.raw else None
        if raw is not None:
            lines.append(("  raw: " + raw.label, *format_value(raw), ""))
        if ours is None:
            continue
        r = f"{ratio(ours, raw):.2f}x" if raw is not None else ""
        lines.append((ours.label, *format_value(ours), r))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    out = [
        f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}"
        for a, b, c, d in lines
    ]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def quantiles(samples: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of latency samples (statistics.quantiles, inclusive method)."""
    if len(samples) < 2:
        only = samples[0] if samples else float("nan")
        return only, only
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49], q[98]


def latency_main(
    script_file: str,
    doc: str | None,
    measure: Callable[[Suite, argparse.Namespace], object],
    *,
    count: tuple[int, int] | None = None,
    burst: tuple[int, int] | None = None,
    options: Callable[[argparse.ArgumentParser, bool], object] | None = None,
) -> None:
    """The ``main()`` of a latency script (no pyperf runner): parse, measure, finish.

    ``count`` and ``burst`` are the (--fast, full) defaults of ``--count`` and
    ``--burst`` (the option is left out when None); ``options`` adds a script's
    own options given the parser and whether ``--fast`` was passed.
    """
    suite = Suite.create(script_file, pyperf_runner=False)
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    for name, defaults in (("--count", count), ("--burst", burst)):
        if defaults is not None:
            parser.add_argument(name, type=int, default=defaults[0] if suite.fast else defaults[1])
    if options is not None:
        options(parser, suite.fast)
    measure(suite, parser.parse_args())
    suite.finish()
