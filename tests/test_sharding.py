"""The op under `jax.jit` with sharded inputs, on 8 simulated CPU devices.

XLA's device count is fixed when JAX initialises, so the cases run in one
subprocess (`sharding_worker.py`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`), once per test session,
and each test here checks one case's record:

- the forward and every gradient equal the unsharded run (one device, nothing
  partitioned) to float32 rounding: the bias gradient is summed over the MSA
  rows of every shard, so an S-sharded run that forgot the psum would be off
  by a factor of the shard count;
- the compiled, partitioned program moves no data: no all-gather, all-to-all
  or collective-permute at all (so q, k, v, gate, mask and bias are never
  gathered), and its only all-reduces are bias-shaped (`[..., N, N]`, the
  bias gradient's psum over the devices that share MSA rows), present exactly
  when S is sharded;
- the output is sharded like q and the bias gradient like the bias;
- two runs of the compiled program are bitwise equal.

`implementation="pallas"` runs the kernels in interpret mode here, but the
sharding mechanism is the one the GPU uses: the kernels are
`custom_partitioning` ops (Auto mesh axes) or run under `shard_map` (Explicit
axes, and `msa_pallas.sharding.sharded_msa_row_attention`), so each device's
program is the kernel on its own shard whichever way the kernel lowers.
Sharding N (the residue axis) is not supported without data movement: that
case checks only that the partitioner gathers and the results stay right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sharding_worker

HERE = os.path.dirname(os.path.abspath(__file__))
N_RES = sharding_worker.SHAPE[2]
GATHERS = {"pallas-residues", "pallas-uneven-rows"}  # expected to move data


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharding") / "records.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharding_worker.py"), str(path)],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(path) as f:
        return json.load(f)


def _expected_specs(spec_axes, options):
    """The specs of the inputs' placement (an extra leading None under vmap)."""
    specs = sharding_worker.msa_partition_specs(**spec_axes)
    lead = (None,) if options.get("vmap") else ()
    return tuple(
        sharding_worker._spec_entries(sharding_worker.P(*lead, *spec))
        for spec in (specs.rows, specs.bias)
    )


def _normalise(entries):
    """"rows" and ["rows"] name the same sharding."""
    return [e[0] if isinstance(e, list) and len(e) == 1 else e for e in entries]


@pytest.mark.parametrize("case", list(sharding_worker.CASES))
def test_sharded_matches_unsharded(case, records):
    implementation, _, spec_axes, options = sharding_worker.CASES[case]
    record = records[case]
    assert record["error"] is None, record["error"]
    tol = 1e-6 if implementation == "pallas" else 1e-5
    bad = {n: e for n, e in record["errors"].items() if not e <= tol}
    assert not bad, f"{case}: relative errors against the unsharded run above {tol}: {bad}"
    expected = {"out", "dq", "dk", "dv", "dbias"} | ({"dgate"} if options.get("gate", True) else set())
    assert set(record["errors"]) == expected
    assert record["deterministic"], f"{case}: two runs of the compiled program differ"


@pytest.mark.parametrize("case", [c for c in sharding_worker.CASES if c not in GATHERS])
def test_no_gather_and_bias_gradient_psum(case, records):
    _, _, spec_axes, options = sharding_worker.CASES[case]
    record = records[case]
    assert record["error"] is None, record["error"]
    assert record["moved"] == [], f"{case}: the partitioned program moves data: {record['moved']}"
    reduced = record["reduced"]
    for entry in reduced:
        shape = entry.split("[")[1].split("]")[0].split(",")
        assert shape[-2:] == [str(N_RES)] * 2, f"{case}: a non-bias all-reduce: {entry}"
    rows_sharded = spec_axes.get("row_axis") is not None
    if rows_sharded:
        assert reduced, f"{case}: S is sharded but the bias gradient is never summed across shards"
    else:
        assert reduced == [], f"{case}: S is not sharded, yet: {reduced}"


@pytest.mark.parametrize("case", [c for c in sharding_worker.CASES if c not in GATHERS])
def test_results_stay_sharded(case, records):
    _, _, spec_axes, options = sharding_worker.CASES[case]
    record = records[case]
    assert record["error"] is None, record["error"]
    rows, bias = _expected_specs(spec_axes, options)
    assert _normalise(record["out_spec"]) == _normalise(rows), (case, record["out_spec"], rows)
    assert _normalise(record["dbias_spec"]) == _normalise(bias), (case, record["dbias_spec"], bias)


def test_residue_sharding_is_gathered_not_wrong(records):
    """N cannot be split (each query needs every key): the partitioner gathers
    it. The results above stay equal to the unsharded run."""
    record = records["pallas-residues"]
    assert record["error"] is None, record["error"]
    assert any("all-gather" in m for m in record["moved"])


def test_export_of_a_sharded_step(records):
    """A step over `sharded_msa_row_attention` exports for 8 devices, survives
    serialisation and computes the unsharded results from sharded inputs.
    Plain jit of sharded inputs (custom_partitioning) cannot be serialised:
    its partitioning is a Python callback (documented limitation)."""
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    record = records["export"]
    assert record["error"] is None, record["error"]
    assert record["nr_devices"] == 8
    bad = {n: e for n, e in record["errors"].items() if not e <= 1e-6}
    assert not bad and len(record["errors"]) == 6, record["errors"]
    assert record["auto_error"] and "host_callbacks" in record["auto_error"], record["auto_error"]
