"""The op benchmark, the layer benchmark and the profiling tools run on CPU (interpret mode).

Speed is never asserted here: on CPU the numbers say nothing. These tests
check that the scripts run end to end, that they measure every case they
should (shapes, dtypes, bias dtypes, padded masks), that their timing loops
count calls correctly and that their tables judge the targets right, so a GPU
session does not discover a broken script."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_pallas
from benchmarks import alternatives, measure, report, shapes
from benchmarks import layer, op, runs, timing
from benchmarks.profiling import backward as profile_backward
from benchmarks.profiling import durations as launch_durations
from benchmarks.profiling import forward as profile_forward
from benchmarks.profiling import kernels as profile_kernels
from benchmarks.profiling import launch as profile_launch
from benchmarks.profiling import timeline as profile_timeline
from benchmarks.profiling import variants as profile_variants

CPU_ONLY = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU smoke shape")


# --- shapes, masks, inputs ---------------------------------------------------------


def test_shapes_cover_every_attention_shape_that_matters():
    expected = {"seed": (2, 8, 32, 4, 16), "train": (1, 128, 256, 8, 32),
                "finetune": (1, 512, 384, 8, 32), "extra": (1, 1024, 384, 8, 8),
                "long": (1, 512, 1024, 8, 32), "longer": (1, 128, 2048, 8, 32),
                "train_padded": (1, 128, 256, 8, 32), "extra_padded": (1, 1024, 384, 8, 8),
                "long_padded": (1, 512, 1024, 8, 32)}
    for name, dims in expected.items():
        assert shapes.SHAPES[name].dims == dims and shapes.DIMS[name] == dims
    assert set(shapes.GPU_DEFAULT_SHAPES) == set(expected) - {"seed"}
    assert all(shapes.SHAPES[name].mask == "padded"
               for name in ("train_padded", "extra_padded", "long_padded"))
    # The GPU tests' shapes: the table's, long and longer cut to 16 MSA rows.
    assert shapes.GPU_TEST_DIMS["long-S16"] == (1, 16, 1024, 8, 32)
    assert shapes.GPU_TEST_DIMS["longer-S16"] == (1, 16, 2048, 8, 32)
    assert shapes.parse_shape("1x2x40x2x8:padded") == shapes.Shape(
        "1x2x40x2x8:padded", (1, 2, 40, 2, 8), "padded")
    assert shapes.parse_shape("1x2x40x2x8").mask == "random"
    for bad in ("nope", "1x2x3x4", "1x2x40x2x8:half"):
        with pytest.raises(ValueError):
            shapes.parse_shape(bad)


def test_padded_mask_masks_a_quarter_of_residues_and_of_rows():
    shape = shapes.SHAPES["train_padded"]
    mask = np.asarray(shapes.make_mask(shape, measure.input_key(0)))
    assert mask.shape == (1, 128, 256) and mask.dtype == bool
    rows, residues = shapes.padding_sizes(shape)
    assert (rows, residues) == (96, 192)
    assert not mask[:, :, 192:].any()  # padding residues: masked in every row
    assert not mask[:, 96:, :].any()  # padding rows: every key masked
    assert mask[:, :96, :192].all()  # the real alignment: every key kept
    assert measure.kept_fraction(mask) == pytest.approx(0.75 * 0.75)
    random = np.asarray(shapes.make_mask(shapes.SHAPES["train"], measure.input_key(0)))
    assert 0.88 < random.mean() < 0.92 and random[:, 96:, 192:].any()


@pytest.mark.parametrize("name, rows, residues", [
    ("extra_padded", 256, 384),   # three quarters of the 1,024 rows padding
    ("long_padded", 512, 922),    # a tenth of the 1,024 residues padding
])
def test_padded_shapes_have_their_own_padding(name, rows, residues):
    shape = shapes.SHAPES[name]
    assert shapes.padding_sizes(shape) == (rows, residues)
    mask = np.asarray(shapes.make_mask(shape, measure.input_key(0)))
    assert mask[:, :rows, :residues].all() and not mask[:, rows:].any()
    assert not mask[:, :, residues:].any()
    with pytest.raises(ValueError, match="padding"):
        shapes.Shape("bad", (1, 2, 8, 1, 8), mask="padded", padding=(1.0, 0.0))


def test_bias_dtypes_per_input_dtype():
    assert shapes.bias_dtype_names("bf16", ["f32", "input"]) == ["f32", "bf16"]
    assert shapes.bias_dtype_names("f16", ["input"]) == ["f16"]
    assert shapes.bias_dtype_names("f32", ["f32", "input"]) == ["f32"]
    with pytest.raises(ValueError):
        shapes.bias_dtype_names("bf16", ["f64"])
    args = op.parse_args(["--shapes", "tiny,train_padded", "--dtypes", "bf16,f32"])
    assert [case.key for case in op.cases(args)] == [
        "tiny/bf16/bias f32", "tiny/bf16/bias bf16",
        "train_padded/bf16/bias f32", "train_padded/bf16/bias bf16",
        "tiny/f32/bias f32", "train_padded/f32/bias f32"]
    with pytest.raises(SystemExit):
        op.parse_args(["--bias-dtypes", "f64"])


def test_input_sets_carry_the_bias_dtype_and_the_shape_mask():
    case = shapes.Case(shapes.parse_shape("1x4x16x2x8:padded"), "bf16", "f32")
    q, k, v, bias, mask, ct = measure.make_input_set(case, measure.input_key(0))
    assert q.dtype == k.dtype == v.dtype == ct.dtype == jnp.bfloat16
    assert bias.dtype == jnp.float32 and bias.shape == (1, 2, 16, 16)
    assert not bool(mask[:, 3:].any()) and not bool(mask[:, :, 12:].any())
    same = shapes.Case(case.shape, "bf16", "bf16")
    assert measure.make_input_set(same, measure.input_key(0))[3].dtype == jnp.bfloat16
    assert measure.input_set_bytes(case) - measure.input_set_bytes(same) == 2 * 2 * 16 * 16


def test_forward_check_leaves_out_padding_rows():
    reference = jnp.ones((1, 4, 3, 2, 2))
    out = reference.at[:, 3].set(7.0)  # another convention in the padding row
    assert measure.relative_error(out, reference) > 1.0
    rows = jnp.array([[True, True, True, False]])
    assert measure.relative_error(out, reference, rows) == 0.0
    assert measure.relative_error(out.at[0, 0, 0, 0, 0].set(2.0), reference, rows) > 0.0


# --- timing ----------------------------------------------------------------------


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
    result, first = measure.measure_callable(executable, arg_sets, iters=4, warmup=2, reps=5)
    assert result["status"] == "ok", result
    assert len(result["times_ms"]) == 4
    assert all(t > 0 for t in result["times_ms"])
    assert result["min_ms"] <= result["median_ms"]
    # Queuing a sample's calls is part of its time: never more than it.
    assert 0 < result["queued_ms"] <= result["median_ms"]
    # 2 warm-up calls, then 4 samples of 5 calls, rotating the three input sets.
    assert len(executable.calls) == 2 + 4 * 5
    assert executable.calls[2:8] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    assert jnp.array_equal(first, arg_sets[0][0] * 2.0)


def test_a_program_of_several_calls_makes_each_of_them():
    """`in_one_program`: the calls are not merged (they see the same inputs) and the
    program gives each call's outputs."""
    fn = jax.jit(lambda x, y: (jnp.cos(x) @ y, jnp.sin(y)))
    args = (jnp.arange(16.0).reshape(4, 4) / 7, jnp.eye(4) + 0.5)
    program = measure.in_one_program(fn, 3)
    hlo = program.lower(*args).compile().as_text()
    assert len(re.findall(r"\bcosine\(", hlo)) == 3, hlo
    assert len(re.findall(r"\bsine\(", hlo)) == 3, hlo
    outputs = program(*args)
    assert len(outputs) == 3
    for call in outputs:
        for got, want in zip(call, fn(*args)):
            np.testing.assert_array_equal(got, want)
    assert measure.in_one_program(fn, 1) is fn


