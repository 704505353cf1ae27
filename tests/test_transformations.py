"""The op under JAX transformations and AOT export, beyond test_attention.py
(which covers eager vs jit, vmap over one extra axis, checkpoint and
value_and_grad, determinism):

- `jax.lax.scan` over a stack of layers with stacked weights (with
  `jax.checkpoint` on the scanned layer), against a Python loop and "xla";
- vmap with an unbatched bias, nested vmap, grad of vmap;
- `jax.export` for CUDA from this CPU host (the Triton kernels, not their
  interpret-mode emulation), serialised; for CPU, called;
- chex: `fake_pmap`, `variants(with_jit, without_jit)`, `assert_max_traces`.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import msa_pallas
from helpers import compare, numpy_results, random_inputs
from msa_pallas import exporting
from msa_pallas.attention import on_gpu, target_platform

TRANSFORM_SHAPE = (2, 3, 20, 2, 8)  # test_attention.py's: compiled already
PALLAS = "pallas"
# Lowering the kernels for CUDA (the export tests) warns that Pallas's Triton
# backend is deprecated in favour of Mosaic GPU: known, and not this test's subject.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


def _op(implementation=PALLAS):
    def f(q, k, v, bias, mask, gate):
        return msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation=implementation)
    return f


# --- scan over stacked layers ---------------------------------------------------

B, S, N, C, CZ, H, D, LAYERS = 1, 2, 12, 16, 8, 2, 8, 3


def _stacked_weights(seed):
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.standard_normal((LAYERS, *shape), np.float32) / np.sqrt(shape[0]))
    return dict(
        q=w(C, H * D), k=w(C, H * D), v=w(C, H * D), g=w(C, H * D),
        bias=w(CZ, H), out=w(H * D, C),
    )


def _layer(implementation, mask, pair, msa, weights):
    """A residual MSA row-attention layer: projections straight into [B, S, N, H, d]."""
    proj = lambda name: (msa @ weights[name]).reshape(B, S, N, H, D)
    bias = jnp.transpose(pair @ weights["bias"], (0, 3, 1, 2))  # [B, H, N, N]
    out = msa_pallas.msa_row_attention(
        proj("q"), proj("k"), proj("v"), bias, mask, proj("g"), implementation=implementation
    )
    return msa + out.reshape(B, S, N, H * D) @ weights["out"]


def _scan_stack(implementation, remat):
    def stack(weights, msa, pair, mask):
        layer = functools.partial(_layer, implementation, mask, pair)
        if remat:
            layer = jax.checkpoint(layer)
        msa, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), msa, weights)
        return jnp.sum(msa ** 2)
    return jax.jit(jax.value_and_grad(stack, argnums=(0, 1, 2)))


def _loop_stack(implementation):
    def stack(weights, msa, pair, mask):
        for i in range(LAYERS):
            msa = _layer(implementation, mask, pair, msa, jax.tree.map(lambda w: w[i], weights))
        return jnp.sum(msa ** 2)
    return jax.jit(jax.value_and_grad(stack, argnums=(0, 1, 2)))


def test_scan_over_stacked_layers(seed):
    rng = np.random.default_rng(seed)
    weights = _stacked_weights(seed)
    msa = jnp.asarray(rng.standard_normal((B, S, N, C), np.float32))
    pair = jnp.asarray(rng.standard_normal((B, N, N, CZ), np.float32))
    mask = jnp.asarray(rng.random((B, S, N)) > 0.2).at[0, 1].set(False)  # one fully masked row
    args = (weights, msa, pair, mask)
    scanned = _scan_stack(PALLAS, remat=True)(*args)
    looped = _loop_stack(PALLAS)(*args)
    xla = _scan_stack("xla", remat=False)(*args)
    chex.assert_trees_all_equal_shapes_and_dtypes(scanned, xla)
    chex.assert_tree_all_finite(scanned)
    flat = lambda tree: jax.tree.leaves(tree)
    for got, want, label in ((scanned, looped, "scan vs loop"), (scanned, xla, "pallas vs xla")):
        for a, b in zip(flat(got), flat(want)):
            assert helpers.rel_err(a, b) <= 1e-5, (label, helpers.rel_err(a, b))
    # Every layer's weights got a gradient.
    for name, g in scanned[1][0].items():
        assert np.all(np.linalg.norm(np.asarray(g).reshape(LAYERS, -1), axis=1) > 0), name


# --- vmap -----------------------------------------------------------------------


def test_vmap_with_unbatched_bias_and_grad_of_vmap(seed):
    """q, k, v, gate, mask carry an extra axis of 3, the bias is shared
    (in_axes None): the op sees each slice with the same bias, and the bias
    gradient of the vmapped loss sums over the mapped axis."""
    V = 3
    B_, S_, N_, H_, D_ = TRANSFORM_SHAPE
    inputs = random_inputs(seed, (V, B_), S_, N_, H_, D_)
    q, k, v, bias, mask, gate, dout = inputs.args
    bias = bias[0]

    def loss(q, k, v, bias, gate):
        out = jax.vmap(_op(), in_axes=(0, 0, 0, None, 0, 0))(q, k, v, bias, mask, gate)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        q, k, v, bias, gate
    )
    shared = inputs._replace(bias=jnp.broadcast_to(bias, inputs.bias.shape))
    ref_out, (rdq, rdk, rdv, rdbias, rdgate) = numpy_results(shared)
    compare((out, grads), (ref_out, (rdq, rdk, rdv, rdbias.sum(axis=0), rdgate)), 1e-5, "vmap shared bias")


def test_nested_vmap(seed):
    """Two extra leading axes, each mapped by its own vmap; no batch dim left."""
    S_, N_, H_, D_ = 2, 12, 2, 8
    inputs = random_inputs(seed, (2, 3), S_, N_, H_, D_)

    def fwd_bwd(q, k, v, bias, mask, gate, dout):
        out, pullback = jax.vjp(lambda q, k, v, bias, gate: _op()(q, k, v, bias, mask, gate), q, k, v, bias, gate)
        return out, pullback(dout)

    result = jax.jit(jax.vmap(jax.vmap(fwd_bwd)))(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, numpy_results(inputs), 1e-5, "nested vmap")


# --- export ---------------------------------------------------------------------

EXPORT_SHAPE = (1, 2, 20, 2, 8)


def _export_args(dtype=jnp.bfloat16):
    B_, S_, N_, H_, D_ = EXPORT_SHAPE
    rows = jax.ShapeDtypeStruct((B_, S_, N_, H_, D_), dtype)
    return (
        rows, rows, rows, jax.ShapeDtypeStruct((B_, H_, N_, N_), jnp.float32),
        jax.ShapeDtypeStruct((B_, S_, N_), jnp.bool_), rows,
    )


def _train_step(implementation):
    def step(q, k, v, bias, mask, gate):
        def loss(q, k, v, bias, gate):
            out = msa_pallas.msa_row_attention(q, k, v, bias, mask, gate, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, gate)
    return step


def _triton_calls(exported) -> int:
    return exported.mlir_module().count(f"@{exporting.TRITON_CUSTOM_CALL}(")


def _mosaic_calls(exported) -> int:
    return exported.mlir_module().count(f"@{exporting.MOSAIC_CUSTOM_CALL}(")


@pytest.mark.parametrize("implementation", [PALLAS, None])
def test_export_kernels_for_cuda_from_any_host(implementation):
    """Forward + backward exported for CUDA: the Triton kernels (forward with
    statistics, dk/dv, and dq + dbias, fused or not) are in the module as compiled-kernel
    custom calls, whatever the host (on this CPU host, `gpu_target` supplies
    the GPU for the Triton lowering and the op leaves interpret mode)."""
    exported = exporting.export(_train_step(implementation))(*_export_args())
    assert exported.platforms == ("cuda",)
    kernels = helpers.expected_kernel_calls(EXPORT_SHAPE[2], EXPORT_SHAPE[4], jnp.bfloat16)
    assert _triton_calls(exported) == kernels
    assert "stablehlo.while" not in exported.mlir_module()  # no interpret-mode loops
    chex.assert_trees_all_equal_shapes_and_dtypes(
        exported.out_avals,
        tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in (
            jax.ShapeDtypeStruct((), jnp.float32), *_export_args()[:4], _export_args()[5])),
    )
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda",)
    assert _triton_calls(restored) == kernels
    assert restored.in_avals == exported.in_avals


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the local GPU is the target there")
@pytest.mark.parametrize("device_kind, kernels", [
    ("NVIDIA H200", "mosaic"), ("NVIDIA H100 80GB HBM3", "mosaic"), ("NVIDIA A100", "triton"),
])
def test_export_holds_the_kernels_that_gpu_runs(device_kind, kernels):
    """`implementation=None` exported for a GPU holds the kernels that GPU
    would run (the plan sees the abstract device's generation): on an sm90
    device kind at N = 192 (16-bit, where the Mosaic kernels are the
    default) the Mosaic GPU forward, dk/dv, dq and dbias kernels and no
    Triton call; on an A100 the Triton kernels only. `explain` under the
    same target says the same."""
    n_res, head_dim = 192, 16
    rows = jax.ShapeDtypeStruct((1, 2, n_res, 2, head_dim), jnp.bfloat16)
    args = (rows, rows, rows, jax.ShapeDtypeStruct((1, 2, n_res, n_res), jnp.float32),
            jax.ShapeDtypeStruct((1, 2, n_res), jnp.bool_), rows)
    exported = exporting.export(_train_step(None), device_kind=device_kind)(*args)
    with exporting.gpu_target(device_kind):
        plan = msa_pallas.explain(*args)
    assert plan.implementation == kernels and not plan.interpret
    if kernels == "mosaic":
        assert (_mosaic_calls(exported), _triton_calls(exported)) == (4, 0)
    else:
        expected = helpers.expected_kernel_calls(n_res, head_dim, jnp.bfloat16)
        assert (_mosaic_calls(exported), _triton_calls(exported)) == (0, expected)
    assert "stablehlo.while" not in exported.mlir_module()  # no interpreter loops


def test_export_refuses_the_triton_call_without_the_helper():
    """Plain jax.export refuses the Triton custom call (no compatibility
    guarantee): what `exporting.export` disables, knowingly."""
    with exporting.gpu_target():
        with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
            jax.export.export(jax.jit(_train_step(PALLAS)), platforms=("cuda",))(*_export_args())


def test_export_xla_path_for_cuda_needs_no_helper():
    exported = jax.export.export(jax.jit(_train_step("xla")), platforms=("cuda",))(*_export_args())
    assert exported.platforms == ("cuda",) and _triton_calls(exported) == 0
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    assert jax.export.deserialize(exported.serialize()).platforms == ("cuda",)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="calls the CPU export on this host")
def test_export_interpret_kernels_for_cpu_and_call(seed):
    """On CPU the kernels export in interpret mode, as they run here; the
    deserialised artifact computes what the op computes."""
    inputs = random_inputs(seed, *EXPORT_SHAPE, jnp.float32)
    args = inputs.args[:6]
    step = _train_step(PALLAS)
    exported = exporting.export(step, platforms=("cpu",))(*args)
    assert exported.platforms == ("cpu",) and _triton_calls(exported) == 0
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs flatbuffers")
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(*args)
    want = jax.jit(step)(*args)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_export_rejects_mixed_platforms():
    with pytest.raises(ValueError, match="export GPU and non-GPU platforms separately"):
        exporting.export(_train_step(PALLAS), platforms=("cpu", "cuda"))


def test_gpu_target_sets_the_platform_only_inside():
    host = jax.default_backend()
    with exporting.gpu_target("NVIDIA H100"):
        assert target_platform() == "gpu" and on_gpu()
    assert on_gpu() == (host == "gpu")
    if host != "gpu":
        # Tracing after the context picks the host's path again (jit caches key on it).
        f = jax.jit(_op(None))
        lowered = f.lower(*_export_args(jnp.float32))
        assert exporting.TRITON_CUSTOM_CALL not in lowered.as_text()


# --- chex ---------------------------------------------------------------------


def test_fake_pmap(seed):
    """The op inside a pmapped function, with chex.fake_pmap (pmap as vmap on
    one device): forward and gradients of each 'device's' slice."""
    inputs = random_inputs(seed, (2, 2), 3, 20, 2, 8)

    def fwd_bwd(q, k, v, bias, mask, gate, dout):
        out, pullback = jax.vjp(lambda q, k, v, bias, gate: _op()(q, k, v, bias, mask, gate), q, k, v, bias, gate)
        return out, pullback(dout)

    with chex.fake_pmap():
        result = jax.pmap(fwd_bwd)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    compare(result, numpy_results(inputs), 1e-5, "fake_pmap")


def test_no_retrace_for_new_values(seed):
    """A jitted step traces once per shape, not per value (the kernels' static
    arguments are hashable and stable)."""
    first = random_inputs(seed, *TRANSFORM_SHAPE)
    second = random_inputs(seed + 1, *TRANSFORM_SHAPE)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k, v, bias, mask, gate, dout):
        out, pullback = jax.vjp(lambda q, k, v, bias, gate: _op()(q, k, v, bias, mask, gate), q, k, v, bias, gate)
        return out, pullback(dout)

    a = step(*first.args)
    b = step(*second.args)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    chex.assert_tree_all_finite((a, b))


class VariantsTest(chex.TestCase):
    """The same assertions with and without jit (chex.variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_and_grad(self):
        inputs = random_inputs(11, *TRANSFORM_SHAPE)
        q, k, v, bias, mask, gate, dout = inputs.args

        @self.variant
        def fwd_bwd(q, k, v, bias, gate):
            out, pullback = jax.vjp(
                lambda q, k, v, bias, gate: _op()(q, k, v, bias, mask, gate), q, k, v, bias, gate
            )
            return out, pullback(dout)

        out, grads = fwd_bwd(q, k, v, bias, gate)
        chex.assert_shape(out, q.shape)
        chex.assert_type(out, q.dtype)
        chex.assert_trees_all_equal_shapes_and_dtypes(grads, (q, k, v, bias, gate))
        chex.assert_tree_all_finite((out, grads))
        compare((out, grads), numpy_results(inputs), 1e-5, f"chex variant {self.variant}")
