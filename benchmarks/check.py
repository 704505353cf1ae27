"""Checks the benchmark's implementations against a float32 reference: forward and gradients.

The benchmark compares only forward outputs. This script also checks the
gradients of q, k, v and bias, on small shapes chosen to catch mapping
mistakes: B > 1 (the bias shared by the S rows of each batch element), N not a
multiple of 8, d = 8. It also runs the forward with a row whose keys are all
masked (msa_pallas gives such a row uniform weights, finite); a different or
non-finite result there is noted, not failed (only the padding rows of padded
shapes have no key left, and their output is not used). The reference is
msa_pallas' plain-jnp path (`implementation="xla"`) in float32 at the highest
matmul precision, on the same values as the inputs. Every dtype is checked with
each bias dtype of `--bias-dtypes` (float32 and the input dtype by default), so
every adapter is seen taking the bias in both.

Two modes:

- `kernels` (the default on a GPU): the benchmark's own builders, so what is
  checked is exactly what is timed, kernels included.
- `reference` (the default without a GPU): the same op wrappers (layout
  transposes, bias and mask mapping) over the packages' portable paths:
  `tokamax.dot_product_attention(implementation="xla")` for tokamax_mosaic and
  tokamax_triton, cuequivariance_jax's jnp reference for cuequivariance (its
  CUDA kernel library, cuequivariance_ops_jax, is kept from loading so that
  cuequivariance_jax takes it), `jax.nn.dot_product_attention(
  implementation="xla")` for cudnn, and Pallas interpret mode for msa_pallas.
  That proves the mapping, not the kernels.

    python -m benchmarks check
    python -m benchmarks check --impls tokamax_mosaic,cuequivariance --dtypes bf16
    python -m benchmarks check --shapes 1x4x128x4x32 --mode reference

Exit status: 1 when a relative error is above its tolerance or a result is not
finite, else 0. Implementations that cannot run here are listed as skipped;
one that raises (an unsupported shape, say) is listed with its error and
counted in the last line, but does not fail the check.
"""

from __future__ import annotations

import argparse
import sys


import jax
import jax.numpy as jnp

from benchmarks import measure
from benchmarks import shapes
from benchmarks.alternatives import (
    IMPLEMENTATIONS, REFERENCE_POINTS, Unavailable, build_xla, cudnn_op,
    cuequivariance_op, import_tokamax, jitted_pair, on_gpu, tokamax_op)

DEFAULT_SHAPES = ("2x3x37x2x8", "2x2x64x2x16", "1x4x128x4x32")  # B x S x N x H x d
QUANTITIES = ("out", "dq", "dk", "dv", "dbias")
# Relative (norm) error against the float32 reference. Layout or broadcasting
# mistakes give errors of order 1.
TOLERANCE = {"bf16": 5e-2, "f16": 2e-2}
F32_TOLERANCE = {"reference": 1e-4, "kernels": 5e-3}  # kernels: TF32 is expected in some


def reference_op(name: str, case: shapes.Case):
    """The op of `name` over its package's portable path (mode `reference`)."""
    # The kernels (interpreted off a GPU).
    if name in ("msa_pallas", "msa_pallas_skip", "msa_pallas_dpa"):
        return IMPLEMENTATIONS[name](case)
    if name == "xla":
        return build_xla(case)
    if name == "cudnn":
        return jitted_pair(cudnn_op(case.scale, implementation="xla"),
                                 {"path": "jax.nn.dot_product_attention xla"})
    if name in ("tokamax_mosaic", "tokamax_triton"):
        tokamax = import_tokamax()
        return jitted_pair(tokamax_op(tokamax, case.scale, "xla"),
                                 {"path": "tokamax implementation='xla'"})
    if name == "cuequivariance":
        # Keep the CUDA kernel library from loading: cuequivariance_jax then
        # uses its jnp reference (triangle_attention_jax_fwd and its autodiff).
        sys.modules.setdefault("cuequivariance_ops_jax", None)
        try:
            import cuequivariance_jax
            from cuequivariance_jax.triangle import _triangle_attention
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"cuequivariance_jax is not importable "
                                    f"({type(exc).__name__}: {exc})") from None
        if _triangle_attention.HAS_CUE_OPS_JAX:
            raise Unavailable("cuequivariance_ops_jax was already loaded: "
                                    "the reference path cannot be forced")
        return jitted_pair(cuequivariance_op(cuequivariance_jax, case.scale),
                                 {"path": "cuequivariance_jax jnp reference"})
    raise Unavailable(f"no reference path for {name}")


def run_reference(case: shapes.Case, inputs: tuple, all_masked: jax.Array,
                  mask_queries: bool = False):
    """Float32 output, gradients and all-masked-row output of msa_pallas' xla path
    (with the op's `mask_queries`, for the variants that take it)."""
    case32 = shapes.Case(case.shape, "f32", "f32")
    f32 = tuple(x.astype(jnp.float32) if x.dtype != jnp.bool_ else x for x in inputs)
    with jax.default_matmul_precision("highest"):
        built = build_xla(case32, mask_queries)
        out = built.fwd(*f32[:5])
        grads = built.fwd_bwd(*f32)
        masked_out = built.fwd(*f32[:4], all_masked)
    return jax.block_until_ready((out, grads, masked_out))


