"""The op and the layers under JAX's global settings and the transformations
protein models use, on every backend: "xla", and the kernels in their CPU
interpreters, "pallas" (Triton) and "mosaic" (Mosaic GPU), at tiny shapes;
the same matrix on a GPU (`gpu` marker) at a small but real shape through the
default dispatch, "pallas" and "mosaic".

Settings (each against the plain run of the same backend, bitwise: the same
kernels run): `jax_enable_x64`, `jax.numpy_dtype_promotion("strict")`,
`jax.numpy_rank_promotion("raise")`, `jax.debug_nans`, `jax.debug_infs`.
Transformations: vmap over extra leading axes with in_axes != 0, lax.scan
over blocks with jax.checkpoint and a dots_saveable policy, jax.eval_shape,
donate_argnums, jax.export round trip, a jitted training step; forward-mode
jvp is refused with an error that names the op.

On the CPU the Mosaic GPU interpreter runs each kernel's threads under the
global `jax_enable_x64`, so its x64 case sets the global flag (restored
after); the thread-local context is refused with the fix. It cannot run under
`jax.checkpoint` (its ordered callbacks: "Effects not supported in AD of
checkpoint/remat: OrderedIOEffect") nor be exported (host callbacks): the GPU
tests cover those on the compiled kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import helpers
import msa_pallas
from helpers import random_inputs, rel_err
from msa_pallas.attention import on_gpu

BACKENDS = ("xla", "pallas", "mosaic")
SETTINGS = {
    "x64": lambda: jax.enable_x64(True),
    "strict_promotion": lambda: jax.numpy_dtype_promotion("strict"),
    "rank_raise": lambda: jax.numpy_rank_promotion("raise"),
    "debug_nans": lambda: jax.debug_nans(True),
    "debug_infs": lambda: jax.debug_infs(True),
}
# The settings that act at trace time only: a program they let through is
# the plain one.
TRACE_TIME_SETTINGS = ("strict_promotion", "rank_raise")
# (B, S, N, H, d): B * H > 1; N = 24 one tile, N = 37 a ragged one.
SHAPE = (1, 2, 24, 2, 16)
# The Mosaic kernels' own feature paths under x64, two to a case (each
# compile of the interpreter is 10-20 s on the CPU): two heads per tile
# (d = 8, even H) at N not a multiple of 8 (the row tiles' untiled views);
# d = 8 zero-padded to 16 (odd H) with float32 inputs (bf16 pieces).
X64_MOSAIC_CASES = {
    "paired_heads_ragged_n": ((1, 2, 37, 2, 8), jnp.bfloat16),
    "padded_head_dim_float32_pieces": ((1, 2, 24, 1, 8), jnp.float32),
}
GPU_SHAPE = (1, 8, 256, 4, 32)
# The Mosaic interpreter's transformation cases that compile a program of
# their own (15-20 s each on the CPU).
SLOW_ON_MOSAIC = [pytest.param(b, marks=pytest.mark.slow) if b == "mosaic" else b
                  for b in BACKENDS]
GPU_BACKENDS = (None, "pallas", "mosaic")


def _dtype(backend):
    # The Mosaic forward is 16-bit (float32 runs the Triton forward).
    return jnp.bfloat16 if backend == "mosaic" else jnp.float32


def _inputs(shape, dtype, seed=7):
    return random_inputs(seed, *shape, dtype=dtype, fully_masked_row=True)


@contextlib.contextmanager
def global_x64():
    """64-bit types on for every thread (`jax.config.update`), restored after."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def _setting(name, backend):
    if name == "x64" and backend == "mosaic" and not on_gpu():
        return global_x64()
    return SETTINGS[name]()


@functools.lru_cache(maxsize=None)
def _plain(backend, shape, dtype):
    """The backend's results without any setting, checked once against float64."""
    inputs = _inputs(shape, dtype)
    result = helpers.fwd_bwd(backend)(*inputs.args)
    expected_out, expected_grads = helpers.numpy_results(inputs)
    tol = 5 * helpers.tolerance(dtype)
    assert rel_err(result[0], expected_out) < tol
    for got, want in zip(result[1], expected_grads):
        assert rel_err(got, want) < tol
    return inputs, jax.tree.map(np.asarray, result)


