"""The `report` command: an op results file's table and plot again, and benchmarks/RESULTS.md.

    python -m benchmarks report OUT/results.json                  # the table, on stdout
    python -m benchmarks report OUT/results.json --out DIR        # DIR/results.md, results.png
    python -m benchmarks report --page benchmarks/RESULTS.md --plot benchmarks/results_h200.png

The last one writes benchmarks/RESULTS.md: the current table with its command, commit,
date and device, and its plot, from the newest complete results file in
benchmarks/results/ that times msa_pallas against an alternative (or the file named),
with the index of the dated entries in benchmarks/log/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.alternatives import OWN_VARIANTS, REFERENCE_POINTS
from benchmarks.measure import MODES
from benchmarks import report
from benchmarks.report import SUBJECT, markdown_table

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
        "file below: change benchmarks/page.py or the results, not this page. -->",
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
        table = report.markdown_table(results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"report: cannot read the results: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(table)
        why_not = report.plot(results, args.out / "results.png")
        print(f"# wrote {args.out}/results.md" + (f"; no plot: {why_not}" if why_not
                                                  else ", results.png"))
    if args.page is not None:
        plot_path = args.plot
        for path in (args.page, plot_path):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if plot_path is not None and (why_not := report.plot(results, plot_path)):
            print(f"# no plot: {why_not}")
            plot_path = None
        args.page.write_text(results_page(results, source, args.page, plot_path))
        print(f"# wrote {args.page} from {source}"
              + (f" and {plot_path}" if plot_path is not None else ""))
    if args.out is None and args.page is None:
        print(table, end="")
    return 0
