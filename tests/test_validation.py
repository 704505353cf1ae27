"""Bad input raises ValueError / TypeError at trace time, with a message
that names the argument, shows what it got and what was expected; and what
the op does with dtypes it accepts but that differ from q's.

Every call goes through `jax.eval_shape` on abstract inputs: nothing is
computed, so the errors are proven to come at trace time.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msa_pallas

B, S, N, H, D = 2, 3, 10, 4, 8
F32 = jnp.float32


def sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def good(**overrides):
    args = dict(
        q=sds((B, S, N, H, D)), k=sds((B, S, N, H, D)), v=sds((B, S, N, H, D)),
        bias=sds((B, H, N, N)), mask=sds((B, S, N), jnp.bool_), gate=sds((B, S, N, H, D)),
    )
    args.update(overrides)
    return args


def trace(args, **kwargs):
    names = ("q", "k", "v", "bias", "mask", "gate")
    f = lambda *a: msa_pallas.msa_row_attention(*a, **kwargs)
    return jax.eval_shape(f, *(args[n] for n in names))


def expect(error, *fragments):
    """pytest.raises matching every fragment, in order, literally."""
    return pytest.raises(error, match=".*".join(re.escape(f) for f in fragments))


@pytest.mark.parametrize("implementation", ["pallas", "xla", None])
def test_good_arguments_trace(implementation):
    out = trace(good(), implementation=implementation)
    assert out.shape == (B, S, N, H, D) and out.dtype == F32


def test_q_wrong_rank():
    args = good(q=sds((N, H, D)))
    with expect(ValueError, "q", "[10, 4, 8]", "rank 3", "[*batch, S, N, H, d]"):
        trace(args, implementation="pallas")


def test_k_shape_differs_from_q():
    args = good(k=sds((B, S, N + 1, H, D)))
    with expect(ValueError, "k has shape [2, 3, 11, 4, 8]", "expected [2, 3, 10, 4, 8]"):
        trace(args)


def test_v_shape_differs_from_q():
    args = good(v=sds((B, S, N, H, D + 8)))
    with expect(ValueError, "v has shape [2, 3, 10, 4, 16]", "expected [2, 3, 10, 4, 8]"):
        trace(args)


def test_v_dtype_differs_from_q():
    args = good(v=sds((B, S, N, H, D), jnp.bfloat16))
    with expect(TypeError, "v has dtype bfloat16", "expected float32"):
        trace(args, implementation="pallas")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
def test_non_float_q(dtype):
    args = good(**{n: sds((B, S, N, H, D), dtype) for n in ("q", "k", "v")})
    with expect(TypeError, "q has dtype", jnp.dtype(dtype).name, "expected one of", "float32"):
        trace(args, implementation="xla")


@pytest.mark.parametrize(
    "shape, what",
    [((B, H + 1, N, N), "heads"), ((B, H, N, N + 1), "N"), ((B, H, N + 1, N), "N rows"),
     ((B + 1, H, N, N), "batch"), ((H, N, N), "rank")],
)
def test_bias_wrong_shape(shape, what):
    got = "[" + ", ".join(map(str, shape)) + "]"
    with expect(ValueError, f"bias has shape {got}", "expected [2, 4, 10, 10]", "[*batch, H, N, N]"):
        trace(good(bias=sds(shape)))


def test_bias_integer_dtype():
    with expect(TypeError, "bias has dtype int32", "expected one of"):
        trace(good(bias=sds((B, H, N, N), jnp.int32)))


@pytest.mark.parametrize("shape", [(B, S, N + 1), (B, N), (B, S, N, 1), (B, 1, N)])
def test_mask_wrong_shape(shape):
    got = "[" + ", ".join(map(str, shape)) + "]"
    with expect(ValueError, f"mask has shape {got}", "expected [2, 3, 10]", "[*batch, S, N]"):
        trace(good(mask=sds(shape, jnp.bool_)))


@pytest.mark.parametrize("shape", [(B, S, N, H, D + 1), (B, S, N, H), (B, S, N, 1, D)])
def test_gate_wrong_shape(shape):
    got = "[" + ", ".join(map(str, shape)) + "]"
    with expect(ValueError, f"gate has shape {got}", "expected [2, 3, 10, 4, 8]"):
        trace(good(gate=sds(shape)))


def test_gate_integer_dtype():
    with expect(TypeError, "gate has dtype int32", "expected one of"):
        trace(good(gate=sds((B, S, N, H, D), jnp.int32)))


def test_head_dim_256_with_pallas():
    rows = sds((B, S, N, H, 256))
    args = good(q=rows, k=rows, v=rows, gate=rows)
    with expect(ValueError, "q has head dim d=256", "[2, 3, 10, 4, 256]", "d <= 128"):
        trace(args, implementation="pallas")
    # The plain path and the automatic choice take it.
    assert trace(args, implementation="xla").shape == (B, S, N, H, 256)
    assert trace(args).shape == (B, S, N, H, 256)


@pytest.mark.parametrize("name", ["Triton", "Pallas", "cudnn", ""])
def test_unknown_implementation(name):
    choices = "expected one of None, 'triton', 'mosaic', 'xla', 'pallas'"
    with expect(ValueError, f"implementation={name!r}", choices):
        trace(good(), implementation=name)


def test_float64_with_pallas():
    with jax.enable_x64(True):
        rows = sds((B, S, N, H, D), jnp.float64)
        args = good(q=rows, k=rows, v=rows, gate=rows)
        with expect(TypeError, "q has dtype float64", "expected one of", "float32"):
            trace(args, implementation="pallas")
        assert trace(args, implementation="xla").dtype == jnp.float64


def test_scale_must_be_a_number():
    with expect(TypeError, "scale must be a Python float", "list"):
        trace(good(), scale=[0.5])


def test_zero_sized_dimension():
    rows = sds((B, S, 0, H, D))
    args = good(q=rows, k=rows, v=rows, gate=rows, bias=sds((B, H, 0, 0)), mask=sds((B, S, 0), jnp.bool_))
    with expect(ValueError, "q has shape [2, 3, 0, 4, 8]", ">= 1"):
        trace(args, implementation="pallas")


def test_dropout_arguments():
    key = jax.random.PRNGKey(0)
    with expect(ValueError, "dropout_rate=1.5", "[0, 1)"):
        trace(good(), dropout_rate=1.5, dropout_rng=key)
    with expect(ValueError, "dropout_rate=0.1", "dropout_rng", "None"):
        trace(good(), dropout_rate=0.1)


@pytest.mark.parametrize("implementation", [None, "xla", "pallas"])
def test_q_not_an_array(implementation):
    """Checked before anything reads q.dtype / q.shape, whatever the implementation."""
    bias = jnp.zeros((H, N, N))
    with expect(TypeError, "q must be an array", "list"):
        msa_pallas.msa_row_attention([[1.0]], [[1.0]], [[1.0]], bias, implementation=implementation)


@pytest.mark.parametrize("implementation", [None, "xla", "pallas"])
def test_q_rank_zero(implementation):
    args = good(q=sds(()), k=sds(()), v=sds(()), gate=None, mask=None)
    with expect(ValueError, "q has shape []", "rank 0", "rank >= 4"):
        trace(args, implementation=implementation)


# --- gaps filled for issue 5 (Reliability) -------------------------------------


@pytest.mark.parametrize("implementation", ["pallas", "xla", None])
def test_k_dtype_differs_from_q(implementation):
    args = good(k=sds((B, S, N, H, D), jnp.bfloat16))
    with expect(TypeError, "k has dtype bfloat16", "expected float32 (the dtype of q)"):
        trace(args, implementation=implementation)


def test_half_q_with_float32_k_and_v():
    half = sds((B, S, N, H, D), jnp.bfloat16)
    with expect(TypeError, "k has dtype float32", "expected bfloat16"):
        trace(good(q=half, gate=half), implementation="pallas")


@pytest.mark.parametrize("implementation", ["pallas", None])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_inputs_for_kernels_and_auto(dtype, implementation):
    rows = sds((B, S, N, H, D), dtype)
    args = good(q=rows, k=rows, v=rows, gate=None)
    with expect(TypeError, "q has dtype", jnp.dtype(dtype).name, "expected one of", "bfloat16"):
        trace(args, implementation=implementation)


@pytest.mark.parametrize(
    "shape", [(B, H, N, N, 1), (N, N), (B, 1, N, N)], ids=["rank5", "rank2", "heads-broadcast"]
)
def test_bias_rank_and_head_broadcast_refused(shape):
    """No implicit broadcasting: a bias of one head for H heads is an error."""
    got = "[" + ", ".join(map(str, shape)) + "]"
    with expect(ValueError, f"bias has shape {got}", "expected [2, 4, 10, 10]"):
        trace(good(bias=sds(shape)), implementation="pallas")


@pytest.mark.parametrize("shape", [(N,), (S, N), (B, S, N, N)], ids=["rank1", "rank2", "rank4"])
def test_mask_rank(shape):
    got = "[" + ", ".join(map(str, shape)) + "]"
    with expect(ValueError, f"mask has shape {got}", "expected [2, 3, 10]"):
        trace(good(mask=sds(shape, jnp.bool_)), implementation="pallas")


@pytest.mark.parametrize("name", ["bias", "mask", "gate"])
def test_argument_not_an_array(name):
    args = good()
    args[name] = [[0.0]]
    error = f"{name} must be an array"
    with expect(TypeError, error, "list"):
        msa_pallas.msa_row_attention(
            *(jnp.zeros(a.shape, a.dtype) if not isinstance(a, list) else a
              for a in (args[n] for n in ("q", "k", "v", "bias", "mask", "gate"))),
            implementation="xla",
        )


def test_gate_float64_with_float32_q_on_kernels():
    with jax.enable_x64(True):
        with expect(TypeError, "gate has dtype float64", "expected one of"):
            trace(good(gate=sds((B, S, N, H, D), jnp.float64)), implementation="pallas")


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("q_dtype, gate_dtype", [
    (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.bfloat16),
], ids=["bf16-q-f32-gate", "f32-q-bf16-gate", "f16-q-bf16-gate"])
def test_gate_dtype_may_differ_from_q(q_dtype, gate_dtype, implementation):
    """The gate may have any floating dtype the path accepts, q's or another: the
    output has q's dtype and the gate's gradient the gate's (as the README says).
    The numbers of a float32 gate with bf16 q: test_attention.py."""
    rows = (B, S, N, H, D)

    def f(q, k, v, bias, mask, gate):
        op = lambda q, k, v, bias, gate: msa_pallas.msa_row_attention(
            q, k, v, bias, mask, gate, implementation=implementation)
        out, pullback = jax.vjp(op, q, k, v, bias, gate)
        return out, pullback(out)

    out, (dq, dk, dv, dbias, dgate) = jax.eval_shape(
        f, sds(rows, q_dtype), sds(rows, q_dtype), sds(rows, q_dtype), sds((B, H, N, N)),
        sds((B, S, N), jnp.bool_), sds(rows, gate_dtype))
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == q_dtype
    assert dgate.dtype == gate_dtype and dbias.dtype == F32


def test_numpy_float64_inputs_without_x64():
    """NumPy float64 arrays with jax_enable_x64 off (JAX's default), as the
    README documents: the "xla" path (and `implementation=None` on CPU) converts
    them to float32, as any jnp function does, and returns float32; the kernels
    refuse them with a TypeError naming q's dtype. `jnp.asarray(x)` (float32
    then) works on both paths."""
    rng = np.random.default_rng(0)
    q, k, v, gate = (rng.standard_normal((1, 2, 6, 2, 8)) for _ in range(4))
    bias = rng.standard_normal((1, 2, 6, 6))
    assert q.dtype == np.float64 and not jax.config.jax_enable_x64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "float64 is not available"
        out = msa_pallas.msa_row_attention(q, k, v, bias, None, gate, implementation="xla")
    assert out.dtype == jnp.float32
    if jax.default_backend() != "gpu":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            auto = msa_pallas.msa_row_attention(q, k, v, bias, None, gate)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(out))
    with expect(TypeError, "q has dtype float64", "expected one of", "float32"):
        msa_pallas.msa_row_attention(q, k, v, bias, None, gate, implementation="pallas")
    as_f32 = [jnp.asarray(x) for x in (q, k, v, bias, gate)]
    assert as_f32[0].dtype == jnp.float32
    kernels = jax.eval_shape(
        lambda *a: msa_pallas.msa_row_attention(*a[:4], None, a[4], implementation="pallas"),
        *as_f32)
    assert kernels.dtype == jnp.float32


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(scale):
    with expect(ValueError, f"scale={scale!r}", "finite"):
        trace(good(), scale=scale)


@pytest.mark.parametrize("config", ["fast", (64, 64), 64])
def test_block_config_type(config):
    with expect(TypeError, "block_config must be a msa_pallas.BlockConfig", type(config).__name__):
        trace(good(), implementation="pallas", block_config=config)


def test_errors_name_the_callers_shapes_through_vmap_and_jit():
    """Under jit and vmap the check still runs at trace time, on the shapes the
    op sees (vmap strips the mapped axis)."""
    f = jax.vmap(lambda q, k, v, bias: msa_pallas.msa_row_attention(q, k, v, bias))
    rows = sds((5, B, S, N, H, D))
    with expect(ValueError, "bias has shape [2, 4, 10, 11]", "expected [2, 4, 10, 10]"):
        jax.eval_shape(jax.jit(f), rows, rows, rows, sds((5, B, H, N, N + 1)))


# --- the sharded entry point (msa_pallas.sharding) -------------------------------


def _mesh():
    return jax.make_mesh((1,), ("rows",))


def test_sharded_op_checks_global_shapes():
    from msa_pallas.sharding import sharded_msa_row_attention

    attention = sharded_msa_row_attention(_mesh(), row_axis="rows", implementation="pallas")
    args = good(bias=sds((B, H, N, N + 1)))
    with expect(ValueError, "bias has shape [2, 4, 10, 11]", "expected [2, 4, 10, 10]"):
        jax.eval_shape(attention, *(args[n] for n in ("q", "k", "v", "bias", "mask", "gate")))
    args = good(k=sds((B, S, N, H, D), jnp.float16))
    with expect(TypeError, "k has dtype float16", "expected float32"):
        jax.eval_shape(attention, *(args[n] for n in ("q", "k", "v", "bias", "mask", "gate")))


def test_sharded_op_rank_must_match_batch_dims():
    from msa_pallas.sharding import sharded_msa_row_attention

    attention = sharded_msa_row_attention(_mesh(), row_axis="rows", batch_dims=2)
    args = good()
    with expect(ValueError, "q has shape [2, 3, 10, 4, 8]", "batch_dims=2", "rank 6"):
        jax.eval_shape(attention, *(args[n] for n in ("q", "k", "v", "bias", "mask", "gate")))


@pytest.mark.parametrize("kwarg", ["dropout_rate", "dropout_rng", "scal"])
def test_sharded_op_refuses_unknown_keywords(kwarg):
    from msa_pallas.sharding import sharded_msa_row_attention

    with expect(TypeError, f"['{kwarg}']", "expected keyword arguments among"):
        sharded_msa_row_attention(_mesh(), row_axis="rows", **{kwarg: 0.1})


def test_partition_specs_batch_dims():
    from jax.sharding import PartitionSpec as P
    from msa_pallas.sharding import msa_partition_specs

    specs = msa_partition_specs("data", "rows", "heads", batch_dims=2)
    assert specs.rows == P("data", None, "rows", None, "heads", None)
    assert specs.bias == P("data", None, "heads", None, None)
    assert specs.mask == P("data", None, "rows", None)
    assert msa_partition_specs(row_axis="rows", batch_dims=0).rows == P("rows", None, None, None)
    with expect(ValueError, "batch_dims=0 with batch_axis='data'"):
        msa_partition_specs("data", batch_dims=0)