def check_case(case: shapes.Case, names: list[str], mode: str,
               seed: int) -> tuple[list, bool, float]:
    """Rows `(name, status, errors dict)` for one case, whether all passed, and the tolerance."""
    inputs = measure.make_input_set(case, measure.input_key(seed))
    q, k, v, bias, mask, ct = inputs
    all_masked = mask.at[0, 0, :].set(False)  # one row (b=0, s=0) with every key masked
    reference_runs = {}

    def references_for(mask_queries: bool):
        """The xla path's results by quantity, and its all-masked row's output."""
        if mask_queries not in reference_runs:
            out, grads, masked = run_reference(case, inputs, all_masked, mask_queries)
            reference_runs[mask_queries] = dict(zip(QUANTITIES, (out, *grads))), masked
        return reference_runs[mask_queries]

    tolerance = TOLERANCE.get(case.dtype_name, F32_TOLERANCE[mode])
    rows, passed = [], True
    for name in names:
        try:
            if mode == "kernels":
                built = IMPLEMENTATIONS[name](case)
            else:
                built = reference_op(name, case)
            out = built.fwd(q, k, v, bias, mask)
            grads = built.fwd_bwd(q, k, v, bias, mask, ct)
            masked_out = built.fwd(q, k, v, bias, all_masked)
            out, grads, masked_out = jax.block_until_ready((out, grads, masked_out))
            references, ref_masked = references_for(built.info.get("masks_queries", False))
        except Unavailable as why:
            rows.append((name, f"skipped: {why}", {}))
            continue
        except Exception as exc:  # noqa: BLE001 - reported, the check goes on
            rows.append((name, measure.describe_failure(exc), {}))
            continue
        errors = {key: measure.relative_error(value, references[key])
                  for key, value in zip(QUANTITIES, (out, *grads))}
        errors["all-masked row"] = measure.relative_error(masked_out[0, 0], ref_masked[0, 0])
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *grads))
        bad = [key for key in QUANTITIES if errors[key] is None or not errors[key] <= tolerance]
        if finite and not bad:
            status = "ok"
            masked_err = errors["all-masked row"]  # NaN there compares False too
            if masked_err is None or not masked_err <= tolerance:
                # A different convention for rows with no key left (msa_pallas
                # gives uniform weights); only padding rows of padded shapes have
                # them, and their output is not used.
                status = "ok; all-masked row differs from msa_pallas' (uniform weights)"
        else:
            status = "FAIL: " + ("not finite; " if not finite else "") + ", ".join(bad)
            passed = False
        rows.append((name, status, errors))
    return rows, passed, tolerance


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    checkable = [name for name in IMPLEMENTATIONS if name not in REFERENCE_POINTS]
    parser.add_argument("--impls", default=",".join(checkable),
                        help="comma-separated, of " + ", ".join(checkable))
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help="comma-separated BxSxNxHxd[:padded] or names of benchmarks/shapes.py "
                             "(default %(default)s)")
    parser.add_argument("--dtypes", default="bf16,f32", help="default %(default)s")
    parser.add_argument("--bias-dtypes", default=",".join(shapes.BIAS_DTYPES),
                        help="f32 and/or input (the q/k/v dtype) (default %(default)s)")
    parser.add_argument("--mode", choices=("auto", "kernels", "reference"), default="auto",
                        help="kernels on a GPU, reference otherwise (default auto)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = split_list(args.impls)
    unknown = [name for name in names if name not in checkable]
    if unknown:
        parser.error(f"unknown impl {', '.join(unknown)}")
    mode = args.mode if args.mode != "auto" else ("kernels" if on_gpu() else "reference")
    try:
        chosen = [shapes.parse_shape(name) for name in split_list(args.shapes)]
        cases = [shapes.Case(shape, dtype, bias) for dtype in split_list(args.dtypes)
                 for shape in chosen
                 for bias in shapes.bias_dtype_names(dtype, split_list(args.bias_dtypes))]
    except (ValueError, KeyError) as exc:
        parser.error(str(exc))
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"mode {mode}; relative errors against msa_pallas' xla path in float32 "
          f"(highest precision)", flush=True)
    all_passed, errors = True, 0
    for case in cases:
        rows, passed, tolerance = check_case(case, names, mode, args.seed)
        all_passed &= passed
        where = f"{case.shape_name} {case.dtype_name} bias {case.bias_dtype_name}"
        print(f"\n{where} (B,S,N,H,d = {case.dims}), tolerance {tolerance:g}")
        columns = (*QUANTITIES, "all-masked row")
        print(f"  {'impl':<15}" + "".join(f"{c:>15}" for c in columns) + "  status")
        for name, status, errs in rows:
            errors += status.startswith("error") or status == "OOM"
            cells = "".join(
                f"{'–' if errs.get(c) is None else format(errs[c], '.1e'):>15}"
                for c in columns)
            tag = "" if status == "ok" or status.startswith("skipped") else f"  [{where}]"
            print(f"  {name:<15}{cells}  {status}{tag}", flush=True)
    if not all_passed:
        verdict = "SOME CHECKS FAILED (a result above its tolerance or not finite)"
    elif errors:
        verdict = (f"all results that were computed passed; {errors} raised an error "
                   "(not counted as a failure)")
    else:
        verdict = "all checks passed"
    print(f"\n# {verdict}")
    return 0 if all_passed else 1
