"""What every benchmark run shares: its progress line, its time budget, its results file,
and the options that drive them (`add_run_options`).

A results file is written after every measurement (atomically: a run killed while
writing leaves the previous version), so a run cut short keeps what it measured, and a
rerun with the same `--out` continues it: `same_run` says whether an earlier file was
measured with the same commit, device and settings, and the benchmark skips the cells
the file already holds. `--budget SECONDS` stops a run before it would start a
measurement that the longest one so far says would not end in time (after the first:
every call measures something); the same command then continues where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The exit status of a run that stopped at its budget with cells left to measure.
EXIT_UNFINISHED = 4


class Progress:
    """A tqdm bar on stderr when stderr is a terminal; result lines go to stdout.

    When stderr is not a terminal (a log file), the bar is disabled and each result
    line starts with `[k/n]`, the time since the start and a guess of the time left
    (at the pace so far) instead, so that a captured log stays one line per result and
    still says how far the run is.
    """

    def __init__(self, total: int):
        from tqdm import tqdm

        self.total, self.done, self.start = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, disable=not self.tty)

    def describe(self, text: str) -> None:
        self.bar.set_description_str(text)

    def result(self, line: str) -> None:
        self.done += 1
        if self.tty:
            self.bar.write(line, file=sys.stdout)
        else:
            elapsed = time.monotonic() - self.start
            left = elapsed / self.done * (self.total - self.done)
            print(f"[{self.done:>{len(str(self.total))}}/{self.total} {elapsed:5.0f} s, "
                  f"~{left:.0f} s left] {line}", flush=True)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Budget:
    """`seconds` of measuring (None: no limit), spent one measurement at a time.

    `allows_another(kind)` is False once the time left is shorter than the longest
    measurement of that kind so far: the next one would likely run past the end. (The
    op benchmark asks for a whole case first, then for each cell of it.) The first
    measurement of a call is always allowed, so that calls with the same budget, however
    short, finish a table one after the other.
    """

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.monotonic()
        self.longest: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows_another(self, kind: str = "measurement") -> bool:
        if self.seconds is None or not self.longest:
            return True
        return self.elapsed() + self.longest.get(kind, 0.0) <= self.seconds

    def spent(self, seconds: float, kind: str = "measurement") -> None:
        """Records the duration of one measurement of `kind`."""
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


def add_run_options(parser: argparse.ArgumentParser, *, unit: str = "measurement",
                    commit: bool = True) -> None:
    """Adds the options of a run that continues to `parser`: `--budget SECONDS`
    (`args.budget`, None without it; `--budget-s` and `--time-budget` are other
    spellings of it), `--fresh` (`args.fresh`) and, with `commit`, `--commit`
    (`args.commit`, None without it: `commit_id` then finds one). `unit` names what
    the budget stops before ("row", "case or cell", ...). The command adds its own
    `--out`: the defaults differ."""
    # --budget-s and --time-budget were the op and multi-gpu spellings; logs and
    # RESULTS.md record commands with them, which must still run.
    parser.add_argument("--budget", "--budget-s", "--time-budget", dest="budget", type=float,
                        default=None, metavar="SECONDS",
                        help=f"stop before a {unit} that the longest so far says would end "
                             f"after this many seconds, with exit status {EXIT_UNFINISHED}; "
                             "the same command continues where it stopped")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: ignore (and replace) the results.json in --out")
    if commit:
        parser.add_argument("--commit", default=None,
                            help="the commit id to record (default $MSA_PALLAS_COMMIT or git)")


def short_commit(commit: str) -> str:
    """A full 40-hex-digit commit id cut to git's short 7 digits (anything else as it is)."""
    return commit[:7] if re.fullmatch(r"[0-9a-f]{40}", commit or "") else commit


def commit_id(explicit: str | None = None) -> str:
    """`explicit`, else $MSA_PALLAS_COMMIT, else `git rev-parse --short HEAD` with
    "+dirty" when tracked files differ from it (the numbers are then of a tree no
    commit holds), else "unknown"."""
    if explicit:
        return explicit
    if os.environ.get("MSA_PALLAS_COMMIT"):
        return os.environ["MSA_PALLAS_COMMIT"]
    git = lambda *args: subprocess.run(  # noqa: E731
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True,
    ).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def portable_argv(argv: list[str]) -> list[str]:
    """The command line as recorded in the results: the output folder, a path of the
    machine that ran it, reads OUT_DIR."""
    recorded, after_out = [], False
    for arg in argv:
        if after_out:
            arg, after_out = "OUT_DIR", False
        elif arg == "--out":
            after_out = True
        elif arg.startswith("--out="):
            arg = "--out=OUT_DIR"
        recorded.append(arg)
    return recorded


def write_json(path: Path, data: dict) -> None:
    """Writes `data` to `path` through a temporary file and a rename (atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def read_json(path: Path) -> dict | None:
    """The results at `path`, or None when there is no such file."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def same_run(earlier: dict, now: dict, keys) -> str | None:
    """None when the metadata `earlier` and `now` agree on `keys`, else why not."""
    for key in keys:
        if earlier.get(key) != now.get(key):
            return f"{key} was {earlier.get(key)!r}, is {now.get(key)!r}"
    return None


def earlier_rows(out_dir, meta: dict, keys, *, fresh: bool) -> list[dict]:
    """The rows of `out_dir/results.json` (`{"meta", "rows"}`) that a run with
    metadata `meta` continues: none with `fresh`, without an `out_dir` or
    without the file. A file of another run (`same_run` on `keys`) is not
    overwritten: the run stops with exit status 2 and says why."""
    if out_dir is None or fresh:
        return []
    earlier = read_json(Path(out_dir) / "results.json")
    if earlier is None:
        return []
    why = same_run(earlier["meta"], meta, keys)
    if why is not None:
        print(f"# {out_dir}/results.json is of another run ({why}): pass --fresh to start "
              "over, or another --out", file=sys.stderr)
        raise SystemExit(2)
    return earlier["rows"]
