"""The benchmarks' one timing loop: warm-up calls, on a GPU a tenth of a second of the
same calls back to back (`settle`), then samples of back-to-back calls.

A sample is `reps` calls queued back to back and waited for once, divided by `reps`
(`msa_pallas.timing.batched_times_ms`, the autotuner's loop too): the host's dispatch
latency stays out of the number. Every benchmark quotes the median of the samples.

And the compiles before it: `compile_timed` compiles now, `start_compile` traces now and
compiles on a thread pool (`compiling_ahead`'s, so that a benchmark compiles many cells at
once and times them after, never beside a compile); both give the compiled program and
its seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from msa_pallas.timing import batched_times_ms


# On a GPU, the seconds a program runs back to back between its warm-up calls and its
# samples (`settle`).
SETTLE_SECONDS = 0.1


def times_ms(launch: Callable[[int], object], *, samples: int, reps: int,
             warmup: int = 1, settle_seconds: float | None = None,
             queued_ms: list[float] | None = None) -> list[float]:
    """Per-call milliseconds of `samples` samples of `reps` calls, after `warmup` calls
    and, on a GPU, `settle_seconds` (default `SETTLE_SECONDS`) of calls back to back.

    `launch(i)` starts the i-th call (i counts from 0, warm-up, settling and samples
    each, e.g. to rotate input sets) and returns its output. `queued_ms`: a list that
    gets each sample's per-call milliseconds of queuing (`batched_times_ms`).
    """
    for i in range(warmup):
        jax.block_until_ready(launch(i))
    settle(launch, reps, SETTLE_SECONDS if settle_seconds is None else settle_seconds)
    return batched_times_ms(launch, samples=samples, reps=reps, queued_ms=queued_ms)


def settle(launch: Callable[[int], object], reps: int, seconds: float,
           on_gpu: bool | None = None) -> int:
    """Runs `launch` in batches of `reps` calls back to back, each batch waited for, until
    `seconds` have passed; returns the calls made. Nothing off a GPU (`on_gpu`: None
    asks JAX), where the calls run interpreted and take long.

    Before the samples of a program, the GPU runs that program alone: after the 1 s
    warm-up of matrix products (`warm_up_device`), the op table's first cell still read
    slow in every sample (the training crop's forward with a float32 bias: 0.087-0.112
    ms, against 0.071 for the same kernel later in the same run; H200, 2026-12-04, log
    entry 11)."""
    if on_gpu is None:
        on_gpu = jax.default_backend() == "gpu"
    if not on_gpu or seconds <= 0:
        return 0
    calls = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(reps):
            out = launch(calls)
            calls += 1
        jax.block_until_ready(out)
        del out
    return calls


def median_ms(launch: Callable[[int], object], *, samples: int, reps: int,
              warmup: int = 1) -> float:
    """The median of `times_ms(...)`."""
    return statistics.median(times_ms(launch, samples=samples, reps=reps, warmup=warmup))


def warm_up_device(seconds: float = 1.0) -> None:
    """Keeps a GPU busy with matrix products for `seconds` before a run's first timing,
    and after compiles that left it idle.

    An idle GPU starts a run at low clocks: the first sample of the op table's first
    case read 0.26-0.41 ms where its others read about 0.08 ms (five H200 runs,
    2026-12-03/04). After a case's cells compiled ahead (several seconds, the GPU idle)
    the first cell timed, msa_pallas' forward at the training crop, read 0.188 ms
    against 0.071 at 226eab1, its samples 0.14-0.47 ms (2026-12-04, log entry 08).
    Nothing to do off a GPU.
    """
    if jax.default_backend() != "gpu":
        return
    a = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)
    product = jax.jit(lambda x: x @ x)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        jax.block_until_ready(product(a))


def compile_lowered(lowered, lowering_seconds: float = 0.0) -> tuple[Any, float]:
    """(`lowered` compiled, `lowering_seconds` plus the seconds the compile took)."""
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, lowering_seconds + time.perf_counter() - start


def compile_timed(lower: Callable[[], Any]) -> tuple[Any, float]:
    """(`lower()` compiled, the seconds of both)."""
    start = time.perf_counter()
    lowered = lower()
    return compile_lowered(lowered, time.perf_counter() - start)


@contextlib.contextmanager
def compiling_ahead(threads: int):
    """A pool of `threads` threads for `start_compile`. On leaving the block every compile
    has ended, and the GPU, idle while they ran, has been warmed up again
    (`warm_up_device`): the first program timed after them is not timed at low clocks."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        yield pool
    warm_up_device()


def start_compile(pool: concurrent.futures.Executor,
                  lower: Callable[[], Any]) -> concurrent.futures.Future:
    """A future of `compile_timed(lower)`: `lower()` (tracing, which may read global
    state such as a patch or a context) runs now on this thread, the compile on `pool`.
    A failure of either is the future's exception."""
    start = time.perf_counter()
    try:
        lowered = lower()
    except Exception as exc:  # noqa: BLE001 - whoever waits for the future gets it
        failed = concurrent.futures.Future()
        failed.set_exception(exc)
        return failed
    return pool.submit(compile_lowered, lowered, time.perf_counter() - start)
