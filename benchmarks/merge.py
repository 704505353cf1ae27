"""Merges benchmark runs of one commit on one device into one results.json.

    python -m benchmarks merge RUN_A/results.json RUN_B/results.json --out MERGED

A table measured in one `--out` needs no merging: `python -m benchmarks op --budget S`
stops in time and the same command continues it. Merging joins runs made apart (other
`--out` folders, or machines of the same kind): each case (shape, dtype, bias dtype)
keeps all of its implementations from one part, so the ratios of a row are still
measured side by side in one process:

- a case found in several parts is taken from the part in which more of its
  cells ran (status ok); on a tie, from the later part on the command line;
- the parts must share the commit, the device kind, jax's version and the
  alternatives' packages (exit status 2 otherwise): a table mixing them would
  compare what was not measured together;
- an implementation that only some parts ran is a column of the whole table,
  `skipped` in the cases of the other parts.

Writes MERGED/results.json (the metadata say which part each case came from),
results.md and results.png, as the op benchmark does; compare and
report read the merged file like any other.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path


from benchmarks import report
from benchmarks.report import MODES

# Metadata that must agree between the parts.
SHARED_KEYS = ("commit", "device_kind", "jax_version", "packages")


def case_key(case: dict) -> tuple[str, str, str]:
    return case["shape"], case["dtype"], case.get("bias_dtype", case["dtype"])


def cells_run(case: dict) -> int:
    """How many (implementation, mode) cells of a case ran."""
    return sum(cell.get("status") == "ok"
               for impl in case["impls"].values()
               for mode, cell in impl.items() if mode != "info")


def _union(lists) -> list:
    """The items of several lists in first-seen order, each once."""
    seen = []
    for items in lists:
        seen += [item for item in items if item not in seen]
    return seen


def merge(parts: list[tuple[str, dict]]) -> dict:
    """One results dict from `(name, results)` parts; raises ValueError when the
    parts' metadata disagree on `SHARED_KEYS`."""
    if not parts:
        raise ValueError("nothing to merge")
    first_name, first = parts[0]
    for name, results in parts[1:]:
        for key in SHARED_KEYS:
            mine, theirs = first["metadata"].get(key), results["metadata"].get(key)
            if mine != theirs:
                raise ValueError(f"{name} has {key} {theirs!r}, {first_name} has {mine!r}: "
                                 "only runs of one commit on one device can be merged")
    chosen: dict[tuple, tuple[int, dict]] = {}
    order: list[tuple] = []
    for index, (_, results) in enumerate(parts):
        for case in results["cases"]:
            key = case_key(case)
            if key not in chosen:
                order.append(key)
            if key not in chosen or cells_run(case) >= cells_run(chosen[key][1]):
                chosen[key] = (index, case)
    metas = [results["metadata"] for _, results in parts]
    meta = dict(metas[0])
    meta["impls"] = _union(m.get("impls", []) for m in metas)
    meta["dtypes"] = _union(m.get("dtypes", []) for m in metas)
    meta["bias_dtypes"] = _union(m.get("bias_dtypes", []) for m in metas)
    meta["shapes"] = {name: dims for m in metas for name, dims in m.get("shapes", {}).items()}
    dates = [m.get("date_utc", "?") for m in metas]
    meta["date_utc"] = dates[0] if len(set(dates)) == 1 else f"{dates[0]} to {dates[-1]}"
    for key in ("iters", "reps", "warmup"):
        values = {m.get(key) for m in metas}
        if len(values) > 1:
            meta[key] = "/".join(str(m.get(key)) for m in metas)
    meta["elapsed_s"] = sum(m.get("elapsed_s") or 0.0 for m in metas)
    meta["merged_from"] = [
        {"part": name, "date_utc": m.get("date_utc"), "argv": m.get("argv"),
         "cases": [list(key) for key in order if chosen[key][0] == index]}
        for index, ((name, _), m) in enumerate(zip(parts, metas))
    ]
    cases = [copy.deepcopy(chosen[key][1]) for key in order]
    for case in cases:  # the table has a column for every implementation of any part
        for impl in meta["impls"]:
            case["impls"].setdefault(impl, {"info": {}, **{
                mode: {"status": "skipped: not in the part this case comes from"}
                for mode in MODES}})
    return {"metadata": meta, "cases": cases}


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", type=Path, nargs="+", help="results.json files, in run order")
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for the merged results.json, results.md, results.png")
    args = parser.parse_args(argv)
    try:
        parts = [(str(path), json.loads(path.read_text())) for path in args.parts]
        merged = merge(parts)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"merge: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    report.write_outputs(merged, args.out)
    why_not = report.plot(merged, args.out / "results.png")
    for part in merged["metadata"]["merged_from"]:
        print(f"# {part['part']} ({part['date_utc']}): {len(part['cases'])} cases")
    print(f"# wrote {args.out}/results.json, results.md"
          + (f"; no plot: {why_not}" if why_not else ", results.png"))
    return 0
