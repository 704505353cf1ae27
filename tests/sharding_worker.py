"""Runs the sharding cases of test_sharding.py on 8 simulated CPU devices.

Not a test module: test_sharding.py runs it as `python sharding_worker.py OUT.json`
in a subprocess whose XLA_FLAGS holds `--xla_force_host_platform_device_count=8`
(set before JAX initialises: it cannot be changed inside the pytest process).
It writes one JSON record per case:

    {"errors": {name: relative error against the unsharded run},
     "collectives": {op: count in the compiled, partitioned HLO},
     "moved": ["f32[2,4,12,4,8] all-gather", ...: the result shapes of the
               collectives that move data: all-gather, all-to-all,
               collective-permute],
     "reduced": [the same for all-reduce and reduce-scatter],
     "out_spec", "dbias_spec": the result shardings (`_spec_entries`),
     "deterministic": bool, "error": traceback or null}

The `prologue-*` cases run the backward's prologue kernel alone; the
`prologue-row-groups-*` ones record, beside the errors, the rows each run
left unwritten (`unwritten`: the dead rows no kernel reads).

The `bf16-*` cases (`sharding_bf16_worker.py`) check the rounding of the bias
gradient with bfloat16 inputs and a bfloat16 bias: their record holds the
all-reduces of the compiled program and how far the sharded bias gradient lies
from the one-device float32 sum, in bfloat16 rounding steps.

Each case runs forward and backward (`jax.vjp`, all five gradients) of the op
under `jax.jit` with inputs placed with `jax.device_put(x, NamedSharding)`,
and the same function on unsharded inputs (one device: no partitioning; the
`*-skipping` cases' sharded run skips padding, the unsharded one visits it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import traceback

if __name__ == "__main__":  # before JAX initialises
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helpers  # noqa: E402
import msa_pallas  # noqa: E402
from msa_pallas.block_sizes import KernelTiles, default_block_config, next_power_of_2  # noqa: E402
from msa_pallas.sharding import msa_partition_specs, sharded_msa_row_attention  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
MOVES_DATA = ("all-gather", "all-to-all", "collective-permute")

# B, S, N, H, d: B divides the 2-way 'data' axis, S and H the 4-way 'rows' axis.
SHAPE = (2, 4, 12, 4, 8)

# id -> (implementation, mesh axis types, specs kwargs (batch/row/head axis), options).
# S sharded alone is the fused cases' and "rows-over-both-axes"'s spec; each
# mechanism (custom_partitioning on Auto axes, Explicit axes, shard_map) runs
# with B and S sharded together, its S-alone spec only where a kernel differs.
CASES = {
    "pallas-batch": ("pallas", "Auto", dict(batch_axis="data"), {}),
    "pallas-batch-rows": ("pallas", "Auto", dict(batch_axis="data", row_axis="rows"), {}),
    "pallas-heads": ("pallas", "Auto", dict(batch_axis="data", head_axis="rows"), {}),
    "pallas-batch-rows-no-mask-no-gate": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(mask=False, gate=False)),
    "pallas-rows-over-both-axes": ("pallas", "Auto", dict(row_axis=("data", "rows")), dict(S=8)),
    "pallas-explicit-batch-rows": (
        "pallas", "Explicit", dict(batch_axis="data", row_axis="rows"), {}),
    "pallas-shard-map-batch-rows": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(shard_map=True)),
    "pallas-shard-map-explicit-rows": (
        "pallas", "Explicit", dict(row_axis="rows"), dict(shard_map=True)),
    "pallas-vmap-rows": ("pallas", "Auto", dict(row_axis="rows"), dict(vmap=True)),
    # The fused dq+dbias kernel: one call with a per-row result (dq) and a sum over S.
    "pallas-rows-fused-dq-dbias": ("pallas", "Auto", dict(row_axis="rows"), dict(fused=True)),
    "pallas-explicit-rows-fused-dq-dbias": (
        "pallas", "Explicit", dict(row_axis="rows"), dict(fused=True)),
    "pallas-shard-map-rows-fused-dq-dbias": (
        "pallas", "Auto", dict(row_axis="rows"), dict(shard_map=True, fused=True)),
    # Not shardable along these: the partitioner gathers (allowed), results stay right.
    "pallas-residues": ("pallas", "Auto", {}, dict(residue_axis="rows")),
    "pallas-uneven-rows": ("pallas", "Auto", dict(row_axis="rows"), dict(S=8, slice_rows=6)),
    # Attention dropout: the mask of the one-device call (row seeds drawn on
    # the global shape), whatever the sharding.
    "pallas-batch-rows-dropout": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(dropout=0.3)),
    "pallas-shard-map-batch-rows-dropout": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"),
        dict(shard_map=True, dropout=0.3)),
    "pallas-shard-map-heads-dropout": (
        "pallas", "Auto", dict(head_axis="rows"), dict(shard_map=True, dropout=0.3)),
    # Padding skipped (`msa_pallas.skipping_padding()`): each shard's kernels
    # read the summaries of their own mask (a fully masked row among them).
    "pallas-batch-rows-skipping": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(skip=True)),
    "pallas-shard-map-batch-rows-dropout-skipping": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"),
        dict(shard_map=True, dropout=0.3, skip=True)),
    "xla-batch-rows-dropout": (
        "xla", "Auto", dict(batch_axis="data", row_axis="rows"), dict(dropout=0.3)),
    "xla-batch-rows": ("xla", "Auto", dict(batch_axis="data", row_axis="rows"), {}),
    "xla-heads": ("xla", "Auto", dict(batch_axis="data", head_axis="rows"), {}),
    "xla-explicit-batch-rows": ("xla", "Explicit", dict(batch_axis="data", row_axis="rows"), {}),
}


def _fwd_bwd(attention, slice_rows=None):
    def run(q, k, v, bias, mask, gate, dout):
        if slice_rows is not None:
            cut = lambda x: None if x is None else x[:, :slice_rows]
            q, k, v, mask, gate, dout = map(cut, (q, k, v, mask, gate, dout))

        def f(q, k, v, bias, gate):
            return attention(q, k, v, bias, mask, gate)

        out, pullback = jax.vjp(f, q, k, v, bias, gate)
        return out, pullback(dout)

    return run


def _collectives(hlo: str) -> dict:
    counts = {}
    for op in COLLECTIVES:
        counts[op] = len(re.findall(rf"\s{op}(?:-start)?\(", hlo))
    return counts


def result_shapes(hlo: str, ops) -> list:
    """`"f32[2,4,12,4,8] all-gather"` for every collective of `ops` in the HLO."""
    found = []
    for line in hlo.splitlines():
        for op in ops:
            if re.search(rf"\s{op}(?:-start)?\(", line):
                shape = line.split("=", 1)[1].strip().split("{")[0].split(" ")[0]
                found.append(f"{shape} {op}")
    return found


def _spec_entries(spec) -> list:
    """A PartitionSpec as a JSON list, trailing Nones dropped."""
    entries = [list(e) if isinstance(e, tuple) else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return entries


def _rel_err(a, b) -> float:
    a, b = helpers.to_f64(a), helpers.to_f64(b)
    denom = np.linalg.norm(b.ravel())
    return float(np.linalg.norm((a - b).ravel()) / (denom if denom > 0 else 1.0))


_REFERENCES = {}


def block_config_for(options, shape=SHAPE, dtype=jnp.float32):
    """The default tiles, plus the fused dq+dbias kernel when `fused` (off by
    default for float32, and for 16-bit inputs with d <= 16)."""
    if not options.get("fused"):
        return None
    _, _, N, _, d = shape
    config = default_block_config(N, d, dtype)
    return dataclasses.replace(config, backward_dq_dbias=KernelTiles(16, next_power_of_2(N)))


def run_case(implementation, axis_type, spec_axes, options) -> dict:
    B, S, N, H, d = SHAPE
    block_config = block_config_for(options)
    S = options.get("S", S)
    mesh = jax.make_mesh((2, 4), ("data", "rows"), axis_types=(getattr(AxisType, axis_type),) * 2)
    inputs = helpers.random_inputs(
        7, B, S, N, H, d, jnp.float32,
        mask_rate=0.2 if options.get("mask", True) else None,
        fully_masked_row=(1, 2) if options.get("mask", True) else None,
        gate=options.get("gate", True),
    )
    args = list(inputs.args)
    specs = msa_partition_specs(**spec_axes)
    if options.get("residue_axis"):
        axis = options["residue_axis"]
        specs = specs._replace(
            rows=P(None, None, axis, None, None), bias=P(None, None, axis, None), mask=P(None, None, axis)
        )
    placement = [specs.rows, specs.rows, specs.rows, specs.bias, specs.mask, specs.rows, specs.rows]

    dropout = {}
    if options.get("dropout"):
        dropout = dict(dropout_rate=options["dropout"], dropout_rng=jax.random.key(11))
    if options.get("shard_map"):
        sharded = sharded_msa_row_attention(
            mesh, implementation=implementation, block_config=block_config, **spec_axes
        )
        attention = lambda *a: sharded(*a, **dropout)
    else:
        attention = lambda *a: msa_pallas.msa_row_attention(
            *a, implementation=implementation, block_config=block_config, **dropout
        )
    run = _fwd_bwd(attention, options.get("slice_rows"))

    if options.get("vmap"):
        # An extra leading axis of 2 on every input; S stays sharded.
        args = [None if x is None else jnp.stack([x, x[::-1]]) for x in args]
        placement = [None if s is None else P(None, *s) for s in placement]
        run = jax.vmap(run)

    place = lambda x, spec: x if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    sharded_args = [place(x, s) for x, s in zip(args, placement)]
    # Against the unsharded run that visits every tile.
    with msa_pallas.skipping_padding(options.get("skip", False)):
        compiled = jax.jit(run).lower(*sharded_args).compile()
    hlo = compiled.as_text()
    got = compiled(*sharded_args)
    again = compiled(*sharded_args)
    # The reference: one device, nothing partitioned (shared by the cases
    # with the same inputs and function).
    key = (implementation, S, options.get("mask", True), options.get("gate", True),
           options.get("slice_rows"), options.get("vmap", False), options.get("fused", False),
           options.get("dropout"))
    if key not in _REFERENCES:
        single = [None if x is None else jax.device_put(x, jax.devices()[0]) for x in args]
        reference_fn = _fwd_bwd(
            lambda *a: msa_pallas.msa_row_attention(
                *a, implementation=implementation, block_config=block_config, **dropout
            ),
            options.get("slice_rows"),
        )
        if options.get("vmap"):
            reference_fn = jax.vmap(reference_fn)
        _REFERENCES[key] = jax.jit(reference_fn)(*single)
    expected = _REFERENCES[key]

    out, grads = got
    errors = {}
    for name, a, b in zip(helpers.RESULT_NAMES, (out, *grads), (expected[0], *expected[1])):
        if b is None:
            continue
        errors[name] = _rel_err(a, b)
        if not np.all(np.isfinite(helpers.to_f64(a))):
            errors[name] = float("inf")
    deterministic = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again))
    )
    spec = lambda x: _spec_entries(x.sharding.spec)
    return dict(
        errors=errors,
        collectives=_collectives(hlo),
        moved=result_shapes(hlo, MOVES_DATA),
        reduced=result_shapes(hlo, ("all-reduce", "reduce-scatter")),
        out_spec=spec(out),
        dbias_spec=spec(grads[3]),
        deterministic=deterministic,
        error=None,
    )


def _sharded_and_on_one_device(function, args, placement, mesh):
    """`(hlo, got, expected)`: `function` jitted on `args` (arrays or None)
    placed by `placement` (PartitionSpecs) on `mesh`, its compiled program's
    text and results, and its results on one device, nothing partitioned."""
    placed = [x if x is None else jax.device_put(x, NamedSharding(mesh, spec))
              for x, spec in zip(args, placement)]
    compiled = jax.jit(function).lower(*placed).compile()
    single = [None if x is None else jax.device_put(x, jax.devices()[0]) for x in args]
    return compiled.as_text(), compiled(*placed), jax.jit(function)(*single)


# The backward's prologue kernel alone (`vjp.partitioned_prologue`: the
# Mosaic kernels around it run only on a GPU), gated or not, B and S or B
# and H sharded, the queries masked too or not: id -> (specs kwargs, gated,
# mask_queries).
PROLOGUE_CASES = {
    "prologue-batch-rows": (dict(batch_axis="data", row_axis="rows"), True, False),
    "prologue-batch-heads-no-gate": (dict(batch_axis="data", head_axis="rows"), False, False),
    "prologue-batch-rows-mask-queries": (dict(batch_axis="data", row_axis="rows"), True, True),
    "prologue-batch-heads-no-gate-mask-queries": (
        dict(batch_axis="data", head_axis="rows"), False, True),
}


def _prologue_placement(spec_axes):
    """`(mesh, placement)`: the 2 x 4 mesh and the PartitionSpecs of the
    prologue's operands (`vjp.partitioned_prologue`'s order: do, gate,
    attention, dead rows' means, the two statistics planes, mask) for
    `msa_partition_specs(**spec_axes)`."""
    mesh = jax.make_mesh((2, 4), ("data", "rows"), axis_types=(AxisType.Auto,) * 2)
    specs = msa_partition_specs(**spec_axes)
    # [B, S, H, ...]: the means' and the planes' rows and heads as q's.
    per_row_head = P(*specs.rows[:2], specs.rows[3], None)
    return mesh, [specs.rows, specs.rows, specs.rows, *(per_row_head,) * 3, specs.mask]


def run_prologue_case(spec_axes, gated: bool, mask_queries: bool = False) -> dict:
    """The prologue on sharded operands against one device: a dead row in
    each batch element, NaN in what it must not read (dead rows'
    residuals, live rows' means; with the queries masked, no means, and a
    dead row's cotangent and gate NaN too)."""
    from msa_pallas.kernels import vjp

    B, S, N, H, d = SHAPE
    rng = np.random.default_rng(5)
    keep = rng.random((B, S, N)) >= 0.2
    keep[:, 1] = False
    dead = ~keep.any(axis=-1)
    rows = lambda dtype: jnp.asarray(rng.standard_normal((B, S, N, H, d)), dtype)  # noqa: E731
    dout, gate = rows(jnp.bfloat16), rows(jnp.bfloat16) if gated else None
    if mask_queries:
        dout = dout.at[dead].set(jnp.nan)
        gate = None if gate is None else gate.at[dead].set(jnp.nan)
    attention = np.asarray(rng.standard_normal((B, S, N, H, d)), np.float32)
    attention[dead] = np.nan
    means = rng.standard_normal((B, S, H, d)).astype(np.float32)
    means[~dead] = np.nan
    means = None if mask_queries else jnp.asarray(means)
    planes = [rng.standard_normal((B, S, H, N)).astype(np.float32) for _ in range(2)]
    for plane in planes:
        plane[dead] = np.nan
    args = [dout, gate, jnp.asarray(attention), means, *map(jnp.asarray, planes),
            jnp.asarray(keep, jnp.int8)]
    mesh, placement = _prologue_placement(spec_axes)

    def prologue(*args):
        return vjp.partitioned_prologue(*args, do_dtype=jnp.bfloat16, interpret=True,
                                        mask_queries=mask_queries)

    hlo, got, expected = _sharded_and_on_one_device(prologue, args, placement, mesh)
    errors = {
        name: _rel_err(a, b) if np.all(np.isfinite(helpers.to_f64(a))) else float("inf")
        for name, a, b in zip(("do", "dgate", "stats", "dead_dv"), got, expected)
        if b is not None
    }
    return dict(errors=errors, moved=result_shapes(hlo, MOVES_DATA),
                reduced=result_shapes(hlo, ("all-reduce", "reduce-scatter")),
                do_spec=_spec_entries(got[0].sharding.spec), error=None)


# The prologue told which dead rows no kernel reads (`row_group_tiles`: the
# Mosaic kernels' groups of two rows), the queries masked: id -> specs kwargs.
# Each device tells them on its own shard, as its kernels do.
ROW_GROUP_PROLOGUE_CASES = {
    "prologue-row-groups-batch-rows": dict(batch_axis="data", row_axis="rows"),
    "prologue-row-groups-batch-heads": dict(batch_axis="data", head_axis="rows"),
}
# (batch element, row) of SHAPE's rows made dead in the row-group cases.
ROW_GROUP_DEAD_ROWS = ((0, 1), (0, 3), (1, 2), (1, 3))


def run_row_group_prologue_case(spec_axes) -> dict:
    """The prologue on sharded operands, told the dead rows no kernel reads
    (`ROW_GROUP_DEAD_ROWS`, queries masked, gated), against one device:
    the rows whose `do` is left unwritten (all NaN: the interpreter's fresh
    buffers) in each run, and the relative errors over the rows both
    wrote."""
    from msa_pallas.kernels import vjp
    from msa_pallas.kernels.mosaic.tiles import MosaicTiles

    B, S, N, H, d = SHAPE
    rng = np.random.default_rng(9)
    keep = rng.random((B, S, N)) >= 0.2
    for batch, row in ROW_GROUP_DEAD_ROWS:
        keep[batch, row] = False
    rows = lambda: jnp.asarray(rng.standard_normal((B, S, N, H, d)), jnp.bfloat16)  # noqa: E731
    args = [rows(), rows(), jnp.asarray(rng.standard_normal((B, S, N, H, d)), jnp.float32),
            None, *(jnp.asarray(rng.standard_normal((B, S, H, N)), jnp.float32) for _ in range(2)),
            jnp.asarray(keep, jnp.int8)]
    mesh, placement = _prologue_placement(spec_axes)

    def prologue(*args):
        return vjp.partitioned_prologue(
            *args, do_dtype=jnp.bfloat16, interpret=True, mask_queries=True,
            row_group_tiles=(MosaicTiles(64, 64, 2, 2),))

    hlo, got, expected = _sharded_and_on_one_device(prologue, args, placement, mesh)

    def unwritten(do):
        return np.isnan(helpers.to_f64(do)).all(axis=(2, 3, 4))

    both = ~unwritten(got[0]) & ~unwritten(expected[0])
    errors = {}
    for name, a, b in zip(("do", "dgate", "stats"), got, expected):
        a, b = helpers.to_f64(a)[both], helpers.to_f64(b)[both]
        errors[name] = _rel_err(a, b) if np.isfinite(a).all() else float("inf")
    return dict(
        errors=errors, moved=result_shapes(hlo, MOVES_DATA),
        unwritten={"sharded": np.argwhere(unwritten(got[0])).tolist(),
                   "one_device": np.argwhere(unwritten(expected[0])).tolist()},
        dgate_finite=bool(np.isfinite(helpers.to_f64(got[1])).all()), error=None,
    )


def run_export_case() -> dict:
    """`jax.export` of a sharded step for 8 CPU devices, serialised,
    deserialised and called. With `sharded_msa_row_attention` (shard_map) the
    kernels inline into the module; the custom_partitioning path (plain jit of
    sharded inputs) keeps a Python partitioning callback in the module, which
    jax.export cannot serialise: recorded as `auto_error`."""
    from msa_pallas import exporting

    B, S, N, H, d = SHAPE
    mesh = jax.make_mesh((2, 4), ("data", "rows"), axis_types=(AxisType.Auto,) * 2)
    specs = msa_partition_specs(batch_axis="data", row_axis="rows")
    inputs = helpers.random_inputs(7, B, S, N, H, d, jnp.float32)
    placement = (specs.rows,) * 3 + (specs.bias, specs.mask, specs.rows, specs.rows)
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(inputs.args, placement)]
    attention = sharded_msa_row_attention(
        mesh, batch_axis="data", row_axis="rows", implementation="pallas"
    )
    step = _fwd_bwd(attention)
    exported = exporting.export(step, platforms=("cpu",))(*args)
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(*args)
    expected = jax.jit(_fwd_bwd(
        lambda *a: msa_pallas.msa_row_attention(*a, implementation="pallas")
    ))(*inputs.args)
    errors = {
        name: _rel_err(a, b)
        for name, a, b in zip(helpers.RESULT_NAMES, jax.tree.leaves(got), jax.tree.leaves(expected))
    }
    auto_error = None
    try:
        auto = _fwd_bwd(lambda *a: msa_pallas.msa_row_attention(*a, implementation="pallas"))
        exporting.export(auto, platforms=("cpu",))(*args).serialize()
    except Exception as e:  # the documented limitation
        auto_error = f"{type(e).__name__}: {e}"
    return dict(
        errors=errors, nr_devices=exported.nr_devices, auto_error=auto_error,
        out_spec=_spec_entries(jax.tree.leaves(got)[0].sharding.spec), error=None,
    )


def main(path: str, names=None) -> None:
    # Imported here: sharding_bf16_worker imports this module's helpers.
    import sharding_bf16_worker

    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    for name in names or [*CASES, *PROLOGUE_CASES, *ROW_GROUP_PROLOGUE_CASES, "export"]:
        start = time.perf_counter()
        try:
            if name == "export":
                results[name] = run_export_case()
            elif name in PROLOGUE_CASES:
                results[name] = run_prologue_case(*PROLOGUE_CASES[name])
            elif name in ROW_GROUP_PROLOGUE_CASES:
                results[name] = run_row_group_prologue_case(ROW_GROUP_PROLOGUE_CASES[name])
            elif name in sharding_bf16_worker.BF16_CASES:
                results[name] = sharding_bf16_worker.run_bf16_bias_case(
                    *sharding_bf16_worker.BF16_CASES[name])
            else:
                results[name] = run_case(*CASES[name])
        except Exception:  # recorded, reported by the test of that case
            results[name] = dict(error=traceback.format_exc())
        print(name, f"{time.perf_counter() - start:.1f} s", json.dumps(results[name])[:200], flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or None)
