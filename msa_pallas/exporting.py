"""`jax.export` of functions that use `msa_row_attention`, for a GPU, from
any host (a CPU-only build machine included).

Two things stand between `jax.export.export(..., platforms=("cuda",))` and
the Pallas kernels:

1. The Triton lowering of a `pallas_call` needs the target GPU's compute
   capability. Without a GPU it reads it from the abstract device of the
   current abstract mesh; `gpu_target(device_kind)` sets one. The op plans
   its kernels for the same target (`msa_pallas.dispatch.current_target`,
   which reads the GPU generation from the device kind), so under
   `gpu_target` it lowers compiled kernels, never the interpreters, and
   `implementation=None` picks the kernels that GPU would run: the Mosaic
   GPU kernels for an "NVIDIA H200" where the rule takes them (custom call
   `mosaic_gpu_v2`), the Triton kernels for an "NVIDIA A100".
   `msa_pallas.explain` under `gpu_target` shows that plan.
2. The Triton kernels lower to the custom call `__gpu$xla.gpu.triton`, which
   has no cross-version compatibility guarantee, so `jax.export` refuses it
   unless that safety check is disabled. An exported artifact that contains
   them must be loaded by the jax / jaxlib release that wrote it (0.11.2
   here); the Triton IR inside is compiled for the actual GPU when the
   artifact is compiled. Mosaic GPU's custom call is on `jax.export`'s list
   of stable targets.

    exported = msa_pallas.exporting.export(jax.jit(step))(*shape_dtype_structs)
    blob = exported.serialize()          # needs the `flatbuffers` package

Multi-platform export (`platforms=("cpu", "cuda")`) of the kernels is not
supported: one trace serves every platform, and the op chooses Triton or
interpret mode at trace time. Use `implementation="xla"` for that.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import jax
from jax.sharding import AbstractDevice, AbstractMesh

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CUSTOM_CALL = "mosaic_gpu_v2"
DEFAULT_DEVICE_KIND = "NVIDIA H200"


def gpu_target(device_kind: str = DEFAULT_DEVICE_KIND, *, num_cores: int | None = None):
    """A context in which functions trace and lower for a GPU of `device_kind`
    (an NVIDIA name JAX knows, e.g. "NVIDIA H100", "NVIDIA A100"), even on a
    host with no GPU.

    It sets an abstract mesh with no axes whose abstract device is that GPU
    (`jax.sharding.use_abstract_mesh`); jit caches key on it, so functions
    traced inside it are traced again outside it.
    """
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def export(
    fun: Callable,
    *,
    platforms: Sequence[str] = ("cuda",),
    device_kind: str = DEFAULT_DEVICE_KIND,
    disabled_checks: Sequence = (),
) -> Callable[..., jax.export.Exported]:
    """`jax.export.export(fun, platforms=...)` that can export the kernels.

    Args:
      fun: a function (jitted or not) that calls `msa_row_attention`.
      platforms: the target platforms: `("cuda",)` or `("cpu",)` (on CPU the
        kernels are exported in interpret mode, as they run there).
      device_kind: the target GPU when this host has none: its generation
        picks the kernels (sm90: the Mosaic GPU kernels where the dispatch
        rule takes them) and the Triton lowering's compute capability.
        Ignored when the default backend is a GPU (that GPU is the target).
      disabled_checks: more `jax.export.DisabledSafetyCheck`s.

    Returns:
      a function of the arguments (arrays or `jax.ShapeDtypeStruct`s) that
      returns the `jax.export.Exported`.
    """
    platforms = tuple(platforms)
    gpu = [p for p in platforms if p in ("cuda", "rocm", "gpu")]
    if gpu and len(gpu) != len(platforms):
        raise ValueError(
            f"platforms={platforms}: the kernels are traced once, for one kind of "
            "platform; export GPU and non-GPU platforms separately, or use "
            "implementation='xla'."
        )
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL), *disabled_checks]
    jitted = fun if hasattr(fun, "lower") else jax.jit(fun)

    def exported(*args, **kwargs) -> jax.export.Exported:
        if gpu and jax.default_backend() != "gpu":
            context = gpu_target(device_kind)
        elif not gpu and jax.default_backend() == "gpu":
            context = _host_target(platforms[0])
        else:
            context = contextlib.nullcontext()
        with context:
            return jax.export.export(jitted, platforms=platforms, disabled_checks=checks)(
                *args, **kwargs
            )

    return exported


def _host_target(platform: str):
    device = AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))
