#!/usr/bin/env python3
"""Benchmark `msa_pallas.msa_row_attention` against other attention implementations.

For every (shape, dtype, implementation) it measures the forward (`fwd`) and the
forward plus the gradients of q, k, v and bias (`f+b`): median and minimum wall
time of jitted calls, XLA's compiled temporary and output memory, and the
time against a lower bound set by the exponentials and the matrix work.

    python benchmarks/bench_attention.py --out DIR                  # GPU: every shape but seed
    python benchmarks/bench_attention.py --shapes train,long --dtypes bf16
    python benchmarks/bench_attention.py --shapes 1x128x4096x8x32   # a custom B x S x N x H x d
    python benchmarks/bench_attention.py --out /tmp/b --iters 3     # CPU: tiny shape, interpret mode
    python benchmarks/bench_attention.py --impls msa_pallas,cuequivariance,tokamax_mosaic

Writes `DIR/results.json` (every number and the run's metadata), `DIR/results.md`
(a Markdown table for benchmarks/RESULTS.md) and `DIR/results.png` (when
matplotlib is importable), and prints the table at the end. Failures (out of
memory, unsupported shapes) are recorded per cell and never stop the run.

Implementations live in `IMPLEMENTATIONS` (name -> builder): msa_pallas, xla
(msa_pallas' plain-jnp path, also the reference of the forward check), cudnn
(`jax.nn.dot_product_attention`), and the alternatives of SPEC §5 from other
packages: cuequivariance (`cuequivariance_jax.triangle_attention`),
tokamax_mosaic and tokamax_triton (`tokamax.dot_product_attention`). Those
packages are not in the GPU image: `bash benchmarks/fetch_wheels.sh` fetches
their wheels into `.whl/` and benchmarks/run_gpu.sh installs them for this
script; where they are missing, or without a GPU, their cells read `skipped`.
benchmarks/check_alternatives.py checks their layout mapping, forward and
gradients, against xla.

Add an implementation by writing a builder that returns `jitted_pair(op)` for
an op with the signature `op(q, k, v, bias, mask) -> out` in msa_pallas'
layout (q/k/v `[B, S, N, H, d]`, bias `[B, H, N, N]`, mask `[B, S, N]` bool,
True keeps a key), and raising `Unavailable` where it cannot run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import msa_pallas

sys.path.insert(0, str(Path(__file__).resolve().parent))
from msa_pallas.timing import batched_times_ms  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent

# --- what is measured -------------------------------------------------------

SHAPES: dict[str, tuple[int, int, int, int, int]] = {  # B, S, N, H, d (SPEC §4)
    "tiny": (1, 4, 64, 2, 16),  # CPU smoke test (interpret mode)
    "seed": (2, 8, 32, 4, 16),
    "train": (1, 128, 256, 8, 32),
    "finetune": (1, 512, 384, 8, 32),
    "extra": (1, 1024, 384, 8, 8),
    "long": (1, 512, 1024, 8, 32),
    "longer": (1, 128, 2048, 8, 32),
}
GPU_DEFAULT_SHAPES = ("train", "finetune", "extra", "long", "longer")
CPU_DEFAULT_SHAPES = ("tiny",)

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
DEFAULT_DTYPES = ("bf16", "f32")

MODES = ("fwd", "fwd_bwd")
MODE_LABELS = {"fwd": "fwd", "fwd_bwd": "f+b"}
SUBJECT = "msa_pallas"  # the implementation the speed-ups and floor fractions are about
CHECK_REFERENCE = "xla"  # forward outputs are compared with this implementation's
# Timed for comparison but computing a different operation (no bias, no mask):
# never an "alternative" in the targets table, and its output is not checked.
REFERENCE_POINTS = ("jax_mha_nobias",)
# SPEC §6: forward and forward+backward speed-ups over the fastest alternative
# (bf16), memory against cuEquivariance's, float32 against XLA's float32.
TARGET_SPEEDUP = {"fwd": 1.5, "fwd_bwd": 2.0}
TARGET_SHAPES = ("train", "finetune", "long")
MEMORY_YARDSTICK = "cuequivariance"
# SPEC §6: at N >= this, forward and backward must run where XLA runs out of memory.
LONG_CHAIN_N = 4096

# --- H200 rates for the lower bound (measured on the card) ------------------

L2_BYTES = 60e6
EXP_PER_S = 3.9e12
MATMUL_FLOP_PER_S = {"bf16": 790e12, "f16": 790e12, "f32": 60e12}
EXPS_PER_LOGIT = {"fwd": 1, "fwd_bwd": 3}  # fwd: 1; backward recomputes p twice
MATMUL_FLOPS_PER_LOGIT_AND_DIM = {"fwd": 4, "fwd_bwd": 14}  # 2 matmuls fwd, 5 bwd
MASKED_FRACTION = 0.1
# Forward relative error (vs CHECK_REFERENCE) above which a note is added.
CHECK_TOLERANCE = {"bf16": 3e-2, "f16": 1e-2, "f32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape and dtype to measure."""

    shape_name: str
    dims: tuple[int, int, int, int, int]  # B, S, N, H, d
    dtype_name: str

    @property
    def key(self) -> str:
        return f"{self.shape_name}/{self.dtype_name}"

    @property
    def dtype(self):
        return DTYPES[self.dtype_name]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dims[4])

    @property
    def logits(self) -> int:
        """B*S*H*N*N: the number of attention logits."""
        b, s, n, h, _ = self.dims
        return b * s * h * n * n

    def input_set_bytes(self) -> int:
        """Bytes of one input set: q, k, v, cotangent, bias and mask."""
        b, s, n, h, d = self.dims
        item = jnp.dtype(self.dtype).itemsize
        return 4 * b * s * n * h * d * item + b * h * n * n * item + b * s * n

    def floor_ms(self, mode: str) -> dict[str, float]:
        """Lower bound in ms: the exponentials, the matrix work, and their max."""
        exp_ms = EXPS_PER_LOGIT[mode] * self.logits / EXP_PER_S * 1e3
        flops = MATMUL_FLOPS_PER_LOGIT_AND_DIM[mode] * self.logits * self.dims[4]
        matmul_ms = flops / MATMUL_FLOP_PER_S[self.dtype_name] * 1e3
        return {"exp_ms": exp_ms, "matmul_ms": matmul_ms, "floor_ms": max(exp_ms, matmul_ms)}


