"""Trace-time checks of `msa_row_attention`'s arguments.

Every error names the argument, shows what it got and what was expected, so a
mistake inside a large model points at the call that made it.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from msa_pallas.block_sizes import BlockConfig
from msa_pallas.kernels.mosaic.support import supports as mosaic_supports

KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
XLA_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float64),)
MAX_KERNEL_HEAD_DIM = 128
# The names `implementation=` takes (None: the dispatch rule picks one).
IMPLEMENTATIONS = ("triton", "mosaic", "xla")
# Older names: "pallas" has always meant the Triton kernels.
IMPLEMENTATION_ALIASES = {"pallas": "triton"}
# The Mosaic GPU interpreter of jax 0.11.2 hangs in its barrier waits on some
# programs under XLA's concurrency-optimised CPU scheduler.
INTERPRETER_SCHEDULE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def shape_str(shape) -> str:
    """`[2, 8, 32]` for error messages."""
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_float(name: str, x, allowed) -> None:
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} has dtype {x.dtype}; expected one of {names}.")


def canonical_implementation(implementation) -> str | None:
    """`implementation` as one of `IMPLEMENTATIONS` (None stays None);
    ValueError listing the choices for any other name."""
    if implementation is None or implementation in IMPLEMENTATIONS:
        return implementation
    if isinstance(implementation, str) and implementation in IMPLEMENTATION_ALIASES:
        return IMPLEMENTATION_ALIASES[implementation]
    choices = ", ".join(repr(name) for name in (None, *IMPLEMENTATIONS, *IMPLEMENTATION_ALIASES))
    raise ValueError(f"implementation={implementation!r}; expected one of {choices}.")


def validate_arguments(q, k, v, bias, mask, gate, scale, implementation) -> None:
    """Raises ValueError / TypeError for arguments `msa_row_attention` cannot take.

    Expected: q, k, v, gate `[*batch, S, N, H, d]` of one floating dtype;
    bias `[*batch, H, N, N]` floating; mask `[*batch, S, N]` bool or numeric.
    """
    implementation = canonical_implementation(implementation)
    for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array; got {type(x).__name__}.")
    if q.ndim < 4:
        raise ValueError(
            f"q has shape {shape_str(q.shape)} (rank {q.ndim}); expected "
            "[*batch, S, N, H, d], rank >= 4."
        )
    *batch, s_rows, n_res, n_heads, head_dim = q.shape
    expected_qkv = tuple(q.shape)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != expected_qkv:
            raise ValueError(
                f"{name} has shape {shape_str(x.shape)}; expected "
                f"{shape_str(expected_qkv)} (the shape of q, [*batch, S, N, H, d])."
            )
    allowed = XLA_DTYPES if implementation == "xla" else KERNEL_DTYPES
    _check_float("q", q, allowed)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype}; expected {q.dtype} (the dtype of q)."
            )
    expected_bias = (*batch, n_heads, n_res, n_res)
    if tuple(bias.shape) != expected_bias:
        raise ValueError(
            f"bias has shape {shape_str(bias.shape)}; expected "
            f"{shape_str(expected_bias)} ([*batch, H, N, N] for q of shape "
            f"{shape_str(q.shape)})."
        )
    _check_float("bias", bias, allowed)
    if mask is not None:
        if not hasattr(mask, "shape"):
            raise TypeError(f"mask must be an array or None; got {type(mask).__name__}.")
        expected_mask = (*batch, s_rows, n_res)
        if tuple(mask.shape) != expected_mask:
            raise ValueError(
                f"mask has shape {shape_str(mask.shape)}; expected "
                f"{shape_str(expected_mask)} ([*batch, S, N] for q of shape "
                f"{shape_str(q.shape)})."
            )
        if not (
            jnp.issubdtype(mask.dtype, jnp.bool_)
            or jnp.issubdtype(mask.dtype, jnp.number)
        ):
            raise TypeError(f"mask has dtype {mask.dtype}; expected bool or numeric.")
    if gate is not None:
        if not hasattr(gate, "shape"):
            raise TypeError(f"gate must be an array or None; got {type(gate).__name__}.")
        if tuple(gate.shape) != expected_qkv:
            raise ValueError(
                f"gate has shape {shape_str(gate.shape)}; expected "
                f"{shape_str(expected_qkv)} (the shape of q)."
            )
        _check_float("gate", gate, allowed)
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(
            f"scale must be a Python float or None; got {type(scale).__name__}."
        )
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale={scale!r}; expected a finite number (or None for 1/sqrt(d)).")
    if min(s_rows, n_res, n_heads, head_dim, *batch, 1) < 1:
        raise ValueError(
            f"q has shape {shape_str(q.shape)}; every dimension must be >= 1."
        )
    if implementation in ("triton", "pallas", "mosaic"):
        check_reverse_mode(q, k, v, bias, gate, implementation=implementation)
    if implementation == "mosaic":
        reason = mosaic_supports(q.shape, q.dtype, bias.dtype)
        if reason is not None:
            raise ValueError(
                f"implementation='mosaic' with q of shape {shape_str(q.shape)}: {reason}. "
                "Use implementation=None or 'triton'."
            )
    if implementation == "triton" and head_dim > MAX_KERNEL_HEAD_DIM:
        raise ValueError(
            f"q has head dim d={head_dim} (shape {shape_str(q.shape)}); the Triton "
            f"kernels support d <= {MAX_KERNEL_HEAD_DIM}. Use implementation='xla'."
        )


def validate_block_config(block_config) -> None:
    """block_config must be a `msa_pallas.BlockConfig` or None."""
    if block_config is not None and not isinstance(block_config, BlockConfig):
        raise TypeError(
            f"block_config must be a msa_pallas.BlockConfig or None; got "
            f"{type(block_config).__name__}."
        )


def validate_dropout(dropout_rate, dropout_rng) -> None:
    """Checks the attention-dropout arguments of `msa_row_attention`."""
    if not isinstance(dropout_rate, (int, float, np.floating)) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate!r}; expected a float in [0, 1).")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs dropout_rng, a PRNG key; got None.")


def check_reverse_mode(*arrays, implementation: str) -> None:
    """Raises TypeError when the kernels are asked for a forward-mode
    derivative (`jax.jvp`, `jax.jacfwd`): their derivative is a custom VJP,
    reverse mode only (`jax.linearize`, which JAX runs as reverse mode, works).

    Caught here when the op itself is traced for `jvp`; under `jvp` of a
    jitted or checkpointed function JAX raises its own "can't apply
    forward-mode autodiff (jvp) to a custom_vjp function" later.
    """
    if any(isinstance(x, ad.JVPTracer) for x in arrays if x is not None):
        raise TypeError(
            f"msa_row_attention(implementation={implementation!r}) has no forward-mode "
            "derivative (jax.jvp, jax.jacfwd): the kernels' derivative is a custom VJP, "
            "reverse mode only. Use reverse mode (jax.grad, jax.vjp, jax.jacrev), or "
            "implementation='xla' where forward mode is needed."
        )


def _flag_is_set(flags: str, flag: str) -> bool:
    name, value = flag.split("=")
    return any(
        entry.split("=")[0] == name and entry.split("=", 1)[-1].lower() in (value, "0")
        for entry in flags.split()
    )


def check_mosaic_interpreter() -> None:
    """Raises RuntimeError, at trace time, where the Mosaic GPU kernels'
    interpreter (`implementation="mosaic"` on a machine without a GPU) would
    hang or fail at run time, with the fix:

    - XLA's concurrency-optimised CPU scheduler is on (XLA_FLAGS lacks
      `INTERPRETER_SCHEDULE_FLAG`): the interpreter hangs in its barrier waits
      on some programs (the backward with B * H > 1, say). XLA reads XLA_FLAGS
      once, when JAX creates its CPU backend, before any op is traced, so the
      flag must be in the environment the program starts with.
    - 64-bit types are on or off for this thread only (`with
      jax.enable_x64(...)`) against the global setting: the interpreter runs
      each kernel's threads under the global setting and fails on the
      mismatched integer types.
    """
    if not _flag_is_set(os.environ.get("XLA_FLAGS", ""), INTERPRETER_SCHEDULE_FLAG):
        raise RuntimeError(
            "implementation='mosaic' on a CPU runs the Mosaic GPU kernels in their "
            "interpreter, which hangs under XLA's concurrency-optimised CPU scheduler. "
            f"Start the program with XLA_FLAGS={INTERPRETER_SCHEDULE_FLAG} in its "
            "environment, e.g. `XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler"
            "=false python train.py` (XLA reads it when JAX creates its CPU backend: "
            "setting os.environ later has no effect), or use implementation='pallas' "
            "(the Triton kernels' interpreter) or 'xla' on a CPU."
        )
    if jax.config.jax_enable_x64 != jax.enable_x64.get_global():
        raise RuntimeError(
            "implementation='mosaic' on a CPU inside `with jax.enable_x64("
            f"{jax.config.jax_enable_x64})`: the Mosaic GPU interpreter runs the kernels "
            "in threads that see only the global setting "
            f"(jax_enable_x64={jax.enable_x64.get_global()}) and fails on the mismatch. "
            "Set it globally, jax.config.update('jax_enable_x64', "
            f"{jax.config.jax_enable_x64}), or use implementation='pallas' or 'xla' "
            "on a CPU."
        )
