"""The `report` command: an op results file's table and plot again, and benchmarks/RESULTS.md.

    python -m benchmarks report OUT/results.json                  # the table, on stdout
    python -m benchmarks report OUT/results.json --out DIR        # DIR/results.md, results.png
    python -m benchmarks report --page benchmarks/RESULTS.md --plot benchmarks/results_h200.png
    python -m benchmarks report --readme README.md

--page writes benchmarks/RESULTS.md: the current table with its command, commit, date and
device, and its plot, from the newest complete results file in benchmarks/results/ that
times msa_pallas against an alternative on the most MSA shapes (or the file named), the newest
such file of the triangle shapes and the newest `model` results below it, and the index
of the dated entries in benchmarks/log/. --readme writes README.md's results block from the same file
(the 16-bit rows against the fastest alternative) between its lines `<!-- results: ... -->`
and `<!-- /results -->`, and leaves the rest of the file as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

from benchmarks.alternatives import OWN_VARIANTS, REFERENCE_POINTS
from benchmarks.measure import MODES
from benchmarks import report, runs
from benchmarks.report import (MEMORY_YARDSTICK, SUBJECT, _median, cell_of, fastest_alternative,
                               fmt_cell, fmt_mb, fmt_ms, fmt_ratio, markdown_table, wrong_output)
from benchmarks.shapes import HALF_DTYPES, TRIANGLE_SHAPES

BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
LOG_DIR = BENCHMARKS_DIR / "log"
REPO_DIR = BENCHMARKS_DIR.parent
README_START = "<!-- results: written by python -m benchmarks report --readme README.md -->"
README_END = "<!-- /results -->"


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


def _newest(folder: Path, accepts, date_of) -> Path | None:
    """The results file in `folder` that `accepts` (a predicate of its parsed JSON) with
    the latest `date_of(results)` (ties: the latest name), or None."""
    found = []
    for path in sorted(folder.glob("*.json")):
        results = json.loads(path.read_text())
        if accepts(results):
            found.append((date_of(results), path.name, path))
    return max(found)[2] if found else None


def _shapes(results: dict) -> set[str]:
    return {case["shape"] for case in results["cases"]}


def _newest_op_table(folder: Path, has_shapes) -> Path | None:
    """The newest complete op results file in `folder` (by the date it records) that times
    msa_pallas against an alternative and whose set of shapes `has_shapes`, or None."""
    return _newest(folder, lambda results: "cases" in results
                   and times_against_an_alternative(results) and complete(results)
                   and has_shapes(_shapes(results)),
                   lambda results: last_date(results["metadata"]))


def newest_results(folder: Path = RESULTS_DIR) -> Path:
    """The current table: of the complete op results files in `folder` that time
    msa_pallas against an alternative on MSA shapes (not triangle shapes alone), those
    with the most MSA shapes, and of them the newest (by the date it records). A run of a
    few shapes beside the table does not replace it. Raises FileNotFoundError when there
    is none."""
    def msa_shapes(results):
        return len(_shapes(results) - set(TRIANGLE_SHAPES))

    newest = _newest(folder, lambda results: "cases" in results
                     and times_against_an_alternative(results) and complete(results)
                     and msa_shapes(results) > 0,
                     lambda results: (msa_shapes(results), last_date(results["metadata"])))
    if newest is None:
        raise FileNotFoundError(f"no complete op results file with an alternative in {folder}")
    return newest


def newest_triangle_results(folder: Path = RESULTS_DIR) -> Path | None:
    """The newest complete op results file in `folder` (by the date it records) that times
    msa_pallas against an alternative on a triangle shape, or None."""
    return _newest_op_table(folder, lambda shapes: bool(shapes & set(TRIANGLE_SHAPES)))


def triangle_section(results: dict, source: Path, relative) -> list[str]:
    """The page's lines on the triangle-attention shapes, from an op results file."""
    meta = results["metadata"]
    triangle = dict(results, cases=[case for case in results["cases"]
                                    if case["shape"] in TRIANGLE_SHAPES])
    return [
        "## Triangle attention",
        "",
        "The same op on AlphaFold's triangle attention (the pair's N rows as the MSA rows, "
        "H = 4, d = 32, one bias shared by all rows); `msa_pallas_dpa` is "
        "`msa_pallas.dot_product_attention`, called with tokamax's / AlphaFold3's layouts. "
        "The target for these shapes: at least as fast as the fastest alternative.",
        "",
        f"- Results file: [{relative(source)}]({relative(source)})",
        f"- Command: `{command_line(meta)}`",
        f"- Commit {runs.short_commit(meta.get('commit', '?'))}, {meta.get('date_utc', '?')}, "
        f"{meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}",
        "",
        markdown_table(triangle).rstrip("\n"),
        "",
    ]


