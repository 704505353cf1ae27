"""The op benchmark's results as Markdown (a table, the targets, notes), a plot, and RESULTS.md.

Everything here reads the `results` dict that `python -m benchmarks op` writes to
results.json, so a table can be rendered again from any run's file:

    python -m benchmarks report OUT/results.json                  # the table, on stdout
    python -m benchmarks report OUT/results.json --out DIR        # DIR/results.md, results.png
    python -m benchmarks report --page benchmarks/RESULTS.md --plot benchmarks/results_h200.png

The last one writes benchmarks/RESULTS.md, the current table with its command, commit,
date and device, and its plot, from the newest complete results file in
benchmarks/results/ that times msa_pallas against an alternative (or the file named),
with the list of the dated entries in benchmarks/log/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks import runs
from benchmarks.alternatives import OWN_VARIANTS, REFERENCE_POINTS
from benchmarks.measure import CHECK_REFERENCE, CHECK_TOLERANCE, EXP_PER_S, MODE_LABELS, MODES, ok
from benchmarks.shapes import HALF_DTYPES

SUBJECT = "msa_pallas"  # the implementation the speed-ups, floor fractions and targets are about

# The targets, all read as ratios measured in one run on one GPU (ratio = the
# other's time or memory / the subject's, so above 1 is better):
# - 16-bit inputs, float32 bias and bias in the input dtype, at every shape: the
#   forward at least 1.5x and the forward+backward at least 2x faster than the
#   fastest alternative, and the forward+backward's temporary+output memory no
#   larger than cuEquivariance's (whose kernels reduce the bias gradient over S too).
# - float32 inputs: faster than XLA's and cuEquivariance's float32 (tokamax's
#   float32 is TF32, not comparable in accuracy; cuDNN has no float32).
# - N >= 4096: the forward+backward runs, where XLA's runs out of memory.
TARGET_SPEEDUP = {"fwd": 1.5, "fwd_bwd": 2.0}
FLOAT32_YARDSTICKS = ("xla", "cuequivariance")
MEMORY_YARDSTICK = "cuequivariance"
LONG_CHAIN_N = 4096


# --- cells ---------------------------------------------------------------------


NOT_MEASURED = "not measured yet"  # a cell a run stopped by its budget has left for the next


def cell_of(case: dict, impl: str, mode: str) -> dict:
    """The `mode` cell of `impl` in a case, `{"status": NOT_MEASURED}` when there is none."""
    return case["impls"].get(impl, {}).get(mode, {"status": NOT_MEASURED})


def fmt_ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def fmt_cell(cell: dict) -> str:
    """A time cell: milliseconds, or a short failure code."""
    if ok(cell):
        return fmt_ms(cell["median_ms"])
    status = cell.get("status", "")
    if status == NOT_MEASURED:
        return "…"
    if status.endswith("OOM"):
        return "OOM"
    return "n/a" if status.startswith("skipped") else "error"


def fmt_mb(cell: dict) -> str:
    value = cell.get("temp_plus_output_bytes")
    return "–" if value is None else f"{value / 1e6:,.0f}" if value >= 1e7 else f"{value / 1e6:.2f}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1e}"


def fmt_pair(values) -> str:
    """Two ratios (fwd, f+b) as `a / b`."""
    return " / ".join(fmt_ratio(v) for v in values)


def bias_dtype(case: dict) -> str:
    """The case's bias dtype; results from before the bias dtype was recorded had the input's."""
    return case.get("bias_dtype", case["dtype"])


def shape_label(case: dict) -> str:
    return f"{case['shape']} ({','.join(str(v) for v in case['dims'].values())})"


# --- the results table -----------------------------------------------------------


def markdown_table(results: dict) -> str:
    """The results as a Markdown table (one row per shape x dtype x bias dtype), notes and targets."""
    impls = results["metadata"]["impls"]
    meta = results["metadata"]
    others = [name for name in impls if name != SUBJECT] if SUBJECT in impls else []
    header = ["shape (B,S,N,H,d)", "dtype", "bias"]
    header += [f"{name} {MODE_LABELS[mode]} ms" for mode in MODES for name in impls]
    header += [f"× vs {name} fwd / f+b" for name in others]
    if SUBJECT in impls:
        header.append(f"{SUBJECT} fraction of floor fwd / f+b")
    header += [f"{name} f+b mem MB" for name in impls]
    lines = [
        f"{meta['device_kind']} · jax {meta['jax_version']} · commit {meta['commit']} · "
        f"{meta['date_utc']} · median of {meta['iters']} samples of "
        f"{meta.get('reps', 1)} back-to-back calls",
        "",
    ]
    installed = [f"{name} {version}" for name, version in meta.get("packages", {}).items()
                 if version is not None]
    if installed:
        lines += ["Alternatives' packages: " + ", ".join(installed), ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: dict[str, list[str]] = {}
    for case in results["cases"]:
        row = [shape_label(case), case["dtype"], bias_dtype(case)]
        row += [fmt_cell(cell_of(case, name, mode)) for mode in MODES for name in impls]
        row += [fmt_pair([case["speedup"].get(name, {}).get(m) for m in MODES])
                for name in others]
        if SUBJECT in impls:
            row.append(fmt_pair([cell_of(case, SUBJECT, m).get("fraction_of_floor")
                                 for m in MODES]))
        row += [fmt_mb(cell_of(case, name, "fwd_bwd")) for name in impls]
        lines.append("| " + " | ".join(row) + " |")
        for note, where in case_notes(case, impls):
            notes.setdefault(note, [])
            if where not in notes[note]:
                notes[note].append(where)
    lines += ["", f"Floor: max(B·S·H·N² exponentials × (1 fwd, 3 f+b) at {EXP_PER_S:.2g}/s, "
              "matrix FLOPs (4, 14)·B·S·H·N²·d at 790e12/s bf16/f16, 60e12/s f32), every "
              "logit counted (masked or not); fraction of floor = floor / median. Memory: "
              "XLA temp + output bytes of the compiled f+b."]
    lines += padding_lines(results)
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {note} ({', '.join(where)})" for note, where in notes.items()]
    targets = targets_table(results)
    if targets:
        lines += ["", targets.rstrip("\n")]
    return "\n".join(lines) + "\n"


def padding_lines(results: dict) -> list[str]:
    """For each padded case: the keys it keeps, and the subject's time against the same
    shape with random masks (a padded batch should cost less as less is left to compute)."""
    lines = []
    for case in results["cases"]:
        if case.get("mask", "random") != "padded":
            continue
        text = (f"- {case['shape']} {case['dtype']} bias {bias_dtype(case)}: "
                f"{case.get('kept_fraction', float('nan')):.0%} of keys kept, "
                f"{case.get('fully_masked_rows', '?')} MSA rows fully masked (left out of "
                "the forward check)")
        full = next((c for c in results["cases"] if c.get("mask", "random") == "random"
                     and c["dims"] == case["dims"] and c["dtype"] == case["dtype"]
                     and bias_dtype(c) == bias_dtype(case)), None)
        if full is not None and SUBJECT in results["metadata"]["impls"]:
            ratios = [_median(case, SUBJECT, m) / _median(full, SUBJECT, m)
                      if _median(case, SUBJECT, m) and _median(full, SUBJECT, m) else None
                      for m in MODES]
            text += (f"; {SUBJECT} time / {full['shape']}'s (random masks, 90% kept) "
                     f"fwd / f+b: {fmt_pair(ratios)}")
        lines.append(text)
    return ["", "Padded batches:", "", *lines] if lines else []


def case_notes(case: dict, impls: list[str]) -> list[tuple[str, str]]:
    """(note, where) for the failures, skips and forward mismatches of one case.

    A failure common to both modes gives one note without the mode.
    """
    found = []
    where = f"{case['shape']} {case['dtype']}" + (
        f" bias {bias_dtype(case)}" if bias_dtype(case) != case["dtype"] else "")
    tolerance = CHECK_TOLERANCE.get(case["dtype"], 1e-2)
    for name in impls:
        if name not in case["impls"]:
            continue  # not measured yet: the table says so
        cells = case["impls"][name]
        statuses = [cells[mode].get("status", "") for mode in MODES]
        if len(set(statuses)) == 1 and statuses[0] != "ok":
            found.append((f"{name}: {statuses[0]}", where))
        else:
            found += [(f"{name} {MODE_LABELS[mode]}: {status}", where)
                      for mode, status in zip(MODES, statuses) if status != "ok"]
        note = cells.get("info", {}).get("note")
        if note and any(ok(cells[mode]) for mode in MODES):
            found.append((f"{name}: {note}", where))
        for mode in MODES:
            err = cells[mode].get("rel_err_vs_" + CHECK_REFERENCE)
            if err is not None and err > tolerance:
                found.append((f"{name} {MODE_LABELS[mode]}: relative error vs "
                              f"{CHECK_REFERENCE} above {tolerance:g}", f"{where}: {err:.1e}"))
    return found


# --- the targets -----------------------------------------------------------------


def _median(case: dict, impl: str, mode: str) -> float | None:
    cell = case["impls"].get(impl, {}).get(mode, {})
    return cell["median_ms"] if ok(cell) else None


def wrong_output(case: dict, impl: str) -> bool:
    """Whether `impl`'s forward output failed the check against CHECK_REFERENCE."""
    err = case["impls"].get(impl, {}).get("fwd", {}).get("rel_err_vs_" + CHECK_REFERENCE)
    return err is not None and err > CHECK_TOLERANCE.get(case["dtype"], 1e-2)