def test_measure_divides_a_program_of_several_calls_into_calls():
    """calls > 1: each timed call is a program of that many, timed per call; the memory
    is a single call's."""
    fn = jax.jit(lambda x: jnp.cumsum(jnp.cos(x) * 3.0))
    arg_sets = [(jnp.linspace(0.0, 1.0, 4096) + i,) for i in range(2)]
    single, _ = measure.measure_callable(fn, arg_sets, iters=3, warmup=1, reps=2)
    several, out = measure.measure_callable(fn, arg_sets, iters=3, warmup=1, reps=2, calls=4)
    assert several["status"] == "ok", several
    assert 0 < several["queued_ms"] <= several["median_ms"]
    assert several["temp_plus_output_bytes"] == single["temp_plus_output_bytes"]
    np.testing.assert_array_equal(out, fn(*arg_sets[0]))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_case_compiles_every_cell_before_timing_one_when_asked(threads, monkeypatch):
    """compile_threads > 1: each cell's compile ends before any cell of the case is timed
    (no compile beside a timing), and the GPU is warmed up between; 1: each cell compiled
    just before it is timed. The cells come out the same either way."""
    events = []

    def logged(function, event):
        def call(*args, **kwargs):
            result = function(*args, **kwargs)
            events.append(event)
            return result
        return call

    # Every compile, ahead or not, ends in timing.compile_lowered.
    for name, event in (("compile_lowered", "compile"), ("times_ms", "time"),
                        ("warm_up_device", "warm up")):
        monkeypatch.setattr(timing, name, logged(getattr(timing, name), event))
    case = shapes.Case(shapes.parse_shape("1x2x16x2x8"), "f32", "f32")
    settings = measure.Settings(iters=1, warmup=1, reps=1, compile_threads=threads)
    record, done = measure.run_case(case, ["xla", "msa_pallas"], settings,
                                    runs.Progress(4))
    assert done == 2
    cells = [record["impls"][impl][mode] for impl in ("xla", "msa_pallas")
             for mode in measure.MODES]
    assert all(cell["status"] == "ok" and cell["compile_s"] > 0 for cell in cells), cells
    if threads > 1:
        # The GPU, idle while the cells compiled, warmed up before the first is timed.
        assert events == ["compile"] * 4 + ["warm up"] + ["time"] * 4, events
    else:
        assert events == ["compile", "time"] * 4, events


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


def test_profile_kernels_float32_products_and_op_tiles(capsys):
    """float32: the defaults in each --float32-products mode; a candidate
    without a products suffix in each mode, one with a suffix in its own; the
    op with --op-tiles beside the defaults."""
    status = profile_kernels.main(
        ["--shapes", "tiny", "--dtypes", "f32", "--reps", "1", "--samples", "1", "--skip-fused",
         "--float32-products", "tf32x3,bf16x6",
         "--tiles", "dq=16x16x4x1,16x16x2x1:bf16x6", "--op-tiles", "dq=16x16x4x1:bf16x6"]
    )
    assert status == 0
    lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    labels = [fields[2] for fields in lines]
    assert sum(label.endswith(" default") for label in labels) == 8, labels
    for products in ("tf32x3", "bf16x6"):
        assert sum(label.endswith(" default") and f"[{products}]" in label
                   for label in labels) == 4, labels
    dq = [label for label in labels if label.startswith("backward_dq KernelTiles(block_q=16")]
    assert sorted(label.split("float32_products=")[1] for label in dq) == [
        "'bf16x6')", "'bf16x6')", "'tf32x3')"], dq
    assert sum("num_warps=2" in label for label in dq) == 1, dq
    assert sum(label.startswith("op forward+backward, dq=16x16x4x1:bf16x6") for label in labels) == 1
    for fields in lines:
        assert float(fields[3]) > 0, fields


def test_profile_backward_compares_each_mosaic_kernel_with_triton(capsys):
    """The Mosaic backward kernels beside the Triton ones, in their interpreters (a float32 bias: the Mosaic interpreter hangs on the dbias
    kernel's two consumers with a 16-bit one, tests/test_mosaic_backward.py)."""
    status = profile_backward.main(
        ["--shapes", "1x2x128x1x32", "--bias-dtypes", "f32", "--reps", "1", "--samples", "1",
         "--no-op", "--ping-pong", "both"]
    )
    assert status == 0
    rows = [
        [field.strip() for field in line.strip("|").split("|")]
        for line in capsys.readouterr().out.splitlines()[2:]
    ]
    kernels = [row[3] for row in rows]
    assert kernels == [
        "triton dkdv", "triton dq", "triton dbias",
        "mosaic dkdv", "mosaic dkdv", "mosaic dq", "mosaic dq", "mosaic dbias",
    ], kernels
    for row in rows:
        assert float(row[5]) > 0, row  # a time, not a failure
        if row[3].startswith("mosaic"):
            assert float(row[7]) < 1e-3, row  # the same gradients as the Triton kernels


@CPU_ONLY
def test_profile_variants_times_each_mosaic_kernel_in_each_variant(capsys):
    """Each Mosaic kernel the op plans, alone, plain, skipping padding, with dropout and
    with both, in the interpreters; each variant's time with its ratio to plain."""
    status = profile_variants.main(["--shapes", "tiny", "--bias-dtypes", "f32", "--no-op"])
    assert status == 0
    header, _, *lines = capsys.readouterr().out.splitlines()
    assert header == ("| shape | dtype | bias | kernel | plain ms | skip ms | dropout ms "
                      "| dropout+skip ms |")
    rows = [[field.strip() for field in line.strip("|").split("|")] for line in lines]
    assert [row[3] for row in rows] == ["forward", "dkdv", "dq", "dbias"], rows
    for row in rows:
        assert row[0].startswith("tiny (kept 0.") and row[1:3] == ["bf16", "f32"], row
        assert float(row[4]) > 0, row  # a time, not a failure
        for cell in row[5:]:
            ms, ratio = cell.split(" (")
            assert float(ms) > 0 and ratio.endswith("×)"), row
    with pytest.raises(SystemExit):
        profile_variants.main(["--dtypes", "f32"])  # the Mosaic forward is 16-bit
    with pytest.raises(SystemExit):
        profile_variants.main(["--variants", "skip"])  # plain is the yardstick


