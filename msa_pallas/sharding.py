"""Running `msa_row_attention` on several devices.

The op needs nothing to be sharded: jit a function that calls it with inputs
sharded over the batch, MSA-row or head axes and each device runs its own
shard through the kernels. The kernels are `custom_partitioning` ops (see
`msa_pallas/kernels/partitioning.py`) with these rules:

- B, S and H may be sharded (over any mesh axes; q's sharding leads, and the
  bias and mask are resharded to match it: the bias follows q's batch and
  head axes, the mask q's batch and row axes);
- N and d must be whole on each device (a sharding of N or d is undone with an
  all-gather: correct, but it moves data);
- the bias gradient, a sum over S, is summed inside the dbias kernel over
  each device's rows and then `psum`-ed over the mesh axes that shard S, in
  float32 whatever the bias dtype: a bfloat16 or float16 bias gradient is
  rounded once, after the sum over all devices, so it equals the one-device
  gradient to within that one rounding (the float32 partial sums may add in
  another order).

With Explicit mesh axes (sharding in types, `jax.make_mesh`'s default), the
kernels run under a `shard_map` with the same rules. The `"xla"` path is plain
`jnp`, which XLA partitions by itself along the same axes.

    mesh = jax.make_mesh((2, 4), ("data", "rows"))
    specs = msa_partition_specs(batch_axis="data", row_axis="rows")
    q, k, v, gate = (jax.device_put(x, NamedSharding(mesh, specs.rows)) for x in (q, k, v, gate))
    bias = jax.device_put(bias, NamedSharding(mesh, specs.bias))
    mask = jax.device_put(mask, NamedSharding(mesh, specs.mask))
    out = jax.jit(msa_pallas.msa_row_attention)(q, k, v, bias, mask, gate)

`sharded_msa_row_attention` is the explicit alternative: the op wrapped in
`jax.shard_map` over given mesh axes, for code that places its own shards.
It is also the way to `jax.export` a program for several devices: the
custom_partitioning path keeps a Python partitioning callback in the module,
which `jax.export` cannot serialise; under shard_map the kernels are inlined.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msa_pallas.attention import msa_row_attention, plan_call, resolve_implementation, run_plan
from msa_pallas.dropout import row_seeds
from msa_pallas.validation import validate_arguments, validate_dropout

_OP_KWARGS = ("scale", "implementation", "block_config")


class MSAPartitionSpecs(NamedTuple):
    """PartitionSpecs of the op's arguments.

    Attributes:
      rows: q, k, v, gate and the output, `[*batch, S, N, H, d]`.
      bias: `[*batch, H, N, N]` (and its gradient).
      mask: `[*batch, S, N]`.
      seeds: attention dropout's row seeds, `[*batch, S, H]`.
    """

    rows: PartitionSpec
    bias: PartitionSpec
    mask: PartitionSpec
    seeds: PartitionSpec


def msa_partition_specs(
    batch_axis=None, row_axis=None, head_axis=None, *, batch_dims: int = 1
) -> MSAPartitionSpecs:
    """PartitionSpecs that shard the op's arguments with no data movement.

    Args:
      batch_axis: mesh axis name(s) for the first leading batch dim, or None.
      row_axis: mesh axis name(s) for the MSA-row axis S, or None.
      head_axis: mesh axis name(s) for the head axis H, or None.
      batch_dims: the number of leading batch dims (only the first is sharded).
    """
    if batch_dims < 0 or (batch_dims == 0 and batch_axis is not None):
        raise ValueError(
            f"batch_dims={batch_dims} with batch_axis={batch_axis!r}; expected "
            "batch_dims >= 1 to shard a batch axis (>= 0 otherwise)."
        )
    batch = (batch_axis,) + (None,) * (batch_dims - 1) if batch_dims else ()
    return MSAPartitionSpecs(
        rows=PartitionSpec(*batch, row_axis, None, head_axis, None),
        bias=PartitionSpec(*batch, head_axis, None, None),
        mask=PartitionSpec(*batch, row_axis, None),
        seeds=PartitionSpec(*batch, row_axis, head_axis),
    )


def sharded_msa_row_attention(
    mesh: Mesh,
    *,
    batch_axis=None,
    row_axis=None,
    head_axis=None,
    batch_dims: int = 1,
    **op_kwargs,
) -> Callable:
    """`msa_row_attention` under `jax.shard_map` over the given mesh axes.

    Each device runs the op on its own shard (the partitioning of the kernels
    is then inlined: no custom partitioning is involved), and the bias
    gradient is summed over the devices that share a bias shard (shard_map's
    transpose psums the cotangent of an input not sharded over `row_axis`),
    in float32: a 16-bit bias enters the shard_map widened to float32 and is
    read by the kernels in its own dtype, so its gradient is rounded once,
    after the sum.

    Args:
      mesh: a `jax.sharding.Mesh` (or AbstractMesh).
      batch_axis, row_axis, head_axis, batch_dims: as `msa_partition_specs`.
      **op_kwargs: keyword arguments of `msa_row_attention` (scale,
        implementation, block_config).

    Returns:
      `f(q, k, v, bias, mask=None, gate=None, *, dropout_rate=0.0,
      dropout_rng=None)` with `msa_row_attention`'s shapes; the inputs are
      resharded to the specs if they are not already. Attention dropout
      draws the one-device call's mask: the row seeds are drawn on the
      global shape and each device reads its slice.

    Example::

        mesh = jax.make_mesh((8,), ("rows",))
        attention = sharded_msa_row_attention(mesh, row_axis="rows")
        out = jax.jit(attention)(q, k, v, bias, mask, gate)
    """
    unknown = sorted(set(op_kwargs) - set(_OP_KWARGS))
    if unknown:
        raise TypeError(
            f"sharded_msa_row_attention got {unknown}; expected keyword arguments "
            f"among {list(_OP_KWARGS)} (attention dropout's rate and key are "
            "arguments of each call)."
        )
    specs = msa_partition_specs(batch_axis, row_axis, head_axis, batch_dims=batch_dims)
    used_axes = frozenset(
        name
        for entry in (batch_axis, row_axis, head_axis)
        for name in ((entry,) if isinstance(entry, str) else (entry or ()))
    )

    def attention(q, k, v, bias, mask=None, gate=None, *, dropout_rate=0.0, dropout_rng=None):
        # Checked on the global shapes, so errors show what the caller passed.
        implementation = resolve_implementation(op_kwargs.get("implementation"), q, 0.0)
        validate_arguments(q, k, v, bias, mask, gate, op_kwargs.get("scale"), implementation)
        validate_dropout(dropout_rate, dropout_rng)
        if q.ndim != 4 + batch_dims:
            raise ValueError(
                f"q has shape {list(q.shape)} (rank {q.ndim}); this sharded op was "
                f"made with batch_dims={batch_dims}, for rank {4 + batch_dims}."
            )
        # The bias gradient is summed over the devices that shard S by
        # shard_map's transpose, in the dtype of the bias shard_map takes in.
        # A 16-bit bias (q's dtype) therefore enters as float32, which is
        # exact, and the kernels read it rounded back to q's dtype
        # (`round_bias`, exact again): each device's partial sum and the
        # psum stay float32, and the sum is rounded to the bias dtype once,
        # by the transpose of the cast below.
        widen_bias = (
            row_axis is not None
            and bias.dtype == q.dtype
            and jnp.dtype(bias.dtype).itemsize < 4
        )

        seeds = None
        if dropout_rate:
            *batch, rows, _, heads, _ = q.shape
            seeds = row_seeds(dropout_rng, math.prod(batch), rows, heads)
            seeds = seeds.reshape(*batch, rows, heads)

        def per_shard(q, k, v, bias, mask, gate, seeds):
            if seeds is None:
                return msa_row_attention(
                    q, k, v, bias, mask, gate, round_bias=widen_bias, **op_kwargs
                )
            # This shard's slice of the global seeds stands for the key
            # (plan_call only checks that one is given).
            plan = plan_call(
                q, k, v, bias, mask, gate, round_bias=widen_bias, dropout_rate=dropout_rate,
                dropout_rng=seeds, **op_kwargs,
            )
            return run_plan(
                plan, q, k, v, bias, mask, gate, scale=op_kwargs.get("scale"),
                dropout_seeds=seeds.reshape(-1, *seeds.shape[-2:]),
            )

        if widen_bias:
            bias = bias.astype(jnp.float32)

        in_specs = (
            specs.rows, specs.rows, specs.rows, specs.bias,
            None if mask is None else specs.mask,
            None if gate is None else specs.rows,
            None if seeds is None else specs.seeds,
        )
        args = (q, k, v, bias, mask, gate, seeds)
        if mesh.explicit_axes:
            # Sharding in types: shard_map takes only inputs of its specs.
            args = tuple(
                x if x is None else jax.reshard(x, NamedSharding(mesh, spec))
                for x, spec in zip(args, in_specs)
            )
        if not used_axes:
            return per_shard(*args)
        # Manual over the named axes only (the others stay with the compiler:
        # a replicated computation over an unused axis would otherwise have
        # its gradients psum-ed over it). The kernels' pallas_call has no
        # varying-manual-axes rule, so check_vma is off; shard_map's transpose
        # psums the bias cotangent over the axes the bias is not sharded on.
        return jax.shard_map(
            per_shard, mesh=mesh, in_specs=in_specs, out_specs=specs.rows,
            axis_names=used_axes, check_vma=False,
        )(*args)

    return attention
