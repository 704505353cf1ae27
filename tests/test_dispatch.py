"""The dispatch (`msa_pallas.dispatch.plan_call`, `msa_pallas.explain`): which
kernels a call runs, with which tiles, padding and reason.

The plans for a GPU are made on this CPU by passing the target (a
`dispatch.Target`) or by tracing under `exporting.gpu_target`; the op's
results on a plan are checked against float64 (the kernels interpreted).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import helpers
import msa_pallas
from msa_pallas import exporting
from msa_pallas.block_sizes import KernelTiles
from msa_pallas.kernels.mosaic.tiles import MosaicTiles
from msa_pallas.kernels.mosaic.tiles import backward_tiles as mosaic_backward_tiles
from msa_pallas.dispatch import (
    MOSAIC_FLOAT32_MIN_RESIDUES, MOSAIC_MIN_RESIDUES, CallPlan, Target, current_target,
    plan_call,
)

HOPPER, AMPERE, CPU = Target("gpu", 90), Target("gpu", 80), Target("cpu")


def structs(n_res, head_dim, dtype=jnp.bfloat16, bias_dtype=jnp.float32, heads=4, rows=2):
    q = jax.ShapeDtypeStruct((1, rows, n_res, heads, head_dim), dtype)
    bias = jax.ShapeDtypeStruct((1, heads, n_res, n_res), bias_dtype)
    return q, q, q, bias


def plan(n_res, head_dim, dtype=jnp.bfloat16, bias_dtype=jnp.float32, heads=4,
         target=HOPPER, **kwargs) -> CallPlan:
    return plan_call(*structs(n_res, head_dim, dtype, bias_dtype, heads), target=target, **kwargs)


def test_cpu_runs_xla_by_default_and_the_interpreters_when_asked():
    assert plan(384, 32, target=CPU).implementation == "xla"
    for asked, backend in (("triton", "triton"), ("pallas", "triton"), ("mosaic", "mosaic")):
        chosen = plan(384, 32, target=CPU, implementation=asked)
        assert chosen.implementation == chosen.forward == chosen.backward == backend
        assert chosen.interpret and "asked" in chosen.reason
    assert not plan(384, 32, implementation="triton").interpret
    # The persistent Mosaic forward stalls the interpreter: never planned there.
    assert not plan(384, 32, target=CPU, implementation="mosaic").forward_tiles.persistent
    assert plan(384, 32, implementation="mosaic").forward_tiles.persistent


def test_hopper_rule_with_the_measured_thresholds():
    """`implementation=None` on sm90: the Mosaic kernels where they were
    measured faster and take the inputs; the Triton kernels elsewhere."""
    picks = lambda *args, **kw: plan(*args, **kw).implementation  # noqa: E731
    # 16-bit: from N = 192 (d = 8 included).
    assert picks(MOSAIC_MIN_RESIDUES, 32) == picks(384, 8, jnp.float16) == "mosaic"
    assert picks(MOSAIC_MIN_RESIDUES - 8, 32) == picks(128, 32) == "triton"
    # N no multiple of 8: where the Mosaic kernels take it (d <= 64).
    assert picks(333, 32) == picks(1001, 8) == picks(333, 64) == "mosaic"
    assert picks(333, 128) == picks(181, 32) == "triton"
    assert "N=333" in plan(333, 128).reason
    # float32 with a float32 bias: from N = 256, a multiple of 128, d <= 64.
    assert picks(MOSAIC_FLOAT32_MIN_RESIDUES, 32, jnp.float32) == "mosaic"
    assert picks(1024, 64, jnp.float32) == picks(384, 8, jnp.float32) == "mosaic"
    assert picks(128, 32, jnp.float32) == picks(320, 32, jnp.float32) == "triton"
    assert picks(384, 128, jnp.float32) == picks(384, 32, jnp.float32, jnp.bfloat16) == "triton"
    # Other GPUs: Triton; float64 and d > 128: XLA. Dropout changes nothing.
    assert picks(384, 32, target=AMPERE) == "triton"
    assert "sm80" in plan(384, 32, target=AMPERE).reason
    key = jax.random.key(0)
    assert picks(384, 32, dropout_rate=0.1, dropout_rng=key) == "mosaic"
    assert picks(384, 32, dropout_rate=0.1, dropout_rng=key, target=AMPERE) == "triton"
    assert picks(384, 256) == "xla"
    # The public wrapper answers the same on the current target (a CPU here).
    q, _, _, bias = structs(384, 32)
    assert msa_pallas.resolve_implementation(None, q, 0.0, bias) == plan(
        384, 32, target=current_target()).implementation
    assert msa_pallas.resolve_implementation("pallas", q, 0.0, bias) == "triton"


def test_float32_runs_the_triton_forward_and_the_mosaic_backward():
    chosen = plan(384, 32, jnp.float32)
    assert (chosen.forward, chosen.backward) == ("triton", "mosaic")
    assert isinstance(chosen.forward_tiles, KernelTiles)
    assert [name for name, _ in chosen.backward_tiles] == ["dkdv", "dq", "dbias"]
    assert all(isinstance(tiles, MosaicTiles) for _, tiles in chosen.backward_tiles)
    # d = 8: the Triton forward reads it as it is, the backward's pieces padded.
    chosen = plan(384, 8, jnp.float32)
    assert (chosen.forward_head_dim, chosen.backward_head_dim) == (8, 16)


def test_head_dim_8_pairs_heads_or_pads():
    """d = 8 with an even H: read as it is, two heads per tile; with an odd
    H zero-padded to 16, forward and backward; d = 16 never padded."""
    even, odd = plan(384, 8, heads=4), plan(384, 8, heads=3)
    assert even.implementation == odd.implementation == "mosaic"
    assert (even.forward_head_dim, even.backward_head_dim) == (8, 8)
    assert (odd.forward_head_dim, odd.backward_head_dim) == (16, 16)
    assert "d = 8 zero-padded to 16" in str(odd) and "zero-padded" not in str(even)
    assert plan(384, 16, heads=3).forward_head_dim == 16
    # The Triton kernels take d = 8 as it is.
    assert plan(384, 8, heads=3, target=AMPERE).forward_head_dim == 8


def test_triton_backward_fuses_dq_and_dbias_where_the_defaults_do():
    fused = plan(256, 32, jnp.bfloat16, target=AMPERE)
    assert [name for name, _ in fused.backward_tiles] == ["dkdv", "dq_dbias"]
    separate = plan(1024, 32, jnp.bfloat16, target=AMPERE)
    assert [name for name, _ in separate.backward_tiles] == ["dkdv", "dq", "dbias"]
    assert separate.tiles_of("dq_dbias") is None and separate.tiles_of("dq") is not None


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_dropout_takes_64_key_forward_stages(bias_dtype):
    """With attention dropout the Mosaic forward takes 64-key stages (the
    H200 sweep in `tiles.forward_tiles`' docstring); the backward kernels
    keep their tiles, and without dropout nothing changes."""
    plain = plan(384, 32, bias_dtype=bias_dtype)
    dropped = plan(384, 32, bias_dtype=bias_dtype, dropout_rate=0.1,
                   dropout_rng=jax.random.key(0))
    assert plain.forward == dropped.forward == "mosaic"
    assert dropped.forward_tiles.block_k == 64
    assert dropped.forward_tiles.block_q == plain.forward_tiles.block_q == 128
    if bias_dtype == jnp.bfloat16:
        assert plain.forward_tiles.block_k == 128
    assert dropped.backward_tiles == plain.backward_tiles
    assert dropped.ping_pong == plain.ping_pong


def test_skipping_padding_takes_the_persistent_dq_and_dkdv_and_the_prologue_kernel():
    """Inside `skipping_padding()` with a mask, 16-bit inputs and no dropout,
    the Mosaic dq and dk/dv kernels run persistent (one CTA per SM), with the
    tiles they have otherwise, and the backward's prologue is one kernel;
    dbias, the forward, and every other call keep the default grids and
    XLA's passes."""
    q, k, v, bias = structs(256, 32, bias_dtype=jnp.bfloat16, rows=4)
    mask = jax.ShapeDtypeStruct((1, 4, 256), jnp.bool_)
    rng = jax.random.key(0)

    def planned(mask=mask, dtype=jnp.bfloat16, **kwargs):
        q_in = jax.ShapeDtypeStruct(q.shape, dtype)
        with msa_pallas.skipping_padding():
            return plan_call(q_in, q_in, q_in, bias, mask, target=HOPPER, **kwargs)

    dense = plan_call(q, k, v, bias, mask, target=HOPPER)
    skipping = planned()
    assert skipping.skips_padding and not dense.skips_padding
    for name in ("dq", "dkdv"):
        assert skipping.tiles_of(name) == dataclasses.replace(dense.tiles_of(name), persistent=True)
    assert not dense.tiles_of("dq").persistent and not dense.tiles_of("dkdv").persistent
    assert skipping.tiles_of("dbias") == dense.tiles_of("dbias")
    assert skipping.forward_tiles == dense.forward_tiles
    # Skipping masked queries too, up to N = 256: four MSA rows per CTA in
    # 64 x 64 forward tiles; the backward's tiles as without.
    queries = planned(mask_queries=True)
    assert queries.kernels_mask_queries
    assert queries.forward_tiles == MosaicTiles(64, 64, 2, 4, ping_pong=False, persistent=True)
    assert queries.backward_tiles == skipping.backward_tiles
    assert plan_call(q, k, v, bias, mask, target=HOPPER, mask_queries=True).forward_tiles == (
        dense.forward_tiles)
    assert skipping.prologue_kernel and "backward prologue" in str(skipping)
    assert not dense.prologue_kernel
    for other in (planned(mask=None), planned(dropout_rate=0.1, dropout_rng=rng),
                  planned(dtype=jnp.float32, implementation="mosaic")):
        assert other.backward == "mosaic"
        assert not any(tiles.persistent for _, tiles in other.backward_tiles), other
        assert not other.prologue_kernel, other
    with pytest.raises(ValueError, match="take no dropout"):
        mosaic_backward_tiles((1, 4, 256, 4, 32), jnp.bfloat16, jnp.bfloat16,
                              dropout=True, persistent=True)


def test_backward_kernels_make_masked_keys_ds_zero_without_a_select():
    """Every Mosaic backward kernel the dispatch plans takes
    `mask_without_select` (measured faster on an H100), at every head dim,
    bias dtype and input dtype, with dropout, skipping padding or visiting
    it; so does a block config built by `default_block_config`."""
    rng = jax.random.key(0)
    for n_res, head_dim, bias_dtype in ((256, 32, jnp.float32), (384, 8, jnp.bfloat16),
                                        (200, 64, jnp.float32), (256, 128, jnp.bfloat16)):
        q, k, v, bias = structs(n_res, head_dim, bias_dtype=bias_dtype, rows=4)
        mask = jax.ShapeDtypeStruct((1, 4, n_res), jnp.bool_)
        plans = [plan_call(q, k, v, bias, mask, target=HOPPER),
                 plan_call(q, k, v, bias, mask, target=HOPPER, dropout_rate=0.1,
                           dropout_rng=rng)]
        with msa_pallas.skipping_padding():
            plans.append(plan_call(q, k, v, bias, mask, target=HOPPER))
        if head_dim <= 64:
            q32 = jax.ShapeDtypeStruct(q.shape, jnp.float32)
            plans.append(plan_call(q32, q32, q32, bias, mask, target=HOPPER,
                                   implementation="mosaic"))
        for planned in plans:
            assert planned.backward == "mosaic", planned
            for name, tiles in planned.backward_tiles:
                assert tiles.mask_without_select, (name, planned)
        config = msa_pallas.default_block_config(n_res, head_dim, jnp.bfloat16, bias_dtype)
        if config.mosaic_backward is not None:
            assert config.mosaic_backward.dq.mask_without_select


def test_user_tiles_and_round_bias():
    config = msa_pallas.default_block_config(384, 32, jnp.bfloat16, jnp.bfloat16)
    mine = MosaicTiles(block_q=64, block_k=64, num_stages=3, msa_rows=1)
    chosen = plan(384, 32, block_config=dataclasses.replace(config, mosaic_forward=mine),
                  round_bias=True)
    assert chosen.forward_tiles == mine and chosen.bias_dtype == "bfloat16"
    assert "bias read as bfloat16" in str(chosen)
    assert plan(384, 32).bias_dtype is None
    # Triton tiles are clipped to N.
    assert plan(20, 32, target=AMPERE).forward_tiles.block_q <= 32


def test_explain_prints_kernels_tiles_padding_and_reason():
    q, k, v, bias = structs(384, 8, heads=3)
    with exporting.gpu_target("NVIDIA H200"):
        chosen = msa_pallas.explain(q, k, v, bias)
    text = str(chosen)
    assert chosen.target == HOPPER and not chosen.interpret
    for fragment in ("mosaic (compiled, target gpu sm90)", "forward:  mosaic MosaicTiles(",
                     "dkdv: MosaicTiles(", "dq: MosaicTiles(", "dbias: MosaicTiles(",
                     "forward head dim: d = 8 zero-padded to 16", "why: Hopper, bfloat16"):
        assert fragment in text, (fragment, text)
    here = str(msa_pallas.explain(q, k, v, bias))
    assert "xla" in here and "no GPU target" in here
    # Hashable, a static argument of the custom VJP: the same kernels asked
    # for by name share it (the reason is not compared).
    asked = msa_pallas.explain(q, k, v, bias, implementation="mosaic", target=HOPPER)
    assert asked.reason != chosen.reason
    assert asked == chosen and hash(asked) == hash(chosen)


def test_explain_validates_as_the_op_does():
    q, k, v, bias = structs(64, 32)
    with pytest.raises(ValueError, match="expected one of None, 'triton', 'mosaic', 'xla'"):
        msa_pallas.explain(q, k, v, bias, implementation="cuda")
    with pytest.raises(ValueError, match="bias has shape"):
        msa_pallas.explain(q, k, v, jax.ShapeDtypeStruct((1, 4, 64, 63), jnp.float32))


@pytest.mark.parametrize("device_kind, capability", [
    ("NVIDIA H200", 90), ("NVIDIA H100 80GB HBM3", 90), ("NVIDIA GH200 480GB", 90),
    ("NVIDIA A100-SXM4-80GB", 80), ("NVIDIA A10", 86), ("Some GPU", None),
])
def test_the_abstract_device_gives_the_gpu_generation(device_kind, capability):
    with exporting.gpu_target(device_kind):
        assert current_target() == Target("gpu", capability)
        assert current_target().hopper == (capability == 90)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans for interpreted kernels")
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_op_on_the_plan_matches_float64_with_d8_and_odd_heads(implementation, seed):
    """The padding path the plan asks for (d = 8, H = 3: no head pairs, the
    Mosaic kernels read d zero-padded to 16), N = 20 (no multiple of 8):
    output and every gradient within the dtype's tolerance of float64, like
    the plain-XLA path."""
    inputs = helpers.random_inputs(seed, 1, 2, 20, 3, 8, jnp.bfloat16, fully_masked_row=True)
    chosen = msa_pallas.explain(*inputs.args[:6], implementation=implementation)
    assert chosen.forward_head_dim == (16 if implementation == "mosaic" else 8)
    result = helpers.fwd_bwd(implementation)(*inputs.args)
    helpers.assert_shapes_dtypes_finite(result, inputs)
    reference = helpers.numpy_results(inputs)
    errors = helpers.compare(result, reference, helpers.tolerance(jnp.bfloat16), implementation)
    xla_errors = helpers.compare(
        helpers.fwd_bwd("xla")(*inputs.args), reference, helpers.tolerance(jnp.bfloat16), "xla"
    )
    helpers.assert_no_worse_than_xla(errors, xla_errors, jnp.bfloat16, implementation)


@pytest.mark.gpu
def test_the_plan_on_this_gpu():
    """On the GPU the tests run on, the plan's target is that GPU and the
    rule's answers where the thresholds put them (H200: sm90)."""
    target = current_target()
    assert target.gpu and target.compute_capability is not None
    q, k, v, bias = structs(384, 32)
    chosen = msa_pallas.explain(q, k, v, bias)
    assert chosen.implementation == ("mosaic" if target.hopper else "triton")
    assert not chosen.interpret
    q, _, _, bias = structs(128, 32)
    assert msa_pallas.resolve_implementation(None, q, 0.0, bias) == "triton"
