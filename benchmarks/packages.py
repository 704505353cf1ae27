"""The alternatives' packages (tokamax, NVIDIA cuEquivariance): importing them, or saying why not.

They are not in the GPU image: `bash benchmarks/fetch_wheels.sh` fetches their wheels
where pip reaches the index, and benchmarks/run_gpu.sh installs them on the GPU machine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import jax

# Versions recorded in results.json and under the table (None: not installed).
ALTERNATIVE_PACKAGES = ("tokamax", "cuequivariance-jax", "cuequivariance-ops-jax-cu13",
                        "cuequivariance-ops-cu13")


class Unavailable(Exception):
    """An implementation cannot run this case here (recorded as `skipped: ...`)."""


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _provide_xprof_stand_in() -> None:
    """Registers a stand-in `xprof.cli.tools.get_kernel_stats_tool` module when no real
    xprof is importable.

    tokamax 0.0.17 imports it at start-up (`tokamax/_src/benchmarking.py`) and calls its
    one function, `compute_kernel_stats`, only from its own xprof-based timing, which
    these benchmarks never use (they time with the wall clock): the stand-in raises if
    it is ever called.
    """
    if "xprof" in sys.modules or importlib.util.find_spec("xprof") is not None:
        return

    def compute_kernel_stats(*args, **kwargs):
        raise NotImplementedError("xprof is not installed: msa_pallas' benchmarks put a "
                                  "stand-in module in its place, without kernel statistics")

    names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
    for name in names:
        module = sys.modules.setdefault(name, types.ModuleType(name))
        module.__path__ = []  # a package, so that the next name imports from it
    sys.modules[names[-1]].compute_kernel_stats = compute_kernel_stats
    for parent, child in zip(names, names[1:]):
        setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])


def import_tokamax():
    """Imports tokamax (with `_provide_xprof_stand_in` first), or raises `Unavailable`."""
    _provide_xprof_stand_in()
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


def tokamax_with(implementation: str):
    """tokamax, once it is known to have `implementation` (a key of its registry)."""
    tokamax = import_tokamax()
    try:
        from tokamax._src.ops.attention import api as tokamax_api
        known = tokamax_api.IMPLEMENTATIONS
    except Exception:  # noqa: BLE001 - a private module; the call will tell
        known = None
    if known is not None and implementation not in known:
        raise Unavailable(f"tokamax has no {implementation!r} implementation here "
                          f"(it has {', '.join(sorted(known))})")
    return tokamax
