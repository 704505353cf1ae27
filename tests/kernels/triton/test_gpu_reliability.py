"""Reliability checks of the compiled Triton kernels on a GPU (issue 5).

Tests marked `gpu` skip without one (conftest.py). Each has a `*_logic`
function that the `gpu` test calls at GPU sizes, and that the unmarked
`test_*_logic_on_cpu` tests at the bottom call at tiny sizes on CPU (Pallas
interpret mode), so the test code itself is exercised by the CPU suite.

- edge cases (edge_checks.py): a fully masked batch element, a NaN / Inf
  query row, a bias of +-1e4 in bfloat16 / float16, N = 1 and S = 1 — at
  sizes with several tiles and tile tails;
- N = 4096, S = 128 (`test_n4096_s128`): B*S*H*N*N exceeds 2^31;
- `jax.export` for CUDA on the GPU host, deserialised and called;
- with two or more GPUs: sharded over S, the kernels move no q, k, v.

Run with `pytest -s -m gpu tests/kernels/triton/test_gpu_reliability.py` for the `[err]` lines.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import edge_checks
import helpers
import msa_pallas
from gpu_inputs import chunk_rows, device_inputs
from helpers import fwd_bwd, tolerance
from msa_pallas import exporting

gpu = pytest.mark.gpu
# Lowering the kernels for CUDA (the export tests) warns that Pallas's Triton
# backend is deprecated in favour of Mosaic GPU: known, and not this test's subject.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _reference(shape):
    """float64 reference on the default device, chunked over MSA rows."""
    return lambda inputs: helpers.jnp_reference_fwd_bwd(inputs, chunk_rows=chunk_rows(shape))


# --- edge cases ------------------------------------------------------------------


def fully_masked_batch_element_logic(seed, shape, dtype):
    inputs = device_inputs(seed, shape, dtype)
    edge_checks.fully_masked_batch_element(
        inputs, shape[0] - 1, fwd_bwd("pallas"), _reference(shape), tolerance(dtype),
        f"gpu {shape} {jnp.dtype(dtype).name}",
    )


def nonfinite_query_row_logic(seed, shape, dtype, value, where):
    inputs = device_inputs(seed, shape, dtype)
    # Compared with the same kernels on the clean inputs: the rows the poison
    # cannot reach are computed by the same programs on the same values.
    tol = 1e-6 if dtype == jnp.float32 else 1e-3
    edge_checks.nonfinite_query_row(
        inputs, where, value, fwd_bwd("pallas"), tol,
        f"gpu {shape} {jnp.dtype(dtype).name} q{list(where)} = {value}",
    )


def huge_bias_logic(seed, shape, dtype):
    inputs = device_inputs(seed, shape, dtype)
    inputs = edge_checks.huge_bias(inputs._replace(bias=inputs.bias.astype(dtype)), 1e4)
    result = fwd_bwd("pallas")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    helpers.compare(
        result, _reference(shape)(inputs), tolerance(dtype),
        f"gpu {shape} bias +-1e4 {jnp.dtype(dtype).name}",
    )


def tiny_shape_logic(seed, shape, dtype):
    inputs = device_inputs(seed, shape, dtype)
    result = fwd_bwd("pallas")(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    edge_checks.assert_close(
        result, _reference(shape)(inputs), tolerance(dtype), f"gpu {shape} {jnp.dtype(dtype).name}"
    )


@gpu
@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_fully_masked_batch_element(dtype_id, seed):
    fully_masked_batch_element_logic(seed, (2, 8, 300, 4, 32), DTYPES[dtype_id])


@gpu
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_nonfinite_query_row(dtype_id, value, seed):
    # Query 131: inside a tile; query 199: the tail of the last tile (N = 200).
    for where in ((1, 5, 131, 2), (0, 0, 199, 3)):
        nonfinite_query_row_logic(seed, (2, 8, 200, 4, 32), DTYPES[dtype_id], value, where)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_bias_1e4_half_precision(dtype, seed):
    huge_bias_logic(seed, (1, 16, 256, 8, 32), dtype)


@gpu
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("shape", [(2, 3, 1, 2, 8), (1, 1, 37, 2, 16), (1, 1, 1, 1, 8), (3, 1, 300, 8, 32)],
                         ids=["N1", "S1", "S1-N1-H1", "S1-N300"])
def test_tiny_shapes(shape, dtype_id, seed):
    tiny_shape_logic(seed, shape, DTYPES[dtype_id])


# --- N = 4096, S = 128: past 2^31 ------------------------------------------------

N4096_SHAPE = (1, 128, 4096, 8, 32)


def n4096_logic(seed, shape, keep_rows=2, max_temp_bytes=None):
    """Forward and backward at `shape`, bf16; the first `keep_rows` MSA rows
    (out, dq, dk, dv, dgate depend on no other row) and the bias gradient (a
    sum over all S rows: its reference is computed over all S, in chunks)
    against float64.

    At (1, 128, 4096, 8, 32): B*S*H*N*N = 128 * 8 * 4096^2 = 1.7e10 logits
    (and as many softmax weights and bias-gradient terms) > 2^31 = 2.1e9, so a
    flat [B, S, H, N, N] index would overflow int32. No kernel forms one: the
    largest arrays any kernel indexes are q, k, v, gate, out and dq/dk/dv,
    [1, 128, 4096, 8, 32] = 2^27 elements, the bias and dbias
    [1, 8, 4096, 4096] = 2^27 elements (2^29 bytes in float32), the float32
    attention residual 2^27 elements, and the row statistics [1, 128, 8, 4096]
    = 2^22: every element (and byte) offset stays below 2^31. The number of
    logits is a loop count, never an offset.
    """
    B, S, N, H, d = shape
    assert B * S * H * N * N > 2**31 or shape != N4096_SHAPE
    inputs = device_inputs(seed, shape, jnp.bfloat16)
    run = fwd_bwd("pallas")
    if max_temp_bytes is not None:
        memory = run.lower(*inputs.args).compile().memory_analysis()
        if memory is not None:
            temp = memory.temp_size_in_bytes
            print(f"[gpu] {shape}: temporary memory {temp / 2**30:.2f} GiB")
            assert temp <= max_temp_bytes, (temp, max_temp_bytes)
    result = jax.block_until_ready(run(*inputs.args))
    helpers.assert_shapes_dtypes_finite(result, inputs)
    reference = helpers.jnp_reference_fwd_bwd(
        inputs, chunk_rows=chunk_rows(shape), keep_rows=keep_rows
    )
    out, grads = result
    first = lambda x: None if x is None else x[:, :keep_rows]
    sliced = (first(out), tuple(g if i == 3 else first(g) for i, g in enumerate(grads)))
    helpers.compare(sliced, reference, 2e-2, f"gpu {shape} bf16 (rows :{keep_rows}, dbias all)")


@gpu
def test_n4096_s128(seed):
    B, S, N, H, d = N4096_SHAPE
    # A [B, S, H, N, N] array of bf16 logits alone would be 32 GiB: the kernels
    # never form one (their temporaries: the float32 attention residual, the
    # row statistics and the gate algebra's, ~1 GiB).
    n4096_logic(seed, N4096_SHAPE, keep_rows=2, max_temp_bytes=8 << 30)


# --- export on the GPU host ---------------------------------------------------------


def export_logic(seed, shape, dtype):
    inputs = device_inputs(seed, shape, dtype)
    q, k, v, bias, mask, gate, dout = inputs.args

    def step(q, k, v, bias, mask, gate):
        def loss(q, k, v, bias, gate):
            out = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation="pallas")
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, gate)

    args = (q, k, v, bias, mask, gate)
    platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
    exported = exporting.export(step, platforms=(platform,))(*args)
    assert exported.platforms == (platform,)
    calls = exported.mlir_module().count(f"@{exporting.TRITON_CUSTOM_CALL}(")
    kernels = helpers.expected_kernel_calls(shape[2], shape[4], dtype)
    assert calls == (kernels if platform == "cuda" else 0), calls
    restored = jax.export.deserialize(exported.serialize())
    got = jax.tree.leaves(restored.call(*args))
    want = jax.tree.leaves(jax.jit(step)(*args))
    for a, b in zip(got, want):
        np.testing.assert_allclose(helpers.to_f64(a), helpers.to_f64(b), rtol=1e-6, atol=1e-6)


@gpu
def test_export_for_cuda_and_call(seed):
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    export_logic(seed, (1, 4, 100, 4, 32), jnp.bfloat16)


@gpu
def test_export_for_cpu_from_a_gpu_host():
    """From a GPU host, an export for CPU runs the kernels in interpret mode
    (exporting.export sets a CPU target), with no Triton call in the module."""
    rows = jax.ShapeDtypeStruct((1, 2, 20, 2, 8), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 2, 20, 20), jnp.float32)
    f = lambda q, k, v, bias: msa_pallas.msa_row_attention(q, k, v, bias, implementation="pallas")
    exported = exporting.export(f, platforms=("cpu",))(rows, rows, rows, bias)
    assert exported.platforms == ("cpu",)
    assert exporting.TRITON_CUSTOM_CALL not in exported.mlir_module()


# --- several GPUs -----------------------------------------------------------------------


def sharded_rows_logic(seed, shape, dtype):
    """S sharded over every device: results equal the one-device run (the bias
    gradient to summation order), and the partitioned program's only
    collectives are the bias gradient's all-reduce."""
    from jax.sharding import NamedSharding

    from msa_pallas.sharding import msa_partition_specs

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    inputs = device_inputs(seed, shape, dtype)
    specs = msa_partition_specs(row_axis="rows")
    placement = (specs.rows,) * 3 + (specs.bias, specs.mask, specs.rows, specs.rows)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs.args, placement)]
    run = fwd_bwd("pallas")
    compiled = run.lower(*sharded).compile()
    hlo = compiled.as_text()
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert not re.search(rf"\s{op}(?:-start)?\(", hlo), f"the sharded program has an {op}"
    got = jax.tree.leaves(compiled(*sharded))
    again = jax.tree.leaves(compiled(*sharded))
    single = [jax.device_put(x, devices[0]) for x in inputs.args]
    want = jax.tree.leaves(run(*single))
    for name, a, b, c in zip(helpers.RESULT_NAMES, got, want, again):
        assert np.array_equal(np.asarray(a), np.asarray(c)), f"{name}: two runs differ"
        assert helpers.rel_err(a, b) <= (1e-2 if name == "dbias" and dtype != jnp.float32 else 1e-5), name