# --- implementations ----------------------------------------------------------


class Unavailable(Exception):
    """An implementation cannot run this case here (recorded as `skipped: ...`)."""


@dataclasses.dataclass
class Callables:
    """Jitted `fwd(q, k, v, bias, mask)` and `fwd_bwd(q, k, v, bias, mask, ct)`.

    `fwd_bwd` returns the gradients of `sum(out.astype(f32) * ct)` with respect
    to q, k, v and bias. `info` is recorded in results.json.
    """

    fwd: Callable
    fwd_bwd: Callable
    info: dict


def jitted_pair(op: Callable, info: dict | None = None) -> Callables:
    """Jitted forward and forward+backward callables of `op(q, k, v, bias, mask)`."""

    def loss(q, k, v, bias, mask, ct):
        out = op(q, k, v, bias, mask)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    return Callables(
        fwd=jax.jit(op),
        fwd_bwd=jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
        info=info or {},
    )


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def build_msa_pallas(case: Case) -> Callables:
    """msa_pallas' Pallas kernels (interpret mode without a GPU)."""
    _, _, n, _, d = case.dims

    def op(q, k, v, bias, mask):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, mask, scale=case.scale, implementation="pallas"
        )

    config = msa_pallas.default_block_config(n, d, case.dtype)
    info = {"interpret": not on_gpu(), "block_config": dataclasses.asdict(config)}
    return jitted_pair(op, info)


def build_xla(case: Case) -> Callables:
    """msa_pallas' plain-jnp path (materialises [B, S, H, N, N] logits)."""

    def op(q, k, v, bias, mask):
        return msa_pallas.msa_row_attention(
            q, k, v, bias, mask, scale=case.scale, implementation="xla"
        )

    return jitted_pair(op)


def cudnn_op(scale: float, implementation: str = "cudnn") -> Callable:
    """`op(q, k, v, bias, mask)` through `jax.nn.dot_product_attention`, MSA rows folded into batch.

    q/k/v `[B, S, N, H, d]` -> `[B*S, N, H, d]` (a free reshape). The bias is
    passed as `[1, H, N, N]` when B == 1 (the API broadcasts it over the
    batch); for B > 1 it has to be repeated over S to `[B*S, H, N, N]`. The key
    mask goes in as bool `[B*S, 1, 1, N]`. Note that jax 0.11.2 turns a boolean
    mask into an additive bias and adds it to `bias`, so with a mask the
    combined `[B*S, H, N, N]` bias is materialised in any case (and its
    gradient reduced over S by XLA). `implementation="xla"` runs the same
    mapping anywhere (benchmarks/check_alternatives.py uses it on CPU).
    """

    def op(q, k, v, bias, mask):
        b, s, n, h, d = q.shape
        rows = lambda x: x.reshape(b * s, n, h, d)  # noqa: E731
        if b == 1:
            bias_rows = bias
        else:
            bias_rows = jnp.broadcast_to(bias[:, None], (b, s, h, n, n))
            bias_rows = bias_rows.reshape(b * s, h, n, n)
        out = jax.nn.dot_product_attention(
            rows(q), rows(k), rows(v),
            bias=bias_rows,
            mask=mask.reshape(b * s, 1, 1, n),
            scale=scale,
            implementation=implementation,
        )
        return out.reshape(b, s, n, h, d)

    return op


def build_cudnn(case: Case) -> Callables:
    """`jax.nn.dot_product_attention(implementation="cudnn")` (see `cudnn_op`)."""
    if not on_gpu():
        raise Unavailable("cuDNN needs a GPU")
    if case.dtype_name not in ("bf16", "f16"):
        raise Unavailable("cuDNN flash attention takes bf16/fp16 only")
    return jitted_pair(cudnn_op(case.scale))


# --- the alternatives from other packages (SPEC §5) --------------------------
#
# Installed on the GPU machine from wheels: `bash benchmarks/fetch_wheels.sh`
# here, then benchmarks/run_gpu.sh installs `.whl/` for the benchmark step.

STUBS_DIR = Path(__file__).resolve().parent / "_stubs"
# Versions recorded in results.json and under the table (None: not installed).
ALTERNATIVE_PACKAGES = ("tokamax", "cuequivariance-jax", "cuequivariance-ops-jax-cu13",
                        "cuequivariance-ops-cu13")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_tokamax():
    """Imports tokamax, or raises `Unavailable` saying why.

    tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` at start-up
    (it calls it only for its own xprof timing); where no real `xprof` is
    importable, the stand-in in benchmarks/_stubs is put on `sys.path` first.
    """
    if importlib.util.find_spec("xprof") is None and str(STUBS_DIR) not in sys.path:
        sys.path.append(str(STUBS_DIR))
    try:
        import tokamax
    except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
        raise Unavailable(f"tokamax is not importable ({type(exc).__name__}: {exc}); "
                          "see benchmarks/fetch_wheels.sh") from None
    return tokamax