@CPU_ONLY
def test_profile_variants_times_more_tiles_of_a_kernel(capsys):
    """`--tiles`: a named kernel also runs with each candidate, on rows of its own;
    `--kernel-options`: every kernel again with its planned tiles and the flags set."""
    status = profile_variants.main(["--shapes", "tiny", "--bias-dtypes", "f32", "--no-op",
                                    "--variants", "plain", "--tiles", "dkdv=64x64x2x1x0",
                                    "--kernel-options", "staggered_bias=0,mask_without_select=0"])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    kernels = [line.strip("|").split("|")[3].strip() for line in lines]
    other = "with staggered_bias=0,mask_without_select=0"
    assert kernels == ["forward", "dkdv", "dq", "dbias", "dkdv 64x64x2x1x0x0x1x1",
                       f"forward {other}", f"dkdv {other}", f"dq {other}", f"dbias {other}"], lines
    for line in lines[4:]:
        assert float(line.strip("|").split("|")[4]) > 0, line
    with pytest.raises(SystemExit):
        profile_variants.main(["--tiles", "dx=64x64x2x1"])
    # An option of the op's backward as a whole has no kernel alone to act on.
    with pytest.raises(SystemExit, match="prologue_kernel"):
        profile_variants.parse_tile_options("prologue_kernel=1")


def test_profile_forward_mosaic_candidates_alone(capsys):
    """`--skip-triton`: only the Mosaic candidates, each timed and checked
    against a float32 XLA forward, their residuals against the first's."""
    status = profile_forward.main(
        ["--shapes", "1x2x64x1x16", "--bias-dtypes", "f32", "--skip-triton",
         "--mosaic", "64x64x2x2,64x64x2x1"]
    )
    assert status == 0
    header, _, *lines = capsys.readouterr().out.splitlines()
    assert header.endswith("| residuals vs first candidate |"), header
    rows = [[field.strip() for field in line.strip("|").split("|")] for line in lines]
    assert [row[3] for row in rows] == ["mosaic", "mosaic"], rows
    for row in rows:
        assert float(row[5]) > 0 and float(row[6]) > 0, row  # times, not a failure
        assert float(row[8]) < 2e-2, row  # bf16 against the float32 forward
    assert float(rows[0][9]) == 0.0 and float(rows[1][9]) < 1e-4, rows


# --- the CLI ---------------------------------------------------------------------------


@CPU_ONLY
def test_op_measures_each_bias_dtype_padded(tmp_path, capsys, monkeypatch):
    seen = []  # the bias dtypes the xla adapter was traced with

    def spying_xla(case):
        built = alternatives.build_xla(case)
        op = lambda q, k, v, bias, mask: seen.append(bias.dtype) or built.fwd(q, k, v, bias, mask)  # noqa: E731
        return alternatives.jitted_pair(op)

    monkeypatch.setitem(alternatives.IMPLEMENTATIONS, "xla", spying_xla)
    status = op.main(
        ["--shapes", "1x4x64x2x16:padded", "--dtypes", "bf16", "--bias-dtypes", "f32,input",
         "--impls", "msa_pallas,xla", "--iters", "1", "--reps", "2", "--warmup", "1",
         "--out", str(tmp_path)])
    assert status == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["metadata"]["bias_dtypes"] == ["f32", "input"]
    padded = "1x4x64x2x16:padded"
    assert [(c["shape"], c["dtype"], c["bias_dtype"], c["mask"]) for c in results["cases"]] == [
        (padded, "bf16", "f32", "padded"), (padded, "bf16", "bf16", "padded")]
    for case in results["cases"]:
        assert case["kept_fraction"] == pytest.approx(0.5625)
        for impl in ("msa_pallas", "xla"):
            assert all(case["impls"][impl][m]["status"] == "ok" for m in measure.MODES), case
        assert case["impls"]["msa_pallas"]["fwd"]["rel_err_vs_xla"] < 3e-2
    assert {jnp.dtype(dtype).name for dtype in seen} == {"float32", "bfloat16"}
    # Not a terminal: no bar, one numbered line per result, naming the bias dtype.
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(log) == 8 and log[0].startswith("[1/8 ") and log[-1].startswith("[8/8 ")
    assert sum("bf16 bias  f32" in line for line in log) == 4
    assert sum("bf16 bias bf16" in line for line in log) == 4
    table = (tmp_path / "results.md").read_text()
    assert "samples of 2 back-to-back calls" in table
    assert f"| {padded} (1,4,64,2,16) | bf16 | f32 |" in table
    assert f"| {padded} (1,4,64,2,16) | bf16 | bf16 |" in table
    assert f"| {padded} | bf16 | bf16 | " in table  # the targets row
    assert f"- {padded} bf16 bias f32: 56% of keys kept, 1 MSA rows fully masked" in table


def test_prime_measures_the_first_case_once_more_and_drops_it(tmp_path, capsys, monkeypatch):
    traced = []  # the cases whose cells were built, in order

    def counting_xla(case):
        traced.append(case.key)
        return alternatives.build_xla(case)

    monkeypatch.setitem(alternatives.IMPLEMENTATIONS, "xla", counting_xla)
    argv = ["--shapes", "tiny", "--dtypes", "f32", "--bias-dtypes", "f32,input", "--impls", "xla",
            "--iters", "1", "--reps", "1", "--warmup", "1", "--compile-threads", "1"]
    assert op.main(argv + ["--prime", "--out", str(tmp_path / "primed")]) == 0
    first = traced[0]
    assert traced.count(first) == 2 and len(traced) == 2  # f32 inputs: one case
    results = json.loads((tmp_path / "primed" / "results.json").read_text())
    assert results["metadata"]["primed"] is True
    assert [measure.case_key(case) for case in results["cases"]] == [first]
    out = capsys.readouterr().out
    assert f"# primed: {first} measured once, dropped" in out
    # Only the measured cells are reported: one per mode.
    assert len([line for line in out.splitlines() if line.startswith("[")]) == len(measure.MODES)

    traced.clear()  # off a GPU the default is not to prime
    assert op.main(argv + ["--out", str(tmp_path / "plain")]) == 0
    assert traced == [first]
    assert "# primed" not in capsys.readouterr().out


def test_persistent_variant_makes_the_mosaic_dq_and_dkdv_tiles_persistent():
    """msa_pallas_persistent: the plan's own Mosaic backward tiles, dq's and dk/dv's
    persistent; a plan on the Triton backward keeps its config."""
    q = jax.ShapeDtypeStruct((1, 8, 256, 8, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 256, 256), jnp.float32)
    config = msa_pallas.default_block_config(256, 32, jnp.bfloat16, jnp.float32)
    plan = msa_pallas.explain(q, q, q, bias, implementation="mosaic")
    tiles = alternatives.persistent_backward_config(config, plan).mosaic_backward
    planned = dict(plan.backward_tiles)
    assert tiles.dq.persistent and tiles.dkdv.persistent and not tiles.dbias.persistent
    assert tiles.dq == dataclasses.replace(planned["dq"], persistent=True)
    assert tiles.dkdv == dataclasses.replace(planned["dkdv"], persistent=True)
    assert tiles.dbias == planned["dbias"] and tiles.ping_pong == plan.ping_pong
    triton = msa_pallas.explain(q, q, q, bias, implementation="triton")
    assert alternatives.persistent_backward_config(config, triton) is config
    variant = "msa_pallas_persistent"
    assert variant in alternatives.OWN_VARIANTS and variant in alternatives.IMPLEMENTATIONS
    assert variant not in alternatives.TABLE_IMPLEMENTATIONS


def _skipping_plan_at_n256(bias_dtype):
    """`(q, bias, mask, config, plan)` at B, S, N, H, d = 1, 8, 256, 8, 32, bf16 q and
    a `bias_dtype` bias: the default block config and the Mosaic plan skipping padding
    makes for an sm90 GPU."""
    q = jax.ShapeDtypeStruct((1, 8, 256, 8, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 256, 256), bias_dtype)
    mask = jax.ShapeDtypeStruct((1, 8, 256), jnp.bool_)
    config = msa_pallas.default_block_config(256, 32, jnp.bfloat16, bias_dtype)
    with msa_pallas.skipping_padding():
        plan = msa_pallas.dispatch.plan_call(q, q, q, bias, mask, implementation="mosaic",
                                             target=msa_pallas.dispatch.Target("gpu", 90))
    return q, bias, mask, config, plan


