"""The bench/ scripts cannot rot: each runs in --fast mode as a real subprocess.

Nothing here asserts a timing (bench/README.md): the scripts must exit 0, print their
table and write a results file that run_all.py can turn into the report. The
target checks of bench/targets.py are tested on fixed figures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("bench_*.py"))
TIMEOUT = 120.0

sys.path.insert(0, str(BENCH))

from _common import Metric, format_table, quantiles, ratio  # noqa: E402
from targets import TARGETS, AtLeastRate, AtLeastRatio, AtMost  # noqa: E402


def _run(args: list[str], results: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TALOS_BENCH_RESULTS=str(results))
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_fast_mode_prints_table_and_writes_results(script: str, tmp_path: Path) -> None:
    # From a foreign cwd, as a user typing the path would: the script must find its helpers.
    proc = _run([str(BENCH / f"{script}.py"), "--fast"], tmp_path / "results", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "benchmark" in proc.stdout and "ours/raw" in proc.stdout
    doc = json.loads((tmp_path / "results" / f"{script}.json").read_text())
    assert doc["script"] == script and doc["fast"] is True
    assert doc["metrics"], "a bench script must measure something"
    for row in doc["rows"]:
        assert row["ours"] in doc["metrics"]
        if row["raw"] is not None:
            assert row["raw"] in doc["metrics"]
    for key, m in doc["metrics"].items():
        # An added latency is a difference of two medians: with a --fast run's few
        # samples on a busy machine, noise can take it below zero.
        assert math.isfinite(m["value"]) and (m["value"] > 0 or ".added." in key), key
        # The printed table carries every figure.
        assert m["label"] in proc.stdout


def test_run_all_fast_writes_report_without_touching_docs(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    docs_before = (
        (REPO / "docs" / "BENCHMARKS.md").read_bytes()
        if (REPO / "docs" / "BENCHMARKS.md").exists()
        else None
    )
    proc = _run(
        [str(BENCH / "run_all.py"), "--fast", "--only", "bench_crypto", "--output", str(out)],
        tmp_path / "results",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "## Machine" in text and "## Targets" in text
    assert "### bench_crypto (smoke run" in text
    assert "OpenSSL Ed25519 sign 64 B" in text
    # One report row per criterion of every docs/DESIGN.md target.
    assert text.count("| ≥ ") + text.count("| ≤ ") >= sum(len(t.criteria) for t in TARGETS)
    docs_after = (
        (REPO / "docs" / "BENCHMARKS.md").read_bytes()
        if (REPO / "docs" / "BENCHMARKS.md").exists()
        else None
    )
    assert docs_after == docs_before


def test_run_all_reports_a_failing_script(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    proc = _run(
        [
            str(BENCH / "run_all.py"),
            "--fast",
            "--only",
            "bench_does_not_exist",
            "--output",
            str(out),
        ],
        tmp_path / "results",
        tmp_path,
    )
    assert proc.returncode == 1
    assert "FAILED bench_does_not_exist" in proc.stderr
    assert "`bench_does_not_exist`: exit status 2" in out.read_text()


def _m(key: str, value: float, unit: str = "s") -> Metric:
    return Metric(key, key, value, unit)


def test_ratio_is_ours_rate_over_raw_rate() -> None:
    assert ratio(_m("a", 2e-6), _m("b", 1e-6)) == pytest.approx(0.5)
    assert ratio(_m("a", 300.0, "B/s"), _m("b", 200.0, "B/s")) == pytest.approx(1.5)


def test_at_least_ratio_uses_the_fastest_raw_call() -> None:
    crit = AtLeastRatio("ours", ("slow", "fast"), 0.9)
    metrics = {"ours": _m("ours", 1.05e-6), "slow": _m("slow", 2e-6), "fast": _m("fast", 1e-6)}
    check = crit.check(metrics)
    assert check.ok is True and check.ratio == "0.95×"
    metrics["ours"] = _m("ours", 1.2e-6)
    assert crit.check(metrics).ok is False


def test_missing_figure_is_not_measured_rather_than_miss() -> None:
    assert AtLeastRatio("ours", ("raw",), 1.0).check({"ours": _m("ours", 1.0)}).ok is None
    assert AtLeastRate("x", 10.0).check({}).ok is None
    assert AtMost("lat", 1e-3, ("a", "b"), 2.0).check({"lat": _m("lat", 1e-4)}).ok is None


def test_at_least_rate_and_at_most_with_floor_multiple() -> None:
    assert AtLeastRate("x", 1000.0).check({"x": _m("x", 0.5e-3)}).ok is True
    assert AtLeastRate("x", 1000.0).check({"x": _m("x", 2e-3)}).ok is False
    crit = AtMost("lat", 1e-3, ("commit", "rtt"), 2.0)
    base = {"commit": _m("commit", 0.2e-3), "rtt": _m("rtt", 0.1e-3)}
    assert crit.check({**base, "lat": _m("lat", 0.5e-3)}).ok is True
    # Under the absolute limit but above 2 x (commit + round trip): a miss.
    assert crit.check({**base, "lat": _m("lat", 0.7e-3)}).ok is False


def test_every_target_names_keys_and_a_rule() -> None:
    for t in TARGETS:
        assert t.what and t.seed and t.criteria
        for c in t.criteria:
            assert c.text.startswith(("≥", "≤"))


def test_table_puts_raw_floor_beside_ours() -> None:
    from _common import Row

    metrics = {"k": _m("k", 2e-6), "k.raw": _m("k.raw", 1e-6)}
    table = format_table(metrics, [Row("k", "k.raw")]).splitlines()
    assert table[2].startswith("  raw: k.raw") and table[3].rstrip().endswith("0.50x")


def test_quantiles() -> None:
    p50, p99 = quantiles([i / 1000 for i in range(1, 101)])
    assert p50 == pytest.approx(0.0505) and p99 == pytest.approx(0.09901)
    assert quantiles([0.25]) == (0.25, 0.25)


def test_run_all_plots_latency_samples_and_checks_latency_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _common

    results = tmp_path / "results"
    monkeypatch.setattr(_common, "RESULTS_DIR", results)
    samples = [0.0004 + i * 1e-6 for i in range(200)]
    p50, _ = quantiles(samples)
    metrics = {
        "e2e.latency.p50": _m("e2e.latency.p50", p50),
        "e2e.sync_commit": _m("e2e.sync_commit", 0.0001),
        "ws.roundtrip.p50": _m("ws.roundtrip.p50", 0.0001),
    }
    _common.write_results("bench_fake", False, metrics, [], {"A -> B": samples})
    out = tmp_path / "out" / "BENCHMARKS.md"
    proc = _run(
        [str(BENCH / "run_all.py"), "--no-run", "--only", "bench_fake", "--output", str(out)],
        results,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "out" / "img" / "bench_fake_latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.read_text()
    assert "![bench_fake_latency](img/bench_fake_latency.png)" in text
    # p50 ~0.5 ms is under 1 ms but above 2 x (0.1 + 0.1) ms: the report says miss.
    e2e_row = next(line for line in text.splitlines() if line.startswith("| end-to-end"))
    assert "**miss**" in e2e_row and "2.50× floor" in e2e_row


def test_run_all_only_keeps_the_sections_and_target_rows_it_did_not_remeasure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import _common

    results = tmp_path / "results"
    monkeypatch.setattr(_common, "RESULTS_DIR", results)
    storage = {"store.append.batch": _m("store.append.batch", 1e-6)}
    storage["store.append.batch.raw"] = _m("store.append.batch.raw", 1e-6)
    _common.write_results("bench_fake_storage", False, storage, [_common.Row("store.append.batch")])
    _common.write_results("bench_fake_other", False, {"x": _m("x", 2e-6)}, [_common.Row("x")])
    out = tmp_path / "BENCHMARKS.md"
    args = [str(BENCH / "run_all.py"), "--no-run", "--output", str(out), "--only"]
    first = _run([*args, "bench_fake_storage", "bench_fake_other"], results, tmp_path)
    assert first.returncode == 0, first.stderr
    before = out.read_text()
    row = next(line for line in before.splitlines() if line.startswith("| LMDB block store write"))
    assert "**pass**" in row
    # The storage results are gone (as if not re-measured); only the other script reruns.
    (results / "bench_fake_storage.json").unlink()
    second = _run([*args, "bench_fake_other"], results, tmp_path)
    assert second.returncode == 0, second.stderr
    after = out.read_text()
    assert "### bench_fake_storage" in after and "### bench_fake_other" in after
    assert row in after.splitlines()
    assert "--only bench_fake_other" in after