def _preload_cuda_libraries() -> None:
    """dlopens cuBLAS and NVRTC 13 from NVIDIA's pip packages, where they are.

    cuequivariance_ops' libcue_ops.so links libcublas.so.13, libcublasLt.so.13
    and libnvrtc.so.13 with no RUNPATH; jax's CUDA plugin normally has them
    loaded already (then this is a no-op). Failures are left to the import.
    """
    import ctypes

    names = ("libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13")
    for module in ("nvidia.cu13", "nvidia.cuda_nvrtc", "nvidia.cublas"):
        try:
            folders = list(importlib.import_module(module).__path__)
        except Exception:  # noqa: BLE001 - not installed
            continue
        for folder in folders:
            for name in names:
                path = Path(folder) / "lib" / name
                if path.exists():
                    try:
                        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        pass


def import_cuequivariance():
    """Imports cuequivariance_jax with its CUDA kernels, or raises `Unavailable`.

    Without `cuequivariance_ops_jax` (or when its libraries do not load),
    cuequivariance_jax silently falls back to a plain-jnp reference on CUDA
    too; that fallback is refused here so that it is never timed as the kernel.
    The CUDA libraries it links (cuBLAS, NVRTC 13) are the ones jax's CUDA
    plugin loads when the GPU backend starts, so call this after
    `jax.devices()` (the benchmark does).
    """
    if on_gpu():
        _preload_cuda_libraries()
    try:
        import cuequivariance_jax
        from cuequivariance_jax.triangle import _triangle_attention
    except Exception as exc:  # noqa: BLE001 - e.g. OSError from a library that does not load
        raise Unavailable(f"cuequivariance_jax is not importable ({type(exc).__name__}: "
                          f"{exc}); see benchmarks/fetch_wheels.sh") from None
    if not getattr(_triangle_attention, "HAS_CUE_OPS_JAX", False):
        try:
            import cuequivariance_ops_jax  # noqa: F401 - for the reason only
            why = "HAS_CUE_OPS_JAX is False"
        except Exception as exc:  # noqa: BLE001
            why = f"{type(exc).__name__}: {exc}"
        raise Unavailable(f"cuequivariance_ops_jax (the CUDA kernels) is not usable ({why})")
    return cuequivariance_jax


def cuequivariance_op(cuet, scale: float) -> Callable:
    """`op(q, k, v, bias, mask)` in msa_pallas' layout through `cuet.triangle_attention`.

    cuEquivariance takes q/k/v `[B, S, H, N, d]` (one transpose each way,
    counted in the time), the pair bias `[B, 1, H, N, N]` in float32 (shared by
    the S rows; its gradient is reduced over S inside the kernel and comes
    back in float32, cast to the bias dtype here) and the key mask
    `[B, S, 1, 1, N]` bool, True keeps a key, masked logits replaced by -1e9.
    It returns `[out, lse, max]`.
    """

    def op(q, k, v, bias, mask):
        heads_first = lambda x: jnp.swapaxes(x, 2, 3)  # noqa: E731 - [B,S,N,H,d] <-> [B,S,H,N,d]
        out, _lse, _max = cuet.triangle_attention(
            heads_first(q), heads_first(k), heads_first(v),
            bias[:, None].astype(jnp.float32),
            mask[:, :, None, None, :].astype(jnp.bool_),
            scale,
        )
        return heads_first(out)

    return op


def tokamax_op(tokamax, scale: float, implementation: str) -> Callable:
    """`op(q, k, v, bias, mask)` through `tokamax.dot_product_attention`.

    tokamax takes `[*batch, N, H, d]`, so msa_pallas' `[B, S, N, H, d]` goes in
    as it is, with (B, S) as two batch dimensions: no transpose. The bias goes
    in as `[B, 1, H, N, N]` and the key mask as `[B, S, 1, 1, N]` (True keeps a
    key; masked logits are replaced by float32's minimum); both broadcast over
    S without a `[B, S, H, N, N]` array in the forward. (tokamax's backward
    kernels write a per-row bias gradient and sum it over S in XLA: that is
    in its `f+b` memory.) One implementation only, so tokamax raises rather
    than falling back to another.
    """

    def op(q, k, v, bias, mask):
        return tokamax.dot_product_attention(
            q, k, v, bias=bias[:, None], mask=mask[:, :, None, None, :].astype(jnp.bool_),
            scale=scale, implementation=implementation,
        )

    return op


def build_cuequivariance(case: Case) -> Callables:
    """`cuequivariance_jax.triangle_attention` (NVIDIA cuEquivariance's CUDA kernels)."""
    if not on_gpu():
        raise Unavailable("cuEquivariance's kernels need a GPU")
    cuet = import_cuequivariance()
    info = {
        "versions": {name: _package_version(name) for name in (
            "cuequivariance-jax", "cuequivariance-ops-jax-cu13", "cuequivariance-ops-cu13")},
        "layout": "q/k/v transposed to [B,S,H,N,d] and back; bias [B,1,H,N,N] f32",
    }
    if case.dtype_name == "f32":
        info["note"] = ("cuequivariance_ops_jax runs the float32 backward in TF32 "
                        "(no full-float32 backward; it warns)")
    return jitted_pair(cuequivariance_op(cuet, case.scale), info)