def _assert_bitwise(got, want, label, ulps=0):
    """Equal leaf by leaf; `ulps` > 0 allows that many units in the last place
    of the largest element (`_x64_ulps`)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for name, a, b in zip(helpers.RESULT_NAMES, got_leaves, want_leaves):
        a = np.asarray(a)
        assert a.dtype == b.dtype and a.shape == b.shape, (label, name, a.dtype, b.dtype)
        if ulps == 0:
            assert np.array_equal(a, b), f"{label}: {name} differs from the plain run"
        else:
            a64, b64 = helpers.to_f64(a), helpers.to_f64(b)
            bound = ulps * float(jnp.finfo(a.dtype).eps) * np.abs(b64).max()
            assert np.abs(a64 - b64).max() <= bound, f"{label}: {name} beyond {ulps} ulps"


def _assert_layer_results_equal(got, plain, ulps=0):
    """Equal leaf by leaf; `ulps` > 0 allows that many units in the last place
    of the largest value of the whole tree (a gradient that is noise around 0
    has no scale of its own)."""
    got, plain = jax.tree.leaves(got), jax.tree.leaves(plain)
    scale = max(float(np.abs(b).max()) for b in plain)
    for a, b in zip(got, plain):
        assert a.dtype == b.dtype and a.shape == b.shape
        if ulps == 0:
            assert np.array_equal(a, b)
        else:
            bound = ulps * float(jnp.finfo(b.dtype).eps) * scale
            assert np.abs(helpers.to_f64(a) - helpers.to_f64(b)).max() <= bound


def _x64_ulps(backend) -> int:
    """The Triton interpreter's float32 sums under x64 on the CPU: the suite
    compiles at XLA's optimisation level 0 (conftest.py), where the HLO's
    64-bit index arithmetic outside the kernels changes the order XLA adds one
    tile in (1 ulp in a few bias-gradient entries); at the default level, and
    on the GPU, the results are bitwise equal."""
    fast_compile = "xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    return 4 if backend == "pallas" and fast_compile and not on_gpu() else 0


# --- settings x backends ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_setting_forward_and_backward_equal_the_plain_run(setting, backend):
    inputs, plain = _plain(backend, SHAPE, _dtype(backend))
    if setting in TRACE_TIME_SETTINGS and backend == "mosaic" and not on_gpu():
        # These act at trace time only (they raise there or change nothing), and
        # a run of the Mosaic interpreter takes seconds: traced and lowered here.
        with _setting(setting, backend):
            helpers.fwd_bwd(backend).lower(*inputs.args)
        return
    with _setting(setting, backend):
        result = helpers.fwd_bwd(backend)(*inputs.args)
        result = jax.tree.map(np.asarray, result)
    ulps = _x64_ulps(backend) if setting == "x64" else 0
    _assert_bitwise(result, plain, f"{setting}/{backend}", ulps)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(X64_MOSAIC_CASES))
def test_x64_mosaic_feature_paths_equal_the_plain_run(case):
    shape, dtype = X64_MOSAIC_CASES[case]
    inputs, plain = _plain("mosaic", shape, dtype)
    with global_x64():
        result = jax.tree.map(np.asarray, helpers.fwd_bwd("mosaic")(*inputs.args))
    _assert_bitwise(result, plain, f"x64/mosaic/{case}")


def test_x64_triton_ragged_n_equals_the_plain_run():
    inputs, plain = _plain("pallas", (1, 2, 37, 2, 16), jnp.float32)
    with jax.enable_x64(True):
        result = jax.tree.map(np.asarray, helpers.fwd_bwd("pallas")(*inputs.args))
    _assert_bitwise(result, plain, "x64/pallas/ragged_n", _x64_ulps("pallas"))


@pytest.mark.skipif("jax.default_backend() == 'gpu'")
def test_mosaic_interpreter_refuses_a_thread_local_x64_with_the_fix():
    inputs = _inputs(SHAPE, jnp.bfloat16)
    # A jit of its own: one compiled under the global setting would be reused.
    op = jax.jit(lambda q, k, v, bias: msa_pallas.msa_row_attention(
        q, k, v, bias, implementation="mosaic"))
    with jax.enable_x64(True), pytest.raises(
        RuntimeError, match=r"jax.config.update\('jax_enable_x64', True\)"
    ):
        op.trace(*inputs.args[:4])


@pytest.mark.skipif("jax.default_backend() == 'gpu'")
def test_mosaic_interpreter_without_the_scheduler_flag_refuses_at_trace_time():
    """Without XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false the
    interpreter can hang: the op refuses at trace time and names the flag."""
    code = (
        "import jax, jax.numpy as jnp, msa_pallas\n"
        "x = jnp.ones((1, 1, 8, 1, 16), jnp.bfloat16)\n"
        "b = jnp.ones((1, 1, 8, 8), jnp.float32)\n"
        "try:\n"
        "    jax.jit(lambda x: msa_pallas.msa_row_attention(x, x, x, b, implementation='mosaic'))"
        ".trace(x)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false" in out.stdout, (
        out.stdout, out.stderr[-2000:])


# --- the layers and converters under the settings ---------------------------------


def _layer_inputs(seed=3, S=2, N=12, c_m=16, c_z=8):
    rng = np.random.default_rng(seed)
    msa = jnp.asarray(rng.standard_normal((1, S, N, c_m), np.float32))
    pair = jnp.asarray(rng.standard_normal((1, N, N, c_z), np.float32))
    mask = jnp.asarray(rng.random((1, S, N)) > 0.2)
    return msa, pair, mask


@functools.lru_cache(maxsize=None)
def _linen_run(implementation):
    layer = msa_pallas.MSARowAttentionWithPairBias(
        msa_dim=16, pair_dim=8, num_heads=2, implementation=implementation
    )

    @jax.jit
    def run(msa, pair, mask):
        variables = layer.init(jax.random.key(0), msa, pair, mask)

        def loss(variables, msa):
            return jnp.sum(layer.apply(variables, msa, pair, mask) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))(variables, msa)

    return run


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_linen_layer_under_setting(setting, implementation):
    args = _layer_inputs()
    plain = jax.tree.map(np.asarray, _linen_run(implementation)(*args))
    with SETTINGS[setting]():
        got = jax.tree.map(np.asarray, _linen_run(implementation)(*args))
    ulps = _x64_ulps(implementation) if setting == "x64" else 0
    _assert_layer_results_equal(got, plain, ulps)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_nnx_layer_and_converters_under_setting(setting):
    from flax import nnx

    torch_sd = _torch_like_state_dict()
    msa, pair, mask = _layer_inputs()

    def run():
        variables = msa_pallas.convert.from_torch_state_dict(torch_sd)
        linen_out = msa_pallas.convert.module_from_variables(variables).apply(
            variables, msa, pair, mask
        )
        model = msa_pallas.convert.to_nnx(variables)
        graph, state = nnx.split(model)

        @jax.jit
        def nnx_loss(state, msa):
            return jnp.sum(nnx.merge(graph, state)(msa, pair, mask) ** 2)

        loss, grads = jax.value_and_grad(nnx_loss, argnums=(0, 1))(state, msa)
        return np.asarray(linen_out), np.asarray(loss), jax.tree.map(np.asarray, grads)

    plain = run()
    with SETTINGS[setting]():
        got = run()
    _assert_layer_results_equal(got, plain)


def _torch_like_state_dict(c_m=16, c_z=8, heads=2, seed=5):
    """The PyTorch reference layer's state dict, as NumPy float32 arrays."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    sd = {
        "layer_norm.weight": 1 + 0.1 * w(c_m), "layer_norm.bias": 0.1 * w(c_m),
        "pair_bias.weight": w(heads, c_z), "pair_bias.bias": w(heads),
    }
    for name in ("query", "key", "value", "gate", "out_proj"):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = w(c_m, c_m), w(c_m)
    return sd


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_haiku_module_under_setting(setting):
    pytest.importorskip("haiku")
    import haiku_helpers

    config, global_config = haiku_helpers.configs(num_head=2, zero_init=False)
    f = haiku_helpers.transformed(config, global_config, implementation="pallas")
    rng = np.random.default_rng(11)
    msa = jnp.asarray(rng.standard_normal((2, 12, 16), np.float32))
    pair = jnp.asarray(rng.standard_normal((12, 12, 8), np.float32))
    mask = jnp.asarray((rng.random((2, 12)) > 0.2).astype(np.float32))
    params = f.init(jax.random.key(1), msa, mask, pair)

    @jax.jit
    def run(params, msa):
        return jax.value_and_grad(lambda p, m: jnp.sum(f.apply(p, None, m, mask, pair) ** 2),
                                  argnums=(0, 1))(params, msa)

    plain = jax.tree.map(np.asarray, run(params, msa))
    with SETTINGS[setting]():
        got = jax.tree.map(np.asarray, run(params, msa))
    ulps = _x64_ulps("pallas") if setting == "x64" else 0
    _assert_layer_results_equal(got, plain, ulps)