def fastest_alternative(case: dict, mode: str) -> tuple[str, float] | None:
    """(name, median ms) of the fastest yardstick that ran and computed the
    op (its forward passed the check), or None.

    16-bit: every implementation but the subject, its own variants and the
    reference points;
    float32: FLOAT32_YARDSTICKS only. A fast wrong answer is no yardstick."""
    half = case["dtype"] in HALF_DTYPES
    times = [
        (name, ms) for name in case["impls"]
        if name != SUBJECT and name not in REFERENCE_POINTS and name not in OWN_VARIANTS
        and (half or name in FLOAT32_YARDSTICKS)
        and not wrong_output(case, name)
        and (ms := _median(case, name, mode)) is not None
    ]
    return min(times, key=lambda item: item[1]) if times else None


def _verdict(ratio: float, goal: float) -> str:
    return f"{'yes' if ratio >= goal else 'no'}: {ratio:.2f}× (≥ {goal:g}×)"


def time_target(case: dict, mode: str) -> tuple[str, bool | None]:
    """(cell, met) of the speed target of one mode; met is None when it cannot be judged."""
    ours = cell_of(case, SUBJECT, mode)
    if not ok(ours):
        return f"{SUBJECT}: {fmt_cell(ours)}", False
    other = fastest_alternative(case, mode)
    if other is None:
        return "no alternative ran", None
    goal = TARGET_SPEEDUP[mode] if case["dtype"] in HALF_DTYPES else 1.0
    ratio = other[1] / ours["median_ms"]
    return (f"{_verdict(ratio, goal)}; {fmt_ms(ours['median_ms'])} vs {fmt_ms(other[1])} ms "
            f"{other[0]}", ratio >= goal)


