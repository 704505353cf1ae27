"""The `bf16-*` sharding cases of test_sharding.py, run by sharding_worker.py on 8
simulated CPU devices: bfloat16 q, k, v and bias, and how the bias gradient is
rounded when S is split across devices.

Each record holds the all-reduces of the program right after partitioning and
`rounding_report`: how far the sharded bias gradient lies from the one-device
float32 sum, in bfloat16 rounding steps.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import helpers
import msa_pallas
from msa_pallas.sharding import msa_partition_specs, sharded_msa_row_attention
from sharding_worker import MOVES_DATA, block_config_for, result_shapes

# (case) -> the one-device bias gradients, computed once per shape and options.
_REFERENCES = {}

# bfloat16 q, k, v and bias, on a 2 x 2 x 2 mesh ("data", "rows", "heads").
# S = 8 over all three axes leaves one MSA row per device: the bias gradient
# is then a sum of 8 per-device partial sums.
BF16_SHAPE = (2, 8, 12, 4, 8)
BF16_ALL_AXES = ("data", "rows", "heads")

# id -> (spec kwargs, options). options: shard_map (sharded_msa_row_attention
# instead of plain jit of sharded inputs), fused (the fused dq+dbias kernel
# instead of the separate dq and dbias kernels), regress (the kernels write
# the bias gradient in the bias dtype, so the psum over the shards of S runs
# in bfloat16: the behaviour before the fix, a negative control of the checks).
BF16_CASES = {
    "bf16-rows-8-ways": (dict(row_axis=BF16_ALL_AXES), {}),
    "bf16-batch-rows-heads-fused-dq-dbias": (
        dict(batch_axis="data", row_axis="rows", head_axis="heads"), dict(fused=True)),
    "bf16-shard-map-rows-8-ways": (dict(row_axis=BF16_ALL_AXES), dict(shard_map=True)),
    "bf16-rows-8-ways-bf16-psum": (dict(row_axis=BF16_ALL_AXES), dict(regress=True)),
}


def bias_grad(attention):
    """`(q, k, v, bias, mask, dout) -> d<out, dout>/dbias` (q, k, v held
    fixed: XLA drops the kernels' other gradients, which keeps the
    interpret-mode compiles short)."""
    def run(q, k, v, bias, mask, dout):
        _, pullback = jax.vjp(lambda bias: attention(q, k, v, bias, mask, None), bias)
        return pullback(dout)[0]

    return run


def compile_with_partitioned_hlo(lowered):
    """`lowered.compile()`, and the HLO text right after SPMD partitioning.

    The collectives there have the dtypes the partitioner (or shard_map) gave
    them: later, the CPU compiler promotes a bfloat16 all-reduce to float32
    (its all-reduce-promotion and float-normalization passes), which would
    hide a bfloat16 psum from a check of the optimised HLO.
    """
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning",
        })
        names = sorted(n for n in os.listdir(dump) if "after_spmd-partitioning" in n)
        if not names:
            # A backend whose pipeline names the pass otherwise: the optimised
            # HLO (GPUs keep a bfloat16 all-reduce in bfloat16).
            assert jax.default_backend() != "cpu", sorted(os.listdir(dump))[:10]
            return compiled, compiled.as_text()
        with open(os.path.join(dump, names[-1])) as f:
            return compiled, f.read()


def bf16_spacing(x) -> np.ndarray:
    """The distance between adjacent bfloat16 numbers at |x| (8 significant
    bits: 2^(e - 7) for 2^e <= |x| < 2^(e + 1)); zeros get the spacing at the
    smallest normal bfloat16."""
    x = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(x, 2.0**-126)))
    return 2.0 ** (exponent - 7)


def rounding_report(sharded, single, exact) -> dict:
    """How far two bfloat16 bias gradients are from one rounding of `exact`.

    Args:
      sharded, single: the bias gradient of the sharded and of the one-device
        run, bfloat16.
      exact: the one-device bias gradient summed in float32 and not rounded
        (the same inputs with the bias passed as float32).

    `steps` is |g - exact| in units of half a bfloat16 spacing at `exact`,
    less the float32 slack: one rounding to nearest puts it at <= 1; a value
    rounded twice (each device's partial sum, then their bfloat16 sum) lands
    farther off. The slack, 1e-5 of the largest |exact|, covers the float32
    sums adding in another order on each side (6e-8 of the partial sums per
    addition); it is under 1/190 of a half spacing at the largest entries, so
    it matters only for entries near zero, where the partial sums cancel.
    `ulps_apart` is |sharded - single|, less the slack, in bfloat16 spacings.
    """
    sharded, single, exact = (np.asarray(x).astype(np.float64) for x in (sharded, single, exact))
    half = bf16_spacing(exact) / 2
    slack = 1e-5 * np.max(np.abs(exact))
    steps = lambda g: np.maximum(np.abs(g - exact) - slack, 0.0) / half
    ulps = np.maximum(np.abs(sharded - single) - slack, 0.0) / bf16_spacing(
        np.maximum(np.abs(sharded), np.abs(single)))
    return dict(
        sharded_steps=float(np.max(steps(sharded))),
        sharded_over_one=int(np.sum(steps(sharded) > 1.0)),
        single_steps=float(np.max(steps(single))),
        ulps_apart=float(np.max(ulps)),
        equal_fraction=float(np.mean(sharded == single)),
        max_rel=float(np.max(np.abs(sharded - single)) / np.max(np.abs(single))),
        size=int(exact.size),
    )


class _BiasGradientInBiasDtype:
    """Patches the kernels' VJP back to the behaviour before the fix: the
    dbias kernels write the bias dtype, so the psum over S runs in it."""

    def __enter__(self):
        from msa_pallas.kernels import vjp

        self.vjp, self.saved = vjp, (vjp.backward_dbias, vjp.backward_dq_dbias)

        def in_bias_dtype(kernel):
            def call(*args, dbias_dtype=None, **kwargs):
                return kernel(*args, dbias_dtype=None, **kwargs)
            return call

        vjp.backward_dbias, vjp.backward_dq_dbias = map(in_bias_dtype, self.saved)
        return self

    def __exit__(self, *exc):
        self.vjp.backward_dbias, self.vjp.backward_dq_dbias = self.saved


def run_bf16_bias_case(spec_axes, options) -> dict:
    B, S, N, H, d = BF16_SHAPE
    block_config = block_config_for(options, BF16_SHAPE, jnp.bfloat16)
    mesh = jax.make_mesh((2, 2, 2), BF16_ALL_AXES, axis_types=(AxisType.Auto,) * 3)
    inputs = helpers.random_inputs(
        11, B, S, N, H, d, jnp.bfloat16, mask_rate=0.2, bias_dtype=jnp.bfloat16, gate=False
    )
    q, k, v, bias, mask, _, dout = inputs.args
    args = [q, k, v, bias, mask, dout]
    specs = msa_partition_specs(**spec_axes)
    placement = [specs.rows, specs.rows, specs.rows, specs.bias, specs.mask, specs.rows]
    op = lambda *a: msa_pallas.msa_row_attention(
        *a, implementation="pallas", block_config=block_config
    )
    if options.get("shard_map"):
        attention = sharded_msa_row_attention(
            mesh, implementation="pallas", block_config=block_config, **spec_axes
        )
    else:
        attention = op
    run = jax.jit(bias_grad(attention))
    sharded_args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, placement)]
    if options.get("regress"):
        with _BiasGradientInBiasDtype():
            compiled, partitioned = compile_with_partitioned_hlo(run.lower(*sharded_args))
    else:
        compiled, partitioned = compile_with_partitioned_hlo(run.lower(*sharded_args))
    hlo = compiled.as_text()
    dbias = compiled(*sharded_args)

    key = ("bf16", options.get("fused", False))
    if key not in _REFERENCES:
        # One device: the bias as given (bfloat16), and the same values as
        # float32 (the bias gradient then leaves the VJP unrounded).
        single = [jax.device_put(x, jax.devices()[0]) for x in args]
        reference = jax.jit(bias_grad(op))
        as_f32 = single[:3] + [single[3].astype(jnp.float32)] + single[4:]
        _REFERENCES[key] = (reference(*single), reference(*as_f32))
    single_dbias, exact = _REFERENCES[key]
    assert dbias.dtype == jnp.bfloat16 and exact.dtype == jnp.float32
    return dict(
        # As partitioned (the dtype of the psum) and as compiled.
        reduced=result_shapes(partitioned, ("all-reduce", "reduce-scatter")),
        reduced_compiled=result_shapes(hlo, ("all-reduce", "reduce-scatter")),
        moved=result_shapes(hlo, MOVES_DATA),
        report=rounding_report(dbias, single_dbias, exact),
        error=None,
    )
