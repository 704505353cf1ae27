"""Compares two op benchmark runs (results.json of `python -m benchmarks op`) cell by cell.

    python -m benchmarks compare OLD/results.json NEW/results.json
    python -m benchmarks compare OLD.json NEW.json --threshold 0.10 --impl msa_pallas,xla

A cell is (shape, dtype, bias dtype, mode) of an implementation (default msa_pallas).
Lists the cells whose median time got worse by more than the threshold (default 5%),
or that ran before and fail now (out of memory, an error); then, separately, those
that got better by more than the threshold or run now and failed before, and the cells
found in only one of the files. Results written before the bias dtype was recorded had
the bias in the input dtype, and are read so.

Exit status: 1 when a cell regressed, else 0 (2 for bad arguments or files).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODE_LABELS = {"fwd": "fwd", "fwd_bwd": "f+b"}


def load_cells(path: Path, impls: list[str]) -> dict[tuple, dict]:
    """{(impl, shape, dtype, bias dtype, mode): cell} of a results.json, old format or new."""
    results = json.loads(Path(path).read_text())
    cells = {}
    for case in results["cases"]:
        bias = case.get("bias_dtype", case["dtype"])
        for impl in impls:
            for mode, cell in case["impls"].get(impl, {}).items():
                if mode in MODE_LABELS:
                    cells[(impl, case["shape"], case["dtype"], bias, mode)] = cell
    return cells


def describe(meta: dict) -> str:
    return (f"commit {meta.get('commit', '?')}, {meta.get('device_kind', '?')}, "
            f"{meta.get('date_utc', '?')}")


def label(key: tuple) -> str:
    impl, shape, dtype, bias, mode = key
    return f"{impl} {shape} {dtype} bias {bias} {MODE_LABELS[mode]}"


def time_text(cell: dict) -> str:
    if cell.get("status") == "ok":
        return f"{cell['median_ms']:.4g} ms"
    return str(cell.get("status", "?"))


def compare(old: dict[tuple, dict], new: dict[tuple, dict], threshold: float) -> dict[str, list]:
    """Sorts the cells into regressed, improved, unchanged, only_old, only_new, failed_both.

    Each of regressed/improved/unchanged is a list of (key, old cell, new cell, new/old
    time or None); only_old/only_new are lists of keys.
    """
    found = {name: [] for name in ("regressed", "improved", "unchanged", "only_old",
                                   "only_new", "failed_both")}
    for key in sorted(set(old) | set(new)):
        if key not in new:
            found["only_old"].append(key)
            continue
        if key not in old:
            found["only_new"].append(key)
            continue
        was_ok, is_ok = old[key].get("status") == "ok", new[key].get("status") == "ok"
        if not was_ok and not is_ok:
            found["failed_both"].append(key)
            continue
        if was_ok and is_ok:
            ratio = new[key]["median_ms"] / old[key]["median_ms"]
            kind = ("regressed" if ratio > 1 + threshold else
                    "improved" if ratio < 1 - threshold else "unchanged")
        else:  # it ran in one run only: a failure now is a regression
            ratio, kind = None, "regressed" if was_ok else "improved"
        found[kind].append((key, old[key], new[key], ratio))
    return found


def format_report(found: dict[str, list], threshold: float) -> list[str]:
    lines = []
    for kind, title in (("regressed", f"slower by more than {threshold:.0%}, or failing now"),
                        ("improved", f"faster by more than {threshold:.0%}, or running now")):
        rows = found[kind]
        lines.append(f"{kind} ({len(rows)}): {title}")
        for key, before, after, ratio in sorted(
                rows, key=lambda row: -(row[3] or float("inf")) if kind == "regressed"
                else (row[3] or 0.0)):
            change = f" ({ratio - 1:+.1%})" if ratio is not None else ""
            lines.append(f"  {label(key)}: {time_text(before)} -> {time_text(after)}{change}")
    for kind, title in (("only_old", "only in OLD"), ("only_new", "only in NEW")):
        if found[kind]:
            lines.append(f"{title} ({len(found[kind])}):")
            lines += [f"  {label(key)}" for key in found[kind]]
    lines.append(f"within {threshold:.0%}: {len(found['unchanged'])}; "
                 f"failing in both: {len(found['failed_both'])}")
    return lines


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="results.json of the earlier run")
    parser.add_argument("new", type=Path, help="results.json of the later run")
    parser.add_argument("--threshold", type=float, default=0.05,
                        help="relative change in median time that counts (default 0.05)")
    parser.add_argument("--impl", default="msa_pallas",
                        help="implementation(s) to compare, comma-separated (default msa_pallas)")
    args = parser.parse_args(argv)
    if not 0 < args.threshold < 1:
        parser.error("--threshold must be between 0 and 1")
    impls = [name.strip() for name in args.impl.split(",") if name.strip()]
    try:
        metas = [json.loads(path.read_text())["metadata"] for path in (args.old, args.new)]
        old, new = (load_cells(path, impls) for path in (args.old, args.new))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare: cannot read the results: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"# OLD {args.old} ({describe(metas[0])})")
    print(f"# NEW {args.new} ({describe(metas[1])})")
    print(f"# median times of {', '.join(impls)}, threshold {args.threshold:.0%}")
    found = compare(old, new, args.threshold)
    print("\n".join(format_report(found, args.threshold)))
    regressed = len(found["regressed"])
    print(f"# {regressed} regressed" if regressed else "# no regression")
    return 1 if regressed else 0