def memory_target(case: dict) -> tuple[str, bool | None]:
    """(cell, met) of the f+b memory target (16-bit inputs only)."""
    if case["dtype"] not in HALF_DTYPES:
        return "–", None
    memory = [case["impls"].get(name, {}).get("fwd_bwd", {}).get("temp_plus_output_bytes")
              for name in (SUBJECT, MEMORY_YARDSTICK)]
    if None in memory:
        return "–", None
    return (f"{_verdict(memory[1] / memory[0], 1.0)}; {memory[0] / 1e6:,.0f} vs "
            f"{memory[1] / 1e6:,.0f} MB {MEMORY_YARDSTICK}", memory[0] <= memory[1])


def long_chain_target(case: dict) -> tuple[str, bool | None]:
    """(cell, met) at N >= LONG_CHAIN_N: the subject's f+b runs where XLA's fails."""
    if case["dims"]["N"] < LONG_CHAIN_N:
        return "–", None
    ours = cell_of(case, SUBJECT, "fwd_bwd")
    xla = case["impls"].get(CHECK_REFERENCE, {}).get("fwd_bwd", {"status": "not run"})
    memory = ours.get("temp_plus_output_bytes")
    ours_text = (f"{fmt_ms(ours['median_ms'])} ms, {memory / 1e6:,.0f} MB" if ok(ours)
                 else ours.get("status", "?"))
    xla_text = f"{fmt_ms(xla['median_ms'])} ms" if ok(xla) else xla.get("status", "?")
    return (f"{'yes' if ok(ours) else 'no'}: {ours_text}; {CHECK_REFERENCE} {xla_text}",
            ok(ours))


