"""The benchmarks as one tool: its entry point, runs that continue where an earlier one
stopped (by a budget or by a cut), and the results page rendered from a results file.

Everything runs on CPU with the plain-jnp path at shapes of a few thousand logits, so a
measured cell costs a second or two; the times themselves are never judged."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import pathlib
import subprocess
import sys
import time

import pytest

from benchmarks import layer, measure, op, page, report, runs, timing

ROOT = pathlib.Path(__file__).resolve().parents[2]
TWO_SHAPES = "1x2x16x2x8,1x2x24x2x8"


def run_op(out, *extra) -> int:
    return op.main(["--shapes", TWO_SHAPES, "--dtypes", "f32", "--impls", "xla", "--iters", "1",
                    "--warmup", "1", "--commit", "abc1234", "--out", str(out), *extra])


def saved(out) -> dict:
    return json.loads((out / "results.json").read_text())


def cells(results) -> dict[tuple, dict]:
    """{(case key, impl, mode): cell} of a results file."""
    return {(measure.case_key(case), impl, mode): entry[mode]
            for case in results["cases"] for impl, entry in case["impls"].items()
            for mode in measure.MODES}


# --- the entry point ----------------------------------------------------------------------


def test_one_entry_point_and_no_module_edits_sys_path():
    listing = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    bare = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stdout == listing.stdout  # the usage, as an error
    for command in ("op", "layer", "model", "multi-gpu", "check", "profile", "compare",
                    "merge", "report"):
        assert f"\n  {command} " in listing.stdout, listing.stdout
    unknown = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown command 'nope'" in unknown.stderr
    profile = subprocess.run([sys.executable, "-m", "benchmarks", "profile", "--help"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert profile.returncode == 0 and "\n  memory " in profile.stdout, profile.stdout
    sources = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(sources) > 15
    editing = [str(path) for path in sources if "sys.path" in path.read_text()]
    assert editing == [], editing


# --- runs that continue ---------------------------------------------------------------------


def test_run_options_are_one_set_in_every_command():
    """`--budget` and its older spellings set `args.budget`; `--commit` where asked for;
    each command that continues a run says so in its `--help`."""
    for spelling in ("--budget", "--budget-s", "--time-budget"):
        parser = argparse.ArgumentParser()
        runs.add_run_options(parser)
        args = parser.parse_args([spelling, "30", "--fresh", "--commit", "abc1234"])
        assert (args.budget, args.fresh, args.commit) == (30.0, True, "abc1234")
    parser = argparse.ArgumentParser()
    runs.add_run_options(parser, commit=False)
    assert vars(parser.parse_args([])) == {"budget": None, "fresh": False}
    for command, records_commit in (("op", True), ("layer", True), ("model", True),
                                    ("multi-gpu", False)):
        helped = subprocess.run([sys.executable, "-m", "benchmarks", command, "--help"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert helped.returncode == 0, helped.stderr
        text = " ".join(helped.stdout.split())
        assert "--budget SECONDS, --budget-s SECONDS, --time-budget SECONDS" in text, text
        assert f"exit status {runs.EXIT_UNFINISHED}" in text and "--fresh" in text, text
        assert ("--commit COMMIT" in text) == records_commit, text


def test_op_budget_stops_and_the_same_command_continues(tmp_path, capsys):
    """`--budget 0`: each call measures one cell (the first of a call always runs) and
    stops with exit status 4; the next call skips what the file holds."""
    assert run_op(tmp_path, "--budget", "0") == runs.EXIT_UNFINISHED
    first = saved(tmp_path)
    assert list(cells(first)) == [("1x2x16x2x8/f32/bias f32", "xla", mode)
                                  for mode in measure.MODES]
    assert first["metadata"]["complete"] is False
    assert "| 1x2x16x2x8 (1,2,16,2,8) | f32 | f32 |" in (tmp_path / "results.md").read_text()
    assert "stopped before the budget of 0 s with 1 cells left" in capsys.readouterr().out

    assert run_op(tmp_path, "--budget", "0") == 0
    second = saved(tmp_path)
    assert second["metadata"]["complete"] is True
    assert [case["shape"] for case in second["cases"]] == ["1x2x16x2x8", "1x2x24x2x8"]
    # The first call's cell was kept as it was measured, not measured again.
    assert second["cases"][0] == first["cases"][0]
    assert [run["cells"] for run in second["metadata"]["runs"]] == [1, 1]
    assert all(cell["status"] == "ok" for cell in cells(second).values())


def test_op_rerun_skips_finished_cells_and_measures_new_ones(tmp_path, capsys):
    assert run_op(tmp_path) == 0
    before = saved(tmp_path)
    capsys.readouterr()
    # The same command again: nothing to measure, the file as it was.
    assert run_op(tmp_path) == 0
    assert "0 cells to measure (2 done in" in capsys.readouterr().out
    assert saved(tmp_path) == before
    # One more implementation: its cells only (here skipped: cuDNN needs a GPU).
    assert run_op(tmp_path, "--impls", "xla,cudnn") == 0
    after = saved(tmp_path)
    assert after["metadata"]["impls"] == ["xla", "cudnn"]
    for key, cell in cells(before).items():
        assert cells(after)[key] == cell
    new = {key: cell for key, cell in cells(after).items() if key not in cells(before)}
    assert sorted({(key[1], cell["status"]) for key, cell in new.items()}) == [
        ("cudnn", "skipped: cuDNN needs a GPU")]
    assert len(new) == 4
    out = capsys.readouterr().out
    assert "# not run here, and why:\n#   cudnn: cuDNN needs a GPU" in out
    # Another commit's file is not continued; --fresh starts over.
    assert op.main(["--shapes", TWO_SHAPES, "--dtypes", "f32", "--impls", "xla", "--iters", "1",
                    "--warmup", "1", "--commit", "fff0000", "--out", str(tmp_path)]) == 2
    assert "is of another run (commit was 'abc1234', is 'fff0000')" in capsys.readouterr().err
    assert saved(tmp_path) == after
    assert run_op(tmp_path, "--fresh", "--budget", "0") == runs.EXIT_UNFINISHED
    assert len(cells(saved(tmp_path))) == 2


def test_layer_budget_stops_and_continues(tmp_path):
    args = ["--shapes", "tiny", "--cores", "xla,cuequivariance", "--iters", "1", "--warmup", "1",
            "--reps", "1", "--out", str(tmp_path), "--commit", "abc1234"]
    with pytest.raises(SystemExit) as stopped:
        layer.main(args + ["--budget", "0"])
    assert stopped.value.code == runs.EXIT_UNFINISHED
    first = json.loads((tmp_path / "results.json").read_text())
    assert [(row["core"], row["status"]) for row in first["rows"]] == [("xla", "ok")]
    rows = layer.main(args + ["--budget", "0"])
    assert [row["core"] for row in rows] == ["xla", "cuequivariance"]
    assert rows[0] == first["rows"][0]  # kept, not measured again
    assert rows[1]["status"].startswith("skipped")


def test_results_file_is_written_whole(tmp_path):
    path = tmp_path / "deep" / "results.json"
    runs.write_json(path, {"cases": [1, 2]})
    runs.write_json(path, {"cases": [3]})
    assert runs.read_json(path) == {"cases": [3]}
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]
    assert runs.read_json(tmp_path / "none.json") is None


# --- the results page ----------------------------------------------------------------------


def _cell(ms):
    return {"status": "ok", "median_ms": ms, "temp_plus_output_bytes": 2e8, "compile_s": 1.0}


def _results(date, commit, impls=("msa_pallas", "cuequivariance")) -> dict:
    case = {"shape": "train", "dtype": "bf16", "bias_dtype": "f32", "mask": "random",
            "dims": {"B": 1, "S": 128, "N": 256, "H": 8, "d": 32}, "logits": 67108864,
            "floor": {mode: {"floor_ms": 0.02} for mode in measure.MODES},
            "impls": {name: {"fwd": _cell(0.1 * (i + 1)), "fwd_bwd": _cell(0.4 * (i + 1))}
                      for i, name in enumerate(impls)}}
    measure.finish_case(case)
    return {"metadata": {
        "date_utc": date, "device_kind": "NVIDIA H200", "jax_version": "0.11.2",
        "commit": commit, "iters": 5, "reps": 5, "impls": list(impls), "packages": {},
        "argv": ["--out", "OUT_DIR", "--shapes", "train"], "complete": True,
        "runs": [{"date_utc": date, "argv": ["--out", "OUT_DIR", "--shapes", "train",
                                             "--budget", "500"], "cells": 2},
                 {"date_utc": date, "argv": ["--out", "OUT_DIR"], "cells": 2}]},
        "cases": [case]}


def test_report_writes_the_page_from_the_newest_complete_results(tmp_path, capsys):
    folder, log = tmp_path / "results", tmp_path / "log"
    folder.mkdir(), log.mkdir()
    older = _results("2026-12-01 10:00 UTC", "aaa1111")
    newest = _results("2026-12-02 09:00 UTC", "bbb2222")
    unfinished = copy.deepcopy(_results("2026-12-03 09:00 UTC", "ccc3333"))
    unfinished["metadata"]["complete"] = False
    own_only = _results("2026-12-04 09:00 UTC", "ddd4444", impls=("msa_pallas", "xla"))
    own_only["metadata"]["impls"] = ["msa_pallas", "msa_pallas_mosaic"]
    for name, results in (("a.json", older), ("b.json", newest), ("c.json", unfinished),
                          ("d.json", own_only)):
        (folder / name).write_text(json.dumps(results))
    # An unfinished run and one without an alternative are not the current table.
    assert page.newest_results(folder) == folder / "b.json"
    # Nor is a newer run of fewer shapes than the table.
    two_shapes = _results("2026-12-01 08:00 UTC", "eee5555")
    two_shapes["cases"].append(dict(copy.deepcopy(two_shapes["cases"][0]), shape="extra"))
    (folder / "e.json").write_text(json.dumps(two_shapes))
    assert page.newest_results(folder) == folder / "e.json"
    fewer = _results("2026-12-05 09:00 UTC", "fff6666")
    (folder / "f.json").write_text(json.dumps(fewer))
    assert page.newest_results(folder) == folder / "e.json"
    for name in ("e.json", "f.json"):
        (folder / name).unlink()
    for name, heading in (("2026-12-01-01-first.md", "### 2026-12-01 · H200 — first"),
                          ("2026-12-02-01-second.md", "### 2026-12-02 · H200 — second")):
        (log / name).write_text(heading + "\n\ntext\n")

    page_path = tmp_path / "RESULTS.md"
    has_plot = importlib.util.find_spec("matplotlib") is not None
    text = page.results_page(newest, folder / "b.json", page_path,
                               tmp_path / "plot.png" if has_plot else None, log)
    assert "- Results file: [results/b.json](results/b.json)" in text
    assert ("- Command: `python -m benchmarks op --out OUT_DIR --shapes train --budget 500` "
            "(continued in 1 more call)") in text
    assert "- Commit bbb2222, 2026-12-02 09:00 UTC, NVIDIA H200, jax 0.11.2" in text
    assert "| train (1,128,256,8,32) | bf16 | f32 | 0.100 | 0.200 | 0.400 | 0.800 |" in text
    assert ("![time and memory against N](plot.png)" in text) == has_plot
    links = [line for line in text.splitlines() if line.startswith("- [")]
    assert links == ["- [2026-12-02 · H200 — second](log/2026-12-02-01-second.md)",
                     "- [2026-12-01 · H200 — first](log/2026-12-01-01-first.md)"]

    # The command: the table on stdout, or files.
    assert page.main([str(folder / "a.json")]) == 0
    assert "commit aaa1111" in capsys.readouterr().out
    assert page.main([str(folder / "b.json"), "--out", str(tmp_path / "again")]) == 0
    assert "commit bbb2222" in (tmp_path / "again" / "results.md").read_text()
    assert page.main([str(tmp_path / "missing.json")]) == 2


def _model_results(date, commit, complete=True) -> dict:
    rows = [dict(block="evoformer", N=256, S=512, dtype="bf16", mode="inference",
                 variant=variant, ms=ms, peak_bytes=peak, status="ok")
            for variant, ms, peak in (("unpatched", 18.0, 2**30), ("patched", 12.0, 2**29))]
    rows[1]["rel_err_vs_unpatched"] = 2.9e-3
    return {"meta": {"device": "NVIDIA H200", "jax": "0.11.2", "commit": commit, "date": date,
                     "settings": {"chunk_mib": 64}, "alphafold": "alphafold-colabfold 2.3.27",
                     "command": "python -m benchmarks model --out OUT_DIR", "complete": complete},
            "rows": rows}


def test_results_page_shows_the_newest_model_results(tmp_path):
    folder, log = tmp_path / "results", tmp_path / "log"
    folder.mkdir(), log.mkdir()
    op_results = _results("2026-12-02 09:00 UTC", "bbb2222")
    (folder / "op.json").write_text(json.dumps(op_results))
    page_path = tmp_path / "RESULTS.md"
    # No model results: no section.
    text = page.results_page(op_results, folder / "op.json", page_path, None, log, folder)
    assert "## AlphaFold2" not in text and page.newest_model_results(folder) is None
    for name, date, commit in (("m1.json", "2026-12-01 10:00 UTC", "aaa1111"),
                               ("m2.json", "2026-12-03 10:00 UTC", "ccc3333")):
        (folder / name).write_text(json.dumps(_model_results(date, commit, complete=False)))
    assert page.newest_model_results(folder) == folder / "m2.json"
    assert page.newest_results(folder) == folder / "op.json"  # model files are not op tables
    text = page.results_page(op_results, folder / "op.json", page_path, None, log, folder)
    assert "- Results file: [results/m2.json](results/m2.json)" in text
    assert ("- Command: `python -m benchmarks model --out OUT_DIR` (stopped at its budget; "
            "the same command measures the rest)") in text
    assert "- Commit ccc3333, 2026-12-03 10:00 UTC, NVIDIA H200" in text
    assert "MEM_FRACTION" not in text  # not recorded in this file
    results = _model_results("2026-12-03 10:00 UTC", "ccc3333")
    results["meta"]["env"] = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"}
    assert ("inference chunks of 64 MiB, XLA_PYTHON_CLIENT_MEM_FRACTION 0.90"
            in "\n".join(page.model_section(results, folder / "m.json", str)))
    results["meta"]["env"] = {"XLA_PYTHON_CLIENT_MEM_FRACTION": None}
    assert ("XLA_PYTHON_CLIENT_MEM_FRACTION unset (JAX: 0.75)"
            in "\n".join(page.model_section(results, folder / "m.json", str)))
    assert ("| evoformer | 256 | 512 | bf16 | inference | 18.00 | 12.00 | 1.50x | 1.00 | 0.50 "
            "| 2.9e-03 |") in text
    assert text.index("## AlphaFold2's Evoformer iteration") < text.index("## The log")


def test_model_table_names_what_failed():
    rows = _model_results("2026-12-03 10:00 UTC", "ccc3333")["rows"]
    for row in rows:
        row["mode"] = "train"
    rows[0].update(status="error", error="JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory "
                                         "while trying to allocate 134.38GiB")
    rows.append(dict(rows[1], mode="inference", status="error", error="ValueError: bad shape"))
    table = report.model_table(rows)
    assert ("| evoformer | 256 | 512 | bf16 | train | out of memory | 12.00 | - | 1.00 | 0.50 "
            "| 2.9e-03 |") in table
    assert "| inference | - | ValueError: bad shape | - |" in table


def test_results_page_shows_the_newest_triangle_results_apart(tmp_path):
    """A results file of the triangle shapes alone is not the op's table; the page shows
    it in its own section, its triangle cases only."""
    folder, log = tmp_path / "results", tmp_path / "log"
    folder.mkdir(), log.mkdir()
    op_results = _results("2026-12-02 09:00 UTC", "bbb2222")
    (folder / "op.json").write_text(json.dumps(op_results))
    page_path = tmp_path / "RESULTS.md"
    assert page.newest_triangle_results(folder) is None
    assert "## Triangle attention" not in page.results_page(
        op_results, folder / "op.json", page_path, None, log, folder)
    triangle = _results("2026-12-03 09:00 UTC", "ccc3333")
    triangle["cases"][0].update(shape="triangle",
                                dims={"B": 1, "S": 384, "N": 384, "H": 4, "d": 32})
    (folder / "tri.json").write_text(json.dumps(triangle))
    assert page.newest_results(folder) == folder / "op.json"
    assert page.newest_triangle_results(folder) == folder / "tri.json"
    text = page.results_page(op_results, folder / "op.json", page_path, None, log, folder)
    section = text.split("## Triangle attention", 1)[1].split("\n## ", 1)[0]
    assert "- Results file: [results/tri.json](results/tri.json)" in section
    assert "- Commit ccc3333, 2026-12-03 09:00 UTC, NVIDIA H200" in section
    assert "| triangle (1,384,384,4,32) | bf16 | f32 | 0.100 | 0.200 |" in section
    assert "| train (1,128,256,8,32)" not in section
    # A file with both kinds of shapes is an op table, and its triangle rows are shown too.
    both = _results("2026-12-04 09:00 UTC", "ddd4444")
    both["cases"].append(triangle["cases"][0])
    (folder / "both.json").write_text(json.dumps(both))
    assert page.newest_results(folder) == page.newest_triangle_results(folder) == (
        folder / "both.json")


def test_results_page_is_the_one_the_report_writes():
    """benchmarks/RESULTS.md is generated: rendering its results file again gives it
    back, and it lists every entry of benchmarks/log/."""
    page_path = ROOT / "benchmarks" / "RESULTS.md"
    text = page_path.read_text()
    source = ROOT / "benchmarks" / text.split("- Results file: [", 1)[1].split("]", 1)[0]
    plot = ROOT / "benchmarks" / "results_h200.png"
    assert plot.exists() and "](results_h200.png)" in text
    assert page.results_page(json.loads(source.read_text()), source, page_path, plot) == text
    for entry in (ROOT / "benchmarks" / "log").glob("2*.md"):
        assert f"](log/{entry.name})" in text, entry.name
        assert entry.read_text().startswith("### " + entry.name[:10] + " "), entry.name


# --- README.md's results block --------------------------------------------------------------


def test_readme_results_are_the_newest_results_files():
    """README.md's Results block is what `report --readme` writes from the newest results
    file: a results file added without running it again fails here."""
    text = (ROOT / "README.md").read_text()
    source = page.newest_results()
    _, block, _ = page.split_readme(text)
    assert block == page.readme_results(json.loads(source.read_text()), source)
    assert f"[benchmarks/results/{source.name}](benchmarks/results/{source.name})" in block
    assert len(text.splitlines()) <= 251, "README.md is to stay at most ~250 lines"


def test_readme_results_say_each_padded_shape_padding():
    meta = {"shapes": {"train": {"mask": "random"},
                       "train_padded": {"mask": "padded", "padding": [0.25, 0.25]},
                       "extra_padded": {"mask": "padded", "padding": [0.75, 0.0]}},
            "constants": {}}
    assert page.padding_text(meta, ["train", "train_padded", "extra_padded"]) == (
        "`train_padded` 25% of rows and 25% of residues; "
        "`extra_padded` 75% of rows and 0% of residues")
    # Files from before each shape recorded its own: one fraction for both.
    old = {"shapes": {"long_padded": {"mask": "padded"}},
           "constants": {"padding_fraction": 0.25}}
    assert page.padding_text(old, ["long_padded"]) == "`long_padded` 25% of rows and 25% of residues"
    assert page.padding_text(meta, ["train"]) == ""


def test_readme_results_rows_ratios_and_ahead_count(tmp_path, capsys):
    results = _results("2026-12-02 09:00 UTC", "bbb2222",
                       impls=("msa_pallas", "cuequivariance", "xla"))
    train = results["cases"][0]  # msa_pallas 0.1 / 0.4 ms, cuequivariance 0.2 / 0.8, xla 0.3 / 1.2
    train["impls"]["msa_pallas"]["fwd_bwd"]["temp_plus_output_bytes"] = 5e7
    bf16_bias = copy.deepcopy(train)
    bf16_bias["bias_dtype"] = "bf16"
    bf16_bias["impls"]["xla"]["fwd"]["median_ms"] = 0.05  # faster than msa_pallas' 0.1
    bf16_bias["impls"]["cuequivariance"]["fwd_bwd"]["median_ms"] = 0.6
    float32 = copy.deepcopy(train)  # float32 inputs: not in the README's rows
    float32["dtype"] = float32["bias_dtype"] = "f32"
    float32["impls"]["msa_pallas"]["fwd"]["median_ms"] = 9.0
    results["cases"] += [bf16_bias, float32]
    source = ROOT / "benchmarks" / "results" / "x.json"
    block = page.readme_results(results, source)

    assert "[benchmarks/results/x.json](benchmarks/results/x.json)" in block
    assert "commit bbb2222, 2026-12-02 09:00 UTC, bf16 inputs" in block
    assert "| fwd: msa_pallas / cuequivariance |" in block
    rows = [line for line in block.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 2
    fwd, fwd_bwd = [0.2 / 0.1, 0.05 / 0.1], [0.8 / 0.4, 0.6 / 0.4]
    memory = 5e7 / 2e8
    assert rows[0] == (f"| train (1, 128, 256, 8, 32) | f32 | **0.100** / 0.200 | "
                       f"{fwd[0]:.2f}× | **0.400** / 0.800 | {fwd_bwd[0]:.2f}× | 50 / 200 MB |")
    # The other alternative's cell is marked and named; the faster one is in bold.
    assert rows[1].startswith(f"| train | bf16 | 0.100 / **0.050†** | {fwd[1]:.2f}× | "
                              f"**0.400** / 0.600 | {fwd_bwd[1]:.2f}× |")
    assert "cuequivariance († xla)" in block
    assert block.endswith(
        f"msa_pallas is ahead of the fastest alternative in 1 of 2 forward cells "
        f"({min(fwd):.2f}× to {max(fwd):.2f}×) and 2 of 2 forward+backward cells "
        f"({min(fwd_bwd):.2f}× to {max(fwd_bwd):.2f}×), in {memory:.2f} to {memory:.2f} of "
        "cuequivariance's f+b memory.\n")

    # The command writes the block between the markers, the rest as it was (line endings too).
    results_path = tmp_path / "x.json"
    results_path.write_text(json.dumps(results))
    head = "# Title\r\n\r\ntext\r\n" + page.README_START + "\r\n"
    tail = page.README_END + "\r\nmore text, no newline at the end"
    readme = tmp_path / "README.md"
    readme.write_bytes((head + "old block\r\n" + tail).encode())
    assert page.main([str(results_path), "--readme", str(readme)]) == 0
    assert readme.read_bytes().decode() == (
        head + page.readme_results(results, results_path) + tail)
    assert page.main([str(results_path), "--readme", str(readme)]) == 0  # again: the same
    assert readme.read_bytes().decode() == (
        head + page.readme_results(results, results_path) + tail)
    capsys.readouterr()
    # Without the markers, or with one only: exit 2, the file untouched.
    for text in ("# Title\n\nno markers\n", "# Title\n" + page.README_START + "\n"):
        readme.write_text(text)
        assert page.main([str(results_path), "--readme", str(readme)]) == 2
        assert readme.read_text() == text
        assert "results block: needs one line '<!-- results: written by" in capsys.readouterr().err


def test_settle_runs_the_program_back_to_back_on_a_gpu_alone():
    """On a GPU, `timing.settle` keeps calling the program, a batch of `reps` at a time,
    until its seconds have passed; off a GPU (interpreted kernels) it calls nothing."""
    calls = []

    def launch(i):
        calls.append(i)
        time.sleep(0.001)
        return i

    start = time.monotonic()
    made = timing.settle(launch, reps=3, seconds=0.05, on_gpu=True)
    assert time.monotonic() - start >= 0.05
    assert made == len(calls) and made >= 3 and made % 3 == 0
    assert calls == list(range(made))
    calls.clear()
    assert timing.settle(launch, reps=3, seconds=0.05, on_gpu=False) == 0 and not calls
    assert timing.settle(launch, reps=3, seconds=0.0, on_gpu=True) == 0 and not calls
