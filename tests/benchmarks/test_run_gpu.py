"""benchmarks/run_gpu.sh: the tests' summary, tests that run out of GPU memory among xdist
workers, and the model benchmark.

The script runs here with `PYTHON` set to a stand-in (a shell script) that answers as
pytest would: with `-n` (the workers) it fails the tests it is told to fail, printing
pytest's short summary lines; alone it passes or fails as told. Nothing of jax runs."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

OOM = "tests/kernels/triton/test_gpu_reliability.py::test_n4096_s128"
OOM_PARAM = "tests/kernels/triton/test_gpu.py::test_dq_dbias_fused_and_separate[shape2-fused-f32]"
OTHER = "tests/kernels/mosaic/test_gpu.py::test_forward[train]"

# `-m pytest` with `-n`: records its arguments, and every id in $FAIL_AMONG_WORKERS fails
# (OOM ids out of memory);
# without `-n`: fails when $FAIL_ALONE is set, and records its arguments.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then echo "python (stand-in)"; exit 0; fi
if [[ $1 == -m && $2 == pytest ]]; then
    if [[ " $* " == *" -n "* ]]; then
        echo "$*" > "$WORKER_ARGS"
        for id in $FAIL_AMONG_WORKERS; do
            if [[ $id == *OOM:* ]]; then
                echo "FAILED ${id#OOM:} - jaxlib._jax.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.03GiB."
            else
                echo "FAILED $id - AssertionError: rel err 0.3 > 2e-2"
            fi
        done
        echo "2 failed, 200 passed in 400.0s"
        exit 1
    fi
    echo "$*" > "$ALONE_ARGS"
    if [[ -n ${FAIL_ALONE:-} ]]; then echo "FAILED x - boom"; echo "1 failed, 1 passed in 80.0s"; exit 1; fi
    echo "2 passed in 85.0s"
    exit 0
fi
if [[ $1 == -m && $2 == benchmarks ]]; then
    echo "PYTHONPATH=$PYTHONPATH $*" > "$RECORD_BENCH"; exit 0
fi
exit 0
"""


def run_script(tmp_path, fail_among_workers, fail_alone=False, **env_extra):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PYTHON=str(fake), TEST_WORKERS="8", BENCH="0", LAYER_BENCH="0",
               CHECK_ALTERNATIVES="0", WHEEL_DIR=str(tmp_path / "no_wheels"),
               FAIL_AMONG_WORKERS=" ".join(fail_among_workers),
               ALONE_ARGS=str(tmp_path / "alone_args"), WORKER_ARGS=str(tmp_path / "worker_args"),
               RECORD_BENCH=str(tmp_path / "bench_args"),
               PATH=f"{tmp_path}:{os.environ['PATH']}", **env_extra)
    env.pop("FAIL_ALONE", None)
    if fail_alone:
        env["FAIL_ALONE"] = "1"
    result = subprocess.run(["bash", str(ROOT / "benchmarks/run_gpu.sh"), str(tmp_path / "out")],
                            env=env, capture_output=True, text=True, timeout=120)
    alone = tmp_path / "alone_args"
    return result, (alone.read_text().split() if alone.exists() else None)


def test_the_summary_names_every_test(tmp_path):
    """pytest runs with -rA, so that a run cut short by TEST_TIMEOUT still lists the
    tests that passed, not only those that failed."""
    run_script(tmp_path, [OTHER])
    assert "-rA" in (tmp_path / "worker_args").read_text().split()


def test_out_of_memory_failures_pass_alone(tmp_path):
    result, alone = run_script(tmp_path, [f"OOM:{OOM}", f"OOM:{OOM_PARAM}"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert OOM in alone and OOM_PARAM in alone and "-n" not in alone
    assert "2 out of memory among the workers, alone: 2 passed" in result.stdout
    assert "tests: passed" in result.stdout


def test_out_of_memory_failures_that_fail_alone_still_fail(tmp_path):
    result, alone = run_script(tmp_path, [f"OOM:{OOM}"], fail_alone=True)
    assert result.returncode == 1
    assert alone is not None and OOM in alone
    assert "tests: FAILED" in result.stdout


@pytest.mark.parametrize("fail_alone", [False, True])
def test_another_failure_keeps_the_run_failed(tmp_path, fail_alone):
    result, alone = run_script(tmp_path, [f"OOM:{OOM}", OTHER], fail_alone=fail_alone)
    assert result.returncode == 1
    assert alone is not None and OOM in alone and OTHER not in alone
    assert f"FAILED {OTHER}" in result.stdout


def test_no_out_of_memory_failure_runs_nothing_again(tmp_path):
    result, alone = run_script(tmp_path, [OTHER])
    assert result.returncode == 1
    assert alone is None
    assert "alone:" not in result.stdout


def test_model_benchmark_runs_when_asked(tmp_path):
    result, _ = run_script(tmp_path, [], MODEL_BENCH="1", TESTS="0",
                           MODEL_ARGS="--blocks evoformer --budget 500")
    assert result.returncode == 0, result.stdout[-3000:]
    recorded = (tmp_path / "bench_args").read_text().split()
    assert recorded[1:4] == ["-m", "benchmarks", "model"]
    assert recorded[4:] == ["--out", str(tmp_path / "out" / "model"), "--blocks", "evoformer",
                            "--budget", "500"]
    assert "model benchmark: exit 0" in result.stdout


def test_model_benchmark_is_off_by_default(tmp_path):
    result, _ = run_script(tmp_path, [], TESTS="0")
    assert result.returncode == 0
    assert not (tmp_path / "bench_args").exists()
    assert "model benchmark" not in result.stdout