def test_skip_k64_variant_cuts_the_forward_and_dkdv_key_tiles_of_the_skipping_plan():
    """msa_pallas_skip_k64: the skipping plan's tiles (dq and dk/dv persistent), the
    forward's and dk/dv's cut to 64 keys; msa_pallas_skip_k64_dbias, the bias
    gradient's too; a plan on the Triton kernels keeps its config."""
    q, bias, mask, config, plan = _skipping_plan_at_n256(jnp.bfloat16)
    planned = dict(plan.backward_tiles)
    assert plan.forward_tiles.block_k == 128 and planned["dkdv"].block_k == 128
    narrowed = alternatives.narrow_key_tiles_config(config, plan)
    assert narrowed.mosaic_forward == dataclasses.replace(plan.forward_tiles, block_k=64)
    tiles = narrowed.mosaic_backward
    assert tiles.dkdv == dataclasses.replace(planned["dkdv"], block_k=64)
    assert tiles.dkdv.persistent and tiles.dq == planned["dq"] and tiles.dbias == planned["dbias"]
    assert tiles.ping_pong == plan.ping_pong
    triton = msa_pallas.explain(q, q, q, bias, mask, implementation="triton")
    assert alternatives.narrow_key_tiles_config(config, triton) is config
    variant = "msa_pallas_skip_k64"
    assert variant in alternatives.OWN_VARIANTS and variant in alternatives.IMPLEMENTATIONS
    assert variant not in alternatives.TABLE_IMPLEMENTATIONS
    # msa_pallas_skip_k64_dbias: the bias gradient's tiles cut too.
    every = alternatives.narrow_key_tiles_config(config, plan, ("forward", "dkdv", "dbias"))
    assert every.mosaic_forward == narrowed.mosaic_forward
    assert every.mosaic_backward.dkdv == tiles.dkdv and every.mosaic_backward.dq == planned["dq"]
    assert planned["dbias"].block_k == 128
    assert every.mosaic_backward.dbias == dataclasses.replace(planned["dbias"], block_k=64)
    backward_only = alternatives.narrow_key_tiles_config(config, plan, ("dbias",))
    assert backward_only.mosaic_forward == plan.forward_tiles
    assert backward_only.mosaic_backward.dkdv == planned["dkdv"]
    with pytest.raises(ValueError, match="dq"):
        alternatives.narrow_key_tiles_config(config, plan, ("dq",))
    variant = "msa_pallas_skip_k64_dbias"
    assert variant in alternatives.OWN_VARIANTS and variant in alternatives.IMPLEMENTATIONS
    assert variant not in alternatives.TABLE_IMPLEMENTATIONS


def test_mask_queries_variants():
    """msa_pallas_skip_mask_queries: the op with `mask_queries` inside
    `skipping_padding()`, its info saying so (the check's reference takes it too);
    msa_pallas_skip_mask_queries_q64: the skipping plan's forward and dq tiles cut to
    64 queries, the others as planned; a plan on the Triton kernels keeps its config."""
    q, bias, mask, config, plan = _skipping_plan_at_n256(jnp.float32)
    planned = dict(plan.backward_tiles)
    assert plan.forward_tiles.block_q == 128 and planned["dq"].block_q == 128
    narrowed = alternatives.narrow_query_tiles_config(config, plan)
    assert narrowed.mosaic_forward == dataclasses.replace(plan.forward_tiles, block_q=64)
    tiles = narrowed.mosaic_backward
    assert tiles.dq == dataclasses.replace(planned["dq"], block_q=64) and tiles.dq.persistent
    assert tiles.dkdv == planned["dkdv"] and tiles.dbias == planned["dbias"]
    assert tiles.prologue_kernel == plan.prologue_kernel
    triton = msa_pallas.explain(q, q, q, bias, mask, implementation="triton")
    assert alternatives.narrow_query_tiles_config(config, triton) is config
    with pytest.raises(ValueError, match="dkdv"):
        alternatives.narrow_query_tiles_config(config, plan, ("dkdv",))
    # msa_pallas_skip_mask_queries_narrow: both narrowings, the second on the first's.
    both = alternatives.narrow_query_tiles_config(
        alternatives.narrow_key_tiles_config(config, plan, ("forward", "dkdv", "dbias")), plan)
    assert both.mosaic_forward == dataclasses.replace(plan.forward_tiles, block_q=64, block_k=64)
    assert both.mosaic_backward.dq == tiles.dq
    for kernel in ("dkdv", "dbias"):
        assert getattr(both.mosaic_backward, kernel) == dataclasses.replace(
            planned[kernel], block_k=64)
    # The profiling commands' --narrow-keys / --narrow-queries ask for the same tiles.
    asked = alternatives.asked_block_config(
        q, bias, mask, implementation="mosaic", skip=True,
        narrow_key_tiles=("forward", "dkdv", "dbias"), narrow_query_tiles=("forward", "dq"))
    interpreted = msa_pallas.dispatch.plan_call(q, q, q, bias, mask, implementation="mosaic")
    assert asked.mosaic_forward == dataclasses.replace(
        interpreted.forward_tiles, block_q=64, block_k=64)
    assert asked.mosaic_backward.dq.block_q == 64 and asked.mosaic_backward.dbias.block_k == 64
    case = shapes.Case(shapes.parse_shape("1x4x64x2x16:padded"), "bf16", "f32")
    built = alternatives.IMPLEMENTATIONS["msa_pallas_skip_mask_queries"](case)
    assert built.info["masks_queries"] and built.info["skips_padding"]
    for variant in ("msa_pallas_skip_mask_queries", "msa_pallas_skip_mask_queries_q64",
                    "msa_pallas_skip_mask_queries_narrow"):
        assert variant in alternatives.OWN_VARIANTS and variant not in \
            alternatives.TABLE_IMPLEMENTATIONS


def test_lean_variant_sets_the_options_in_every_planned_mosaic_kernel():
    """msa_pallas_lean: the plan's own tiles, each Mosaic kernel's with
    `LEAN_OPTIONS` set; a plan on the Triton kernels keeps its config."""
    q = jax.ShapeDtypeStruct((1, 8, 256, 8, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 256, 256), jnp.float32)
    config = msa_pallas.default_block_config(256, 32, jnp.bfloat16, jnp.float32)
    plan = msa_pallas.dispatch.plan_call(q, q, q, bias, implementation="mosaic",
                                         target=msa_pallas.dispatch.Target("gpu", 90))
    options = alternatives.LEAN_OPTIONS
    lean = alternatives.kernel_options_config(config, plan, options)
    assert lean.mosaic_forward == dataclasses.replace(plan.forward_tiles, **options)
    planned = dict(plan.backward_tiles)
    for kernel in ("dkdv", "dq", "dbias"):
        tiles = getattr(lean.mosaic_backward, kernel)
        assert tiles == dataclasses.replace(planned[kernel], **options), kernel
        assert not tiles.staggered_bias and tiles.mask_without_select
    assert lean.mosaic_backward.ping_pong == plan.ping_pong
    # On tiles a config already sets (here the persistent dq and dk/dv), those are kept.
    persistent = alternatives.persistent_backward_config(config, plan)
    both = alternatives.kernel_options_config(persistent, plan, options).mosaic_backward
    assert both.dq == dataclasses.replace(persistent.mosaic_backward.dq, **options)
    assert both.dq.persistent and both.dkdv.persistent and not both.dkdv.staggered_bias
    triton = msa_pallas.explain(q, q, q, bias, implementation="triton")
    assert alternatives.kernel_options_config(config, triton, options) is config
    for variant in ("msa_pallas_lean", "msa_pallas_skip_lean"):
        assert variant in alternatives.OWN_VARIANTS and variant in alternatives.IMPLEMENTATIONS
        assert variant not in alternatives.TABLE_IMPLEMENTATIONS


