"""The benchmark scripts run on CPU (interpret mode) and report what they time.

Speed is never asserted here: on CPU the numbers say nothing. These tests
check that the scripts run end to end and that their timing loops count
calls correctly, so a GPU session does not discover a broken script."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_attention  # noqa: E402
import profile_kernels  # noqa: E402


class _CountingExecutable:
    """Stands in for `jax.jit(f)`: lowers and compiles to itself and records
    the argument of every call, so the timing loop's calls can be counted."""

    def __init__(self):
        self.calls = []
        self.compiled = jax.jit(lambda x: x * 2.0)

    def lower(self, *args):
        return self

    def compile(self):
        return self

    def memory_analysis(self):
        return None

    def __call__(self, x):
        self.calls.append(float(x[0]))
        return self.compiled(x)


def test_measure_times_batches_of_back_to_back_calls():
    executable = _CountingExecutable()
    arg_sets = [(jnp.arange(3.0) + i,) for i in range(3)]
    result, first = bench_attention.measure(executable, arg_sets, iters=4, warmup=2, reps=5)
    assert result["status"] == "ok", result
    assert len(result["times_ms"]) == 4
    assert all(t > 0 for t in result["times_ms"])
    assert result["min_ms"] <= result["median_ms"]
    # 2 warm-up calls, then 4 samples of 5 calls, rotating the three input sets.
    assert len(executable.calls) == 2 + 4 * 5
    assert executable.calls[2:8] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    assert jnp.array_equal(first, arg_sets[0][0] * 2.0)


def test_profile_kernels_runs_every_kernel(capsys):
    status = profile_kernels.main(
        ["--shapes", "tiny", "--dtypes", "bf16", "--reps", "1", "--samples", "1",
         "--tiles", "dbias=16x32x4x2;dkdv=16x16x2x1"]
    )
    assert status == 0
    lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    labels = [fields[2] for fields in lines]
    for name in ("forward", "backward_dkdv", "backward_dq", "backward_dbias",
                 "backward_dq_dbias", "op forward", "op forward+backward"):
        assert any(label.startswith(name) for label in labels), (name, labels)
    for candidate in ("backward_dbias KernelTiles(block_q=16, block_k=32, num_warps=4",
                      "backward_dkdv KernelTiles(block_q=16, block_k=16, num_warps=2"):
        assert sum(label.startswith(candidate) for label in labels) == 1, (candidate, labels)
    assert sum(label.endswith(" default") for label in labels) == 4, labels
    for fields in lines:
        assert float(fields[3]) > 0, fields  # a time, not an ERROR line


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU smoke shape")
def test_bench_attention_smoke(tmp_path):
    status = bench_attention.main(
        ["--shapes", "tiny", "--dtypes", "f32", "--impls", "msa_pallas,xla",
         "--iters", "1", "--reps", "2", "--out", str(tmp_path)]
    )
    assert status == 0
    table = (tmp_path / "results.md").read_text()
    assert "samples of 2 back-to-back calls" in table
    assert "msa_pallas" in table and "xla" in table


def _case(shape, dtype, times, memory=None, n_res=256):
    """A results.json case: {impl: (fwd ms, f+b ms)}, f+b memory in MB by impl."""
    memory = memory or {}
    return {
        "shape": shape, "dtype": dtype, "dims": {"B": 1, "S": 128, "N": n_res, "H": 8, "d": 32},
        "impls": {
            name: {
                "fwd": {"status": "ok", "median_ms": fwd},
                "fwd_bwd": {"status": "ok", "median_ms": fwd_bwd,
                            "temp_plus_output_bytes": memory.get(name, 0) * 1e6 or None},
            }
            for name, (fwd, fwd_bwd) in times.items()
        },
    }


def test_targets_table_compares_with_the_fastest_alternative():
    impls = ["msa_pallas", "xla", "cuequivariance", "tokamax_mosaic", "jax_mha_nobias"]
    cases = [
        _case("train", "bf16",
              {"msa_pallas": (0.1, 0.4), "xla": (0.6, 1.1), "cuequivariance": (0.2, 0.9),
               "tokamax_mosaic": (0.08, 0.5), "jax_mha_nobias": (0.01, 0.01)},
              memory={"msa_pallas": 100, "cuequivariance": 150}),
        _case("extra", "bf16", {"msa_pallas": (1.0, 1.0), "xla": (2.0, 2.0)}),
        _case("train", "f32", {"msa_pallas": (0.3, 1.6), "xla": (0.6, 1.5)}),
    ]
    results = {"metadata": {"impls": impls}, "cases": cases}
    rows = [line.split(" | ") for line in bench_attention.targets_table(results).splitlines()
            if line.startswith("| train")]
    by_target = {(row[1], row[2]): row for row in rows}
    # The reference point (no bias) is faster still, but never the yardstick.
    assert "tokamax_mosaic" in by_target["bf16", "fwd"][4]
    assert by_target["bf16", "fwd"][5] == "0.80×" and by_target["bf16", "fwd"][7] == "no |"
    assert "tokamax_mosaic" in by_target["bf16", "f+b"][4]
    assert by_target["bf16", "f+b"][5] == "1.25×" and by_target["bf16", "f+b"][7] == "no |"
    assert by_target["bf16", "f+b memory"][5] == "1.50×"
    assert by_target["bf16", "f+b memory"][7] == "yes |"
    # float32 is held against XLA's float32 with a goal of 1x.
    assert "xla" in by_target["f32", "fwd"][4] and by_target["f32", "fwd"][7] == "yes |"
    assert by_target["f32", "f+b"][7] == "no |"
    # Shapes outside SPEC §6's list are not targets in 16 bits.
    assert "| extra |" not in bench_attention.targets_table(results)
    assert len(rows) == 5


def test_targets_table_long_chain_row():
    """SPEC §6: forward and backward run at N = 4096 where XLA runs out of memory."""
    case = _case("1x128x4096x8x32", "f32", {"msa_pallas": (50.0, 310.0)}, {"msa_pallas": 2198},
                 n_res=4096)
    case["impls"]["xla"] = {"fwd": {"status": "OOM"}, "fwd_bwd": {"status": "OOM"}}
    other = _case("train", "f32", {"msa_pallas": (1, 1), "xla": (2, 2)})
    results = {"metadata": {"impls": ["msa_pallas", "xla"]}, "cases": [case, other]}
    rows = [line for line in bench_attention.targets_table(results).splitlines()
            if "N = 4096" in line]
    assert rows == ["| 1x128x4096x8x32 | f32 | f+b at N = 4096 | 310.0 ms, 2,198 MB | "
                    "OOM (xla) | – | runs | yes |"]
    case["impls"]["msa_pallas"]["fwd_bwd"] = {"status": "OOM"}
    assert bench_attention.targets_table(results).count("| runs | no |") == 1