def _build_tokamax(case: Case, implementation: str, half_only: bool = False) -> Callables:
    """The builder of a tokamax entry; `implementation` is a key of tokamax's registry."""
    if not on_gpu():
        raise Unavailable(f"tokamax's {implementation} kernels need a GPU")
    if half_only and case.dtype_name not in ("bf16", "f16"):
        # tokamax 0.0.17 maps float32 to the TF32 (or F32) dot preset, and its
        # Mosaic GPU kernels cast only to bf16/fp16: NotImplementedError.
        raise Unavailable(f"tokamax's {implementation} kernels take bf16/fp16 only")
    tokamax = import_tokamax()
    try:
        from tokamax._src.ops.attention import api as tokamax_api
        known = tokamax_api.IMPLEMENTATIONS
    except Exception:  # noqa: BLE001 - a private module; the call will tell
        known = None
    if known is not None and implementation not in known:
        raise Unavailable(f"tokamax has no {implementation!r} implementation here "
                          f"(it has {', '.join(sorted(known))})")
    info = {"versions": {"tokamax": _package_version("tokamax")},
            "implementation": implementation,
            "layout": "no transpose: (B, S) are batch dims; bias [B,1,H,N,N], mask [B,S,1,1,N]",
            "config": "tokamax's default (its autotuning cache, else heuristics)"}
    if case.dtype_name == "f32":
        info["note"] = "tokamax's default precision for float32 on GPU is TF32"
    return jitted_pair(tokamax_op(tokamax, case.scale, implementation), info)


def build_tokamax_mosaic(case: Case) -> Callables:
    """`tokamax.dot_product_attention(implementation="mosaic")` on NVIDIA (Mosaic GPU kernels)."""
    # "mosaic_gpu" is what tokamax's API makes of implementation="mosaic" when
    # the default device's kind contains "NVIDIA" (else it picks "mosaic_tpu");
    # naming it directly never takes the TPU kernels.
    return _build_tokamax(case, "mosaic_gpu", half_only=True)


def build_tokamax_triton(case: Case) -> Callables:
    """`tokamax.dot_product_attention(implementation="triton")`: Pallas Triton kernels."""
    return _build_tokamax(case, "triton")