def test_prologue_variants_set_the_prologue_kernel_and_keep_the_tiles():
    """msa_pallas_prologue asks for the prologue kernel where the plan (padding
    visited) has none; msa_pallas_skip_xla_prologue asks for XLA's passes
    where the plan (skipping) takes the kernel. Both keep the plan's tiles,
    every kernel's, and the op's plan then takes what they ask; options that
    are not the prologue's keep the plan's choice of it."""
    q = jax.ShapeDtypeStruct((1, 8, 256, 8, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 256, 256), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 8, 256), jnp.bool_)
    config = msa_pallas.default_block_config(256, 32, jnp.bfloat16, jnp.float32)
    target = msa_pallas.dispatch.Target("gpu", 90)
    for skip, asked_value in ((False, True), (True, False)):
        with msa_pallas.skipping_padding(skip):
            plan = msa_pallas.dispatch.plan_call(q, q, q, bias, mask, implementation="mosaic",
                                                 target=target)
            assert plan.prologue_kernel == skip
            asked = alternatives.kernel_options_config(
                config, plan, {"prologue_kernel": asked_value})
            assert asked.mosaic_forward is None, "the forward's tiles are not the option's"
            tiles = asked.mosaic_backward
            assert tiles.prologue_kernel == asked_value and tiles.ping_pong == plan.ping_pong
            assert dict(plan.backward_tiles) == {
                k: getattr(tiles, k) for k in ("dkdv", "dq", "dbias")}
            taken = msa_pallas.dispatch.plan_call(q, q, q, bias, mask, implementation="mosaic",
                                                  block_config=asked, target=target)
            assert taken.prologue_kernel == asked_value
            other = alternatives.kernel_options_config(
                config, plan, alternatives.MASK_WITH_SELECT_OPTIONS)
            assert other.mosaic_backward.prologue_kernel == skip
            assert dict(plan.backward_tiles)["dq"].mask_without_select
            assert not other.mosaic_backward.dq.mask_without_select
    assert alternatives.backward_options() == {"prologue_kernel"}
    for variant in ("msa_pallas_prologue", "msa_pallas_skip_xla_prologue",
                    "msa_pallas_mask_with_select", "msa_pallas_skip_mask_with_select"):
        assert variant in alternatives.OWN_VARIANTS and variant in alternatives.IMPLEMENTATIONS
        assert variant not in alternatives.TABLE_IMPLEMENTATIONS


# --- the targets table -------------------------------------------------------------------


def _case(shape, dtype, times, memory=None, n_res=256, bias=None, mask="random"):
    """A results.json case: {impl: (fwd ms, f+b ms)}, f+b memory in MB by impl."""
    memory = memory or {}
    return {
        "shape": shape, "dtype": dtype, "bias_dtype": bias or dtype, "mask": mask,
        "dims": {"B": 1, "S": 128, "N": n_res, "H": 8, "d": 32},
        "impls": {
            name: {
                "fwd": {"status": "ok", "median_ms": fwd},
                "fwd_bwd": {"status": "ok", "median_ms": fwd_bwd,
                            "temp_plus_output_bytes": memory.get(name, 0) * 1e6 or None},
            }
            for name, (fwd, fwd_bwd) in times.items()
        },
    }


def _target_rows(results) -> dict[tuple, list[str]]:
    """{(shape, dtype, bias): [fwd, f+b, memory, long chain, met]} of the targets table."""
    rows = {}
    for line in report.targets_table(results).splitlines():
        fields = line.strip("| ").split(" | ")
        if len(fields) == 8 and fields[0] not in ("shape", "---|---"):
            rows[tuple(fields[:3])] = fields[3:]
    return rows


def test_targets_table_every_shape_against_the_fastest_alternative():
    impls = ["msa_pallas", "xla", "cuequivariance", "tokamax_mosaic", "tokamax_triton",
             "jax_mha_nobias"]
    results = {"metadata": {"impls": impls}, "cases": [
        _case("train", "bf16",
              {"msa_pallas": (0.1, 0.4), "xla": (0.6, 1.1), "cuequivariance": (0.2, 0.9),
               "tokamax_mosaic": (0.08, 0.5), "jax_mha_nobias": (0.01, 0.01)},
              memory={"msa_pallas": 100, "cuequivariance": 150}, bias="f32"),
        _case("extra", "bf16", {"msa_pallas": (1.0, 1.0), "xla": (2.0, 2.0)}),
        _case("train", "f32", {"msa_pallas": (0.3, 1.6), "xla": (0.6, 1.5),
                               "cuequivariance": (0.5, 1.2), "tokamax_triton": (0.1, 0.1)}),
    ]}
    rows = _target_rows(results)
    assert list(rows) == [("train", "bf16", "f32"), ("extra", "bf16", "bf16"),
                          ("train", "f32", "f32")]
    # The reference point (no bias) is faster still, but never the yardstick.
    fwd, fwd_bwd, memory, long_chain, met = rows["train", "bf16", "f32"]
    assert fwd == "no: 0.80× (≥ 1.5×); 0.100 vs 0.080 ms tokamax_mosaic"
    assert fwd_bwd == "no: 1.25× (≥ 2×); 0.400 vs 0.500 ms tokamax_mosaic"
    assert memory == "yes: 1.50× (≥ 1×); 100 vs 150 MB cuequivariance"
    assert (long_chain, met) == ("–", "1 of 3")
    # Every shape is a target now, extra included; no memory yardstick ran there.
    assert rows["extra", "bf16", "bf16"][:2] == [
        "yes: 2.00× (≥ 1.5×); 1.000 vs 2.000 ms xla", "yes: 2.00× (≥ 2×); 1.000 vs 2.000 ms xla"]
    assert rows["extra", "bf16", "bf16"][4] == "2 of 2"
    # float32 against the faster of xla's and cuequivariance's float32 (tokamax's is TF32).
    fwd, fwd_bwd, memory, _, met = rows["train", "f32", "f32"]
    assert fwd == "yes: 1.67× (≥ 1×); 0.300 vs 0.500 ms cuequivariance"
    assert fwd_bwd == "no: 0.75× (≥ 1×); 1.600 vs 1.200 ms cuequivariance"
    assert (memory, met) == ("–", "1 of 2")


