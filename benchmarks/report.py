"""The op benchmark's results as Markdown (a table, the targets, notes) and as a plot;
the model benchmark's rows as a Markdown table (`model_table`).

Everything here reads the `results` dict that `python -m benchmarks op` writes to
results.json, so a table can be rendered again from any run's file
(`python -m benchmarks report OUT/results.json`, page.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks import runs
from benchmarks.alternatives import OWN_VARIANTS, REFERENCE_POINTS
from benchmarks.measure import (CHECK_REFERENCE, CHECK_TOLERANCE, EXP_PER_S, MODE_LABELS, MODES,
                                is_out_of_memory, ok)
from benchmarks.shapes import HALF_DTYPES, TRIANGLE_SHAPES

SUBJECT = "msa_pallas"  # the implementation the speed-ups, floor fractions and targets are about
# msa_pallas inside `msa_pallas.skipping_padding()`: judged too on the padded shapes.
SKIPPING_SUBJECT = "msa_pallas_skip"
# ... with the op's `mask_queries` too (a masked residue's output 0, its query skipped):
# judged on the padded shapes beside it.
MASKED_QUERIES_SUBJECT = "msa_pallas_skip_mask_queries"

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
# Triangle attention's: at least as fast as the fastest alternative (tokamax's Mosaic kernel).
TRIANGLE_TARGET_SPEEDUP = {"fwd": 1.0, "fwd_bwd": 1.0}
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
        f"{meta['device_kind']} · jax {meta['jax_version']} · "
        f"commit {runs.short_commit(meta['commit'])} · {meta['date_utc']} · "
        f"median of {meta['iters']} samples of {meta.get('reps', 1)} back-to-back calls"
        + (f", each a program of {meta['calls_per_program']} calls"
           if meta.get("calls_per_program", 1) > 1 else ""),
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


# The padding targets: time ÷ the unpadded shape's within this factor of the fraction of
# the logits the mask keeps, and this many times faster than the fastest alternative.
PADDING_PROPORTION_SLACK = 1.15
PADDING_TARGET_SPEEDUP = 2.5


def padding_lines(results: dict) -> list[str]:
    """For each padded case: the keys it keeps, and the subject's time against the same
    shape with random masks (a padded batch should cost less as less is left to compute),
    judged against the padding targets: that ratio at most PADDING_PROPORTION_SLACK times
    the kept fraction, and PADDING_TARGET_SPEEDUP times the fastest alternative's speed.
    Where the results hold SKIPPING_SUBJECT (the op inside `msa_pallas.skipping_padding()`),
    or MASKED_QUERIES_SUBJECT (that, with `mask_queries`), each is judged the same way,
    against the subject's time on the unpadded shape."""
    lines = []
    for case in results["cases"]:
        if case.get("mask", "random") != "padded":
            continue
        kept = case.get("kept_fraction")
        text = (f"- {case['shape']} {case['dtype']} bias {bias_dtype(case)}: "
                f"{float('nan') if kept is None else kept:.0%} of keys kept, "
                f"{case.get('fully_masked_rows', '?')} MSA rows fully masked (left out of "
                "the forward check)")
        full = next((c for c in results["cases"] if c.get("mask", "random") == "random"
                     and c["dims"] == case["dims"] and c["dtype"] == case["dtype"]
                     and bias_dtype(c) == bias_dtype(case)), None)
        for subject in (SUBJECT, SKIPPING_SUBJECT, MASKED_QUERIES_SUBJECT):
            if subject in results["metadata"]["impls"]:
                text += _padding_verdict(case, full, subject, kept)
        lines.append(text)
    return ["", "Padded batches:", "", *lines] if lines else []