def newest_model_results(folder: Path = RESULTS_DIR) -> Path | None:
    """The newest results file of `python -m benchmarks model` in `folder` (by the date it
    records), or None."""
    return _newest(folder, lambda results: "rows" in results and "alphafold" in results.get(
        "meta", {}), lambda results: results["meta"].get("date", ""))


def model_section(results: dict, source: Path, relative) -> list[str]:
    """The page's lines on AlphaFold2's Evoformer iteration, from a model results file."""
    meta = results["meta"]
    settings = meta.get("settings", {})
    return [
        "## AlphaFold2's Evoformer iteration",
        "",
        "One iteration of AlphaFold2's own `EvoformerIteration` as it ships (`AF2`) against the "
        "same block with its row and triangle attention on msa_pallas "
        "(`msa_pallas.alphafold2.patched()`); inference, and a jitted training step (the "
        "gradient of a loss of both outputs); random parameters; median ms, XLA's peak memory "
        "of the compiled program; rel. err: the patched inference outputs against AF2's.",
        "",
        f"- Results file: [{relative(source)}]({relative(source)})",
        f"- Command: `{meta.get('command', '?')}`"
        + (" (stopped at its budget; the same command measures the rest)"
           if not meta.get("complete", True) else ""),
        f"- Commit {runs.short_commit(meta.get('commit', '?'))}, {meta.get('date', '?')}, "
        f"{meta.get('device', '?')}, jax {meta.get('jax', '?')}, {meta.get('alphafold', '?')}, "
        f"inference chunks of {settings.get('chunk_mib', '?')} MiB"
        + (f", XLA_PYTHON_CLIENT_MEM_FRACTION "
           f"{meta['env'].get('XLA_PYTHON_CLIENT_MEM_FRACTION') or 'unset (JAX: 0.75)'}"
           if "env" in meta else ""),
        "",
        report.model_table(results["rows"]),
        "",
    ]


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
                 log_folder: Path = LOG_DIR, results_folder: Path = RESULTS_DIR) -> str:
    """benchmarks/RESULTS.md: the current table of `results` (read from `source`) with
    its command, commit, date and device, the plot at `plot_path`, the newest triangle
    shapes' and model results files' tables in `results_folder`, and the log's index. Links
    are relative to `page`."""
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
        + (f" (continued in {calls - 1} more call{'s' if calls > 2 else ''})" if calls > 1 else ""),
        f"- Commit {runs.short_commit(meta.get('commit', '?'))}, {meta.get('date_utc', '?')}, "
        f"{meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}",
        "",
        markdown_table(results).rstrip("\n"),
        "",
    ]
    if plot_path is not None:
        lines += [f"![time and memory against N]({relative(plot_path)})", ""]
    triangle_source = newest_triangle_results(results_folder)
    if triangle_source is not None:
        lines += triangle_section(json.loads(triangle_source.read_text()), triangle_source,
                                  relative)
    model_source = newest_model_results(results_folder)
    if model_source is not None:
        lines += model_section(json.loads(model_source.read_text()), model_source, relative)
    lines += [
        "## Measuring it again",
        "",
        "    bash benchmarks/fetch_wheels.sh        # where pip reaches the index: the "
        "alternatives' wheels, into .whl/",
        "    python -m benchmarks op --out OUT      # on the GPU machine (benchmarks/run_gpu.sh "
        "installs the wheels first)",
        "    cp OUT/results.json benchmarks/results/DATE-DEVICE-WHAT.json",
        "    python -m benchmarks model --out OUT   # AlphaFold2's Evoformer (docs/models.md); "
        "its results.json goes there too",
        "    python -m benchmarks report --page benchmarks/RESULTS.md "
        "--plot benchmarks/results_h200.png",
        "    python -m benchmarks report --readme README.md   # README.md's results block, "
        "from the same file",
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


def _times(case: dict, mode: str, fastest: tuple[str, float] | None,
           mark: str) -> tuple[str, float | None]:
    """(`ours / theirs` ms with the faster in bold, their time / ours) of one mode of a
    case; the ratio is None when either is missing or the subject's output is wrong."""
    ours = _median(case, SUBJECT, mode)
    ours_text = "wrong output" if wrong_output(case, SUBJECT) else fmt_cell(
        cell_of(case, SUBJECT, mode))
    theirs_text = "–" if fastest is None else fmt_ms(fastest[1]) + mark
    if fastest is None or ours is None or wrong_output(case, SUBJECT):
        return f"{ours_text} / {theirs_text}", None
    ratio = fastest[1] / ours
    if ratio > 1:
        ours_text = f"**{ours_text}**"
    elif ratio < 1:
        theirs_text = f"**{theirs_text}**"
    return f"{ours_text} / {theirs_text}", ratio


def _range(ratios: list[float]) -> str:
    """`lowest× to highest×` of the ratios."""
    return f"{fmt_ratio(min(ratios))}× to {fmt_ratio(max(ratios))}×" if ratios else "no ratio"


def readme_results(results: dict, source: Path) -> str:
    """README.md's results block (ending in a newline): where `results` (read from `source`)
    was measured; one row per 16-bit case, its shape's cases together, with msa_pallas'
    time and the fastest alternative's forward and forward+backward, their ratio, and the
    f+b memory against MEMORY_YARDSTICK's; then in how many rows msa_pallas is ahead."""
    meta = results["metadata"]
    cases = [case for case in results["cases"] if case["dtype"] in HALF_DTYPES]
    shapes = list(dict.fromkeys(case["shape"] for case in cases))
    cases.sort(key=lambda case: shapes.index(case["shape"]))
    dtypes = sorted({case["dtype"] for case in cases})
    fastest = [{mode: fastest_alternative(case, mode) for mode in MODES} for case in cases]
    counts = Counter(found[0] for row in fastest for found in row.values() if found)
    named = counts.most_common(1)[0][0] if counts else "none ran"
    # The header names the alternative of most cells; each other one gets its own mark.
    marks = {name: "†" * (i + 1) for i, name in enumerate(n for n in counts if n != named)}
    link = Path(os.path.relpath(source, REPO_DIR)).as_posix()
    alternatives = [name for name in meta["impls"] if name != SUBJECT]
    lines = [
        f"From [{link}]({link}): {meta.get('device_kind', '?')}, commit "
        f"{runs.short_commit(meta.get('commit', '?'))}, {meta.get('date_utc', '?')}, "
        f"{' and '.join(dtypes)} "
        f"inputs; ms, the faster in bold, against the fastest alternative that passed the "
        f"forward check (of {', '.join(alternatives)}): {named}"
        + (f" ({', '.join(f'{mark} {name}' for name, mark in marks.items())})" if marks else "")
        + "; × is its time / msa_pallas'.",
        "",
        f"| shape (B, S, N, H, d) | bias | fwd: {SUBJECT} / {named} | fwd × | f+b: {SUBJECT} / "
        f"{named} | f+b × | f+b memory: {SUBJECT} / {MEMORY_YARDSTICK} |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    memory_ratios = []
    for i, (case, row) in enumerate(zip(cases, fastest)):
        shape = case["shape"]
        if i == 0 or cases[i - 1]["shape"] != shape:
            shape += f" ({', '.join(str(v) for v in case['dims'].values())})"
        bias = (f"{case['dtype']}, bias " if len(dtypes) > 1 else "") + report.bias_dtype(case)
        cells = [shape, bias]
        for mode in MODES:
            found = row[mode]
            text, ratio = _times(case, mode, found, marks.get(found[0], "") if found else "")
            cells += [text, "–" if ratio is None else f"{fmt_ratio(ratio)}×"]
            if ratio is not None:
                ratios[mode].append(ratio)
        memory = [cell_of(case, name, "fwd_bwd") for name in (SUBJECT, MEMORY_YARDSTICK)]
        cells.append(f"{fmt_mb(memory[0])} / {fmt_mb(memory[1])} MB")
        if None not in (used := [cell.get("temp_plus_output_bytes") for cell in memory]):
            memory_ratios.append(used[0] / used[1])
        lines.append("| " + " | ".join(cells) + " |")
    ahead = {mode: sum(ratio > 1 for ratio in ratios[mode]) for mode in MODES}
    lines += [
        "",
        f"{SUBJECT} is ahead of the fastest alternative in {ahead['fwd']} of {len(cases)} "
        f"forward cells ({_range(ratios['fwd'])}) and {ahead['fwd_bwd']} of {len(cases)} "
        f"forward+backward cells ({_range(ratios['fwd_bwd'])}), in "
        + (f"{fmt_ratio(min(memory_ratios))} to {fmt_ratio(max(memory_ratios))} of "
           f"{MEMORY_YARDSTICK}'s f+b memory." if memory_ratios
           else f"f+b memory not compared with {MEMORY_YARDSTICK}'s."),
    ]
    padded = padding_text(meta, shapes)
    if padded:
        lines += ["", f"Padding at the end of the MSA rows and of the residues: {padded}."]
    return "\n".join(lines) + "\n"


def padding_text(meta: dict, shape_names) -> str:
    """`name` rows% and residues% padding, of each padded shape among `shape_names` in a
    results file's metadata (files from before shapes had their own padding recorded
    one `padding_fraction` for both)."""
    old = meta.get("constants", {}).get("padding_fraction", 0.25)
    parts = []
    for name in shape_names:
        entry = meta.get("shapes", {}).get(name, {})
        if entry.get("mask") != "padded":
            continue
        rows, residues = entry.get("padding", (old, old))
        parts.append(f"`{name}` {rows:.0%} of rows and {residues:.0%} of residues")
    return "; ".join(parts)


def split_readme(text: str) -> tuple[str, str, str]:
    """(up to and with README_START's line, the block, from README_END's line) of `text`
    (README.md), every character kept; ValueError unless there is one of each, in order."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == README_START]
    ends = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == README_END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"needs one line {README_START!r} and, after it, one line "
                         f"{README_END!r} around the results block")
    start, end = starts[0] + 1, ends[0]
    return "".join(lines[:start]), "".join(lines[start:end]), "".join(lines[end:])


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
    parser.add_argument("--readme", type=Path, default=None,
                        help="write the results block between the markers of this README.md")
    args = parser.parse_args(argv)
    try:
        source = args.results or newest_results()
        results = json.loads(source.read_text())
        table = report.markdown_table(results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"report: cannot read the results: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.readme is not None:  # before writing anything else, so a refusal writes nothing
        try:
            # Bytes, not text: the file's line endings stay as they are.
            head, _, tail = split_readme(args.readme.read_bytes().decode("utf-8"))
            readme = head + readme_results(results, source) + tail
        except (OSError, ValueError) as exc:
            print(f"report: cannot write {args.readme}'s results block: {exc}", file=sys.stderr)
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
    if args.readme is not None:
        args.readme.write_bytes(readme.encode("utf-8"))
        print(f"# wrote {args.readme}'s results block from {source}")
    if args.out is None and args.page is None and args.readme is None:
        print(table, end="")
    return 0