def test_a_cell_the_host_bounded_gets_a_note():
    """A cell whose calls took the host most of their time to queue timed the host: the
    report says so, for that cell alone."""
    case = _case("train", "bf16", {"msa_pallas": (0.07, 0.35), "tokamax_mosaic": (0.09, 0.6)})
    case["impls"]["msa_pallas"]["fwd"]["queued_ms"] = 0.065
    case["impls"]["msa_pallas"]["fwd_bwd"]["queued_ms"] = 0.05
    case["impls"]["tokamax_mosaic"]["fwd"]["queued_ms"] = 0.02
    notes = report.case_notes(case, ["msa_pallas", "tokamax_mosaic"])
    host_bound = [(note, where) for note, where in notes if "host-bound" in note]
    assert host_bound == [(
        "msa_pallas fwd: host-bound, the host queued a call in at least 80% of the time per "
        "call (the GPU waited for calls)", "train bf16: 0.065 of 0.07 ms")]
    case["impls"]["msa_pallas"]["fwd"]["queued_ms"] = 0.05
    assert not [note for note, _ in report.case_notes(case, ["msa_pallas"])
                if "host-bound" in note]


def test_an_alternative_with_a_wrong_forward_is_no_yardstick():
    # tokamax's Triton kernel gives wrong outputs at d = 8: faster, but not the op.
    case = _case("extra", "bf16", {"msa_pallas": (1.0, 6.0), "tokamax_triton": (0.9, 5.0),
                                   "tokamax_mosaic": (1.2, 8.0)})
    results = {"metadata": {"impls": ["msa_pallas", "tokamax_triton", "tokamax_mosaic"]},
               "cases": [case]}
    assert _target_rows(results)["extra", "bf16", "bf16"][1].endswith("5.000 ms tokamax_triton")
    case["impls"]["tokamax_triton"]["fwd"]["rel_err_vs_xla"] = 1.4
    case["impls"]["tokamax_mosaic"]["fwd"]["rel_err_vs_xla"] = 2e-3
    assert _target_rows(results)["extra", "bf16", "bf16"][1] == (
        "no: 1.33× (≥ 2×); 6.000 vs 8.000 ms tokamax_mosaic")


def test_targets_table_triangle_shapes_ask_for_parity():
    """Triangle attention's target: as fast as the fastest alternative (1×), not 1.5× / 2×."""
    times = {"msa_pallas": (0.18, 0.88), "tokamax_mosaic": (0.20, 1.43)}
    triangle = _case("triangle", "bf16", times, n_res=384)
    msa = _case("train", "bf16", times)
    results = {"metadata": {"impls": list(times)}, "cases": [triangle, msa]}
    rows = _target_rows(results)
    assert rows["triangle", "bf16", "bf16"][:2] == [
        "yes: 1.11× (≥ 1×); 0.180 vs 0.200 ms tokamax_mosaic",
        "yes: 1.62× (≥ 1×); 0.880 vs 1.430 ms tokamax_mosaic"]
    assert rows["train", "bf16", "bf16"][0].startswith("no: 1.11× (≥ 1.5×)")
    assert "Triangle shapes: forward and f+b at least as fast" in report.targets_table(results)
    assert "Triangle shapes" not in report.targets_table(
        {"metadata": results["metadata"], "cases": [msa]})


def test_targets_table_long_chain_and_failures():
    """At N = 4096 the forward and backward must run where XLA runs out of memory."""
    case = _case("1x128x4096x8x32", "f32", {"msa_pallas": (50.0, 310.0)}, {"msa_pallas": 2198},
                 n_res=4096)
    case["impls"]["xla"] = {"fwd": {"status": "OOM"}, "fwd_bwd": {"status": "OOM"}}
    results = {"metadata": {"impls": ["msa_pallas", "xla"]}, "cases": [case]}
    assert _target_rows(results)["1x128x4096x8x32", "f32", "f32"] == [
        "no alternative ran", "no alternative ran", "–",
        "yes: 310.0 ms, 2,198 MB; xla OOM", "1 of 1"]
    case["impls"]["msa_pallas"]["fwd_bwd"] = {"status": "OOM"}
    row = _target_rows(results)["1x128x4096x8x32", "f32", "f32"]
    assert row[1] == "msa_pallas: OOM" and row[3] == "no: OOM; xla OOM" and row[4] == "0 of 2"
    assert report.targets_table({"metadata": {"impls": ["xla"]}, "cases": [case]}) == ""


def test_padding_lines_compare_with_the_same_shape_unpadded():
    results = {"metadata": {"impls": ["msa_pallas"]}, "cases": [
        _case("train", "bf16", {"msa_pallas": (1.0, 4.0)}, bias="f32"),
        dict(_case("train_padded", "bf16", {"msa_pallas": (0.5, 3.0)}, bias="f32",
                   mask="padded"), kept_fraction=0.5625, fully_masked_rows=32),
    ]}
    assert report.padding_lines(results)[-1] == (
        "- train_padded bf16 bias f32: 56% of keys kept, 32 MSA rows fully masked (left out "
        "of the forward check); msa_pallas time / train's msa_pallas (random masks, 90% "
        "kept) fwd / f+b: 0.50 / 0.75 (target ≤ 1.15 × 0.56 = 0.65: yes / no)")


def test_padding_lines_judge_the_skipping_variant_against_the_op_unpadded():
    """msa_pallas_skip (the op inside `skipping_padding()`) is judged too, its padded time
    against msa_pallas' on the unpadded shape, and against the fastest alternative (its
    own variants are none)."""
    times = {"msa_pallas": (1.0, 4.0), "msa_pallas_skip": (1.2, 4.4),
             "tokamax_mosaic": (1.5, 6.0)}
    padded_times = {"msa_pallas": (1.0, 4.0), "msa_pallas_skip": (0.4, 2.0),
                    "tokamax_mosaic": (1.5, 6.0)}
    results = {"metadata": {"impls": list(times)}, "cases": [
        _case("extra", "bf16", times, bias="f32"),
        dict(_case("extra_padded", "bf16", padded_times, bias="f32", mask="padded"),
             kept_fraction=0.25, fully_masked_rows=768),
    ]}
    line = report.padding_lines(results)[-1]
    assert line.endswith(
        "; msa_pallas_skip time / extra's msa_pallas (random masks, 90% kept) fwd / f+b: "
        "0.40 / 0.50 (target ≤ 1.15 × 0.25 = 0.29: no / no); fastest alternative's time / "
        "msa_pallas_skip's fwd / f+b: 3.75× (tokamax_mosaic) / 3.00× (tokamax_mosaic) "
        "(target ≥ 2.5×: yes / yes)")
    assert "msa_pallas time / extra's msa_pallas (random masks, 90% kept) fwd / f+b: " \
        "1.00 / 1.00" in line


def test_padding_lines_judge_the_speed_up_over_the_fastest_alternative():
    """The padding targets: at least 2.5× the fastest alternative, per mode."""
    padded = dict(_case("train_padded", "bf16", {"msa_pallas": (0.04, 0.3),
                                                 "tokamax_mosaic": (0.1, 0.6),
                                                 "cuequivariance": (0.2, 0.9)},
                        bias="f32", mask="padded"), kept_fraction=0.5625, fully_masked_rows=32)
    results = {"metadata": {"impls": ["msa_pallas", "tokamax_mosaic", "cuequivariance"]},
               "cases": [padded]}
    assert report.padding_lines(results)[-1].endswith(
        "(left out of the forward check); fastest alternative's time / msa_pallas's fwd / f+b: "
        "2.50× (tokamax_mosaic) / 2.00× (tokamax_mosaic) (target ≥ 2.5×: yes / no)")


# --- adapters and the layer benchmark -------------------------------------------------


def _attention(q, k, v, bias, mask, scale, logits_spec, out_spec):
    """Softmax attention in plain jnp (float32), given the einsums of the logits and output."""
    logits = jnp.einsum(logits_spec, q, k, preferred_element_type=jnp.float32) * scale + bias
    p = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    return jnp.einsum(out_spec, p, v.astype(jnp.float32)).astype(q.dtype)