@gpu
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two or more devices")
def test_sharded_over_rows_on_gpus(seed):
    shape = (1, 2 * len(jax.devices()), 200, 4, 32)
    for dtype in (jnp.float32, jnp.bfloat16):
        sharded_rows_logic(seed, shape, dtype)


# --- the same logic at tiny sizes on CPU (unmarked) -------------------------------------


def test_edge_case_logic_on_cpu(seed):
    # Shapes of test_edge_cases.py's (their interpret-mode compiles are shared).
    fully_masked_batch_element_logic(seed, (2, 3, 20, 2, 8), jnp.float32)
    nonfinite_query_row_logic(seed, (2, 3, 20, 2, 8), jnp.float32, np.inf, (1, 1, 19, 1))
    huge_bias_logic(seed, (1, 3, 40, 2, 32), jnp.bfloat16)
    tiny_shape_logic(seed, (1, 1, 1, 1, 8), jnp.float32)


def test_n4096_logic_on_cpu(seed):
    """Rows :2 of S = 6 against float64, the bias gradient over all rows in
    chunks of 2 (chunk_rows of this shape), the memory check on."""
    shape = (1, 6, 20, 2, 8)
    assert chunk_rows(shape) == 4  # two chunks, the second partial
    n4096_logic(seed, shape, keep_rows=2, max_temp_bytes=1 << 30)


def test_export_logic_on_cpu(seed):
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    export_logic(seed, (1, 2, 20, 2, 8), jnp.float32)