def targets_table(results: dict) -> str:
    """The targets (see TARGET_SPEEDUP above) read off this run, one row per case, each
    cell with the subject's ratio to its yardstick. Empty when the subject did not run."""
    if SUBJECT not in results["metadata"]["impls"]:
        return ""
    lines = [
        "| shape | dtype | bias | fwd | f+b | f+b memory | f+b runs at N ≥ 4096 | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        cells = [time_target(case, "fwd"), time_target(case, "fwd_bwd"),
                 memory_target(case), long_chain_target(case)]
        judged = [met for _, met in cells if met is not None]
        lines.append(f"| {case['shape']} | {case['dtype']} | {bias_dtype(case)} | "
                     + " | ".join(text for text, _ in cells)
                     + f" | {sum(judged)} of {len(judged)} |")
    return "\n".join([
        f"Targets in this run: {SUBJECT} against the fastest alternative that ran and "
        "passed the forward check (ratio = "
        "its time or memory / msa_pallas', above 1 is better). 16-bit inputs: forward "
        "≥ 1.5×, forward+backward ≥ 2×, f+b memory no more than cuequivariance's. float32: "
        "faster than xla's and cuequivariance's float32. N ≥ 4096: f+b runs where xla's "
        "runs out of memory.", "", *lines]) + "\n"


# --- files ---------------------------------------------------------------------------


def plot(results: dict, path: Path) -> str | None:
    """Writes results.png (bf16 inputs, float32 bias where measured); returns why not when it cannot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable"
    kinds = [(case["dtype"], bias_dtype(case)) for case in results["cases"]]
    if not kinds:
        return "no results"
    kind = ("bf16", "f32") if ("bf16", "f32") in kinds else kinds[0]
    cases = sorted((c for c in results["cases"] if (c["dtype"], bias_dtype(c)) == kind),
                   key=lambda c: (c["dims"]["N"], c["logits"], c["shape"]))
    labels = [f"{c['shape']}\nN={c['dims']['N']}" for c in cases]
    x = np.arange(len(cases))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [(MODE_LABELS[mode] + " time (ms)", mode, "median_ms", 1.0) for mode in MODES]
    panels.append(("f+b temp+output memory (MB)", "fwd_bwd", "temp_plus_output_bytes", 1e-6))
    for ax, (title, mode, field, factor) in zip(axes, panels):
        for name in results["metadata"]["impls"]:
            values = [cell_of(c, name, mode).get(field) for c in cases]
            ys = [np.nan if v is None else v * factor for v in values]
            if field == "median_ms":
                ys = [y if ok(cell_of(c, name, mode)) else np.nan for y, c in zip(ys, cases)]
            ax.plot(x, ys, marker="o", label=name)
        if field == "median_ms" and len(cases):
            ax.plot(x, [c["floor"][mode]["floor_ms"] for c in cases], "k--", linewidth=1,
                    label="floor")
        ax.set_yscale("log")
        ax.set_xticks(x, labels)
        ax.set_title(f"{title}, {kind[0]}, bias {kind[1]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = results["metadata"]
    fig.suptitle(f"MSA row attention — {meta['device_kind']}, jax {meta['jax_version']}, "
                 f"commit {meta['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(results: dict, out_dir: Path) -> None:
    """results.json and results.md (rewritten after every cell, so a cut run keeps its part)."""
    runs.write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(markdown_table(results))


# --- RESULTS.md ---------------------------------------------------------------------------

BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
LOG_DIR = BENCHMARKS_DIR / "log"


def last_date(meta: dict) -> str:
    """The date a results file was finished (`"A to B"`: B), as written, sortable."""
    return str(meta.get("date_utc", "")).split(" to ")[-1]


def times_against_an_alternative(results: dict) -> bool:
    """Whether a results file has msa_pallas and an alternative (not a variant of its own,
    not a reference point): a table worth showing as the current one."""
    impls = results.get("metadata", {}).get("impls", [])
    return SUBJECT in impls and any(
        name != SUBJECT and name not in OWN_VARIANTS and name not in REFERENCE_POINTS
        for name in impls)


def complete(results: dict) -> bool:
    """Whether every cell a results file was asked for was measured: its `complete`, or in
    files written before runs could be continued, no cell cut by a time budget."""
    if "complete" in results["metadata"]:
        return results["metadata"]["complete"]
    return all(cell.get("status") != "skipped: time budget"
               for case in results["cases"] for entry in case["impls"].values()
               for mode, cell in entry.items() if mode in MODES)


def newest_results(folder: Path = RESULTS_DIR) -> Path:
    """The newest complete op results file in `folder` (by the date it records) that
    times msa_pallas against an alternative; raises FileNotFoundError when there is none."""
    found = []
    for path in sorted(folder.glob("*.json")):
        results = json.loads(path.read_text())
        if "cases" in results and times_against_an_alternative(results) and complete(results):
            found.append((last_date(results["metadata"]), path.name, path))
    if not found:
        raise FileNotFoundError(f"no complete op results file with an alternative in {folder}")
    return max(found)[2]


def command_line(meta: dict) -> str:
    """The command that measured a results file, as recorded (OUT_DIR for its --out)."""
    first = (meta.get("runs") or [{}])[0].get("argv", meta.get("argv", []))
    return " ".join(["python -m benchmarks op", *first])


def log_entries(folder: Path = LOG_DIR) -> list[tuple[str, str]]:
    """(file name, title) of each dated entry in benchmarks/log/, newest first; the title
    is the entry's heading without its `###`."""
    entries = []
    for path in sorted(folder.glob("[0-9]*.md"), reverse=True):
        heading = path.read_text().split("\n", 1)[0]
        entries.append((path.name, heading.lstrip("# ").strip()))
    return entries