class _FakeCuet:
    """cuequivariance_jax.triangle_attention's contract: q/k/v [B,S,H,N,d], bias
    [B,1,H,N,N] float32, mask [B,S,1,1,N] bool; returns (out, lse, max)."""

    @staticmethod
    def triangle_attention(q, k, v, bias, mask, scale):
        assert bias.dtype == jnp.float32 and bias.shape[1] == 1, bias
        assert mask.dtype == jnp.bool_ and mask.shape[2:4] == (1, 1), mask
        return _attention(q, k, v, bias, mask, scale, "bshqd,bshkd->bshqk",
                          "bshqk,bshkd->bshqd"), None, None


class _FakeTokamax:
    """tokamax.dot_product_attention's contract: q/k/v [*batch, N, H, d]."""

    @staticmethod
    def dot_product_attention(q, k, v, *, bias, mask, scale, implementation):
        return _attention(q, k, v, bias, mask, scale, "...qhd,...khd->...hqk",
                          "...hqk,...khd->...qhd")


@pytest.mark.parametrize("name, mask_kind", [
    ("cuequivariance", "bool"), ("cuequivariance", "none"), ("tokamax", "int8")])
def test_layer_cores_map_the_layout_and_apply_the_gate(name, mask_kind):
    b, s, n, h, d = 2, 3, 20, 2, 8
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 6)
    q, k, v, gate = (jax.random.normal(key, (b, s, n, h, d)) for key in keys[:4])
    bias = jax.random.normal(keys[4], (b, h, n, n)).astype(jnp.bfloat16)
    mask = jax.random.bernoulli(keys[5], 0.8, (b, s, n))
    mask = {"bool": mask, "int8": mask.astype(jnp.int8), "none": None}[mask_kind]
    if name == "cuequivariance":
        core = alternatives.gated_attention_fn(
            lambda scale: alternatives.cuequivariance_op(_FakeCuet, scale))
    else:
        core = alternatives.gated_attention_fn(
            lambda scale: alternatives.tokamax_op(_FakeTokamax, scale, "xla"))
    out = jax.jit(lambda *args: core(*args, implementation="pallas", block_config=None,
                                     dropout_rate=0.0, dropout_rng=None))(
        q, k, v, bias, mask, gate)
    expected = jax.jit(lambda *args: msa_pallas.msa_row_attention(*args, implementation="xla"))(
        q, k, v, bias.astype(jnp.float32), mask, gate)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError):
        core(q, k, v, bias, mask, gate, dropout_rate=0.1)


def _xla_core():
    """A swapped core that runs msa_pallas' plain path through `gated_attention_fn`."""
    return alternatives.gated_attention_fn(lambda scale: lambda q, k, v, bias, mask: (
        msa_pallas.msa_row_attention(q, k, v, bias, mask, scale=scale, implementation="xla")))


def test_layer_core_options():
    assert layer.core_options("pallas") == {"implementation": "pallas"}

    class NoField:
        __dataclass_fields__ = {"msa_dim": None}

    with pytest.raises(alternatives.Unavailable, match="no attention_fn"):
        layer.core_options("cuequivariance", NoField)


def test_layer_table_judges_dropout_against_the_step_without_and_the_xla_path():
    def row(shape, core, fwd_bwd):
        return dict(shape=shape, core=core, status="ok", fwd_ms=0.1, fwd_bwd_ms=fwd_bwd, B=1,
                    S=128, N=256, heads=8, head_dim=32, msa_dim=256, pair_dim=128)

    rows = [row("train", "default", 0.887), row("train", "default+dropout", 1.007),
            row("train", "xla+dropout", 1.703),
            row("finetune", "default", 4.322), row("finetune", "default+dropout", 5.595),
            row("finetune", "xla+dropout", 12.54), row("extra", "default", 1.0)]
    table = layer.markdown(rows, ["default", "default+dropout", "xla+dropout"])
    lines = table.split("Attention dropout (f+b, the training step):\n\n")[1].splitlines()
    assert lines == [
        "- train: step with dropout / without 1.14 (target ≤ 1.15: yes); XLA path with "
        "dropout / the kernels' 1.69× (target ≥ 2×: no)",
        "- finetune: step with dropout / without 1.29 (target ≤ 1.15: no); XLA path with "
        "dropout / the kernels' 2.24× (target ≥ 2×: yes)"]
    assert "Attention dropout" not in layer.markdown(rows[:1], ["default"])


def test_layer_core_suffixes_and_padded_shapes():
    """`CORE[+dropout][+skip]`; the padded shapes' layer inputs carry their padding
    in the mask, the others 90% of keys kept."""
    assert layer.core_flags("default+dropout+skip") == ("default", True, True)
    assert layer.core_flags("xla+skip") == ("xla", False, True)
    assert layer.core_flags("pallas") == ("pallas", False, False)
    for wrong in ("default+skip+dropout", "fast", "default+fast"):
        with pytest.raises(ValueError, match="unknown core"):
            layer.core_flags(wrong)
    shape = layer.layer_shape("extra_padded")
    assert shape["padding"] == (0.75, 0.0) and layer.layer_shape("extra")["padding"] is None
    small = dict(shape, S=8, N=16)  # the padded extra MSA's mask at a small size
    _, _, mask, _ = layer.make_inputs(small, jnp.bfloat16)
    assert np.asarray(mask[0, :2]).all() and not np.asarray(mask[0, 2:]).any()
    _, _, mask, _ = layer.make_inputs(dict(small, padding=None), jnp.bfloat16)
    assert 0.8 < float(np.asarray(mask).mean()) < 1.0


def test_layer_table_gives_skipping_against_visiting():
    def row(core, fwd, fwd_bwd, padding=(0.25, 0.25)):
        return dict(shape="train_padded", core=core, status="ok", fwd_ms=fwd,
                    fwd_bwd_ms=fwd_bwd, B=1, S=128, N=256, heads=8, head_dim=32, msa_dim=256,
                    pair_dim=128, padding=padding)

    rows = [row("default+dropout", 0.4, 1.0), row("default+dropout+skip", 0.3, 0.8),
            row("default", 0.35, 0.9)]
    table = layer.markdown(rows, ["default", "default+dropout", "default+dropout+skip"])
    lines = table.split("Padding skipped (skipping / visiting):\n\n")[1].splitlines()
    assert lines == ["- train_padded: default+dropout+skip / default+dropout: fwd 0.75, "
                     "f+b 0.80 (the mask keeps 0.56 of the logits)"]
    unpadded = [dict(r, shape="train", padding=None) for r in rows]
    table = layer.markdown(unpadded, ["default", "default+dropout", "default+dropout+skip"])
    assert table.split("Padding skipped (skipping / visiting):\n\n")[1].splitlines() == [
        "- train: default+dropout+skip / default+dropout: fwd 0.75, f+b 0.80 (no padding: "
        "nothing to skip)"]
    assert "Padding skipped" not in layer.markdown(rows[:1] + rows[2:], ["default"])


