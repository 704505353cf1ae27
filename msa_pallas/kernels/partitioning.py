"""SPMD partitioning of the kernels, so that `jax.jit` with sharded inputs
runs each device's shard through the kernels instead of gathering q, k, v.

A `pallas_call` is an opaque custom call to XLA's partitioner: left alone, a
jitted program whose q, k, v are sharded over the batch or the MSA-row axis
would all-gather them and run the whole kernel on every device. Each kernel
call (forward, dk/dv, dq, dbias) therefore goes through
`jax.experimental.custom_partitioning`, with these rules:

- the batch axis B, the MSA-row axis S and the head axis H may be sharded
  (any mesh axes, as the lead operand q carries them); the residue axis N and
  the head dim d must be whole on each device, so a sharding of N or d is
  undone by the partitioner (an all-gather: correct, not fast);
- every operand and result is resharded to the lead operand's B, S, H axes
  (the bias and the mask follow q);
- the bias gradient is the sum over S: each device sums its own MSA rows
  inside the dbias kernel and the partial sums are `psum`-ed over the mesh
  axes that shard S.

On one device (and inside a `shard_map` whose every mesh axis is manual) the
partitioning is inlined: the program is the plain kernel call.

With Explicit mesh axes (sharding in types) a `pallas_call` cannot take
sharded operands at all; the kernels then run under a `jax.shard_map` over
the explicit axes, with the same specs and the same psum (`_shard_map_call`).

`custom_partitioning` has no `vmap` rule of its own, so each partitioned call
is also a `jax.custom_batching.custom_vmap` whose rule folds the mapped axis
into B (every operand and result of the kernels leads with B).

Layouts are named by Shardy factors: b, s, h (shardable), i (query residue),
j (key residue), d (head dim), t (the three stacked row statistics).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

QUERY_ROWS = "b s i h d"  # q, gate, do, the output: [B, S, N, H, d]
KEY_ROWS = "b s j h d"  # k, v: [B, S, N, H, d]
BIAS = "b h i j"  # [B, H, N, N]
MASK = "b s j"  # [B, S, N]
STATS = "b s h i"  # row max, log2 row sum, delta: [B, S, H, N]
STACKED_STATS = "b s h t i"  # the three stacked: [B, S, H, 3, N]
SEEDS = "b s h"  # attention dropout's row seeds: [B, S, H]
ROWS = "b s"  # a value per MSA row: [B, S]
ROW_VECTORS = "b s h d"  # a vector per MSA row and head (dead rows' means): [B, S, H, d]

SHARDABLE = ("b", "s", "h")
WHOLE = ("i", "j", "d", "t")  # must not be split across devices


def _lead_axes(sharding, shape, mesh_shape, allowed=None) -> dict:
    """The mesh axes of the b, s and h factors of a QUERY_ROWS array.

    An axis is dropped (that dim runs unsharded) when it is not in `allowed`
    (when given), or when the dim does not divide evenly over its mesh axes:
    an uneven shard would be padded, and padded MSA rows would enter the sum
    over S of the bias gradient.
    """
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    axes = {}
    for factor, entry, size in zip(QUERY_ROWS.split(), spec, shape):
        if factor not in SHARDABLE:
            continue
        names = tuple(n for n in _axis_names(entry) if allowed is None or n in allowed)
        ways = 1
        for n in names:
            ways *= mesh_shape[n]
        if names and size % ways == 0:
            axes[factor] = names[0] if len(names) == 1 else names
    return axes


def _spec(layout: str, axes: dict) -> PartitionSpec:
    return PartitionSpec(*(axes.get(f) if f in SHARDABLE else None for f in layout.split()))


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _axis_names(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _sums_over_rows(out_layouts) -> tuple[bool, ...]:
    """Which results are sums over S: those whose layout has no s factor."""
    return tuple("s" not in layout.split() for layout in out_layouts)


def _psum_row_sums(results, out_layouts, row_axes) -> tuple:
    """Each shard's partial sums over S, psum-ed over the mesh axes of S."""
    if not row_axes:
        return results
    return tuple(
        jax.lax.psum(r, row_axes) if summed else r
        for r, summed in zip(results, _sums_over_rows(out_layouts))
    )


