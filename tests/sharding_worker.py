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

The `bf16-*` cases (`BF16_CASES`, `run_bf16_bias_case`) check the rounding of
the bias gradient with bfloat16 inputs and a bfloat16 bias: their record holds
the all-reduces of the compiled program and how far the sharded bias gradient
lies from the one-device float32 sum, in bfloat16 rounding steps.

Each case runs forward and backward (`jax.vjp`, all five gradients) of the op
under `jax.jit` with inputs placed with `jax.device_put(x, NamedSharding)`,
and the same function on unsharded inputs (one device: no partitioning).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
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

# id -> (implementation, mesh axis types, specs kwargs (batch/row/head axis), options)
CASES = {
    "pallas-batch": ("pallas", "Auto", dict(batch_axis="data"), {}),
    "pallas-rows": ("pallas", "Auto", dict(row_axis="rows"), {}),
    "pallas-batch-rows": ("pallas", "Auto", dict(batch_axis="data", row_axis="rows"), {}),
    "pallas-heads": ("pallas", "Auto", dict(batch_axis="data", head_axis="rows"), {}),
    "pallas-batch-rows-no-mask-no-gate": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(mask=False, gate=False)),
    "pallas-rows-over-both-axes": ("pallas", "Auto", dict(row_axis=("data", "rows")), dict(S=8)),
    "pallas-explicit-batch-rows": (
        "pallas", "Explicit", dict(batch_axis="data", row_axis="rows"), {}),
    "pallas-explicit-rows": ("pallas", "Explicit", dict(row_axis="rows"), {}),
    "pallas-shard-map-rows": ("pallas", "Auto", dict(row_axis="rows"), dict(shard_map=True)),
    "pallas-shard-map-batch-rows": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(shard_map=True)),
    "pallas-shard-map-explicit-rows": (
        "pallas", "Explicit", dict(row_axis="rows"), dict(shard_map=True)),
    "pallas-vmap-rows": ("pallas", "Auto", dict(row_axis="rows"), dict(vmap=True)),
    # The fused dq+dbias kernel: one call with a per-row result (dq) and a sum over S.
    "pallas-rows-fused-dq-dbias": ("pallas", "Auto", dict(row_axis="rows"), dict(fused=True)),
    "pallas-batch-rows-fused-dq-dbias": (
        "pallas", "Auto", dict(batch_axis="data", row_axis="rows"), dict(fused=True)),
    "pallas-explicit-rows-fused-dq-dbias": (
        "pallas", "Explicit", dict(row_axis="rows"), dict(fused=True)),
    "pallas-shard-map-rows-fused-dq-dbias": (
        "pallas", "Auto", dict(row_axis="rows"), dict(shard_map=True, fused=True)),
    # Not shardable along these: the partitioner gathers (allowed), results stay right.
    "pallas-residues": ("pallas", "Auto", {}, dict(residue_axis="rows")),
    "pallas-uneven-rows": ("pallas", "Auto", dict(row_axis="rows"), dict(S=8, slice_rows=6)),
    "xla-batch-rows": ("xla", "Auto", dict(batch_axis="data", row_axis="rows"), {}),
    "xla-heads": ("xla", "Auto", dict(batch_axis="data", head_axis="rows"), {}),
    "xla-explicit-batch-rows": ("xla", "Explicit", dict(batch_axis="data", row_axis="rows"), {}),
}


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


def _result_shapes(hlo: str, ops) -> list:
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


def _block_config(options, shape=SHAPE, dtype=jnp.float32):
    """The default tiles, plus the fused dq+dbias kernel when `fused` (off by
    default for float32, and for 16-bit inputs with d <= 16)."""
    if not options.get("fused"):
        return None
    _, _, N, _, d = shape
    config = default_block_config(N, d, dtype)
    return dataclasses.replace(config, backward_dq_dbias=KernelTiles(16, next_power_of_2(N)))


def run_case(implementation, axis_type, spec_axes, options) -> dict:
    B, S, N, H, d = SHAPE
    block_config = _block_config(options)
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

    if options.get("shard_map"):
        attention = sharded_msa_row_attention(
            mesh, implementation=implementation, block_config=block_config, **spec_axes
        )
    else:
        attention = lambda *a: msa_pallas.msa_row_attention(
            *a, implementation=implementation, block_config=block_config
        )
    run = _fwd_bwd(attention, options.get("slice_rows"))

    if options.get("vmap"):
        # An extra leading axis of 2 on every input; S stays sharded.
        args = [None if x is None else jnp.stack([x, x[::-1]]) for x in args]
        placement = [None if s is None else P(None, *s) for s in placement]
        run = jax.vmap(run)

    place = lambda x, spec: x if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    sharded_args = [place(x, s) for x, s in zip(args, placement)]
    compiled = jax.jit(run).lower(*sharded_args).compile()
    hlo = compiled.as_text()
    got = compiled(*sharded_args)
    again = compiled(*sharded_args)
    # The reference: one device, nothing partitioned (shared by the cases
    # with the same inputs and function).
    key = (implementation, S, options.get("mask", True), options.get("gate", True),
           options.get("slice_rows"), options.get("vmap", False), options.get("fused", False))
    if key not in _REFERENCES:
        single = [None if x is None else jax.device_put(x, jax.devices()[0]) for x in args]
        reference_fn = _fwd_bwd(
            lambda *a: msa_pallas.msa_row_attention(
                *a, implementation=implementation, block_config=block_config
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
        moved=_result_shapes(hlo, MOVES_DATA),
        reduced=_result_shapes(hlo, ("all-reduce", "reduce-scatter")),
        out_spec=spec(out),
        dbias_spec=spec(grads[3]),
        deterministic=deterministic,
        error=None,
    )


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
    block_config = _block_config(options, BF16_SHAPE, jnp.bfloat16)
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
        reduced=_result_shapes(partitioned, ("all-reduce", "reduce-scatter")),
        reduced_compiled=_result_shapes(hlo, ("all-reduce", "reduce-scatter")),
        moved=_result_shapes(hlo, MOVES_DATA),
        report=rounding_report(dbias, single_dbias, exact),
        error=None,
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
    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    for name in names or [*CASES, "export"]:
        start = time.perf_counter()
        try:
            if name == "export":
                results[name] = run_export_case()
            elif name in BF16_CASES:
                results[name] = run_bf16_bias_case(*BF16_CASES[name])
            else:
                results[name] = run_case(*CASES[name])
        except Exception:  # recorded, reported by the test of that case
            results[name] = dict(error=traceback.format_exc())
        print(name, f"{time.perf_counter() - start:.1f} s", json.dumps(results[name])[:200], flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or None)
