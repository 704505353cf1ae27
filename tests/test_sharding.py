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

With bfloat16 inputs and a bfloat16 bias (the `bf16_records` cases), the bias
gradient is summed over the devices in float32 and rounded once: the
partitioned program's all-reduce is float32, and the sharded gradient lies
within one bfloat16 rounding of the one-device float32 sum (see
`test_bf16_bias_gradient_is_rounded_once`). A negative control runs the kernels
as they were before that fix (the psum in bfloat16) and must fail both checks.

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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import sharding_bf16_worker
import sharding_worker

HERE = os.path.dirname(os.path.abspath(__file__))
N_RES = sharding_worker.SHAPE[2]
GATHERS = {"pallas-residues", "pallas-uneven-rows"}  # expected to move data


def _run_worker(path, names=()):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharding_worker.py"), str(path), *names],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("sharding") / "records.json")


@pytest.fixture(scope="module")
def bf16_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharding_bf16") / "records.json"
    return _run_worker(path, list(sharding_bf16_worker.BF16_CASES))


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


@pytest.mark.parametrize("case", list(sharding_worker.PROLOGUE_CASES))
def test_prologue_sharded_matches_unsharded(case, records):
    """The backward's prologue kernel (`kernels.triton.backward_prologue`) on
    each device's shard: the unsharded results, no data moved, no sum, `do`
    sharded like the cotangent; the queries masked too (the op's
    `mask_queries`) or not."""
    spec_axes, gated, mask_queries = sharding_worker.PROLOGUE_CASES[case]
    record = records[case]
    assert record["error"] is None, record["error"]
    # With the queries masked a dead row's dv is 0: no dead_dv.
    assert set(record["errors"]) == ({"do", "stats"} | ({"dgate"} if gated else set())
                                     | (set() if mask_queries else {"dead_dv"}))
    bad = {n: e for n, e in record["errors"].items() if not e <= 1e-6}
    assert not bad, f"{case}: relative errors against the unsharded run above 1e-6: {bad}"
    assert record["moved"] == [] and record["reduced"] == [], record
    rows, _ = _expected_specs(spec_axes, {})
    assert _normalise(record["do_spec"]) == _normalise(rows), (case, record["do_spec"], rows)


@pytest.mark.parametrize("case", list(sharding_worker.ROW_GROUP_PROLOGUE_CASES))
def test_prologue_tells_unread_rows_on_each_shard(case, records):
    """Told the Mosaic kernels' groups of rows (`row_group_tiles`), the
    prologue leaves the `do` and statistics of dead rows no kernel reads
    unwritten, and each device tells them on its own shard, as its kernels
    do: with S split over four devices (one row each) every dead row is
    left unwritten, where one device (groups of two rows) writes the dead
    rows that share a group with a live one, or that come before a batch
    element's last live row. Every row both runs wrote is the same, and
    the gate's gradient is written everywhere."""
    record = records[case]
    assert record["error"] is None, record["error"]
    dead = [list(row) for row in sharding_worker.ROW_GROUP_DEAD_ROWS]
    # Batch element 1's dead rows 2 and 3 are the group after its last live row.
    after_last_live = [[1, 2], [1, 3]]
    rows_split = "row_axis" in sharding_worker.ROW_GROUP_PROLOGUE_CASES[case]
    assert record["unwritten"]["one_device"] == after_last_live, record["unwritten"]
    assert record["unwritten"]["sharded"] == (dead if rows_split else after_last_live), record
    bad = {n: e for n, e in record["errors"].items() if not e <= 1e-6}
    assert not bad, f"{case}: relative errors against the unsharded run above 1e-6: {bad}"
    assert record["dgate_finite"] and record["moved"] == [], record


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


# --- bfloat16 bias gradient: summed in float32, rounded once -----------------------

BF16_REGRESSED = "bf16-rows-8-ways-bf16-psum"


def _check_rounded_once(label, reduced, report):
    """The checks shared by the CPU cases and the GPU test.

    `reduced`: the all-reduces of the partitioned HLO ("f32[...] all-reduce").
    `report`: `sharding_bf16_worker.rounding_report(sharded, single, exact)`.

    Criterion: with `exact` the one-device bias gradient summed in float32
    and not rounded, |sharded - exact| <= half a bfloat16 spacing at `exact`
    plus 1e-5 of max |exact| (the float32 partial sums add in another order on
    each device: 6e-8 relative per addition; this slack matters only for
    entries near zero). Rounding to nearest once gives
    exactly that; the one-device bfloat16 gradient meets it too, so the two
    are equal or adjacent bfloat16 numbers (at most one spacing apart, which
    is between 2^-8 and 2^-7 of their size: a fixed relative bound of 2^-8
    would fail on honest roundings just above a power of two). Bitwise
    equality is not required: it holds only when the float32 sums associate
    alike on both sides. A psum of bfloat16 partial sums rounds every
    device's partial sum and then their sum: where the partial sums cancel
    that lands many spacings off.
    """
    assert reduced, f"{label}: S is sharded but the bias gradient is never summed across devices"
    not_f32 = [e for e in reduced if not e.startswith("f32[")]
    assert not not_f32, f"{label}: the bias gradient is summed across devices in {not_f32}"
    assert report["single_steps"] <= 1.0, (label, "one-device gradient not rounded once", report)
    assert report["sharded_steps"] <= 1.0 and report["sharded_over_one"] == 0, (label, report)
    assert report["ulps_apart"] <= 1.0, (label, report)