def results_page(results: dict, source: Path, page: Path, plot_path: Path | None,
                 log_folder: Path = LOG_DIR) -> str:
    """benchmarks/RESULTS.md: the current table of `results` (read from `source`) with
    its command, commit, date and device, the plot at `plot_path`, and the log's index.
    Links are relative to `page`."""
    meta = results["metadata"]
    relative = lambda path: Path(os.path.relpath(path, page.parent)).as_posix()  # noqa: E731
    calls = len(meta.get("runs") or [None])
    lines = [
        "# Benchmark results",
        "",
        "<!-- Written by `python -m benchmarks report --page ... --plot ...` from the results "
        "file below: change benchmarks/report.py or the results, not this page. -->",
        "",
        "`msa_pallas.msa_row_attention` against the other ways of computing MSA row attention "
        "with a pair bias in JAX, measured in one run on one GPU (ratios measured in the same "
        "run are what count; absolute times drift between machines).",
        "",
        f"- Results file: [{relative(source)}]({relative(source)})",
        f"- Command: `{command_line(meta)}`"
        + (f" (continued in {calls - 1} more calls)" if calls > 1 else ""),
        f"- Commit {meta.get('commit', '?')}, {meta.get('date_utc', '?')}, "
        f"{meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}",
        "",
        markdown_table(results).rstrip("\n"),
        "",
    ]
    if plot_path is not None:
        lines += [f"![time and memory against N]({relative(plot_path)})", ""]
    lines += [
        "## Measuring it again",
        "",
        "    bash benchmarks/fetch_wheels.sh        # where pip reaches the index: the "
        "alternatives' wheels, into .whl/",
        "    python -m benchmarks op --out OUT      # on the GPU machine (benchmarks/run_gpu.sh "
        "installs the wheels first)",
        "    cp OUT/results.json benchmarks/results/DATE-DEVICE-WHAT.json",
        "    python -m benchmarks report --page benchmarks/RESULTS.md "
        "--plot benchmarks/results_h200.png",
        "",
        "`--budget SECONDS` stops the op benchmark before that many seconds and the same "
        "command continues it; `python -m benchmarks compare OLD.json NEW.json` lists the "
        "cells that changed. benchmarks/README.md says more.",
        "",
        "## The log",
        "",
        "What was measured and why, one dated entry per file in "
        f"[{relative(log_folder)}/]({relative(log_folder)}/), newest first:",
        "",
    ]
    lines += [f"- [{title}]({relative(log_folder / name)})"
              for name, title in log_entries(log_folder)]
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="?", default=None,
                        help="an op results.json (default: the newest complete one in "
                             "benchmarks/results/ that times msa_pallas against an alternative)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results.md and results.png of the file into this folder")
    parser.add_argument("--page", type=Path, default=None,
                        help="write the results page (benchmarks/RESULTS.md) here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="with --page: write the page's plot here")
    args = parser.parse_args(argv)
    try:
        source = args.results or newest_results()
        results = json.loads(source.read_text())
        table = markdown_table(results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"report: cannot read the results: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(table)
        why_not = plot(results, args.out / "results.png")
        print(f"# wrote {args.out}/results.md" + (f"; no plot: {why_not}" if why_not
                                                  else ", results.png"))
    if args.page is not None:
        plot_path = args.plot
        for path in (args.page, plot_path):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if plot_path is not None and (why_not := plot(results, plot_path)):
            print(f"# no plot: {why_not}")
            plot_path = None
        args.page.write_text(results_page(results, source, args.page, plot_path))
        print(f"# wrote {args.page} from {source}"
              + (f" and {plot_path}" if plot_path is not None else ""))
    if args.out is None and args.page is None:
        print(table, end="")
    return 0