@CPU_ONLY
def test_layer_times_each_core(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(alternatives.LAYER_CORES, "xla_swapped", _xla_core)
    monkeypatch.setattr(layer, "CORES", layer.CORES + ("xla_swapped",))
    rows = layer.main(
        ["--shapes", "tiny", "--cores", "xla,xla_swapped,cuequivariance", "--iters", "1",
         "--warmup", "1", "--reps", "1", "--out", str(tmp_path), "--commit", "abc1234"])
    by_core = {row["core"]: row for row in rows}
    assert by_core["xla"]["status"] == "ok" and by_core["xla"]["fwd_bwd_ms"] > 0
    assert by_core["xla"]["finite"]
    assert (by_core["xla"]["S"], by_core["xla"]["N"], by_core["xla"]["msa_dim"]) == (4, 64, 32)
    assert by_core["cuequivariance"]["status"].startswith("skipped")
    if layer.supports_attention_fn():
        # The swapped core (gate applied by the adapter) gives the layer's own result.
        assert by_core["xla_swapped"]["status"] == "ok", by_core["xla_swapped"]
        assert by_core["xla_swapped"]["fwd_bwd_ms"] > 0
        assert by_core["xla_swapped"]["reference_core"] == "xla"
        assert by_core["xla_swapped"]["rel_err"] < 1e-2
    else:
        assert "no attention_fn" in by_core["xla_swapped"]["status"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [row["core"] for row in saved["rows"]] == ["xla", "xla_swapped", "cuequivariance"]
    assert saved["meta"]["commit"] == "abc1234" and saved["meta"]["date_utc"].endswith(" UTC")
    assert "| xla_swapped fwd | xla_swapped f+b |" in saved["table"]
    assert "| tiny | 1, 4, 64, 2, 16 | 32, 16 |" in capsys.readouterr().out


def test_layer_keeps_the_rows_of_a_run_cut_short(tmp_path, monkeypatch):
    measured = layer.bench_one
    calls = []

    def cut_at_the_second_core(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise TimeoutError("the call's time ran out")
        return measured(*args, **kwargs)

    monkeypatch.setattr(layer, "bench_one", cut_at_the_second_core)
    with pytest.raises(TimeoutError):
        layer.main(["--shapes", "tiny", "--cores", "xla,cuequivariance", "--iters", "1",
                          "--warmup", "1", "--reps", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(row["core"], row["status"]) for row in saved["rows"]] == [("xla", "ok")]
    assert saved["table"] is None  # no table: the run did not finish


def test_parse_mosaic_candidates():
    """`BQxBKxSTAGESxROWS[xPING_PONG[xPERSISTENT[xSTAGGERED_BIAS[xMASK_WITHOUT_SELECT]]]]`:
    the flags in that order, left out meaning the defaults (ping-pong on, one CTA per
    item, staggered bias loads, ds made 0 without a select); `mosaic_text` writes
    every field, and reads back as the same tiles."""
    plain, turns_off, persistent, other = profile_kernels.parse_mosaic(
        "128x64x2x2,128x128x2x2x0,64x64x3x1x1x1,64x128x2x2x1x0x0x0"
    )
    assert (plain.block_q, plain.block_k, plain.num_stages, plain.msa_rows) == (128, 64, 2, 2)
    assert plain.ping_pong and not plain.persistent
    assert plain.staggered_bias and plain.mask_without_select
    assert not turns_off.ping_pong and not turns_off.persistent
    assert persistent.ping_pong and persistent.persistent and persistent.num_stages == 3
    assert not other.staggered_bias and not other.mask_without_select and not other.persistent
    assert profile_kernels.mosaic_text(other) == "64x128x2x2x1x0x0x0"
    for tiles in (plain, turns_off, persistent, other):
        assert profile_kernels.parse_mosaic(profile_kernels.mosaic_text(tiles)) == [tiles]


def test_launch_durations_reads_the_last_call_from_ncu_csv():
    """The per-launch table of `profile durations`: compile-time launches
    (here an autotuning kernel and a transpose) and the inputs' (an iota run
    twice, as many times as there are calls) are left out, the last call's
    launches kept in order, each value converted to microseconds."""
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name",'
              '"Metric Unit","Metric Value"')
    calls = [("forward", "58,688"), ("input_reduce_fusion", "19,392"), ("dq", "72,256")]
    inputs = [("wrapped_iota", "2,304"), ("loop_compare_fusion", "2,816")] * 2
    launches = inputs + [("RedzoneAllocatorKernel", "24,160"), ("wrapped_transpose", "3,392")] + calls * 2
    lines = ["==PROF== Connected to process", header] + [
        f'"{i}","1","python3","host","{name}","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0",'
        f'"Command line profiler metrics","gpu__time_duration.sum","nsecond","{value}"'
        for i, (name, value) in enumerate(launches)
    ] + ["ran 2 forward+backward calls"]
    parsed = launch_durations.parse_launches("\n".join(lines))
    assert len(parsed) == len(launches) and parsed[4] == ("RedzoneAllocatorKernel", 24.16)
    last = launch_durations.last_call(parsed, calls=2)
    assert [name for name, _ in last] == ["forward", "input_reduce_fusion", "dq"]
    assert [us for _, us in last] == [58.688, 19.392, 72.256]


def test_timeline_reads_the_gpu_streams_of_a_trace(tmp_path):
    """`profile timeline` keeps the GPU stream threads' complete events (not the
    host's, not the GPU's derived "XLA Ops" line), orders them by start, and
    reports each gap and the busy share of the span."""
    meta = lambda ph_name, pid, tid, name: dict(ph="M", name=ph_name, pid=pid, tid=tid,
                                                args=dict(name=name))
    events = [
        meta("process_name", 1, 0, "/host:CPU"), meta("thread_name", 1, 5, "python"),
        meta("process_name", 2, 0, "/device:GPU:0"),
        meta("thread_name", 2, 7, "Stream #7(Compute)"), meta("thread_name", 2, 9, "XLA Ops"),
        dict(ph="X", pid=2, tid=7, name="dq", ts=130.0, dur=20.0),
        dict(ph="X", pid=2, tid=7, name="forward", ts=100.0, dur=10.0),
        dict(ph="X", pid=2, tid=7, name="dq", ts=160.0, dur=40.0),
        dict(ph="X", pid=2, tid=9, name="fusion.1", ts=100.0, dur=10.0),
        dict(ph="X", pid=1, tid=5, name="PjitFunction", ts=90.0, dur=200.0),
    ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    import gzip
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)
    kernels = profile_timeline.gpu_kernels(profile_timeline.read_trace(tmp_path))
    assert [(k["name"], k["ts"]) for k in kernels] == [("forward", 100.0), ("dq", 130.0),
                                                       ("dq", 160.0)]
    lines = profile_timeline.summarise(kernels, top=5)
    assert lines[2] == "| 0 | 0.0 | 10.0 | 0.0 | forward |"
    assert lines[3] == "| 1 | 30.0 | 20.0 | 20.0 | dq |"
    assert lines[4] == "| 2 | 60.0 | 40.0 | 10.0 | dq |"
    summary = next(line for line in lines if line.startswith("3 kernels"))
    assert "span 100.0 µs" in summary and "busy 70.0 µs (70% of the span)" in summary
    assert "| 60.0 | 86% | 2 | dq |" in lines


@CPU_ONLY
def test_launch_runs_the_layer_training_step(capsys):
    """`profile launch --layer` runs the layer's step (the tools built on it, durations
    and timeline, pass their arguments to it)."""
    assert profile_launch.main(["--layer", "reference", "--shape", "tiny", "--implementation",
                                "xla", "--dropout-rate", "0.1", "--calls", "1"]) == 0
    assert "training steps of the reference layer at tiny, core xla, dropout 0.1" in (
        capsys.readouterr().out)
