"""Run every bench script and regenerate docs/BENCHMARKS.md (docs/DESIGN.md "Performance targets").

``python bench/run_all.py`` runs each ``bench/bench_*.py`` in turn (pyperf
settings chosen so the whole suite stays within a few minutes on 2 cores),
then writes docs/BENCHMARKS.md from the results JSON files: the machine, each
docs/DESIGN.md target with its measured figure, its raw floor from the same run, the
ratio and pass/miss, every figure of every script, and PNG plots of the latency
distributions (docs/img/). Every number in that document comes from here.

``--no-run`` only regenerates the document from existing results; ``--fast``
runs the scripts in their smoke mode and writes the document under
bench/results/ instead, so a smoke run never overwrites the published figures.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCH_DIR,
    REPO_ROOT,
    RESULTS_DIR,
    Metric,
    format_value,
    load_results,
    machine_description,
    ratio,
)
from targets import TARGETS

DOCS = REPO_ROOT / "docs"
DEFAULT_OUTPUT = DOCS / "BENCHMARKS.md"
IMG_DIR = DOCS / "img"
# Enough processes and values for stable ratios while the suite stays < 10 min.
DEFAULT_PYPERF_ARGS = "--processes 3 --values 3 --warmups 1 --min-time 0.05"
# Scripts that are plain asyncio programs, not pyperf runners: no pyperf options.
NON_PYPERF = frozenset(
    {
        "bench_agents",
        "bench_cli",
        "bench_e2e",
        "bench_relay",
        "bench_scale",
        "bench_tunnel",
        "bench_transfer",
    }
)


def discover() -> list[str]:
    """Every bench script present, so a new one joins the report by existing."""
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def run_script(name: str, *, fast: bool, pyperf_args: str, timeout: float) -> tuple[bool, str]:
    """Run one script as a subprocess; return (succeeded, reason if not)."""
    stale = RESULTS_DIR / f"{name}.json"
    stale.unlink(missing_ok=True)  # a failed run must not leave old figures behind
    cmd = [sys.executable, str(BENCH_DIR / f"{name}.py")]
    if fast:
        cmd.append("--fast")
    elif name not in NON_PYPERF:
        cmd.extend(shlex.split(pyperf_args))
    print(f"== {name}: {shlex.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    print(f"== {name}: exit {proc.returncode} in {time.monotonic() - start:.1f} s", flush=True)
    if proc.returncode != 0:
        return False, f"exit status {proc.returncode}"
    if not stale.exists():
        return False, "wrote no results file"
    return True, ""


def load_all(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Results of every script that has a results file."""
    out = {}
    for name in names:
        path = RESULTS_DIR / f"{name}.json"
        if path.exists():
            out[name] = load_results(path)
    return out


def merged_metrics(results: dict[str, dict[str, Any]]) -> dict[str, Metric]:
    """All metrics of all scripts in one map (keys are unique across scripts)."""
    merged: dict[str, Metric] = {}
    for doc in results.values():
        merged.update(doc["metrics"])
    return merged


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def previous_report(
    path: Path,
) -> tuple[dict[str, list[str]], dict[tuple[str, str, str], str]]:
    """What an earlier report held: its per-script figure sections and its target rows.

    ``--only`` re-measures some scripts; a script with no results file here
    keeps its section (with its own "measured" date) and its target rows from
    the report being replaced, so a partial run never drops figures.
    """
    sections: dict[str, list[str]] = {}
    rows: dict[tuple[str, str, str], str] = {}
    if not path.exists():
        return sections, rows
    current: list[str] | None = None
    in_targets = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            current = None
            in_targets = line.startswith("## Targets")
            continue
        if line.startswith("### "):
            name = line[4:].split(" ", 1)[0]
            current = sections.setdefault(name, [])
        if current is not None:
            current.append(line)
        elif in_targets and line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if len(cells) == 8:
                # A target may have several criteria with the same text: number them.
                n = sum(1 for k in rows if k[:2] == (cells[0], cells[6]))
                rows[(cells[0], cells[6], str(n))] = line
    return sections, rows


