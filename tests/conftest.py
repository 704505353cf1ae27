"""Test configuration.

The `gpu` and `slow` markers are registered in pyproject.toml. Tests marked
`gpu` are skipped unless JAX's default backend is a GPU. The `implementation`
fixture runs a test once per backend of the op. The `seed` fixture
gives every test its own PRNG seed, derived from the test's id, so no two
tests draw the same inputs while every run of one test draws the same ones.

Compile time. On CPU the suite's time is almost all XLA compiling the
interpret-mode kernels (the programs run in milliseconds), so a CPU-only run
(no JAX GPU plugin installed, or JAX_PLATFORMS=cpu), serial or parallel:

- uses one JAX persistent compilation cache: a temporary folder made for the
  run and removed after it, shared by the pytest-xdist workers and by the
  subprocesses that tests start. A program that two tests compile alike
  through different `jax.jit` objects, in one process or in two workers, is
  compiled once. With JAX_COMPILATION_CACHE_DIR set, that cache is used
  instead and left in place (a warm cache makes a rerun several times faster);
- compiles with LLVM's optimisations off (`--xla_backend_optimization_level=0
  --xla_llvm_disable_expensive_passes=true` added to XLA_FLAGS, inherited by
  the workers and subprocesses): about a quarter less compile time. The
  floating-point semantics are the same (XLA's CPU fast-math is off either
  way). An XLA_FLAGS that sets `--xla_backend_optimization_level` itself is
  left as it is;
- turns XLA's concurrency-optimised CPU scheduler off
  (`--xla_cpu_enable_concurrency_optimized_scheduler=false`, unless XLA_FLAGS
  names it). With it on, the Mosaic GPU interpreter of jax 0.11.2 hangs in
  its barrier waits on some programs: the dk/dv and dbias kernels with
  B * H > 1, dbias with two consumers and a 16-bit bias, the op's
  forward + backward with d = 8 two heads per tile and the mask an argument
  of the jitted function. With it off every one of them runs;
- runs the Mosaic GPU interpreter's host callbacks without copying their
  arguments, and compiles each simulated thread's program once instead of at
  every kernel launch (`interpreter_callbacks.py`): two thirds of the time of
  its tests, and the suite's 13 minutes on 2 cores down to under 10;
- drops JAX's in-memory caches after each test module (`jax.clear_caches()`;
  the persistent cache keeps the compiles). Each XLA:CPU executable held
  about three memory mappings until then, and a worker's count grew with
  every module it ran (14,046 after three minutes of the padded kernels'
  Mosaic backward, Mosaic forward and Triton prologue test modules in one
  process), towards Linux's limit of 65,530 a
  process (`vm.max_map_count`). Full parallel runs then died, nine of twelve on
  2026-12-05 and 2026-12-06 and in CI, of a segmentation fault or an abort
  inside XLA's compile or serialisation of some later program. Dropped per
  module, no worker held more than 15,708 mappings, and the run passed in
  605 s (2026-12-06).

With a GPU plugin installed, nothing of this applies: GPU runs compile as they
always did.

Parallel runs (scripts/test.sh: `-n auto --dist loadfile`) keep each test
module in one worker, so a module's tests share its compiles and its
module-scoped fixtures (test_sharding.py's subprocesses run once per run).
The longest modules are collected first (`LONGEST_FIRST`), so that the two
workers finish together.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib
import shutil
import tempfile
import zlib

import interpreter_callbacks
import jax
import pytest

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
INTERPRETER_SCHEDULE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _cpu_only() -> bool:
    """No JAX PJRT plugin (CUDA, ROCm) is installed, or JAX is told to use the CPU."""
    return (
        os.environ.get("JAX_PLATFORMS") == "cpu" or importlib.util.find_spec("jax_plugins") is None
    )


def pytest_configure(config):
    if _cpu_only():
        # Per process: the controller, each xdist worker.
        interpreter_callbacks.install()
    # An xdist worker inherits what the controller set up (its environment).
    if hasattr(config, "workerinput") or not _cpu_only():
        return
    # Read by XLA when JAX first makes its CPU client (after this hook) and by
    # the workers and subprocesses, which start after it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} {FAST_COMPILE_FLAGS}"
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        flags = f"{flags} {INTERPRETER_SCHEDULE_FLAG}"
    os.environ["XLA_FLAGS"] = flags.strip()
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        path = tempfile.mkdtemp(prefix="msa_pallas_jax_cache_")
        config._msa_pallas_jax_cache = path
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        # This process imported JAX above and has compiled nothing yet.
        jax.config.update("jax_compilation_cache_dir", path)
    # Interpret-mode compiles of the kernels take 0.1-3 s each: cache them all.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )


def pytest_runtest_teardown(item, nextitem):
    # Each XLA:CPU executable holds about three memory mappings until JAX's
    # caches drop it: a worker keeping every program of its modules heads for
    # Linux's 65,530 mappings a process (vm.max_map_count), where XLA dies in
    # a later compile (the module docstring says more).
    if _cpu_only() and (nextitem is None or nextitem.path != item.path):
        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    path = getattr(config, "_msa_pallas_jax_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


# The modules that take longest on a CPU, longest first (measured on
# 2026-12-03: 60-130 s each alone on one core; the benchmarks' scripts about
# 100 s in a parallel run): run first. pytest-xdist's `--dist loadfile` hands a
# worker the next module in collection order when it finishes one, so a long
# module collected last would run alone while the other worker idles.
LONGEST_FIRST = (
    "kernels/mosaic/test_backward.py",
    "test_attention.py",
    "test_jax_modes.py",
    "kernels/mosaic/test_padding_backward.py",
    "test_padding.py",
    "benchmarks/test_op.py",
    "kernels/mosaic/test_forward.py",
    "kernels/triton/test_padding.py",
    "test_sharding.py",  # most of it one subprocess
    "kernels/mosaic/test_backward_plan.py",
    "layers/test_alphafold2_patch.py",
)
TESTS = pathlib.Path(__file__).resolve().parent


def _schedule_rank(item) -> int:
    try:
        module = item.path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return len(LONGEST_FIRST)
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_schedule_rank)  # stable: the rest keep their order
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend is {jax.default_backend()!r})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The op's backends: its `implementation` values.
IMPLEMENTATIONS = ("triton", "mosaic", "xla")


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
    """Each backend of the op in turn, for the behaviour cases written once for
    all of them: "triton" and "mosaic" (on a CPU in Pallas interpret mode and in
    the Mosaic GPU interpreter), "xla" (the plain-jnp path). A test that runs on
    some backends only parametrises `implementation` itself."""
    return request.param


@pytest.fixture
def seed(request) -> int:
    """A per-test seed: crc32 of the test id."""
    return zlib.crc32(request.node.nodeid.encode())