# --- transformations x backends --------------------------------------------------

CPU_MOSAIC_NO_REMAT = (
    "the Mosaic GPU interpreter's ordered host callbacks cannot be differentiated "
    "under jax.checkpoint on the CPU (JAX: 'Effects not supported in AD of "
    "checkpoint/remat: OrderedIOEffect'); test_gpu_transformations covers it"
)
CPU_MOSAIC_NO_EXPORT = (
    "the Mosaic GPU interpreter runs as host callbacks, which jax.export cannot "
    "serialise (JAX: 'serialization of host_callbacks is not yet implemented'); "
    "test_gpu_transformations exports the compiled kernels"
)


def _fwd_bwd(backend, **jit_kwargs):
    def run(q, k, v, bias, mask, gate, dout):
        out, pullback = jax.vjp(
            lambda q, k, v, bias, gate: msa_pallas.msa_row_attention(
                q, k, v, bias, mask, gate, implementation=backend),
            q, k, v, bias, gate,
        )
        return out, pullback(dout)
    return jax.jit(run, **jit_kwargs)


def _close(got, want, label, rtol=1e-6):
    for name, a, b in zip(helpers.RESULT_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (label, name)
        assert rel_err(a, b) <= rtol, (label, name, rel_err(a, b))


@pytest.mark.parametrize("backend", SLOW_ON_MOSAIC)
def test_vmap_over_an_extra_axis_not_the_first(backend):
    _check_vmap(backend, SHAPE, _dtype(backend))


def _check_vmap(backend, shape, dtype):
    """vmap with in_axes=1 over q, k, v, gate and the cotangent (the bias and
    mask mapped over their axis 0): each slice equals the plain run on it."""
    first, _ = _plain(backend, shape, dtype)
    second = _inputs(shape, dtype, seed=8)
    rows = lambda name: jnp.stack([getattr(first, name), getattr(second, name)], axis=1)
    stacked = lambda name: jnp.stack([getattr(first, name), getattr(second, name)])
    args = (rows("q"), rows("k"), rows("v"), stacked("bias"), stacked("mask"), rows("gate"),
            rows("dout"))
    mapped = jax.jit(jax.vmap(helpers.fwd_bwd(backend).__wrapped__,
                              in_axes=(1, 1, 1, 0, 0, 1, 1), out_axes=1))
    got = jax.tree.map(np.asarray, mapped(*args))
    for i, inputs in enumerate((first, second)):
        want = jax.tree.map(np.asarray, helpers.fwd_bwd(backend)(*inputs.args))
        out, grads = got
        sliced = (out[:, i], tuple(g[:, i] for g in grads))
        # One float32 / bf16 ulp: the mapped program is a different compile.
        _close(sliced, want, f"vmap/{backend}/{i}", rtol=1e-6 if dtype == jnp.float32 else 8e-3)


LAYERS = 2


BLOCK_SHAPE = (1, 2, 24, 2, 8)
GPU_BLOCK_SHAPE = (1, 8, 256, 4, 32)


@functools.lru_cache(maxsize=None)
def _block_stack(backend, policy, remat: bool, shape=BLOCK_SHAPE):
    """A residual stack of row-attention blocks over stacked weights, run by
    lax.scan, each block under jax.checkpoint with `policy` when `remat`."""
    B, S, N, H, D = shape

    def block(mask, pair_bias, msa, weights):
        proj = lambda w: (msa @ w).reshape(B, S, N, H, D)
        out = msa_pallas.msa_row_attention(
            proj(weights["q"]), proj(weights["k"]), proj(weights["v"]), pair_bias, mask,
            proj(weights["g"]), implementation=backend)
        return msa + out.reshape(B, S, N, H * D) @ weights["o"]

    def stack(weights, msa, pair_bias, mask):
        layer = functools.partial(block, mask, pair_bias)
        if remat:
            layer = jax.checkpoint(layer, policy=policy)
        msa, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), msa, weights)
        return jnp.sum(msa.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(stack, argnums=(0, 1, 2)))


