"""`python -m benchmarks compare` on synthetic results.json files, new format and old."""

from __future__ import annotations

import json

import pytest

from benchmarks import compare


def _cell(ms):
    """An ok cell of `ms` milliseconds, or a failed one when `ms` is a status string."""
    return {"status": ms} if isinstance(ms, str) else {"status": "ok", "median_ms": ms}


def _results(cases, commit):
    """A results.json: cases are (shape, dtype, bias dtype or None for the old format,
    {impl: (fwd, f+b)})."""
    out = []
    for shape, dtype, bias, impls in cases:
        case = {"shape": shape, "dtype": dtype,
                "impls": {name: {"fwd": _cell(fwd), "fwd_bwd": _cell(fwd_bwd), "info": {}}
                          for name, (fwd, fwd_bwd) in impls.items()}}
        if bias is not None:
            case["bias_dtype"] = bias
        out.append(case)
    return {"metadata": {"commit": commit, "device_kind": "H200", "date_utc": "today"},
            "cases": out}


@pytest.fixture
def runs(tmp_path):
    # OLD was written before the bias dtype was recorded: its bias had the input dtype.
    old = _results([
        ("train", "bf16", None, {"msa_pallas": (1.0, 2.0), "xla": (5.0, 9.0)}),
        ("long", "bf16", None, {"msa_pallas": (5.0, 10.0), "xla": (30.0, "OOM")}),
        ("finetune", "bf16", None, {"msa_pallas": (3.0, 6.0)}),
        ("train", "f32", None, {"msa_pallas": ("OOM", "OOM")}),
        ("extra", "bf16", None, {"msa_pallas": (2.0, 4.0)}),
    ], "aaa")
    new = _results([
        ("train", "bf16", "bf16", {"msa_pallas": (1.06, 2.5), "xla": (5.0, 9.0)}),
        ("long", "bf16", "bf16", {"msa_pallas": (4.0, "OOM"), "xla": (30.0, 60.0)}),
        ("train", "bf16", "f32", {"msa_pallas": (1.0, 2.0)}),
        ("train", "f32", "f32", {"msa_pallas": ("OOM", "OOM")}),
        ("extra", "bf16", "bf16", {"msa_pallas": (2.08, 4.0)}),
    ], "bbb")
    paths = tmp_path / "old.json", tmp_path / "new.json"
    for path, results in zip(paths, (old, new)):
        path.write_text(json.dumps(results))
    return paths


def _sections(text: str) -> dict[str, list[str]]:
    """The report's sections: {first word of the heading: the lines under it}."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith("  "):
            found[current].append(line.strip())
        else:
            current = line.split(" (")[0].split(":")[0]
            found[current] = []
    return found


def test_compare_finds_regressions_and_lists_the_rest(runs, capsys):
    assert compare.main([str(runs[0]), str(runs[1])]) == 1
    out = capsys.readouterr().out
    sections = _sections(out)
    # A failure now counts as a regression and comes first; then the slowdowns, down to
    # the default threshold's 5% (+6% is one, +4% is not).
    assert sections["regressed"] == [
        "msa_pallas long bf16 bias bf16 f+b: 10 ms -> OOM",
        "msa_pallas train bf16 bias bf16 f+b: 2 ms -> 2.5 ms (+25.0%)",
        "msa_pallas train bf16 bias bf16 fwd: 1 ms -> 1.06 ms (+6.0%)",
    ]
    assert sections["improved"] == ["msa_pallas long bf16 bias bf16 fwd: 5 ms -> 4 ms (-20.0%)"]
    assert sections["only in OLD"] == ["msa_pallas finetune bf16 bias bf16 fwd",
                                       "msa_pallas finetune bf16 bias bf16 f+b"]
    assert sections["only in NEW"] == ["msa_pallas train bf16 bias f32 fwd",
                                       "msa_pallas train bf16 bias f32 f+b"]
    assert "within 5%: 2; failing in both: 2" in out  # extra +4% and +0%; train f32
    assert out.rstrip().endswith("# 3 regressed")
    assert "commit aaa" in out and "commit bbb" in out


def test_compare_threshold_and_impl(runs, capsys):
    # At 30% the +25% is no regression, but the OOM still is.
    assert compare.main([str(runs[0]), str(runs[1]), "--threshold", "0.3"]) == 1
    sections = _sections(capsys.readouterr().out)
    assert sections["regressed"] == ["msa_pallas long bf16 bias bf16 f+b: 10 ms -> OOM"]
    assert sections["improved"] == []
    # xla's f+b at long ran out of memory before and runs now: an improvement only.
    assert compare.main([str(runs[0]), str(runs[1]), "--impl", "xla"]) == 0
    out = capsys.readouterr().out
    assert _sections(out)["improved"] == ["xla long bf16 bias bf16 f+b: OOM -> 60 ms"]
    assert out.rstrip().endswith("# no regression")


def test_compare_same_file_and_bad_input(runs, tmp_path, capsys):
    assert compare.main([str(runs[1]), str(runs[1])]) == 0
    assert "within 5%: 7; failing in both: 3" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert compare.main([str(runs[0]), str(bad)]) == 2
    with pytest.raises(SystemExit):
        compare.main([str(runs[0]), str(runs[1]), "--threshold", "2"])