@pytest.mark.parametrize("case", [c for c in sharding_bf16_worker.BF16_CASES if c != BF16_REGRESSED])
def test_bf16_bias_gradient_is_rounded_once(case, bf16_records):
    """bf16 q, k, v and bias on 8 devices: S alone over all 8 (plain jit, and
    `sharded_msa_row_attention`'s shard_map), and B, S and H over 2 each with
    the fused dq+dbias kernel: the psum is float32 and the sharded bias
    gradient is one bfloat16 rounding of the one-device float32 sum."""
    record = bf16_records[case]
    assert record["error"] is None, record["error"]
    assert record["moved"] == [], f"{case}: the partitioned program moves data: {record['moved']}"
    print(case, record["report"])
    _check_rounded_once(case, record["reduced"], record["report"])


def test_bf16_psum_negative_control(bf16_records):
    """The kernels patched back to a bias gradient in the bias dtype (the
    psum in bfloat16): both checks above must see it."""
    record = bf16_records[BF16_REGRESSED]
    assert record["error"] is None, record["error"]
    print(BF16_REGRESSED, record["report"])
    assert any(e.startswith("bf16[") for e in record["reduced"]), record["reduced"]
    assert record["report"]["sharded_over_one"] > 0, record["report"]
    with pytest.raises(AssertionError):
        _check_rounded_once(BF16_REGRESSED, record["reduced"], record["report"])


_GPU_REFERENCES = {}


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2, reason="needs two or more devices")
@pytest.mark.parametrize("shape", [(1, 16, 256, 8, 32), (2, 8, 200, 4, 16)])
@pytest.mark.parametrize("shard_map", [False, True], ids=["jit", "shard_map"])
def test_bf16_bias_gradient_on_gpus(shape, shard_map):
    """All visible GPUs, S sharded over them (N = 256, d = 32: the fused
    dq+dbias kernel; N = 200, d = 16: the separate dbias kernel), plain jit
    and shard_map: the rounded-once checks above, against one GPU."""
    devices = jax.devices()
    B, S, N, H, d = shape
    S = S * len(devices) // 2
    mesh = jax.make_mesh((len(devices),), ("rows",))
    inputs = sharding_worker.helpers.random_inputs(
        23, B, S, N, H, d, jnp.bfloat16, mask_rate=0.1, bias_dtype=jnp.bfloat16, gate=False
    )
    q, k, v, bias, mask, _, dout = inputs.args
    args = [q, k, v, bias, mask, dout]
    specs = sharding_worker.msa_partition_specs(row_axis="rows")
    placement = (specs.rows,) * 3 + (specs.bias, specs.mask, specs.rows)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, placement)]
    op = lambda *a: sharding_worker.msa_pallas.msa_row_attention(*a, implementation="pallas")
    attention = (
        sharding_worker.sharded_msa_row_attention(mesh, row_axis="rows", implementation="pallas")
        if shard_map else op
    )
    run = jax.jit(sharding_bf16_worker.bias_grad(attention))
    compiled, partitioned = sharding_bf16_worker.compile_with_partitioned_hlo(run.lower(*sharded))
    dbias = compiled(*sharded)
    if shape not in _GPU_REFERENCES:
        reference = jax.jit(sharding_bf16_worker.bias_grad(op))
        single = [jax.device_put(x, devices[0]) for x in args]
        as_f32 = single[:3] + [single[3].astype(jnp.float32)] + single[4:]
        _GPU_REFERENCES[shape] = (reference(*single), reference(*as_f32))
    single_dbias, exact = _GPU_REFERENCES[shape]
    report = sharding_bf16_worker.rounding_report(dbias, single_dbias, exact)
    print(shape, "shard_map" if shard_map else "jit", report)
    reduced = sharding_worker.result_shapes(partitioned, ("all-reduce", "reduce-scatter"))
    _check_rounded_once(f"{shape}", reduced, report)
    assert np.array_equal(np.asarray(dbias), np.asarray(compiled(*sharded)))
