"""The model benchmark (AlphaFold2's EvoformerIteration, unpatched against patched)
runs end to end on CPU at a tiny shape, stops at its budget and continues.

Speed is never asserted: on CPU the numbers say nothing."""

from __future__ import annotations

import json

import jax
import pytest

pytest.importorskip("alphafold.model.modules", reason="needs alphafold-colabfold (test extra)")

from benchmarks import model, runs  # noqa: E402

CPU_ONLY = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU smoke shape")


@CPU_ONLY
def test_model_benchmark_measures_each_pair_and_continues_after_its_budget(tmp_path, capsys):
    argv = ["--sizes", "16,24", "--msa-depth", "4", "--dtypes", "f32", "--blocks", "evoformer",
            "--modes", "inference", "--iters", "1", "--warmup", "0", "--compile-threads", "2",
            "--budget", "0", "--commit", "abc1234", "--out", str(tmp_path)]
    # The first block, N and dtype of a call always runs; the budget of 0 s stops the next.
    assert model.main(argv) == runs.EXIT_UNFINISHED
    first = json.loads((tmp_path / "results.json").read_text())
    assert first["meta"]["complete"] is False
    assert [(r["N"], r["variant"]) for r in first["rows"]] == [(16, "unpatched"), (16, "patched")]
    assert model.main(argv) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["complete"] is True and saved["meta"]["settings"]["compile_threads"] == 2
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in saved["meta"]["env"]  # what decides an OOM
    rows = saved["rows"]
    assert [(r["N"], r["variant"]) for r in rows] == [
        (16, "unpatched"), (16, "patched"), (24, "unpatched"), (24, "patched")]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["compile_s"] >= 0 for r in rows)
    # The patched block is AF2's own block on the fused op: float32 outputs agree.
    patched = [r for r in rows if r["variant"] == "patched"]
    assert all(r["rel_err_vs_unpatched"] < 1e-5 for r in patched), patched
    assert "| evoformer | 24 | 4 | f32 | inference |" in capsys.readouterr().out