def _block_args(dtype, shape=BLOCK_SHAPE, seed=13):
    B, S, N, H, D = shape
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(
        (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 2 else 1)).astype(np.float32)
    ).astype(dtype)
    weights = {name: n(LAYERS, H * D, H * D) for name in ("q", "k", "v", "g", "o")}
    return weights, n(B, S, N, H * D), n(B, H, N, N).astype(jnp.float32), jnp.asarray(
        rng.random((B, S, N)) > 0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_over_blocks_with_checkpoint_policies(backend):
    """lax.scan over blocks under jax.checkpoint (everything recomputed, and
    dots_saveable as AF2-style stacks use): equal to the stack without remat."""
    if backend == "mosaic" and not on_gpu():
        with pytest.raises(Exception, match="OrderedIOEffect"):
            _block_stack(backend, None, True).trace(*_block_args(jnp.bfloat16))
        pytest.skip(CPU_MOSAIC_NO_REMAT)
    _check_scan_with_checkpoint(backend, BLOCK_SHAPE, _dtype(backend))


def _check_scan_with_checkpoint(backend, shape, dtype):
    args = _block_args(dtype, shape)
    plain = jax.tree.map(np.asarray, _block_stack(backend, None, False, shape)(*args))
    for policy in (None, jax.checkpoint_policies.dots_saveable):
        got = jax.tree.map(np.asarray, _block_stack(backend, policy, True, shape)(*args))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
            # bf16: the recomputing program rounds its projections where XLA fuses them;
            # float32 on a GPU: its projections' default-precision products differ
            # between the two programs (measured 2.8e-6 on an H200).
            rtol = (1e-5 if on_gpu() else 1e-6) if dtype == jnp.float32 else 1e-2
            assert a.dtype == b.dtype and rel_err(a, b) <= rtol, (backend, policy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_shape_and_donated_arguments(backend):
    """jax.eval_shape gives the plain run's shapes and dtypes without running
    it; with q, k, v and the cotangent donated the results are the plain run's."""
    _check_eval_shape_and_donation(backend, SHAPE, _dtype(backend))


def _check_eval_shape_and_donation(backend, shape, dtype):
    inputs, plain = _plain(backend, shape, dtype)
    shapes = jax.eval_shape(helpers.fwd_bwd(backend), *inputs.args)
    for shape, value in zip(jax.tree.leaves(shapes), jax.tree.leaves(plain)):
        assert (shape.shape, shape.dtype) == (value.shape, value.dtype)
    if backend == "mosaic" and not on_gpu():
        return  # the compile below would add a minute; the GPU test donates
    donated = _fwd_bwd(backend, donate_argnums=(0, 1, 2, 6))
    copies = [None if x is None else jnp.array(x, copy=True) for x in inputs.args]
    got = jax.tree.map(np.asarray, donated(*copies))
    _close(got, plain, f"donate/{backend}", rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_round_trip(backend):
    """jax.export of forward + backward for this host, serialised, restored
    and called: the plain run's results."""
    if backend == "mosaic" and not on_gpu():
        pytest.skip(CPU_MOSAIC_NO_EXPORT)
    _check_export(backend, SHAPE, _dtype(backend))


def _check_export(backend, shape, dtype):
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    from msa_pallas import exporting

    inputs, plain = _plain(backend, shape, dtype)
    platforms = ("cuda",) if on_gpu() else ("cpu",)
    exported = exporting.export(helpers.fwd_bwd(backend).__wrapped__, platforms=platforms)(
        *inputs.args)
    restored = export.deserialize(exported.serialize())
    got = jax.tree.map(np.asarray, restored.call(*inputs.args))
    _close(got, plain, f"export/{backend}", rtol=1e-6 if dtype == jnp.float32 else 8e-3)


@pytest.mark.parametrize("backend", SLOW_ON_MOSAIC)
def test_jitted_training_step_of_the_linen_layer(backend):
    """One jitted SGD step of the linen layer (params donated): the new params
    are params - lr * the gradient, and a second step lowers the loss."""
    msa, pair, mask = _layer_inputs()
    layer = msa_pallas.MSARowAttentionWithPairBias(
        msa_dim=16, pair_dim=8, num_heads=2, implementation=backend)
    params = layer.init(jax.random.key(0), msa, pair, mask)
    target = jnp.roll(msa, 1, axis=-1)

    def loss(params):
        return jnp.mean((layer.apply(params, msa, pair, mask) - target) ** 2)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params):
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), grads

    before = jax.tree.map(np.asarray, params)
    first_loss, params, grads = step(params)
    for p, b, g in zip(jax.tree.leaves(params), jax.tree.leaves(before), jax.tree.leaves(grads)):
        # Within an ulp: XLA on a GPU fuses the update into one multiply-add.
        np.testing.assert_allclose(
            np.asarray(p), (b - 0.5 * np.asarray(g)).astype(b.dtype), rtol=2e-7, atol=1e-9)
    second_loss, _, _ = step(params)
    assert np.isfinite(first_loss) and second_loss < first_loss


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_forward_mode_is_refused_with_the_op_named(backend):
    inputs = _inputs(SHAPE, _dtype(backend))
    f = lambda q: msa_pallas.msa_row_attention(
        q, inputs.k, inputs.v, inputs.bias, implementation=backend)
    with pytest.raises(TypeError, match=r"msa_row_attention.*reverse mode"):
        jax.jvp(f, (inputs.q,), (inputs.q,))


# --- the same matrix on a GPU: compiled kernels, a small but real shape ------------


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", GPU_BACKENDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_gpu_setting_equals_the_plain_run(setting, implementation):
    inputs, plain = _plain(implementation, GPU_SHAPE, jnp.bfloat16)
    with SETTINGS[setting]():
        got = jax.tree.map(np.asarray, helpers.fwd_bwd(implementation)(*inputs.args))
    _assert_bitwise(got, plain, f"gpu/{setting}/{implementation}")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", GPU_BACKENDS)
@pytest.mark.parametrize("case", list(X64_MOSAIC_CASES))
def test_gpu_x64_feature_paths_equal_the_plain_run(case, implementation):
    """d = 8 two heads per tile and zero-padded, float32 inputs, N = 37,
    under `with jax.enable_x64(True)` (no interpreter threads on a GPU)."""
    shape, dtype = X64_MOSAIC_CASES[case]
    inputs, plain = _plain(implementation, shape, dtype)
    with jax.enable_x64(True):
        got = jax.tree.map(np.asarray, helpers.fwd_bwd(implementation)(*inputs.args))
    _assert_bitwise(got, plain, f"gpu/x64/{case}/{implementation}")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", GPU_BACKENDS)
@pytest.mark.parametrize("transformation", ["vmap", "scan_checkpoint", "eval_shape_donate",
                                            "export"])
def test_gpu_transformations(transformation, implementation):
    """The CPU transformation tests at GPU_SHAPE, bf16, on the compiled
    kernels (the Mosaic kernels under jax.checkpoint and jax.export too)."""
    check = {
        "vmap": _check_vmap,
        "scan_checkpoint": _check_scan_with_checkpoint,
        "eval_shape_donate": _check_eval_shape_and_donation,
        "export": _check_export,
    }[transformation]
    shape = GPU_BLOCK_SHAPE if transformation == "scan_checkpoint" else GPU_SHAPE
    check(implementation, shape, jnp.bfloat16)