def build_jax_mha_nobias(case: Case) -> Callables:
    """JAX's own Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`),
    default block sizes, MSA rows folded into the batch, **without bias and mask**.

    Not an alternative (it computes less): a reference point for what a
    Triton flash-attention kernel reaches at these shapes on this GPU when
    there is no bias to add and no bias gradient to reduce.
    """
    if not on_gpu():
        raise Unavailable("a Triton kernel: needs a GPU")
    if case.dtype_name not in ("bf16", "f16"):
        raise Unavailable("16-bit only (its float32 products would be TF32)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_attention

    def op(q, k, v, bias, mask):
        del bias, mask  # not supported by this kernel: the point of the comparison
        b, s, n, h, d = q.shape
        rows = lambda x: x.reshape(b * s, n, h, d)  # noqa: E731
        out = jax_attention.mha(rows(q), rows(k), rows(v), None, sm_scale=case.scale)
        return out.reshape(b, s, n, h, d)

    info = {"reference_point": True,
            "note": "no bias and no mask: a reference point, not an alternative"}
    return jitted_pair(op, info)


IMPLEMENTATIONS: dict[str, Callable[[Case], Callables]] = {
    "msa_pallas": build_msa_pallas,
    "xla": build_xla,
    "cudnn": build_cudnn,
    "cuequivariance": build_cuequivariance,
    "tokamax_mosaic": build_tokamax_mosaic,
    "tokamax_triton": build_tokamax_triton,
    "jax_mha_nobias": build_jax_mha_nobias,
}


# --- inputs, timing, memory --------------------------------------------------


def make_input_set(case: Case, key: jax.Array) -> tuple:
    """Random (q, k, v, bias, mask, ct); ~MASKED_FRACTION of the keys masked."""
    b, s, n, h, d = case.dims
    kq, kk, kv, kb, km, kc = jax.random.split(key, 6)
    qkv_shape = (b, s, n, h, d)
    normal = lambda k_, shape: jax.random.normal(k_, shape, jnp.float32).astype(case.dtype)  # noqa: E731
    mask = jax.random.bernoulli(km, 1.0 - MASKED_FRACTION, (b, s, n))
    inputs = (
        normal(kq, qkv_shape), normal(kk, qkv_shape), normal(kv, qkv_shape),
        normal(kb, (b, h, n, n)), mask, normal(kc, qkv_shape),
    )
    return jax.block_until_ready(inputs)


def num_input_sets(case: Case) -> int:
    """Input sets to rotate: enough to exceed twice the L2 when one set fits in it."""
    set_bytes = case.input_set_bytes()
    if set_bytes >= L2_BYTES:
        return 1
    return int(min(16, max(2, math.ceil(2 * L2_BYTES / set_bytes))))


def mode_args(mode: str, inputs: tuple) -> tuple:
    """The arguments of the `mode` callable: fwd takes no cotangent."""
    return inputs[:5] if mode == "fwd" else inputs


def describe_failure(exc: BaseException) -> str:
    """`OOM` for out-of-memory errors, otherwise `error: <first line>`."""
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if "resource_exhausted" in lowered or "out of memory" in lowered:
        return "OOM"
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"error: {type(exc).__name__}: {first.strip()}"[:200]


def memory_stats(compiled) -> dict[str, int | None]:
    """XLA's temporary and output bytes of a compiled executable (None if unknown)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        analysis = None
    temp = getattr(analysis, "temp_size_in_bytes", None)
    output = getattr(analysis, "output_size_in_bytes", None)
    total = temp + output if temp is not None and output is not None else None
    return {"temp_bytes": temp, "output_bytes": output, "temp_plus_output_bytes": total}


def measure(
    jitted: Callable, arg_sets: list[tuple], iters: int, warmup: int, reps: int = 1
) -> tuple[dict, object]:
    """Compiles, reads memory, warms up, then takes `iters` samples rotating `arg_sets`.

    A sample is `reps` back-to-back calls, waited for once, divided by
    `reps` (`msa_pallas.timing.batched_times_ms`).

    Returns (result dict, output of the first call or None). Failures are
    recorded in the result's `status`, never raised.
    """
    result: dict = {"status": "ok"}
    first_output = None
    try:
        t0 = time.perf_counter()
        compiled = jitted.lower(*arg_sets[0]).compile()
        result["compile_s"] = time.perf_counter() - t0
        result.update(memory_stats(compiled))
        for i in range(max(1, warmup)):
            out = jax.block_until_ready(compiled(*arg_sets[i % len(arg_sets)]))
            if i == 0:
                first_output = out
            del out
        times = batched_times_ms(
            lambda i: compiled(*arg_sets[i % len(arg_sets)]), samples=iters, reps=reps
        )
        result.update(
            median_ms=statistics.median(times), min_ms=min(times), times_ms=times
        )
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        result["status"] = describe_failure(exc)
        result["detail"] = f"{type(exc).__name__}: {exc}"[:2000]
        first_output = None
    return result, first_output


def relative_error(out, reference) -> float | None:
    """||out - reference|| / ||reference|| in float32; None if it cannot be computed."""
    try:
        out32 = jnp.asarray(out, jnp.float32)
        ref32 = jnp.asarray(reference, jnp.float32)
        return float(jnp.linalg.norm(out32 - ref32) / jnp.linalg.norm(ref32))
    except Exception:  # noqa: BLE001 - a check, not a measurement
        return None


# --- progress ------------------------------------------------------------------


class TextProgress:
    """A minimal stand-in for tqdm.

    On a terminal it redraws `[k/n] description` on stderr. Elsewhere (a log
    file) it draws nothing and prefixes each result line with `[k/n]`
    instead, so that a captured log stays compact.
    """

    def __init__(self, total: int, tty: bool):
        self.total, self.n, self.desc, self.tty = total, 0, "", tty
        self.width = len(str(total))

    def _draw(self) -> None:
        sys.stderr.write(f"\r\033[K[{self.n}/{self.total}] {self.desc}")
        sys.stderr.flush()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self.tty:
            self._draw()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.tty:
            self._draw()

    def write(self, line: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            print(line, flush=True)
            self._draw()
        else:
            print(f"[{self.n + 1:>{self.width}}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def make_progress(total: int):
    """A tqdm bar on stderr when it is a terminal and tqdm is importable, else `TextProgress`."""
    tty = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not tty:
        return TextProgress(total, tty)
    bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
    bar.write = lambda line: tqdm.write(line, file=sys.stdout)  # results go to stdout
    return bar


# --- one case -------------------------------------------------------------------


def run_case(case: Case, impls: list[str], args, progress, deadline: float | None) -> dict:
    """Measures every implementation on one case; returns the case's record."""
    floors = {mode: case.floor_ms(mode) for mode in MODES}
    record = {
        "shape": case.shape_name, "dims": dict(zip("BSNHd", case.dims)),
        "dtype": case.dtype_name, "logits": case.logits, "floor": floors,
        "impls": {},
    }
    n_sets = num_input_sets(case)
    record["input_sets"] = n_sets
    try:
        if deadline is not None and time.monotonic() > deadline:
            raise Unavailable("time budget")
        keys = jax.random.split(jax.random.PRNGKey(args.seed), n_sets)
        arg_sets = [make_input_set(case, key) for key in keys]
    except Exception as exc:  # noqa: BLE001 - every cell of the case records it
        status = f"skipped: {exc}" if isinstance(exc, Unavailable) else (
            f"inputs: {describe_failure(exc)}")
        for impl in impls:
            record["impls"][impl] = {mode: {"status": status} for mode in MODES}
            for mode in MODES:
                progress.write(format_result_line(case, impl, mode, record["impls"][impl][mode]))
                progress.update(1)
        return finish_case(record, impls)

    # The reference implementation goes first so its forward output can check the others.
    reference_out = None
    for impl in sorted(impls, key=lambda name: name != CHECK_REFERENCE):
        entry, out = run_impl(case, impl, arg_sets, args, progress, deadline, reference_out)
        record["impls"][impl] = entry
        if impl == CHECK_REFERENCE:
            reference_out = out
        del out
        gc.collect()
    del arg_sets, reference_out
    gc.collect()
    return finish_case(record, impls)


def run_impl(case: Case, impl: str, arg_sets: list[tuple], args, progress,
             deadline: float | None, reference_out) -> tuple[dict, object]:
    """Measures one implementation in both modes; returns (entry, forward output or None).

    The forward output is compared with `reference_out` when there is one.
    """
    entry: dict = {}
    try:
        built = IMPLEMENTATIONS[impl](case)
        entry["info"] = built.info
    except Unavailable as why:
        built, unavailable = None, f"skipped: {why}"
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        built, unavailable = None, describe_failure(exc)
    fwd_out = None
    for mode in MODES:
        progress.set_description(f"{case.key} {impl} {MODE_LABELS[mode]}")
        if built is None:
            entry[mode] = {"status": unavailable}
        elif deadline is not None and time.monotonic() > deadline:
            entry[mode] = {"status": "skipped: time budget"}
        else:
            sets = [mode_args(mode, inputs) for inputs in arg_sets]
            entry[mode], out = measure(
                getattr(built, mode), sets, args.iters, args.warmup, args.reps
            )
            if mode == "fwd":
                fwd_out = out
                if (out is not None and reference_out is not None
                        and impl not in REFERENCE_POINTS):
                    entry[mode]["rel_err_vs_" + CHECK_REFERENCE] = relative_error(
                        out, reference_out)
            del out
        progress.write(format_result_line(case, impl, mode, entry[mode]))
        progress.update(1)
    return entry, fwd_out


def finish_case(record: dict, impls: list[str]) -> dict:
    """Adds fraction of floor for every implementation and the subject's speed-ups."""
    for impl in impls:
        for mode in MODES:
            cell = record["impls"][impl][mode]
            if cell.get("status") == "ok":
                cell["fraction_of_floor"] = record["floor"][mode]["floor_ms"] / cell["median_ms"]
    record["speedup"] = {}
    if SUBJECT in impls:
        subject = record["impls"][SUBJECT]
        for other in impls:
            if other == SUBJECT:
                continue
            record["speedup"][other] = {
                mode: (
                    record["impls"][other][mode]["median_ms"] / subject[mode]["median_ms"]
                    if ok(subject[mode]) and ok(record["impls"][other][mode]) else None
                )
                for mode in MODES
            }
    return record


def ok(cell: dict) -> bool:
    return cell.get("status") == "ok"


def format_result_line(case: Case, impl: str, mode: str, cell: dict) -> str:
    """One log line per measurement."""
    head = f"{case.shape_name:>9} {case.dtype_name:>4} {impl:>14} {MODE_LABELS[mode]:>3}:"
    if not ok(cell):
        return f"{head} {cell['status']}"
    mem = cell.get("temp_plus_output_bytes")
    mem_text = f"{mem / 1e6:.1f} MB" if mem is not None else "?"
    text = (f"{head} median {cell['median_ms']:.4g} ms, min {cell['min_ms']:.4g} ms, "
            f"temp+out {mem_text}, compile {cell['compile_s']:.1f} s")
    err = cell.get("rel_err_vs_" + CHECK_REFERENCE)
    if err is not None:
        text += f", rel.err vs {CHECK_REFERENCE} {err:.1e}"
    return text


# --- output ------------------------------------------------------------------


def fmt_ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def fmt_cell(cell: dict) -> str:
    """A time cell: milliseconds, or a short failure code."""
    if ok(cell):
        return fmt_ms(cell["median_ms"])
    status = cell.get("status", "")
    if status.endswith("OOM"):
        return "OOM"
    return "n/a" if status.startswith("skipped") else "error"


def fmt_mb(cell: dict) -> str:
    value = cell.get("temp_plus_output_bytes")
    return "–" if value is None else f"{value / 1e6:,.0f}" if value >= 1e7 else f"{value / 1e6:.2f}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1e}"


def fmt_pair(values) -> str:
    """Two ratios (fwd, f+b) as `a / b`."""
    return " / ".join(fmt_ratio(v) for v in values)


def markdown_table(results: dict) -> str:
    """The results as a Markdown table (one row per shape x dtype) plus notes."""
    impls = results["metadata"]["impls"]
    meta = results["metadata"]
    others = [name for name in impls if name != SUBJECT] if SUBJECT in impls else []
    header = ["shape (B,S,N,H,d)", "dtype"]
    header += [f"{name} {MODE_LABELS[mode]} ms" for mode in MODES for name in impls]
    header += [f"× vs {name} fwd / f+b" for name in others]
    if SUBJECT in impls:
        header.append(f"{SUBJECT} fraction of floor fwd / f+b")
    header += [f"{name} f+b mem MB" for name in impls]
    lines = [
        f"{meta['device_kind']} · jax {meta['jax_version']} · commit {meta['commit']} · "
        f"{meta['date_utc']} · median of {meta['iters']} samples of "
        f"{meta.get('reps', 1)} back-to-back calls",
        "",
    ]
    installed = [f"{name} {version}" for name, version in meta.get("packages", {}).items()
                 if version is not None]
    if installed:
        lines += ["Alternatives' packages: " + ", ".join(installed), ""]
    lines += [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    notes: dict[str, list[str]] = {}
    for case in results["cases"]:
        cells = case["impls"]
        dims = ",".join(str(v) for v in case["dims"].values())
        row = [f"{case['shape']} ({dims})", case["dtype"]]
        row += [fmt_cell(cells[name][mode]) for mode in MODES for name in impls]
        row += [fmt_pair([case["speedup"][name][m] for m in MODES]) for name in others]
        if SUBJECT in impls:
            row.append(fmt_pair([cells[SUBJECT][m].get("fraction_of_floor") for m in MODES]))
        row += [fmt_mb(cells[name]["fwd_bwd"]) for name in impls]
        lines.append("| " + " | ".join(row) + " |")
        for note, where in case_notes(case, impls):
            notes.setdefault(note, [])
            if where not in notes[note]:
                notes[note].append(where)
    lines += ["", f"Floor: max(B·S·H·N² exponentials × (1 fwd, 3 f+b) at {EXP_PER_S:.2g}/s, "
              "matrix FLOPs (4, 14)·B·S·H·N²·d at 790e12/s bf16/f16, 60e12/s f32); "
              "fraction of floor = floor / median. Memory: XLA temp + output bytes of the "
              "compiled f+b."]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {note} ({', '.join(where)})" for note, where in notes.items()]
    targets = targets_table(results)
    if targets:
        lines += ["", targets.rstrip("\n")]
    return "\n".join(lines) + "\n"


def _median(case: dict, impl: str, mode: str) -> float | None:
    cell = case["impls"].get(impl, {}).get(mode, {})
    return cell["median_ms"] if ok(cell) else None


def fastest_alternative(case: dict, mode: str) -> tuple[str, float] | None:
    """(name, median ms) of the fastest implementation other than the subject
    and the reference points, or None when none ran."""
    times = [
        (name, ms) for name in case["impls"]
        if name != SUBJECT and name not in REFERENCE_POINTS
        and (ms := _median(case, name, mode)) is not None
    ]
    return min(times, key=lambda item: item[1]) if times else None


def targets_table(results: dict) -> str:
    """SPEC §6 read off this run: the subject against the fastest alternative
    (16-bit dtypes, at TARGET_SHAPES), f+b memory against MEMORY_YARDSTICK's,
    float32 against XLA's float32, and at N >= LONG_CHAIN_N whether f+b runs
    (where XLA's runs out of memory). Empty when the subject did not run."""
    if SUBJECT not in results["metadata"]["impls"]:
        return ""
    lines = [
        "| shape | dtype | target | msa_pallas | fastest alternative (float32: xla) | ratio | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        if case["dims"]["N"] >= LONG_CHAIN_N:
            lines.append(_long_chain_row(case))
            continue
        half = case["dtype"] in ("bf16", "f16")
        if half and case["shape"] not in TARGET_SHAPES:
            continue
        for mode in MODES:
            ours = _median(case, SUBJECT, mode)
            other = (fastest_alternative(case, mode) if half
                     else (CHECK_REFERENCE, _median(case, CHECK_REFERENCE, mode)))
            if ours is None or other is None or other[1] is None:
                continue
            goal = TARGET_SPEEDUP[mode] if half else 1.0
            ratio = other[1] / ours
            lines.append(
                f"| {case['shape']} | {case['dtype']} | {MODE_LABELS[mode]} | {fmt_ms(ours)} ms | "
                f"{fmt_ms(other[1])} ms ({other[0]}) | {ratio:.2f}× | ≥ {goal:g}× | "
                f"{'yes' if ratio >= goal else 'no'} |")
        memory = [case["impls"].get(name, {}).get("fwd_bwd", {}).get("temp_plus_output_bytes")
                  for name in (SUBJECT, MEMORY_YARDSTICK)]
        if half and None not in memory:
            lines.append(
                f"| {case['shape']} | {case['dtype']} | f+b memory | {memory[0] / 1e6:,.0f} MB | "
                f"{memory[1] / 1e6:,.0f} MB ({MEMORY_YARDSTICK}) | {memory[1] / memory[0]:.2f}× | "
                f"≥ 1× | {'yes' if memory[0] <= memory[1] else 'no'} |")
    if len(lines) == 2:
        return ""
    return "\n".join(["Targets (SPEC §6) in this run:", "", *lines]) + "\n"


def _long_chain_row(case: dict) -> str:
    """SPEC §6's N = 4096 target: forward+backward runs where XLA's fails."""
    ours = case["impls"][SUBJECT]["fwd_bwd"]
    xla = case["impls"].get(CHECK_REFERENCE, {}).get("fwd_bwd", {"status": "not run"})
    memory = ours.get("temp_plus_output_bytes")
    ours_text = (f"{fmt_ms(ours['median_ms'])} ms, {memory / 1e6:,.0f} MB" if ok(ours)
                 else ours.get("status", "?"))
    xla_text = fmt_ms(xla["median_ms"]) + " ms" if ok(xla) else xla.get("status", "?")
    ratio = f"{xla['median_ms'] / ours['median_ms']:.2f}×" if ok(ours) and ok(xla) else "–"
    return (f"| {case['shape']} | {case['dtype']} | f+b at N = {case['dims']['N']} | {ours_text} | "
            f"{xla_text} ({CHECK_REFERENCE}) | {ratio} | runs | {'yes' if ok(ours) else 'no'} |")


def case_notes(case: dict, impls: list[str]) -> list[tuple[str, str]]:
    """(note, where) for the failures, skips and forward mismatches of one case.

    A failure common to both modes gives one note without the mode.
    """
    found = []
    where = f"{case['shape']} {case['dtype']}"
    tolerance = CHECK_TOLERANCE.get(case["dtype"], 1e-2)
    for name in impls:
        cells = case["impls"][name]
        statuses = [cells[mode].get("status", "") for mode in MODES]
        if len(set(statuses)) == 1 and statuses[0] != "ok":
            found.append((f"{name}: {statuses[0]}", where))
        else:
            found += [(f"{name} {MODE_LABELS[mode]}: {status}", where)
                      for mode, status in zip(MODES, statuses) if status != "ok"]
        note = cells.get("info", {}).get("note")
        if note and any(ok(cells[mode]) for mode in MODES):
            found.append((f"{name}: {note}", where))
        for mode in MODES:
            err = cells[mode].get("rel_err_vs_" + CHECK_REFERENCE)
            if err is not None and err > tolerance:
                found.append((f"{name} {MODE_LABELS[mode]}: relative error vs "
                              f"{CHECK_REFERENCE} above {tolerance:g}", f"{where}: {err:.1e}"))
    return found


def plot(results: dict, path: Path) -> str | None:
    """Writes results.png; returns why not when it cannot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable"
    dtypes = [case["dtype"] for case in results["cases"]]
    if not dtypes:
        return "no results"
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    cases = sorted((c for c in results["cases"] if c["dtype"] == dtype),
                   key=lambda c: (c["dims"]["N"], c["logits"]))
    labels = [f"{c['shape']}\nN={c['dims']['N']}" for c in cases]
    x = np.arange(len(cases))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [(MODE_LABELS[mode] + " time (ms)", mode, "median_ms", 1.0) for mode in MODES]
    panels.append(("f+b temp+output memory (MB)", "fwd_bwd", "temp_plus_output_bytes", 1e-6))
    for ax, (title, mode, field, factor) in zip(axes, panels):
        for name in results["metadata"]["impls"]:
            values = [c["impls"][name][mode].get(field) for c in cases]
            ys = [np.nan if v is None else v * factor for v in values]
            if field == "median_ms":
                ys = [y if ok(c["impls"][name][mode]) else np.nan for y, c in zip(ys, cases)]
            ax.plot(x, ys, marker="o", label=name)
        if field == "median_ms" and len(cases):
            floors = [c["floor"][mode]["floor_ms"] for c in cases]
            ax.plot(x, floors, "k--", linewidth=1, label="floor")
        ax.set_yscale("log")
        ax.set_xticks(x, labels)
        ax.set_title(f"{title}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = results["metadata"]
    fig.suptitle(f"MSA row attention — {meta['device_kind']}, jax {meta['jax_version']}, "
                 f"commit {meta['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(results: dict, out_dir: Path) -> None:
    """results.json and results.md (rewritten after every case)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(markdown_table(results))


# --- metadata and arguments ---------------------------------------------------


def commit_id(explicit: str | None) -> str:
    """--commit, else $MSA_PALLAS_COMMIT, else `git rev-parse --short HEAD`, else unknown."""
    if explicit:
        return explicit
    if os.environ.get("MSA_PALLAS_COMMIT"):
        return os.environ["MSA_PALLAS_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata(args, impls: list[str]) -> dict:
    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_kind": device.device_kind,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "msa_pallas_version": getattr(msa_pallas, "__version__", None),
        "packages": {name: _package_version(name) for name in ALTERNATIVE_PACKAGES},
        "python": platform.python_version(),
        "commit": commit_id(args.commit),
        "argv": sys.argv[1:],
        "impls": impls,
        "iters": args.iters,
        "reps": args.reps,
        "warmup": args.warmup,
        "seed": args.seed,
        "env": {name: os.environ.get(name) for name in (
            "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "constants": {
            "exp_per_s": EXP_PER_S, "matmul_flop_per_s": MATMUL_FLOP_PER_S,
            "l2_bytes": L2_BYTES, "exps_per_logit": EXPS_PER_LOGIT,
            "matmul_flops_per_logit_and_dim": MATMUL_FLOPS_PER_LOGIT_AND_DIM,
            "masked_fraction": MASKED_FRACTION,
            "note": "floor constants are an H200's; on other devices the fractions are only indicative",
        },
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def parse_shape(name: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """A named shape of SHAPES, or `BxSxNxHxd`."""
    if name in SHAPES:
        return name, SHAPES[name]
    parts = name.lower().split("x")
    if len(parts) == 5 and all(p.isdigit() and int(p) > 0 for p in parts):
        return name, tuple(int(p) for p in parts)
    raise argparse.ArgumentTypeError(
        f"unknown shape {name!r}; expected one of {', '.join(SHAPES)} or BxSxNxHxd")


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None):
    gpu = on_gpu()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(GPU_DEFAULT_SHAPES if gpu else CPU_DEFAULT_SHAPES),
                        help=f"comma-separated names ({', '.join(SHAPES)}) or BxSxNxHxd "
                             "(default: all but seed and tiny on GPU, tiny on CPU)")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                        help=f"comma-separated, of {', '.join(DTYPES)} (default %(default)s)")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                        help=f"comma-separated, of {', '.join(IMPLEMENTATIONS)} (default: all; "
                             "those that cannot run here are recorded as skipped)")
    parser.add_argument("--iters", type=int, default=10 if gpu else 5,
                        help="timed samples per measurement (default 10 on GPU, 5 on CPU)")
    parser.add_argument("--reps", type=int, default=10 if gpu else 1,
                        help="back-to-back calls per timed sample (default 10 on GPU, 1 on CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip measurements that would start after this many seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json, results.md, results.png")
    parser.add_argument("--commit", default=None,
                        help="commit id to record (default $MSA_PALLAS_COMMIT or git)")
    args = parser.parse_args(argv)
    try:
        args.shapes = [parse_shape(name) for name in split_list(args.shapes)]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.dtypes = split_list(args.dtypes)
    args.impls = split_list(args.impls)
    for kind, chosen, known in (("dtype", args.dtypes, DTYPES), ("impl", args.impls, IMPLEMENTATIONS)):
        unknown = [name for name in chosen if name not in known]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; expected {', '.join(known)}")
    if args.iters < 1 or args.reps < 1:
        parser.error("--iters and --reps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = None if args.budget_s is None else start + args.budget_s
    results = {"metadata": metadata(args, args.impls), "cases": []}
    meta = results["metadata"]
    print(f"# {meta['device_kind']} ({meta['backend']}), jax {meta['jax_version']}, "
          f"commit {meta['commit']}, impls {','.join(args.impls)}, iters {args.iters} x reps {args.reps}", flush=True)
    cases = [Case(shape, dims, dtype) for dtype in args.dtypes for shape, dims in args.shapes]
    progress = make_progress(len(cases) * len(args.impls) * len(MODES))
    try:
        for case in cases:
            results["cases"].append(run_case(case, args.impls, args, progress, deadline))
            results["metadata"]["elapsed_s"] = time.monotonic() - start
            if args.out is not None:
                write_outputs(results, args.out)
    finally:
        progress.close()
    table = markdown_table(results)
    if args.out is not None:
        why_not = plot(results, args.out / "results.png")
        print(f"# wrote {args.out}/results.json, results.md"
              + (f"; no plot: {why_not}" if why_not else ", results.png"), flush=True)
    print(f"# total {time.monotonic() - start:.0f} s\n", flush=True)
    print(table, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
