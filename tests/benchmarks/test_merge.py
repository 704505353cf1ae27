"""`python -m benchmarks merge`: parts of one table, measured in separate runs, merged."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import compare, merge, op

SHAPE = "1x2x16x2x16"


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """A real results.json from the CPU: the xla path, bf16 with both bias dtypes."""
    out = tmp_path_factory.mktemp("run")
    status = op.main(
        ["--shapes", SHAPE, "--dtypes", "bf16", "--bias-dtypes", "f32,input", "--impls", "xla",
         "--iters", "1", "--reps", "1", "--warmup", "1", "--out", str(out), "--commit", "abc1234"])
    assert status == 0
    return json.loads((out / "results.json").read_text())


def _parts(measured):
    """Part A measured both cases but ran out of budget in the bf16-bias one; part B,
    later, measured only that case, with one more implementation."""
    part_a = copy.deepcopy(measured)
    part_a["metadata"]["date_utc"] = "2026-01-01 10:00 UTC"
    cut = part_a["cases"][1]
    assert cut["bias_dtype"] == "bf16"
    cut["impls"]["xla"]["fwd_bwd"] = {"status": "skipped: time budget"}
    part_b = copy.deepcopy(measured)
    part_b["metadata"]["date_utc"] = "2026-01-01 10:09 UTC"
    part_b["metadata"]["impls"] = ["xla", "extra_impl"]
    part_b["cases"] = [copy.deepcopy(measured["cases"][1])]
    part_b["cases"][0]["impls"]["extra_impl"] = copy.deepcopy(part_b["cases"][0]["impls"]["xla"])
    return part_a, part_b


def test_merge_takes_each_case_whole_from_the_part_that_ran_most(measured):
    part_a, part_b = _parts(measured)
    merged = merge.merge([("a.json", part_a), ("b.json", part_b)])
    assert [merge.case_key(c) for c in merged["cases"]] == [
        (SHAPE, "bf16", "f32"), (SHAPE, "bf16", "bf16")]
    first, second = merged["cases"]
    assert first["impls"]["xla"] == part_a["cases"][0]["impls"]["xla"]
    # An implementation that part A did not run is a column all the same, skipped.
    assert {cell["status"] for mode, cell in first["impls"]["extra_impl"].items()
            if mode != "info"} == {"skipped: not in the part this case comes from"}
    assert second == part_b["cases"][0]  # the whole case, both impls
    meta = merged["metadata"]
    assert meta["impls"] == ["xla", "extra_impl"]
    assert meta["date_utc"] == "2026-01-01 10:00 UTC to 2026-01-01 10:09 UTC"
    assert [(p["part"], p["cases"]) for p in meta["merged_from"]] == [
        ("a.json", [[SHAPE, "bf16", "f32"]]), ("b.json", [[SHAPE, "bf16", "bf16"]])]
    # A later part that measured less does not replace a case that ran whole.
    worse = copy.deepcopy(part_a)
    worse["cases"][0]["impls"]["xla"]["fwd"] = {"status": "error: out of memory"}
    again = merge.merge([("a.json", part_a), ("b.json", part_b), ("c.json", worse)])
    assert again["cases"][0]["impls"]["xla"] == part_a["cases"][0]["impls"]["xla"]


def test_merge_refuses_parts_of_other_commits_or_devices(measured):
    part_a, part_b = _parts(measured)
    for key, value in (("commit", "fffffff"), ("device_kind", "NVIDIA A100"),
                       ("jax_version", "0.0.1")):
        other = copy.deepcopy(part_b)
        other["metadata"][key] = value
        with pytest.raises(ValueError, match=key):
            merge.merge([("a.json", part_a), ("b.json", other)])


def test_merge_command_writes_a_table_that_compare_reads(measured, tmp_path, capsys):
    part_a, part_b = _parts(measured)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, (part_a, part_b)):
        path.write_text(json.dumps(part))
    out = tmp_path / "merged"
    assert merge.main([str(p) for p in paths] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"# {paths[0]} (2026-01-01 10:00 UTC): 1 cases" in printed
    table = (out / "results.md").read_text()
    assert "commit abc1234 · 2026-01-01 10:00 UTC to 2026-01-01 10:09 UTC" in table
    assert "skipped: time budget" not in table
    # Against part A, the merged file has the cut cell running again.
    assert compare.main([str(paths[0]), str(out / "results.json"), "--impl", "xla"]) == 0
    assert "xla 1x2x16x2x16 bf16 bias bf16 f+b: skipped: time budget ->" in capsys.readouterr().out
    bad = tmp_path / "other.json"
    other = copy.deepcopy(part_b)
    other["metadata"]["commit"] = "fffffff"
    bad.write_text(json.dumps(other))
    assert merge.main([str(paths[0]), str(bad), "--out", str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()