def targets_section(
    metrics: dict[str, Metric], previous: dict[tuple[str, str, str], str] | None = None
) -> list[str]:
    """docs/DESIGN.md's targets, checked against the figures measured in this run."""
    lines = [
        '## Targets (docs/DESIGN.md "Performance targets")',
        "",
        "Measured and raw floor come from the same run; the ratio is ours ÷ raw "
        '(rates) or ours ÷ floor (latency). Seed and "floor here" are copied from docs/DESIGN.md.',
        "",
        "| what | seed | floor here (docs/DESIGN.md) | measured | raw floor (this run) | ratio "
        "| target | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    passed = missed = pending = 0
    for t in TARGETS:
        for c in t.criteria:
            check = c.check(metrics)
            same = sum(1 for x in t.criteria[: t.criteria.index(c)] if x.text == c.text)
            kept = (previous or {}).get((_cell(t.what), _cell(c.text), str(same)))
            if check.ok is None and kept is not None:
                lines.append(kept)
                if "**pass**" in kept:
                    passed += 1
                elif "**miss**" in kept:
                    missed += 1
                else:
                    pending += 1
                continue
            if check.ok is None:
                verdict, pending = "not measured yet", pending + 1
            elif check.ok:
                verdict, passed = "**pass**", passed + 1
            else:
                verdict, missed = "**miss**", missed + 1
            cells = (
                t.what,
                t.seed,
                t.floor_here,
                check.measured,
                check.floor,
                check.ratio,
                c.text,
                verdict,
            )
            lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    lines += ["", f"{passed} pass, {missed} miss, {pending} not measured yet.", ""]
    return lines


def figures_section(
    results: dict[str, dict[str, Any]], previous: dict[str, list[str]] | None = None
) -> list[str]:
    """Every figure of every script, each of ours beside its raw floor."""
    lines = ["## All figures", ""]
    kept = {n: sec for n, sec in (previous or {}).items() if n not in results}
    for name in sorted({*results, *kept}):
        if name in kept:
            lines += kept[name]
            if lines[-1] != "":
                lines.append("")
            continue
        doc = results[name]
        note = " (smoke run: --fast, not meaningful)" if doc.get("fast") else ""
        lines += [
            f"### {name}{note}",
            "",
            f"`python bench/{name}.py`, measured {doc['measured_at']}.",
            "",
            "| benchmark | time / value | rate | raw floor | raw rate | ours ÷ raw |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        metrics: dict[str, Metric] = doc["metrics"]
        for row in doc["rows"]:
            ours = metrics.get(row.ours)
            if ours is None:
                continue
            raw = metrics.get(row.raw) if row.raw else None
            value, rate = format_value(ours)
            raw_cells = ("", "", "")
            if raw is not None:
                raw_value, raw_rate = format_value(raw)
                raw_cells = (f"{raw.label}: {raw_value}", raw_rate, f"{ratio(ours, raw):.2f}×")
            cells = (ours.label, value, rate, *raw_cells)
            lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
        lines.append("")
    return lines


def plot_latency(results: dict[str, dict[str, Any]], img_dir: Path) -> list[Path]:
    """One PNG per script with latency samples: empirical CDFs in milliseconds."""
    samples_by_script = {n: d["samples"] for n, d in results.items() if d.get("samples")}
    if not samples_by_script:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, samples in samples_by_script.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, values in samples.items():
            ms = sorted(v * 1e3 for v in values)
            if not ms:
                continue
            ys = [(i + 1) / len(ms) for i in range(len(ms))]
            ax.step(ms, ys, where="post", label=f"{key} (n={len(ms)})")
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests ≤ x")
        ax.set_title(f"{name}: latency distribution")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = img_dir / f"{name}_latency.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def render(
    results: dict[str, dict[str, Any]],
    failures: dict[str, str],
    command: str,
    plots: Sequence[Path],
    output: Path,
    keep_previous: bool = False,
) -> str:
    """The whole BENCHMARKS.md text (``keep_previous``: see :func:`previous_report`)."""
    old_sections, old_rows = previous_report(output) if keep_previous else ({}, {})
    machine = next(iter(results.values()))["machine"] if results else machine_description()
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by bench/run_all.py. Do not edit by hand: rerun the script. -->",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}`. "
        "Every figure below was measured by the bench/ scripts (each section says when), "
        "each of ours beside the raw call it wraps; see bench/README.md.",
        "",
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {k} | {_cell(v)} |" for k, v in machine.items()),
        "",
        *targets_section(merged_metrics(results), old_rows),
    ]
    if plots:
        lines += ["## Latency distributions", ""]
        for p in plots:
            rel = p.relative_to(output.parent) if p.is_relative_to(output.parent) else p
            lines += [f"![{p.stem}]({rel.as_posix()})", ""]
    lines += figures_section(results, old_sections)
    if failures:
        lines += ["## Scripts that produced no figures in this run", ""]
        lines += [f"- `{n}`: {why}" for n, why in sorted(failures.items())]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite (unless --no-run) and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="smoke-run every script")
    parser.add_argument("--no-run", action="store_true", help="only regenerate the report")
    parser.add_argument("--only", nargs="*", default=None, help="script names (bench_crypto ...)")
    parser.add_argument("--pyperf-args", default=DEFAULT_PYPERF_ARGS)
    parser.add_argument("--timeout", type=float, default=600.0, help="per script, seconds")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    names = args.only or discover()
    output: Path = args.output or (
        RESULTS_DIR / "BENCHMARKS-fast.md" if args.fast else DEFAULT_OUTPUT
    )
    failures: dict[str, str] = {}
    if not args.no_run:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        for name in names:
            ok, why = run_script(
                name, fast=args.fast, pyperf_args=args.pyperf_args, timeout=args.timeout
            )
            if not ok:
                failures[name] = why
    # --only re-measures some scripts; the report still covers every script's
    # latest results, so a partial re-run never hides the other rows.
    results = load_all(sorted({*discover(), *names}))
    img_dir = IMG_DIR if output == DEFAULT_OUTPUT else output.parent / "img"
    plots = plot_latency(results, img_dir)
    if args.only and output.exists():  # kept sections keep their plots too
        kept = previous_report(output)[0].keys() - results.keys()
        plots += [p for n in sorted(kept) if (p := img_dir / f"{n}_latency.png").exists()]
    command = "python bench/run_all.py" + (" --fast" if args.fast else "")
    if args.no_run:
        command += " --no-run"
    if args.only:
        command += " --only " + " ".join(args.only)
    output.parent.mkdir(parents=True, exist_ok=True)
    text = render(results, failures, command, plots, output, keep_previous=bool(args.only))
    output.write_text(text)
    print(f"wrote {output}")
    for name, why in failures.items():
        print(f"FAILED {name}: {why}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