def _partitioned_op(body: Callable, in_layouts: tuple, out_layouts: tuple) -> Callable:
    """`custom_vmap(custom_partitioning(body))` for arrays of the given layouts.

    body(*arrays) -> tuple of arrays. A result whose layout has no s (the
    bias gradient) is a sum over S: each shard's partial result is psum-ed
    over the mesh axes that shard S.
    """

    def shardings(mesh, lead_shape):
        lead = lead_shape.sharding
        if not isinstance(lead, NamedSharding):
            # No mesh to name axes by: run replicated (correct; gathers).
            axes = {}
        else:
            axes = _lead_axes(lead, lead_shape.shape, dict(mesh.shape))
        arg_shardings = tuple(NamedSharding(mesh, _spec(l, axes)) for l in in_layouts)
        result_shardings = tuple(NamedSharding(mesh, _spec(l, axes)) for l in out_layouts)
        return axes, arg_shardings, result_shardings

    def mesh_of(mesh, arg_shapes):
        lead = arg_shapes[0].sharding
        return lead.mesh if isinstance(lead, NamedSharding) else mesh

    def partition(mesh, arg_shapes, result_shape):
        mesh = mesh_of(mesh, arg_shapes)
        axes, arg_shardings, result_shardings = shardings(mesh, arg_shapes[0])
        row_axes = _axis_names(axes.get("s"))

        def lower_fn(*arrays):
            return _psum_row_sums(body(*arrays), out_layouts, row_axes)

        return mesh, lower_fn, result_shardings, arg_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        # Used by the GSPMD partitioner only (Shardy, the default, uses the rule).
        mesh = mesh_of(mesh, arg_shapes)
        return shardings(mesh, arg_shapes[0])[2]

    rule = ", ".join(in_layouts) + " -> " + ", ".join(out_layouts)
    # Shardy wants the special factors in the order the rule first names them.
    order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
    op = custom_partitioning(body)
    op.def_partition(
        partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=rule,
        need_replication_factors=tuple(
            sorted((f for f in WHOLE if f in order), key=order.index)
        ),
        reduction_factors=("s",) if all(_sums_over_rows(out_layouts)) else (),
    )

    @jax.custom_batching.custom_vmap
    def batched_op(*arrays):
        return op(*arrays)

    @batched_op.def_vmap
    def fold_mapped_axis_into_batch(axis_size, in_batched, *arrays):
        # Every operand and result leads with B: [V, B, ...] -> [V * B, ...].
        arrays = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(arrays, in_batched)
        ]
        folded = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays]
        results = batched_op(*folded)
        results = tuple(
            r.reshape(axis_size, r.shape[0] // axis_size, *r.shape[1:]) for r in results
        )
        return results, (True,) * len(results)

    return batched_op


def partitioned_call(
    fn: Callable,
    args: Sequence,
    in_layouts: Sequence[str],
    out_layouts: Sequence[str],
) -> tuple:
    """Calls `fn(*args)` (which returns an array or a tuple of arrays) as one
    SPMD-partitioned op; `None` arguments (no mask, no gate) are passed through.

    Args:
      fn: the kernel entry point, its static arguments bound.
      args: the array arguments or None, a QUERY_ROWS array first (its
        sharding leads).
      in_layouts, out_layouts: the factor strings of each argument / result.
        A result whose layout has no s is a sum over S (psum-ed across
        the shards of S).

    Returns:
      a tuple of the results.
    """
    present = tuple(i for i, a in enumerate(args) if a is not None)
    in_layouts = tuple(in_layouts[i] for i in present)
    out_layouts = tuple(out_layouts)
    arrays = tuple(args[i] for i in present)

    def body(*arrays):
        full = [None] * len(args)
        for i, x in zip(present, arrays):
            full[i] = x
        return _as_tuple(fn(*full))

    mesh = _explicit_mesh(arrays)
    if mesh is not None:
        return _shard_map_call(body, mesh, arrays, in_layouts, out_layouts)
    op = _partitioned_op(body, in_layouts, out_layouts)
    return op(*arrays)


# --- explicit sharding (sharding in types) ------------------------------------


def _explicit_mesh(arrays):
    """The abstract mesh of the arrays' types when any of them is sharded over
    an Explicit mesh axis, else None.

    With Explicit axes the sharding is part of each array's type at trace
    time, and a `pallas_call` cannot take sharded operands: the kernels then
    run under a `shard_map` whose specs are the same as custom_partitioning's.
    """
    for x in arrays:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not mesh.explicit_axes:
            continue
        used = {name for entry in sharding.spec for name in _axis_names(entry)}
        if used & set(mesh.explicit_axes):
            return mesh
    return None


def _shard_map_call(body, mesh, arrays, in_layouts, out_layouts):
    explicit = set(mesh.explicit_axes)
    lead = jax.typeof(arrays[0])
    axes = _lead_axes(lead.sharding, lead.shape, dict(mesh.shape), allowed=explicit)
    in_specs = tuple(_spec(l, axes) for l in in_layouts)
    out_specs = tuple(_spec(l, axes) for l in out_layouts)
    row_axes = _axis_names(axes.get("s"))
    arrays = tuple(
        jax.sharding.reshard(x, NamedSharding(mesh, spec))
        if tuple(jax.typeof(x).sharding.spec) != tuple(spec) else x
        for x, spec in zip(arrays, in_specs)
    )

    def per_shard(*arrays):
        return _psum_row_sums(body(*arrays), out_layouts, row_axes)

    return jax.shard_map(
        per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
        axis_names=frozenset(explicit), check_vma=False,
    )(*arrays)
