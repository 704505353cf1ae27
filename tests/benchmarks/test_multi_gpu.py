"""`python -m benchmarks multi-gpu` on 2 simulated CPU devices (and, marked gpu, on the
visible GPUs): it runs, its numbers are consistent, and what it reports about the
sharded programs is true (an all-reduce exactly where the MSA rows are sharded, in
float32 and bias-shaped for the op; gradients equal to one device's)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "benchmarks", "multi-gpu"]
# B = 2 = the device count: the batch rows then share the one-device program.
SHAPE = (2, 4, 16, 2, 8)
SHAPE_TEXT = "x".join(map(str, SHAPE))


def run_bench(out_dir, *args, devices=2) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [*COMMAND, "--out", str(out_dir), "--shapes", SHAPE_TEXT,
         "--iters", "1", "--samples", "1", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out_dir / "results.json") as f:
        return json.load(f)


def check_row(row, devices):
    assert row["error"] is None, row["error"]
    assert row["devices"] == devices
    for key in ("one_ms", "sharded_ms"):
        assert row[key] > 0, (key, row)
    assert row["speedup"] == pytest.approx(row["one_ms"] / row["sharded_ms"])
    assert row["efficiency"] == pytest.approx(row["speedup"] / devices)
    assert set(row["collectives"]) == {
        "all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"}


def test_op_through_the_kernels(tmp_path):
    """The op with a bf16 bias through the Pallas kernels (interpret mode),
    MSA rows sharded: no data moved, one float32 bias-shaped all-reduce (the
    bias gradient's sum over the devices), and the gradients within one
    bfloat16 spacing (2^-7 relative) of one device's."""
    result = run_bench(tmp_path, "--variants", "op-bias-in-dtype", "--axes", "rows",
                       "--implementation", "pallas")
    assert result["meta"]["devices"] == 2 and result["meta"]["implementation"] == "pallas"
    (row,) = result["rows"]
    B, S, N, H, d = SHAPE
    check_row(row, 2)
    assert row["dims"] == list(SHAPE) and row["axis"] == "rows"
    moved = {k: v for k, v in row["collectives"].items() if k != "all-reduce" and v}
    assert not moved, moved
    assert row["collectives"]["all-reduce"] == 1
    assert row["collective_shapes"] == [f"f32[{B},{H},{N},{N}] all-reduce"]
    assert row["dbias_max_rel"] <= 2.0**-7, row["dbias_max_rel"]
    assert row["grads_max_rel"] <= 2.0**-7, row["grads_max_rel_by_name"]
    assert set(row["grads_max_rel_by_name"]) == {"['dq']", "['dk']", "['dv']", "['dbias']"}
    table = (tmp_path / "results.md").read_text()
    assert f"| {SHAPE_TEXT} | op-bias-in-dtype | rows |" in table


def test_layer_head_parallel(tmp_path):
    """The Flax layer with its projections split by head (plain-jnp path: the
    kernels' program is the op test's): runs, all-reduces, and its pair-input
    gradient stays within bf16 rounding of one device's. The parameter
    gradients are Flax's bf16 Dense backward, each device's partial sums
    rounded to bf16 before the sum: a few 1e-2 of their largest entry."""
    result = run_bench(tmp_path, "--variants", "layer", "--axes", "heads")
    (row,) = result["rows"]
    assert row["axis"] == "heads"
    check_row(row, 2)
    assert row["collectives"]["all-reduce"] >= 1, row["collective_shapes"]
    assert row["dbias_max_rel"] <= 2e-2, row["dbias_max_rel"]
    assert row["grads_max_rel"] <= 1e-1, row["grads_max_rel_by_name"]
    names = row["grads_max_rel_by_name"]
    assert "['dpair']" in names and "['dparams']['query']['kernel']" in names
    assert "| layer | heads |" in (tmp_path / "results.md").read_text()


def test_bad_arguments(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    for args in (["--axes", "rows,columns", "--variants", "op", "--shapes", "1x2x3"],):
        proc = subprocess.run(
            [*COMMAND, "--out", str(tmp_path), *args],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode != 0 and ("expected" in proc.stderr), (args, proc.stderr[-500:])


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2, reason="needs two or more devices")
def test_multi_gpu_bench_on_gpus(tmp_path):
    """A quick run on the visible GPUs (train shape, rows and heads): the
    kernels' rows run has one float32 all-reduce and the bias gradient of one
    GPU within a bfloat16 spacing, and sharding the rows is faster than one GPU."""
    from benchmarks import multi_gpu

    rows = multi_gpu.main([
        "--out", str(tmp_path), "--shapes", "train", "--axes", "rows,heads",
        "--variants", "op-bias-in-dtype", "--iters", "5", "--samples", "3",
    ])
    devices = jax.device_count()
    for row in rows:
        check_row(row, devices)
        assert row["dbias_max_rel"] <= 2.0**-7, row
    by_axis = {r["axis"]: r for r in rows}
    assert all(s.startswith("f32[") for s in by_axis["rows"]["collective_shapes"])
    assert by_axis["rows"]["collectives"]["all-reduce"] >= 1
    assert by_axis["rows"]["speedup"] > 1.0, by_axis["rows"]