def _padding_verdict(case: dict, full: dict | None, subject: str, kept) -> str:
    """`padding_lines`' judgement of `subject` at padded `case`, against SUBJECT's
    time at `full` (the same shape with random masks; None: not measured)."""
    text = ""
    if full is not None:
        ratios = [_median(case, subject, m) / _median(full, SUBJECT, m)
                  if _median(case, subject, m) and _median(full, SUBJECT, m) else None
                  for m in MODES]
        text += (f"; {subject} time / {full['shape']}'s {SUBJECT} (random masks, 90% kept) "
                 f"fwd / f+b: {fmt_pair(ratios)}")
        if kept is not None:
            bound = PADDING_PROPORTION_SLACK * kept
            text += (f" (target ≤ {PADDING_PROPORTION_SLACK:g} × {kept:.2f} = {bound:.2f}: "
                     + " / ".join("–" if r is None else "yes" if r <= bound else "no"
                                  for r in ratios) + ")")
    speedups = []
    for mode in MODES:
        found, ours = fastest_alternative(case, mode), _median(case, subject, mode)
        speedups.append(None if found is None or not ours else (found[1] / ours, found[0]))
    if any(speedups):
        text += ("; fastest alternative's time / " + subject + "'s fwd / f+b: "
                 + " / ".join("–" if x is None else f"{fmt_ratio(x[0])}× ({x[1]})"
                              for x in speedups)
                 + f" (target ≥ {PADDING_TARGET_SPEEDUP:g}×: "
                 + " / ".join("–" if x is None else "yes" if x[0] >= PADDING_TARGET_SPEEDUP
                              else "no" for x in speedups) + ")")
    return text


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
            if host_bound(cells[mode]):
                found.append((f"{name} {MODE_LABELS[mode]}: host-bound, the host queued a call "
                              f"in at least {HOST_BOUND_SHARE:.0%} of the time per call (the GPU "
                              "waited for calls)", f"{where}: {cells[mode]['queued_ms']:.3g} of "
                              f"{cells[mode]['median_ms']:.3g} ms"))
    return found


# A cell whose calls took the host this share of their time per call to queue (medians
# over the samples) timed the host as much as the GPU.
HOST_BOUND_SHARE = 0.8


def host_bound(cell: dict) -> bool:
    """Whether a timed cell's host took HOST_BOUND_SHARE of its time per call or more
    to queue the calls (`measure.measure_callable`'s `queued_ms`; False without it)."""
    queued = cell.get("queued_ms")
    return ok(cell) and queued is not None and queued >= HOST_BOUND_SHARE * cell["median_ms"]


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
    targets = TRIANGLE_TARGET_SPEEDUP if case["shape"] in TRIANGLE_SHAPES else TARGET_SPEEDUP
    goal = targets[mode] if case["dtype"] in HALF_DTYPES else 1.0
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
        "runs out of memory."
        + (" Triangle shapes: forward and f+b at least as fast (≥ 1×)."
           if any(case["shape"] in TRIANGLE_SHAPES for case in results["cases"]) else ""),
        "", *lines]) + "\n"


# --- files ---------------------------------------------------------------------------


def fmt_gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def model_table(rows: list[dict]) -> str:
    """The Markdown table of `python -m benchmarks model`'s rows: one line per block, N,
    dtype and mode, AlphaFold2's own against the patched (speed-up > 1: patched faster)."""
    cells: dict[tuple, dict] = {}
    for row in rows:
        key = (row["block"], row["N"], row["dtype"], row["mode"])
        cells.setdefault(key, {})[row["variant"]] = row
    lines = ["| block | N | S | dtype | mode | AF2 ms | patched ms | speed-up | AF2 peak GiB "
             "| patched peak GiB | rel. err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(row: dict) -> str:
        if row.get("status") == "ok":
            return f"{row['ms']:.2f}"
        error = row.get("error", "-")
        return "out of memory" if is_out_of_memory(error) else error[:40]

    for (block, n, dtype, mode), by in cells.items():
        plain, patched = by.get("unpatched", {}), by.get("patched", {})
        both_ok = plain.get("status") == patched.get("status") == "ok"
        ratio = f"{plain['ms'] / patched['ms']:.2f}x" if both_ok else "-"
        err = patched.get("rel_err_vs_unpatched")
        lines.append(f"| {block} | {n} | {(plain or patched).get('S', '-')} | {dtype} | {mode} "
                     f"| {ms(plain)} | {ms(patched)} | {ratio} "
                     f"| {fmt_gib(plain.get('peak_bytes'))} | {fmt_gib(patched.get('peak_bytes'))} "
                     f"| {'-' if err is None else f'{err:.1e}'} |")
    return "\n".join(lines)


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
                 f"commit {runs.short_commit(meta['commit'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(results: dict, out_dir: Path) -> None:
    """results.json and results.md (rewritten after every cell, so a cut run keeps its part)."""
    runs.write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(markdown_table(results))
