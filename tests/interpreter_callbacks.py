"""The Mosaic GPU interpreter without its callbacks' argument copies and its
per-launch compiles, for CPU test runs (installed by `conftest.py` and by the
tests' subprocesses).

The interpreter of jax 0.11.2 runs a kernel as thousands of `io_callback`s
(each load, store, copy and barrier of each simulated thread). JAX's
`io_callback_impl` first `device_put`s every argument of every callback to
the CPU device, although on a CPU-only run the arguments arrive as NumPy
arrays in host memory already and every interpreter callback reads them as
NumPy values (or Python ints) again. Those copies were two thirds of the
time of a Mosaic interpreter test (a dk/dv + dq + dbias case: 30 s, 10 s
without them) and most of the CPU suite's.

Each simulated warpgroup's program runs in a thread of its own, and the
interpreter traces, lowers and compiles that program again on every launch
of every kernel (ahead-of-time `trace().lower().compile()`, which no cache
in memory keeps): a tenth of one Mosaic interpreter test's time, and a
quarter of the CPU suite's (781 s of pytest on 2 cores, 574 s without).

`install` replaces three private functions: `io_callback_impl` calls the
callback on the arguments as they come; the interpreter's `_to_int` (which
reads a thread or device id) takes NumPy integers as it takes 0-d JAX
arrays; and `thread_map._run_jaxpr` compiles a thread's program once per
program and argument types, then runs it as before (compiling under a lock
and running outside it: the threads of one launch wait for each other at
the kernel's barriers, so none may hold a lock while it runs; a plain
`jax.jit` call deadlocks there, as concurrent first calls of one jitted
function wait for the first to finish running). Nothing else changes: the
same kernels, the same interpreter, the same values (the arguments' dtypes
are those XLA hands the callback, with or without 64-bit types). Installed
only for the JAX version it was written against (the pinned one);
MSA_PALLAS_TEST_CALLBACK_COPIES=1 keeps JAX's own functions.
"""

from __future__ import annotations

import os
import threading
import weakref

import jax
import numpy as np

WRITTEN_FOR = "0.11.2"


def install() -> bool:
    """Installs the copy-free callbacks (once per process); True if installed."""
    if jax.__version__ != WRITTEN_FOR or os.environ.get("MSA_PALLAS_TEST_CALLBACK_COPIES") == "1":
        return False
    from jax._src import callback as jax_callback, config, tree_util, xla_bridge
    from jax._src.pallas.mosaic.interpret import thread_map
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    if getattr(jax_callback.io_callback_impl, "_msa_pallas_copy_free", False):
        return True

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xla_bridge.local_devices(backend="cpu")
        with config.default_device(cpu_device):
            try:
                return tree_util.tree_map(np.asarray, callback(*args))
            except BaseException:
                jax_callback.logger.exception("jax.io_callback failed")
                raise

    jax_to_int = shared_memory._to_int

    def to_int(x):
        if isinstance(x, (np.ndarray, np.generic)):
            return int(x)
        return jax_to_int(x)

    compiled_threads = weakref.WeakKeyDictionary()  # jaxpr -> {argument types: executable}
    compile_lock = threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        types = tuple(map(jax.typeof, jax.tree.leaves((consts, args))))
        with compile_lock:
            executables = compiled_threads.setdefault(jaxpr, {})
            if types not in executables:
                executables[types] = (
                    jax.jit(thread_map._run, static_argnums=(0,))
                    .trace(jaxpr, consts, *args).lower().compile())
        executables[types](consts, *args)

    io_callback_impl._msa_pallas_copy_free = True
    jax_callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = to_int
    thread_map._run_jaxpr = run_jaxpr
    return True
